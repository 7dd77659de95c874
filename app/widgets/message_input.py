"""The input box: Enter sends, Shift+Enter adds a line, Tab moves on; Send turns into Stop while a reply streams.

Edit mode swaps "Edit last" for "Cancel edit" in the same place and the hint wraps, so the row's
minimum width, and with it the panes beside the chat, do not move.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QSizePolicy, QVBoxLayout, QWidget


class _Editor(QPlainTextEdit):
    submit = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
                event.modifiers() & Qt.KeyboardModifier.ShiftModifier):
            self.submit.emit()
            return
        super().keyPressEvent(event)


class MessageInput(QWidget):
    send_requested = Signal(str)
    resend_requested = Signal(str)   # the edited last user message
    stop_requested = Signal()
    regenerate_requested = Signal()
    edit_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.editing = False
        self.busy = False
        self.editor = _Editor()
        self.editor.setObjectName("messageInput")
        self.editor.setPlaceholderText("Type a message (Enter to send, Shift+Enter for a new line)")
        self.editor.setTabChangesFocus(True)  # Tab leaves the box, as in any other form field
        self.editor.setFixedHeight(84)
        self.editor.submit.connect(self._primary)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.clicked.connect(self._primary)
        self.regenerate_button = QPushButton("Regenerate")
        self.regenerate_button.setToolTip("Ask again for the last reply")
        self.regenerate_button.clicked.connect(self.regenerate_requested)
        self.edit_button = QPushButton("Edit last")
        self.edit_button.setToolTip("Edit your last message and send it again")
        self.edit_button.clicked.connect(self.edit_requested)
        self.cancel_edit_button = QPushButton("Cancel edit")
        self.cancel_edit_button.clicked.connect(self.cancel_edit)
        self.cancel_edit_button.hide()
        self.hint = QLabel("")
        self.hint.setObjectName("muted")
        self.hint.setWordWrap(True)
        self.hint.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        width = max(self.edit_button.sizeHint().width(), self.cancel_edit_button.sizeHint().width())
        self.edit_button.setMinimumWidth(width)
        self.cancel_edit_button.setMinimumWidth(width)

        row = QHBoxLayout()
        row.addWidget(self.hint, 1)
        row.addWidget(self.cancel_edit_button)
        row.addWidget(self.edit_button)
        row.addWidget(self.regenerate_button)
        row.addWidget(self.send_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 4, 12, 10)
        layout.addWidget(self.editor)
        layout.addLayout(row)

    def set_busy(self, busy: bool) -> None:
        self.busy = busy
        self.send_button.setText("Stop" if busy else ("Resend" if self.editing else "Send"))
        self.send_button.setToolTip("Stop the reply (Esc)" if busy else "Send (Enter)")
        self.regenerate_button.setEnabled(not busy)
        self.edit_button.setEnabled(not busy)

    def start_edit(self, text: str) -> None:
        self.editing = True
        self.editor.setPlainText(text)
        self.editor.setFocus()
        self.hint.setText("Editing your last message: what followed it will be replaced.")
        self.edit_button.hide()
        self.cancel_edit_button.show()
        self.set_busy(self.busy)

    def cancel_edit(self) -> None:
        self.editing = False
        self.editor.clear()
        self.hint.setText("")
        self.cancel_edit_button.hide()
        self.edit_button.show()
        self.set_busy(self.busy)

    def _primary(self) -> None:
        if self.busy:
            self.stop_requested.emit()
            return
        text = self.editor.toPlainText().strip()
        if not text:
            return
        if self.editing:
            self.resend_requested.emit(text)
            self.cancel_edit()
        else:
            self.send_requested.emit(text)
            self.editor.clear()
