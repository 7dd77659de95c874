"""An inline notice above the chat (for example: a damaged settings file was moved aside)."""

from __future__ import annotations

from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QWidget


class NoticeBar(QFrame):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("noticeBar")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(10, 6, 6, 6)
        self.label = QLabel()
        self.label.setWordWrap(True)
        close = QPushButton("Dismiss")
        close.clicked.connect(self.hide)
        layout.addWidget(self.label, 1)
        layout.addWidget(close)
        self.hide()

    def show_notice(self, text: str) -> None:
        existing = self.label.text()
        self.label.setText(f"{existing}\n{text}" if existing and not self.isHidden() else text)
        self.show()
