"""Settings and the conversations database: round trips, migration, damaged files moved aside."""

from __future__ import annotations

import json
import sqlite3

import pytest

from moeferry.app import history_db
from moeferry.app.history import History, export_markdown, title_from
from moeferry.app.settings import DEFAULTS, Key, coerce, load_settings


def test_settings_round_trip_and_coercion(tmp_path):
    s = load_settings(tmp_path)
    assert s.get(Key.PREFETCH) == DEFAULTS[Key.PREFETCH] and not s.notice
    s.update({Key.PREFETCH: "9", Key.TEMPERATURE: "0.3", Key.THEME: "purple", "seed": 42})
    assert s.get(Key.PREFETCH) == 4, "clamped to 0-4"
    assert s.get(Key.THEME) == "system", "unknown choice -> default"
    s.save()
    again = load_settings(tmp_path)
    assert again.get(Key.TEMPERATURE) == pytest.approx(0.3) and again.get(Key.SEED) == 42
    assert coerce(Key.MAX_NEW_TOKENS, "lots") == DEFAULTS[Key.MAX_NEW_TOKENS]


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe\x00"])
def test_damaged_settings_are_moved_aside(tmp_path, content):
    (tmp_path / "settings.json").write_bytes(content)
    s = load_settings(tmp_path)
    assert "moved to settings.json.corrupt-" in s.notice
    aside = list(tmp_path.glob("settings.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content
    assert s.get(Key.TEMPERATURE) == DEFAULTS[Key.TEMPERATURE]
    s.save()
    assert json.loads((tmp_path / "settings.json").read_text())["version"] == 1


def test_history_round_trip(tmp_path):
    path = tmp_path / history_db.DB_FILE
    h = History(path)
    conv = h.new_conversation()
    h.rename(conv.id, "Cats")
    h.set_system_prompt(conv.id, "Be brief.")
    h.add_message(conv.id, "user", "Tell me about cats")
    reply = h.add_message(conv.id, "assistant", "Cats are", complete=False)
    reply.content += " great."
    reply.complete = True
    reply.stats = {"tokens_per_s": 2.5}
    h.save_message(conv.id, reply)
    other = h.new_conversation("Dogs")
    h.add_message(other.id, "user", "woof")
    h.truncate(other.id, 0)
    h.delete(other.id)
    h.close()
    again = History(path)
    [c] = again.conversations()
    assert (c.title, c.system_prompt) == ("Cats", "Be brief.")
    assert [(m.role, m.content, m.complete) for m in c.messages] == [
        ("user", "Tell me about cats", True), ("assistant", "Cats are great.", True)]
    assert c.messages[1].stats == {"tokens_per_s": 2.5}
    assert again.search("GREAT")[0].id == c.id and again.search("nothing") == []
    again.close()


def test_damaged_database_is_moved_aside(tmp_path):
    path = tmp_path / history_db.DB_FILE
    path.write_bytes(b"this is not a database" * 100)
    h = History(path)
    assert "moved to conversations.sqlite3.corrupt-" in h.notice
    assert h.conversations() == []
    assert len(list(tmp_path.glob("conversations.sqlite3.corrupt-*"))) == 1
    h.new_conversation("fresh")
    h.close()
    assert [c.title for c in History(path).conversations()] == ["fresh"]


def test_newer_schema_is_not_overwritten(tmp_path):
    path = tmp_path / history_db.DB_FILE
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    h = History(path)
    assert h.notice and list(tmp_path.glob("*.corrupt-*"))
    h.close()


def test_migrations_bring_an_empty_file_to_the_current_schema(tmp_path):
    conn = history_db.connect(tmp_path / "x.sqlite3")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == history_db.SCHEMA_VERSION
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"conversations", "messages"} <= tables


def test_app_shows_recovery_notices(launch, data_dir):
    (data_dir / "settings.json").write_text("{broken")
    (data_dir / history_db.DB_FILE).write_bytes(b"garbage" * 200)
    parts = launch()
    notice = parts.window.chat.notice
    assert notice.isVisibleTo(parts.window)
    assert "settings file was damaged" in notice.label.text()
    assert "conversations database was damaged" in notice.label.text()
    assert parts.window.wizard is not None, "defaults: set-up not done"


def test_export_and_titles():
    from moeferry.app.history_db import Conversation, Message

    conv = Conversation("1", "T", 0, 0, "sys", [Message("a", "user", "q", 0),
                                              Message("b", "assistant", "partial", 0, complete=False)])
    text = export_markdown(conv)
    assert "> System prompt: sys" in text and "incomplete" in text
    assert title_from("  a  b\n c ") == "a b c"
    assert len(title_from("x" * 100)) == 40
