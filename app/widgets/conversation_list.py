"""The conversation list: search, new, rename (in place), delete."""

from __future__ import annotations

from PySide6.QtCore import QSignalBlocker, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from moeferry.app.history_db import Conversation

ID_ROLE = Qt.ItemDataRole.UserRole


def confirm_delete(parent: QWidget, title: str) -> bool:
    answer = QMessageBox.question(parent, "Delete conversation",
                                  f"Delete “{title}”? This cannot be undone.",
                                  QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                  QMessageBox.StandardButton.No)
    return answer == QMessageBox.StandardButton.Yes


class ConversationList(QWidget):
    selected = Signal(str)
    new_requested = Signal()
    rename_requested = Signal(str, str)
    delete_requested = Signal(str)
    search_changed = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 4, 8)
        self.new_button = QPushButton("New chat")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.new_requested)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search conversations")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.search_changed)
        self.list = QListWidget()
        self.list.setObjectName("conversationList")
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)  # long titles are elided
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.currentItemChanged.connect(self._current_changed)
        self.list.itemChanged.connect(self._item_edited)
        buttons = QHBoxLayout()
        self.rename_button = QPushButton("Rename")
        self.delete_button = QPushButton("Delete")
        self.rename_button.clicked.connect(self.start_rename)
        self.delete_button.clicked.connect(self.delete_current)
        buttons.addWidget(self.rename_button)
        buttons.addWidget(self.delete_button)
        layout.addWidget(self.new_button)
        layout.addWidget(self.search)
        layout.addWidget(self.list, 1)
        layout.addLayout(buttons)

    def set_conversations(self, conversations: list[Conversation], current_id: str) -> None:
        blocker = QSignalBlocker(self.list)
        self.list.clear()
        for conv in conversations:
            item = QListWidgetItem(conv.title)
            item.setData(ID_ROLE, conv.id)
            item.setToolTip(conv.title)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            self.list.addItem(item)
            if conv.id == current_id:
                self.list.setCurrentItem(item)
        del blocker
        has = self.current_id() != ""
        self.rename_button.setEnabled(has)
        self.delete_button.setEnabled(has)

    def current_id(self) -> str:
        item = self.list.currentItem()
        return item.data(ID_ROLE) if item else ""

    def start_rename(self) -> None:
        item = self.list.currentItem()
        if item:
            self.list.editItem(item)

    def delete_current(self) -> None:
        item = self.list.currentItem()
        if item and confirm_delete(self, item.text()):
            self.delete_requested.emit(item.data(ID_ROLE))

    def _current_changed(self, item, _previous) -> None:
        if item is not None:
            self.selected.emit(item.data(ID_ROLE))

    def _item_edited(self, item: QListWidgetItem) -> None:
        # Deferred: the rename rebuilds the list, which must not happen inside the item's own signal.
        conv_id, title = item.data(ID_ROLE), item.text()
        QTimer.singleShot(0, lambda: self.rename_requested.emit(conv_id, title))

    def _menu(self, pos) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        self.list.setCurrentItem(item)
        menu = QMenu(self)
        menu.addAction("Rename", self.start_rename)
        menu.addAction("Delete", self.delete_current)
        menu.exec(self.list.viewport().mapToGlobal(pos))
