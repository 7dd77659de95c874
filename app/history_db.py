"""The conversations database: schema, migrator and the queries. Plain sqlite3, no Qt.

SQLite does not enforce column types, so rows are read field by field: a title, prompt or
time of the wrong type is replaced by a default, a message whose role or content cannot be
used is left out, and a `stats` value that is not a JSON object is dropped; open_or_recover
names what it repaired in its notice. A database that fails SQLite's own check is moved aside.
"""

from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from moeferry.app.paths import move_aside

DB_FILE = "conversations.sqlite3"

# One entry per schema version; entry i upgrades version i to i+1.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        title TEXT NOT NULL,
        system_prompt TEXT NOT NULL DEFAULT '',
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE messages (
        id TEXT PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        complete INTEGER NOT NULL DEFAULT 1,
        created REAL NOT NULL,
        stats TEXT
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, position);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass
class Message:
    id: str
    role: str  # user | assistant
    content: str
    created: float
    complete: bool = True
    stats: dict | None = None


@dataclass
class Conversation:
    id: str
    title: str
    created: float
    updated: float
    system_prompt: str = ""
    messages: list[Message] = field(default_factory=list)


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=10)
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    migrate(conn)
    return conn


def migrate(conn: sqlite3.Connection) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise sqlite3.DatabaseError(f"database schema {version} is newer than this app ({SCHEMA_VERSION})")
    for v in range(version, SCHEMA_VERSION):
        with conn:
            conn.executescript(MIGRATIONS[v])
            conn.execute(f"PRAGMA user_version = {v + 1}")


def open_or_recover(path: Path) -> tuple[list[Conversation], str]:
    """Load every conversation; a damaged database is moved aside (with a notice) and a new one made."""
    try:
        conn = connect(path)
        try:
            if conn.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("quick_check failed")
            repaired: list[str] = []
            convs = load_all(conn, repaired)
            if repaired:
                return convs, f"A saved conversation was damaged and reset: {', '.join(repaired)}."
            return convs, ""
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        moved = move_aside(path)
        for suffix in ("-wal", "-shm"):
            side = path.with_name(path.name + suffix)
            if side.exists():
                side.unlink()
        connect(path).close()
        return [], f"The conversations database was damaged, so it was moved to {moved.name} and a new one was started."


def load_all(conn: sqlite3.Connection, repaired: list[str] | None = None) -> list[Conversation]:
    """Every conversation with its messages; what had to be repaired is appended to `repaired`."""
    notes: dict[str, int] = {}

    def note(what: str) -> None:
        notes[what] = notes.get(what, 0) + 1

    convs = {}
    for cid, title, prompt, created, updated in conn.execute(
            "SELECT id, title, system_prompt, created, updated FROM conversations ORDER BY updated DESC"):
        if not (isinstance(title, str) and isinstance(prompt, str)) or None in (_time(created), _time(updated)):
            note("conversation title, prompt or time")
        convs[cid] = Conversation(id=str(cid), title=title if isinstance(title, str) else "Untitled chat",
                                  system_prompt=prompt if isinstance(prompt, str) else "",
                                  created=_time(created) or 0.0, updated=_time(updated) or 0.0)
    for cid, mid, role, content, complete, created, stats in conn.execute(
        "SELECT conversation_id, id, role, content, complete, created, stats FROM messages "
        "ORDER BY conversation_id, position"
    ):
        if cid not in convs:
            continue
        if role not in ("user", "assistant") or not isinstance(content, str):
            note("message left out")
            continue
        parsed = _stats(stats)
        if stats is not None and parsed is None:
            note("message stats")
        convs[cid].messages.append(
            Message(id=str(mid), role=role, content=content, created=_time(created) or 0.0,
                    complete=bool(complete) if isinstance(complete, int) else False, stats=parsed))
    if repaired is not None:
        repaired += [f"{what} ({n})" for what, n in notes.items()]
    return list(convs.values())


def _time(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _stats(text) -> dict | None:
    """A message's stats column: a JSON object, or None when absent or damaged."""
    if not isinstance(text, str) or not text:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# Writes. Each runs in its own transaction; the async writer calls them in order.

def save_conversation(conn: sqlite3.Connection, conv: Conversation) -> None:
    with conn:
        conn.execute(
            "INSERT INTO conversations (id, title, system_prompt, created, updated) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET title = excluded.title, system_prompt = excluded.system_prompt, "
            "updated = excluded.updated",
            (conv.id, conv.title, conv.system_prompt, conv.created, conv.updated),
        )


def delete_conversation(conn: sqlite3.Connection, conv_id: str) -> None:
    with conn:
        conn.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))


def save_message(conn: sqlite3.Connection, conv_id: str, position: int, msg: Message, updated: float) -> None:
    with conn:
        conn.execute(
            "INSERT INTO messages (id, conversation_id, position, role, content, complete, created, stats) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET content = excluded.content, "
            "complete = excluded.complete, stats = excluded.stats, position = excluded.position",
            (msg.id, conv_id, position, msg.role, msg.content, int(msg.complete), msg.created,
             json.dumps(msg.stats) if msg.stats else None),
        )
        conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (updated, conv_id))


def truncate_messages(conn: sqlite3.Connection, conv_id: str, keep: int) -> None:
    with conn:
        conn.execute("DELETE FROM messages WHERE conversation_id = ? AND position >= ?", (conv_id, keep))
