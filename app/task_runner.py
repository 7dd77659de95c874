"""Run one long function (probe, download, convert, verify) on its own QThread with progress and cancel."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from PySide6.QtCore import QObject, QThread, Signal, Slot

from moeferry.app.errors import describe_error

log = logging.getLogger(__name__)


class _Job(QObject):
    progress = Signal(object)
    finished = Signal(object)
    failed = Signal(object)      # ErrorInfo
    cancelled = Signal()

    def __init__(self, fn: Callable[[Callable[[Any], None], threading.Event], Any], cancel: threading.Event):
        super().__init__()
        self._fn = fn
        self._cancel = cancel

    @Slot()
    def run(self) -> None:
        try:
            result = self._fn(self.progress.emit, self._cancel)
        except Exception as exc:
            if self._cancel.is_set():
                self.cancelled.emit()
            else:
                log.exception("task failed")
                self.failed.emit(describe_error(exc))
            return
        if self._cancel.is_set():
            self.cancelled.emit()
        else:
            self.finished.emit(result)


class TaskRunner(QObject):
    """`fn(report, cancel)` runs on a worker thread; its signals arrive on the UI thread."""

    progress = Signal(object)
    finished = Signal(object)
    failed = Signal(object)
    cancelled = Signal()

    def __init__(self, fn: Callable, parent: QObject | None = None):
        super().__init__(parent)
        self.cancel_event = threading.Event()
        self._thread = QThread()
        self._job = _Job(fn, self.cancel_event)
        self._job.moveToThread(self._thread)
        self._thread.started.connect(self._job.run)
        for sig, out in ((self._job.progress, self.progress), (self._job.finished, self.finished),
                         (self._job.failed, self.failed), (self._job.cancelled, self.cancelled)):
            sig.connect(out)
        for sig in (self._job.finished, self._job.failed, self._job.cancelled):
            sig.connect(self._thread.quit)
        self.running = False
        self._thread.finished.connect(self._on_thread_finished)

    def start(self) -> None:
        self.running = True
        self._thread.start()

    def cancel(self) -> None:
        self.cancel_event.set()

    def stop(self, timeout_ms: int = 3000) -> bool:
        """Cancel and wait (bounded) for the thread to end."""
        self.cancel_event.set()
        if not self._thread.isRunning():
            return True
        self._thread.quit()
        return self._thread.wait(timeout_ms)

    def _on_thread_finished(self) -> None:
        self.running = False
