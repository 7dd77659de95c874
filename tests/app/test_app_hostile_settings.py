"""Damaged settings and history never stop the app from starting (issue 12 case 4, issue 13
points 5 and 17): each bad value is reset to its default and named in the notice bar; a start
that fails anyway is logged under the data folder and shown in a dialog; no display, one sentence."""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import subprocess
import sys

import pytest

from moeferry.app import history_db
from moeferry.app.history import History
from moeferry.app.settings import DEFAULTS, Key, load_settings
from tests.app.conftest import ROOT

# settings.json lines as a damaged or hand-edited file holds them (JSON that Python reads)
DAMAGED = [
    ('"max_new_tokens": 1e400', Key.MAX_NEW_TOKENS),
    ('"temperature": NaN', Key.TEMPERATURE),
    ('"temperature": 1e-45', Key.TEMPERATURE),
    ('"top_p": Infinity', Key.TOP_P),
    ('"top_p": -Infinity', Key.TOP_P),
    ('"prefetch": 99', Key.PREFETCH),
    ('"prefetch": "2"', Key.PREFETCH),
    ('"seed": true', Key.SEED),
    ('"cache_experts": 1.5', Key.CACHE_EXPERTS),
    ('"vram_budget_gb": [1]', Key.VRAM_BUDGET_GB),
    ('"theme": 5', Key.THEME),
    ('"wizard_done": "yes"', Key.WIZARD_DONE),
    ('"store_path": {"a": 1}', Key.STORE_PATH),
    ('"pending_install": {"source": "catalog"}', Key.PENDING_INSTALL),
    ('"pending_install": {"source": "demo", "name": "d", "expert_bits": "2"}', Key.PENDING_INSTALL),
    ('"pending_install": [1, 2]', Key.PENDING_INSTALL),
    ('"installed": {"path": "/x"}', Key.INSTALLED),
]


def write_raw(folder, line: str) -> None:
    (folder / "settings.json").write_text('{"version": 1, ' + line + "}")


@pytest.mark.parametrize("line,key", DAMAGED, ids=[d[0][:40] for d in DAMAGED])
def test_each_damaged_value_is_reset_and_named(tmp_path, line, key):
    write_raw(tmp_path, line)
    s = load_settings(tmp_path)
    assert s.get(key) == DEFAULTS[key]
    assert s.notice == f"A setting was damaged and reset: {key.value}."
    s.save()  # what is written back is valid JSON (no NaN, no Infinity) and loads cleanly
    json.loads((tmp_path / "settings.json").read_text(), parse_constant=pytest.fail)
    assert not load_settings(tmp_path).notice


def test_good_values_and_good_entries_survive_beside_bad_ones(tmp_path):
    good = {"path": "/models/a", "name": "A", "expert_bits": 2, "attn_bits": 4, "source_path": ""}
    write_raw(tmp_path, '"temperature": 0.2, "max_new_tokens": 512.0, "installed": ['
              + json.dumps(good) + ', {"path": 7, "name": "bad"}, {"name": "no path"}, "x",'
              ' {"path": "/b", "name": "B", "expert_bits": true}]')
    s = load_settings(tmp_path)
    assert s.get(Key.TEMPERATURE) == pytest.approx(0.2) and s.get(Key.MAX_NEW_TOKENS) == 512
    assert s.get(Key.INSTALLED) == [good]
    assert s.notice == "A setting was damaged and reset: installed."


def test_a_pending_install_that_is_whole_is_kept(tmp_path):
    req = {"source": "catalog", "name": "Mixtral", "dest": "/d", "repo_id": "org/m", "revision": None,
           "expert_bits": 2, "needs_convert": True}
    write_raw(tmp_path, '"pending_install": ' + json.dumps(req))
    s = load_settings(tmp_path)
    assert s.get(Key.PENDING_INSTALL) == req and not s.notice


def test_the_app_starts_and_says_which_settings_were_reset(launch, data_dir):
    write_raw(data_dir, '"wizard_done": true, "max_new_tokens": 1e400, "temperature": NaN, '
              '"top_p": NaN, "pending_install": {"source": "catalog"}, "installed": [{"path": 3, "name": "x"}]')
    parts = launch()
    text = parts.window.chat.notice.label.text()
    assert parts.window.chat.notice.isVisibleTo(parts.window)
    assert text.startswith("A setting was damaged and reset: ")
    for key in ("max_new_tokens", "temperature", "top_p", "pending_install", "installed"):
        assert key in text
    assert parts.window.wizard is None, "no pending install left to resume"
    from moeferry.app.chat_controller import sampling_from

    sampling = sampling_from(parts.settings)  # what a reply is generated with: finite again
    assert math.isfinite(sampling.temperature) and math.isfinite(sampling.top_p)


def test_damaged_history_rows_are_repaired_and_named(tmp_path):
    path = tmp_path / history_db.DB_FILE
    h = History(path)
    conv = h.new_conversation("Chat")
    h.add_message(conv.id, "user", "hello")
    h.add_message(conv.id, "assistant", "hi")
    h.close()
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE messages SET stats = '{not json' WHERE role = 'assistant'")
        conn.execute("INSERT INTO messages VALUES ('m3', ?, 2, 'system', 'x', 1, 0, NULL)", (conv.id,))
        conn.execute("INSERT INTO messages VALUES ('m4', ?, 3, 'user', X'FF00', 1, 0, NULL)", (conv.id,))
        conn.execute("UPDATE conversations SET title = 5, updated = 'soon'")
    conn.close()
    again = History(path)
    assert again.notice.startswith("A saved conversation was damaged and reset: ")
    assert "message stats (1)" in again.notice and "message left out (2)" in again.notice
    (c,) = again.conversations()
    assert [(m.role, m.content, m.stats) for m in c.messages] == [("user", "hello", None), ("assistant", "hi", None)]
    assert isinstance(c.title, str) and c.updated == 0.0
    again.close()


def test_the_app_starts_with_a_damaged_history_row(launch, data_dir):
    h = History(data_dir / history_db.DB_FILE)
    conv = h.new_conversation("Chat")
    h.add_message(conv.id, "assistant", "hi")
    h.close()
    conn = sqlite3.connect(data_dir / history_db.DB_FILE)
    with conn:
        conn.execute("UPDATE messages SET stats = '[1, 2'")
    conn.close()
    parts = launch()
    assert "A saved conversation was damaged and reset" in parts.window.chat.notice.label.text()


def test_no_display_is_one_sentence_not_an_abort(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env.update(PYTHONPATH=str(ROOT), MOEFERRY_DATA_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "moeferry.app.cli"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip() == ("moeferry: no display found; the desktop app needs one; the command "
                                "line works: moeferry --help")


def test_has_display_reads_the_environment():
    from moeferry.app.main import has_display

    assert not has_display({}, "linux")
    assert has_display({"DISPLAY": ":0"}, "linux") and has_display({"WAYLAND_DISPLAY": "wayland-0"}, "linux")
    assert has_display({"QT_QPA_PLATFORM": "offscreen"}, "linux")
    assert not has_display({"QT_QPA_PLATFORM": "xcb"}, "linux")
    assert has_display({}, "win32") and has_display({}, "darwin")


def run_gui_then_drop_its_log_handlers(main_module) -> int:
    """moeferry.app.main.run_gui's exit code; the log handlers it added are closed afterwards, so the
    next test's data folder gets its own log."""
    before = list(logging.getLogger().handlers)
    try:
        return main_module.run_gui(["moeferry"])
    finally:
        for h in logging.getLogger().handlers:
            if h not in before:
                h.close()
                logging.getLogger().removeHandler(h)


def test_a_failed_start_is_logged_and_shown_with_the_log_path(qapp, data_dir, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from moeferry.app import main as app_main

    def boom(*a, **k):
        raise RuntimeError("the model list is unreadable")

    shown = []
    monkeypatch.setattr(app_main, "start", boom)
    monkeypatch.setattr(QMessageBox, "critical", lambda parent, title, text: shown.append(text))
    assert run_gui_then_drop_its_log_handlers(app_main) == 1
    log_file = data_dir / "moeferry.log"
    assert shown and str(log_file) in shown[0] and "the model list is unreadable" in shown[0]
    text = log_file.read_text()
    assert "MoE Ferry could not start" in text and "Traceback" in text and "RuntimeError" in text


def test_a_broken_qt_is_one_sentence_and_a_log_entry(data_dir, monkeypatch, capsys):
    from moeferry.app import main as app_main

    monkeypatch.setitem(sys.modules, "PySide6.QtWidgets", None)  # `import` now raises ImportError
    assert run_gui_then_drop_its_log_handlers(app_main) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeferry: the desktop app cannot load Qt") and "\n" not in err
    assert str(data_dir / "moeferry.log") in err
    assert "Qt cannot be loaded" in (data_dir / "moeferry.log").read_text()


@pytest.mark.parametrize("manifest", [
    {"quantization": [1, 2], "source": 7},
    {"quantization": {"experts": "2", "attention": None}, "source": {"repo": ["x"]}},
    {"quantization": {"experts": {"bits": "two"}}, "source": "org/repo"},
])
def test_a_store_manifest_of_the_wrong_shape_is_described_not_raised(tmp_path, manifest):
    """The wizard describes a chosen store from its manifest before any check runs: sections of
    the wrong type read as absent (the store's own checks refuse it when it is opened)."""
    from moeferry.app.catalog import read_store_info
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    info = read_store_info(tmp_path)
    assert info is not None and info.expert_bits is None and info.attn_bits is None
    assert info.name == tmp_path.name and info.source == ""
