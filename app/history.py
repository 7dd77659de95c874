"""Conversations in memory, written to SQLite by a background thread so the UI never waits on disk."""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Callable

from moeferry.app import history_db as db
from moeferry.app.history_db import Conversation, Message

log = logging.getLogger(__name__)
_STOP = object()


class AsyncWriter:
    """Runs database writes in order on one thread that owns the connection."""

    def __init__(self, path: Path):
        self._queue: queue.Queue = queue.Queue()
        self._path = path
        self._thread = threading.Thread(target=self._run, name="moeferry-db-writer", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> None:
        self._queue.put((fn, args))

    def flush(self, timeout: float = 5.0) -> bool:
        done = threading.Event()
        self._queue.put((lambda _conn: done.set(), ()))
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        conn = db.connect(self._path)
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                fn, args = item
                try:
                    fn(conn, *args)
                except Exception:  # a failed write must not stop the ones after it
                    log.exception("database write failed")
        finally:
            conn.close()


def _new_id() -> str:
    return uuid.uuid4().hex


class History:
    """The app's conversations. Reads come from memory; every change is queued for the database."""

    def __init__(self, path: Path):
        self.path = path
        conversations, self.notice = db.open_or_recover(path)
        self._convs: dict[str, Conversation] = {c.id: c for c in conversations}
        self._writer = AsyncWriter(path)

    def close(self, timeout: float = 5.0) -> None:
        self._writer.close(timeout)

    def flush(self, timeout: float = 5.0) -> bool:
        return self._writer.flush(timeout)

    # Reading
    def conversations(self) -> list[Conversation]:
        return sorted(self._convs.values(), key=lambda c: c.updated, reverse=True)

    def get(self, conv_id: str) -> Conversation | None:
        return self._convs.get(conv_id)

    def search(self, text: str) -> list[Conversation]:
        needle = text.strip().lower()
        if not needle:
            return self.conversations()
        return [
            c for c in self.conversations()
            if needle in c.title.lower() or any(needle in m.content.lower() for m in c.messages)
        ]

    # Changing
    def new_conversation(self, title: str = "New chat", system_prompt: str = "") -> Conversation:
        now = time.time()
        conv = Conversation(id=_new_id(), title=title, created=now, updated=now, system_prompt=system_prompt)
        self._convs[conv.id] = conv
        self._save_conv(conv)
        return conv

    def rename(self, conv_id: str, title: str) -> None:
        conv = self._convs[conv_id]
        conv.title = title.strip() or conv.title
        self._save_conv(conv)

    def set_system_prompt(self, conv_id: str, prompt: str) -> None:
        conv = self._convs[conv_id]
        conv.system_prompt = prompt
        self._save_conv(conv)

    def delete(self, conv_id: str) -> None:
        self._convs.pop(conv_id, None)
        self._writer.submit(db.delete_conversation, conv_id)

    def add_message(self, conv_id: str, role: str, content: str, complete: bool = True) -> Message:
        conv = self._convs[conv_id]
        msg = Message(id=_new_id(), role=role, content=content, created=time.time(), complete=complete)
        conv.messages.append(msg)
        self.save_message(conv_id, msg)
        return msg

    def save_message(self, conv_id: str, msg: Message) -> None:
        """Write the message as it is now (content, complete flag, stats)."""
        conv = self._convs.get(conv_id)
        if conv is None:
            return
        conv.updated = time.time()
        position = next((i for i, m in enumerate(conv.messages) if m.id == msg.id), len(conv.messages))
        self._writer.submit(db.save_message, conv_id, position, replace(msg, stats=copy.deepcopy(msg.stats)),
                            conv.updated)

    def truncate(self, conv_id: str, keep: int) -> None:
        """Drop every message from position `keep` on (for regenerate and edit)."""
        conv = self._convs[conv_id]
        del conv.messages[keep:]
        self._writer.submit(db.truncate_messages, conv_id, keep)

    def _save_conv(self, conv: Conversation) -> None:
        conv.updated = time.time()
        self._writer.submit(db.save_conversation, replace(conv, messages=[]))


def title_from(text: str, limit: int = 40) -> str:
    """A conversation title from its first message."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def export_markdown(conv: Conversation) -> str:
    parts = [f"# {conv.title}", ""]
    if conv.system_prompt:
        parts += ["> System prompt: " + conv.system_prompt.replace("\n", "\n> "), ""]
    for msg in conv.messages:
        who = "You" if msg.role == "user" else "Assistant"
        parts += [f"## {who}", "", msg.content.rstrip(), ""]
        if not msg.complete:
            parts += ["*(incomplete: the reply was cut off)*", ""]
    return "\n".join(parts)
