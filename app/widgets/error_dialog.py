"""A non-blocking error dialog: one sentence, the details folded away, and the action that fixes it."""

from __future__ import annotations

from typing import Callable

from PySide6.QtWidgets import QMessageBox, QWidget

from moeferry.app.errors import ACTION_LABELS, Action, ErrorInfo


class ErrorDialog(QMessageBox):
    def __init__(self, info: ErrorInfo, on_action: Callable[[Action], None] | None = None,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.info = info
        self.setIcon(QMessageBox.Icon.Warning)
        self.setWindowTitle(info.title)
        self.setText(info.title)
        self.setInformativeText(info.message)
        if info.detail:
            self.setDetailedText(info.detail)
        self.action_button = None
        if info.action in ACTION_LABELS:
            self.action_button = self.addButton(ACTION_LABELS[info.action], QMessageBox.ButtonRole.AcceptRole)
        self.close_button = self.addButton("Close", QMessageBox.ButtonRole.RejectRole)
        self.setDefaultButton(self.action_button or self.close_button)
        self._on_action = on_action
        self.buttonClicked.connect(self._clicked)

    def _clicked(self, button) -> None:
        if button is self.action_button and self._on_action is not None:
            self._on_action(self.info.action)
