"""The middle of the window: title, per-conversation system prompt, transcript, input, copy/export."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLineEdit, QPushButton, QVBoxLayout, QWidget

from moeferry.app.widgets.chat_view import ChatView
from moeferry.app.widgets.elided_label import ElidedLabel
from moeferry.app.widgets.message_input import MessageInput
from moeferry.app.widgets.notice_bar import NoticeBar


class ChatPanel(QWidget):
    system_prompt_changed = Signal(str)
    export_requested = Signal()
    copy_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.title = ElidedLabel("New chat")
        self.title.setObjectName("pageHeadline")
        self.copy_button = QPushButton("Copy chat")
        self.copy_button.setToolTip("Copy the whole conversation as Markdown")
        self.copy_button.clicked.connect(self.copy_requested)
        self.export_button = QPushButton("Export…")
        self.export_button.setToolTip("Save the conversation as a Markdown file")
        self.export_button.clicked.connect(self.export_requested)
        self.system_prompt = QLineEdit()
        self.system_prompt.setPlaceholderText("System prompt for this conversation (optional)")
        self.system_prompt.editingFinished.connect(
            lambda: self.system_prompt_changed.emit(self.system_prompt.text()))
        self.notice = NoticeBar()
        self.view = ChatView()
        self.input = MessageInput()

        header = QHBoxLayout()
        header.addWidget(self.title, 1)
        header.addWidget(self.copy_button)
        header.addWidget(self.export_button)
        top = QVBoxLayout()
        top.setContentsMargins(12, 8, 12, 4)
        top.addLayout(header)
        top.addWidget(self.system_prompt)
        top.addWidget(self.notice)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addLayout(top)
        layout.addWidget(self.view, 1)
        layout.addWidget(self.input)
