"""The transcript: Markdown messages with styled code blocks; the streaming reply is re-rendered on a throttle."""

from __future__ import annotations

import html

from PySide6.QtCore import QTimer, QUrl, Signal
from PySide6.QtGui import QColor, QFont, QPalette, QTextBlockFormat, QTextCursor, QTextFormat
from PySide6.QtWidgets import QTextBrowser, QWidget

from app.history_db import Conversation, Message

RENDER_INTERVAL_MS = 80  # a long reply is re-rendered at most this often while it streams
LINK_SCHEME = "moeferry"


def _is_dark(widget: QWidget) -> bool:
    return widget.palette().color(QPalette.ColorRole.Base).lightness() < 128


class ChatView(QTextBrowser):
    action_requested = Signal(str, str)  # action (copy | edit | regenerate), message id

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._anchor)
        self.document().setDocumentMargin(14)
        self._stream_start: int | None = None
        self._stream_text = ""
        self.render_count = 0  # stream re-renders so far (tests check the throttle)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(RENDER_INTERVAL_MS)
        self._timer.timeout.connect(self._render_stream)
        self.empty_text = ""

    # Whole conversation
    def show_conversation(self, conv: Conversation | None, streaming_id: str = "") -> None:
        self._timer.stop()
        self.clear()
        self._stream_start = None
        if conv is None or not conv.messages:
            if self.empty_text:
                self.setHtml(self.empty_text)
            return
        last_user = max((i for i, m in enumerate(conv.messages) if m.role == "user"), default=-1)
        last = len(conv.messages) - 1
        for i, msg in enumerate(conv.messages):
            actions = ["copy"]
            if i == last_user and not streaming_id:
                actions.append("edit")
            if i == last and msg.role == "assistant" and not streaming_id:
                actions.append("regenerate")
            if msg.id == streaming_id:
                self._append_header(msg, [])
                self._stream_start = self._end().position()
                self._stream_text = msg.content
                self._render_stream()
            else:
                self._append_message(msg, actions)
        self._scroll_to_end()

    # Streaming
    def set_stream_text(self, text: str) -> None:
        """Record the streaming text; it is drawn at most every RENDER_INTERVAL_MS."""
        self._stream_text = text
        if not self._timer.isActive():
            self._timer.start()

    def flush_stream(self) -> None:
        if self._timer.isActive():
            self._timer.stop()
            self._render_stream()

    def _render_stream(self) -> None:
        if self._stream_start is None:
            return
        bar = self.verticalScrollBar()
        at_end = bar.value() >= bar.maximum() - 4
        cursor = QTextCursor(self.document())
        cursor.setPosition(self._stream_start)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        self._insert_markdown(cursor, self._stream_text or "…")
        self.render_count += 1
        if at_end:
            self._scroll_to_end()

    # Building blocks
    def _end(self) -> QTextCursor:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor

    def _append_header(self, msg: Message, actions: list[str]) -> None:
        cursor = self._end()
        if not self.document().isEmpty():
            cursor.insertBlock()
        fmt = QTextBlockFormat()
        fmt.setTopMargin(14)
        fmt.setBottomMargin(2)
        cursor.setBlockFormat(fmt)
        you = msg.role == "user"
        color = "#2f6fdb" if you else "#0f9d74"
        if _is_dark(self):
            color = "#7eaaf7" if you else "#4fd1a5"
        links = "".join(f"&nbsp;&nbsp;<a href='{LINK_SCHEME}:{a}/{msg.id}' style='text-decoration:none'>"
                        f"<small>{a.capitalize()}</small></a>" for a in actions)
        who = "You" if you else "Assistant"
        cursor.insertHtml(f"<span style='color:{color}; font-weight:600'>{who}</span>{links}")
        cursor.insertBlock(QTextBlockFormat())

    def _append_message(self, msg: Message, actions: list[str]) -> None:
        self._append_header(msg, actions)
        cursor = self._end()
        self._insert_markdown(cursor, msg.content or "…")
        notes = []
        if not msg.complete:
            notes.append("⚠ Incomplete: the app closed before this reply finished.")
        elif msg.stats and msg.stats.get("stopped"):
            notes.append("Stopped.")
        if notes:
            cursor = self._end()
            cursor.insertBlock(QTextBlockFormat())
            cursor.insertHtml(f"<i style='color:#b7791f'>{html.escape(' '.join(notes))}</i>")

    def _insert_markdown(self, cursor: QTextCursor, text: str) -> None:
        start = cursor.position()
        cursor.insertMarkdown(text)
        self._style_code_blocks(start, cursor.position())

    def _style_code_blocks(self, start: int, end: int) -> None:
        dark = _is_dark(self)
        background = QColor("#262b35" if dark else "#f1f3f6")
        mono = QFont("monospace")
        mono.setStyleHint(QFont.StyleHint.Monospace)
        block = self.document().findBlock(start)
        while block.isValid() and block.position() <= end:
            fmt = block.blockFormat()
            if fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.nonBreakableLines():
                cursor = QTextCursor(block)
                fmt.setBackground(background)
                fmt.setLeftMargin(8)
                fmt.setRightMargin(8)
                cursor.setBlockFormat(fmt)
            block = block.next()

    def _scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _anchor(self, url: QUrl) -> None:
        if url.scheme() != LINK_SCHEME:
            return
        action, _, msg_id = url.path().partition("/")
        self.action_requested.emit(action, msg_id)
