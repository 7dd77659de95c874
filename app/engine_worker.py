"""The engine's worker: a QObject living on its own QThread; the UI talks to it by signals only."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QThread, Signal, Slot

from moeferry.app.engine_backend import EngineBackend, LoadOptions
from moeferry.app.errors import Action, ErrorInfo, describe_error
from moeferry.engine.contract import EngineProtocol, ExpertTrace, GenerationStats, SamplingSettings

log = logging.getLogger(__name__)
# Pieces are coalesced so a fast model does not flood the UI thread with one signal per token.
EMIT_INTERVAL_S = 0.03


@dataclass
class GenerateRequest:
    id: int
    messages: list[dict]
    sampling: SamplingSettings
    prefetch: int
    cache_experts: int | None
    cpu_threads: int = 0  # 0: the engine's own choice
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class LoadedInfo:
    options: LoadOptions
    num_experts: int
    note: str  # e.g. the engine fell back to pageable memory; "" when none
    max_context: int  # tokens; what the local API checks max_tokens against
    device: str  # where it runs: "cuda" or "cpu"


@dataclass
class ReplyResult:
    id: int
    text: str
    stopped: bool
    stats: GenerationStats | None = None
    trace: ExpertTrace | None = None
    error: ErrorInfo | None = None


NO_MODEL = ErrorInfo("No model loaded", "No model is loaded yet; set one up with the wizard first.",
                     Action.CHOOSE_MODEL)


class EngineWorker(QObject):
    load_progress = Signal(float, str)
    loaded = Signal(object)        # LoadedInfo
    load_failed = Signal(object)   # ErrorInfo
    pieces = Signal(int, str)      # request id, new text
    reply_done = Signal(object)    # ReplyResult (error set when it failed)
    api_busy = Signal(bool)        # a local API request is being served

    def __init__(self, backend: EngineBackend):
        super().__init__()
        self._backend = backend
        self._engine: EngineProtocol | None = None
        self._options: LoadOptions | None = None
        self._prefetch: int | None = None
        self._cache: int | None = None
        self._cpu_threads = 0

    @Slot(object)
    def load(self, opts: LoadOptions) -> None:
        self._close_engine()
        try:
            self._engine = self._backend.load(opts, lambda f, m="": self.load_progress.emit(float(f), str(m)))
        except Exception as exc:
            log.exception("loading %s failed", opts.store)
            self.load_failed.emit(describe_error(exc))
            return
        self._options, self._prefetch, self._cache, self._cpu_threads = opts, opts.prefetch, opts.cache_experts, 0
        e = self._engine
        self.loaded.emit(LoadedInfo(opts, e.config.num_experts, e.note, e.max_context, e.device.type))

    @Slot(object)
    def generate(self, req: GenerateRequest) -> None:
        if self._engine is None:
            self.reply_done.emit(ReplyResult(req.id, "", False, error=NO_MODEL))
            return
        text: list[str] = []
        pending: list[str] = []
        last_emit = 0.0  # the first piece goes out at once
        try:
            if req.prefetch != self._prefetch:
                self._engine.set_prefetch(req.prefetch)
                self._prefetch = req.prefetch
            if req.cache_experts is not None and req.cache_experts != self._cache:
                self._engine.set_cache_experts(req.cache_experts)
                self._cache = req.cache_experts
            if req.cpu_threads != self._cpu_threads:
                self._engine.set_cpu_threads(req.cpu_threads)
                self._cpu_threads = req.cpu_threads
            for piece in self._engine.stream(req.messages, req.sampling, cancel=req.cancel):
                text.append(piece.text)
                pending.append(piece.text)
                now = time.monotonic()
                if now - last_emit >= EMIT_INTERVAL_S:
                    self.pieces.emit(req.id, "".join(pending))
                    pending.clear()
                    last_emit = now
                if req.cancel.is_set():
                    break
        except Exception as exc:
            log.exception("generation failed")
            if pending:
                self.pieces.emit(req.id, "".join(pending))
            self.reply_done.emit(ReplyResult(req.id, "".join(text), True, error=describe_error(exc)))
            return
        if pending:
            self.pieces.emit(req.id, "".join(pending))
        self.reply_done.emit(ReplyResult(req.id, "".join(text), req.cancel.is_set(),
                                         self._engine.last_stats, self._engine.last_trace))

    @Slot(object)
    def serve_job(self, job) -> None:
        """One local API request (moeferry.engine.api.serve.Job), between the chat's requests."""
        from moeferry.engine.api.serve import run_job

        self.api_busy.emit(True)
        try:
            run_job(self._engine, job)
        finally:
            self.api_busy.emit(False)

    @Slot()
    def shutdown(self) -> None:
        self._close_engine()
        QThread.currentThread().quit()

    def _close_engine(self) -> None:
        if self._engine is not None:
            try:
                self._engine.close()
            except Exception:
                log.exception("closing the engine failed")
        self._engine = None


class EngineHost(QObject):
    """Owns the worker thread; everything here runs on the UI thread and returns at once."""

    _load = Signal(object)
    _generate = Signal(object)
    _serve = Signal(object)
    _shutdown = Signal()

    def __init__(self, backend: EngineBackend, parent: QObject | None = None):
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("moeferry-engine")
        self.worker = EngineWorker(backend)
        self.worker.moveToThread(self.thread)
        self._load.connect(self.worker.load)
        self._generate.connect(self.worker.generate)
        self._serve.connect(self.worker.serve_job)
        self._shutdown.connect(self.worker.shutdown)
        self._next_id = 0
        self._current: GenerateRequest | None = None
        self.thread.start()

    def load(self, opts: LoadOptions) -> None:
        self._load.emit(opts)

    def generate(self, messages: list[dict], sampling: SamplingSettings, prefetch: int,
                 cache_experts: int | None, cpu_threads: int = 0) -> GenerateRequest:
        self._next_id += 1
        req = GenerateRequest(self._next_id, messages, sampling, prefetch, cache_experts, cpu_threads)
        self._current = req
        self._generate.emit(req)
        return req

    def run_api_job(self, job) -> None:
        """Run a local API request on the engine thread, after what is queued there; returns when
        it is done. Called from the API's queue thread, never the UI thread."""
        self._serve.emit(job)
        job.done.wait()

    def stop(self) -> None:
        if self._current is not None:
            self._current.cancel.set()

    def shutdown(self, timeout_ms: int = 5000) -> bool:
        """Cancel, close the engine and stop the thread; False when it did not stop in time."""
        self.stop()
        self._shutdown.emit()  # runs after the current request, which the cancel ends quickly
        stopped = self.thread.wait(timeout_ms)
        if not stopped:
            log.warning("the engine thread did not stop within %d ms", timeout_ms)
        return stopped
