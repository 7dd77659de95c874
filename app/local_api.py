"""The app's local OpenAI-compatible API: engine/api/serve.py's server, sharing the chat's model.

The server listens on 127.0.0.1 only (other machines cannot reach it; the CLI is the way to
serve a network). Its queue thread hands each request to the chat's engine thread
(EngineHost.run_api_job), so the chat window and API clients take turns on the one loaded
model in the order they asked. While no model is loaded (or it is reloading), requests get a
503 error object. moeferry.engine.api.serve (and aiohttp) is imported only when the switch is on.
Everything here runs on the UI thread except what the server's own threads do.
"""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from moeferry.app.engine_worker import EngineHost, LoadedInfo
from moeferry.app.settings import Key, Settings

log = logging.getLogger(__name__)
HOST = "127.0.0.1"
QUEUE_SIZE = 8  # API requests that may wait behind the one being served


def base_url(port: int) -> str:
    return f"http://{HOST}:{port}/v1"


class LocalApi(QObject):
    state_changed = Signal(str, bool)  # words for the settings panel, whether it is listening
    status_text = Signal(str)          # for the status bar ("" = the API is off)

    def __init__(self, host: EngineHost, parent: QObject | None = None):
        super().__init__(parent)
        self.host = host
        self.model = None                  # moeferry.engine.api.serve.ModelInfo of the loaded model, or None
        self.listening: tuple[int, str] | None = None  # (port, key) the server runs with
        self._server = None
        self._scheduler = None
        host.worker.api_busy.connect(self._on_busy)

    def set_model(self, info: LoadedInfo | None) -> None:
        if info is None or not info.max_context:
            self.model = None
            return
        from moeferry.engine.api.serve import ModelInfo

        path = Path(info.options.store)
        try:
            created = int(path.stat().st_mtime)
        except OSError:
            created = 0
        self.model = ModelInfo(path.name, info.max_context, created)

    def apply(self, settings: Settings) -> None:
        """Start, restart or stop the server to match the settings (nothing when they match)."""
        want = (settings.get(Key.API_PORT), settings.get(Key.API_KEY)) if settings.get(Key.API_ENABLED) else None
        if want == self.listening and (want is None or self._server is not None):
            return
        self.stop()
        if want is None:
            self.state_changed.emit("Off.", False)
            self.status_text.emit("")
            return
        from moeferry.engine.api.serve import ApiServer, Scheduler, make_app
        from moeferry.engine.errors import UserError

        port, key = want
        scheduler = Scheduler(self.host.run_api_job, QUEUE_SIZE)
        server = ApiServer(make_app(scheduler, lambda: self.model, key or None), HOST, port)
        try:
            server.start()
        except UserError:
            scheduler.close()
            self.state_changed.emit(f"Not serving: port {port} is in use by another program; pick another port.",
                                    False)
            self.status_text.emit("")
            return
        self._server, self._scheduler, self.listening = server, scheduler, want
        log.info("local API listening on %s", base_url(port))
        self.state_changed.emit(f"Serving at {base_url(port)}" + (" (key required)." if key else "."), True)
        self.status_text.emit(f"API on port {port}")

    def stop(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._server is not None:
            self._server.stop()
        self._server = self._scheduler = self.listening = None

    def _on_busy(self, busy: bool) -> None:
        if self.listening is not None:
            self.status_text.emit("API: serving a request…" if busy else f"API on port {self.listening[0]}")
