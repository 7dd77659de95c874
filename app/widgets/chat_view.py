"""The transcript: replies as Markdown (code blocks shaded and highlighted, with Copy; links open in the
browser), the user's messages as typed (line breaks kept); the streaming reply is re-rendered on a throttle.
Ctrl+wheel asks for a bigger or smaller text size (zoom_requested), which the window keeps as a setting.
"""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication, QPalette, QTextBlockFormat, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import QTextBrowser, QWidget

from moeferry.app.history_db import Conversation, Message
from moeferry.app.theme import colors
from moeferry.app.widgets.code_blocks import find_code_blocks, style_code_block

RENDER_INTERVAL_MS = 80  # a long reply is re-rendered at most this often while it streams
LINK_SCHEME = "moeferry"
WEB_SCHEMES = ("http", "https", "mailto")


def _is_dark(widget: QWidget) -> bool:
    return widget.palette().color(QPalette.ColorRole.Base).lightness() < 128


class ChatView(QTextBrowser):
    action_requested = Signal(str, str)  # action (copy | edit | regenerate), message id
    code_copied = Signal()
    zoom_requested = Signal(int)         # +1 bigger text, -1 smaller (Ctrl+wheel)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._anchor)
        self.document().setDocumentMargin(14)
        self._stream_start: int | None = None
        self._stream_text = ""
        self._stream_id = ""
        self.code: dict[str, str] = {}  # copy key -> the code block's text
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
        self.code.clear()
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
                self._stream_id = msg.id
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
        self._insert_markdown(cursor, self._stream_text or "…", self._stream_id)
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
        color = colors(_is_dark(self))["you" if you else "assistant"]
        links = "".join(f"&nbsp;&nbsp;<a href='{LINK_SCHEME}:{a}/{msg.id}' style='text-decoration:none'>"
                        f"<small>{a.capitalize()}</small></a>" for a in actions)
        who = "You" if you else "Assistant"
        cursor.insertHtml(f"<span style='color:{color}; font-weight:600'>{who}</span>{links}")
        cursor.insertBlock(QTextBlockFormat())

    def _append_message(self, msg: Message, actions: list[str]) -> None:
        self._append_header(msg, actions)
        cursor = self._end()
        if msg.role == "user":
            cursor.insertText(msg.content, QTextCharFormat())  # as typed: line breaks kept, no Markdown
        else:
            self._insert_markdown(cursor, msg.content or "…", msg.id)
        notes = []
        if not msg.complete:
            notes.append("⚠ Incomplete: the app closed before this reply finished.")
        elif msg.stats and msg.stats.get("stopped"):
            notes.append("Stopped.")
        if notes:
            cursor = self._end()
            cursor.insertBlock(QTextBlockFormat())
            color = colors(_is_dark(self))["warning"]
            cursor.insertHtml(f"<i style='color:{color}'>{html.escape(' '.join(notes))}</i>")

    def _insert_markdown(self, cursor: QTextCursor, text: str, msg_id: str) -> None:
        start = cursor.position()
        cursor.insertMarkdown(text)
        palette = colors(_is_dark(self))
        blocks = find_code_blocks(self.document(), start, cursor.position())
        for n, code in reversed(list(enumerate(blocks))):  # from the end: headers shift what follows
            key = f"{msg_id}.{n}"
            self.code[key] = style_code_block(self.document(), code, key, palette, self.font())

    def _scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _anchor(self, url: QUrl) -> None:
        if url.scheme() in WEB_SCHEMES:
            QDesktopServices.openUrl(url)
            return
        if url.scheme() != LINK_SCHEME:
            return
        action, _, key = url.path().partition("/")
        if action == "copycode":
            if key in self.code:
                QGuiApplication.clipboard().setText(self.code[key])
                self.code_copied.emit()
            return
        self.action_requested.emit(action, key)

    def wheelEvent(self, event) -> None:
        if event.modifiers() & Qt.KeyboardModifier.ControlModifier:
            step = event.angleDelta().y()
            if step:
                self.zoom_requested.emit(1 if step > 0 else -1)
            event.accept()
            return
        super().wheelEvent(event)
