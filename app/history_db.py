"""The conversations database: schema, migrator and the queries. Plain sqlite3, no Qt."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from app.paths import move_aside

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
            return load_all(conn), ""
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


def load_all(conn: sqlite3.Connection) -> list[Conversation]:
    convs = {
        row[0]: Conversation(id=row[0], title=row[1], system_prompt=row[2], created=row[3], updated=row[4])
        for row in conn.execute(
            "SELECT id, title, system_prompt, created, updated FROM conversations ORDER BY updated DESC"
        )
    }
    for cid, mid, role, content, complete, created, stats in conn.execute(
        "SELECT conversation_id, id, role, content, complete, created, stats FROM messages "
        "ORDER BY conversation_id, position"
    ):
        if cid in convs:
            convs[cid].messages.append(
                Message(id=mid, role=role, content=content, created=created, complete=bool(complete),
                        stats=json.loads(stats) if stats else None)
            )
    return list(convs.values())


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
