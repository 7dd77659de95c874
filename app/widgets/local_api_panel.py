"""The settings panel's "Local API" group: the switch, port, key, base URL and a curl example.

Changes are emitted as {Key: value} like the rest of the settings panel; the main window's
LocalApi starts or stops the server to match, and its state comes back through set_state.
"""

from __future__ import annotations

import json

from PySide6.QtCore import QSignalBlocker, Signal
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QWidget,
)

from moeferry.app.local_api import base_url
from moeferry.app.settings import Key, Settings


def curl_example(port: int, model_id: str, key: str) -> str:
    body = json.dumps({"model": model_id or "MODEL", "messages": [{"role": "user", "content": "Hello!"}]})
    auth = f' \\\n  -H "Authorization: Bearer {key}"' if key else ""
    return (f"curl {base_url(port)}/chat/completions \\\n  -H \"Content-Type: application/json\"{auth} \\\n"
            f"  -d '{body}'")


class LocalApiPanel(QGroupBox):
    changed = Signal(dict)  # {Key: value}

    def __init__(self, parent: QWidget | None = None):
        super().__init__("Local API", parent)
        self.model_id = ""
        form = QFormLayout(self)
        self.enabled = QCheckBox("Serve the loaded model to other programs")
        self.enabled.setToolTip("An OpenAI-compatible API on this computer (127.0.0.1) for editors, notebooks "
                                "and agents; the chat and API requests take turns on the model")
        self.port = QSpinBox()
        self.port.setRange(1024, 65535)
        self.port.setKeyboardTracking(False)  # one restart when the number is typed, not one per digit
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.key.setPlaceholderText("Optional")
        self.key.setToolTip("Programs must send this key (Authorization: Bearer KEY); empty: any program on "
                            "this computer may use the API")
        self.url = QLineEdit()
        self.url.setReadOnly(True)
        copy_url = QPushButton("Copy")
        copy_url.setToolTip("Copy the base URL (for the openai client's base_url)")
        copy_url.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.url.text()))
        url_row = QHBoxLayout()
        url_row.addWidget(self.url, 1)
        url_row.addWidget(copy_url)
        self.curl = QPlainTextEdit()
        self.curl.setReadOnly(True)
        self.curl.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.curl.setFixedHeight(self.curl.fontMetrics().lineSpacing() * 5 + 12)
        self.copy_curl = QPushButton("Copy curl example")
        self.copy_curl.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.curl.toPlainText()))
        self.state = QLabel("Off.")
        self.state.setObjectName("muted")
        self.state.setWordWrap(True)
        form.addRow(self.enabled)
        form.addRow("Port", self.port)
        form.addRow("API key", self.key)
        form.addRow("Base URL", url_row)
        form.addRow(self.curl)
        form.addRow(self.copy_curl)
        form.addRow(self.state)

        self.enabled.toggled.connect(lambda on: self.changed.emit({Key.API_ENABLED: on}))
        self.port.valueChanged.connect(self._port_changed)
        self.key.editingFinished.connect(self._key_changed)

    def load(self, settings: Settings) -> None:
        """Show `settings` without emitting changes."""
        blockers = [QSignalBlocker(w) for w in (self.enabled, self.port, self.key)]
        self.enabled.setChecked(settings.get(Key.API_ENABLED))
        self.port.setValue(settings.get(Key.API_PORT))
        self.key.setText(settings.get(Key.API_KEY))
        del blockers
        self._refresh()

    def set_model_id(self, model_id: str) -> None:
        self.model_id = model_id
        self._refresh()

    def set_state(self, text: str, _listening: bool) -> None:
        self.state.setText(text)

    def _port_changed(self, port: int) -> None:
        self._refresh()
        self.changed.emit({Key.API_PORT: port})

    def _key_changed(self) -> None:
        self._refresh()
        self.changed.emit({Key.API_KEY: self.key.text().strip()})

    def _refresh(self) -> None:
        self.url.setText(base_url(self.port.value()))
        self.curl.setPlainText(curl_example(self.port.value(), self.model_id, self.key.text().strip()))
