"""Progress of a download: byte counts, the recent rate and ETA, and how the CLI draws them.

engine/setup/download.py reports through _Tracker, which throttles events to one per EVERY_S and
estimates the rate over the last WINDOW_S seconds; _ProgressBar redraws one line on a
terminal and writes a line every log_every_s otherwise.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from moeferry.engine.setup.hf_cache import RemoteFile
from moeferry.engine.units import fmt_bytes, fmt_duration


@dataclass
class FetchProgress:
    """One progress event; `phase` is "download", "verify", "reuse" or "done"."""
    file: str
    file_done: int
    file_total: int
    done: int
    total: int
    rate_bps: float
    eta_s: float | None
    files_done: int
    files_total: int
    phase: str = "download"



class _Tracker:
    """Counts bytes, estimates the rate over the last seconds, and throttles events."""

    WINDOW_S = 5.0
    EVERY_S = 0.1

    def __init__(self, files: list[RemoteFile], state: dict, callback, log=None):
        self.callback = callback
        self.log = log or (lambda msg: None)
        self.total = sum(f.size for f in files)
        self.files_total = len(files)
        self.done = sum(f.size for f in files if f.path in state["verified"])
        self.files_done = sum(1 for f in files if f.path in state["verified"])
        self.transferred = 0
        self.samples: deque = deque([(time.monotonic(), 0)])
        self.file_done_bytes = 0
        self.last_emit = 0.0
        self.current: RemoteFile | None = None

    def start_file(self, rf: RemoteFile, done: int) -> None:
        self.current, self.file_done_bytes = rf, done

    def advance(self, rf: RemoteFile, n: int, transferred: bool = True, phase: str = "download"):
        self.file_done_bytes += n
        self.done += n
        if transferred:
            self.transferred += n
        self.emit(rf.path, self.file_done_bytes, rf.size, phase)

    def file_done(self, rf: RemoteFile) -> None:
        self.files_done += 1
        self.emit(rf.path, rf.size, rf.size, "download", force=True)

    def file_failed(self, rf: RemoteFile) -> None:
        self.done -= self.file_done_bytes
        self.emit(rf.path, 0, rf.size, "verify", force=True)

    def rate(self) -> float:
        now = time.monotonic()
        self.samples.append((now, self.transferred))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.WINDOW_S:
            self.samples.popleft()
        t0, b0 = self.samples[0]
        return (self.transferred - b0) / (now - t0) if now > t0 else 0.0

    def emit(self, name: str, file_done: int, file_total: int, phase: str, force: bool = False):
        now = time.monotonic()
        if self.callback is None or (not force and now - self.last_emit < self.EVERY_S):
            return
        self.last_emit = now
        rate = self.rate()
        left = max(self.total - self.done, 0)
        eta = left / rate if rate > 0 else (0.0 if left == 0 else None)
        self.callback(FetchProgress(name, file_done, file_total, self.done, self.total, rate, eta,
                                    self.files_done, self.files_total, phase))


@dataclass
class _ProgressBar:
    """Renders FetchProgress on a terminal (one redrawn line) or a log (a line now and then)."""
    stream: object
    width: int = 24
    log_every_s: float = 10.0
    _last_log: float = 0.0
    _drawn: bool = field(default=False)

    def __call__(self, p: FetchProgress) -> None:
        frac = p.done / p.total if p.total else 1.0
        fill = int(frac * self.width)
        eta = fmt_duration(p.eta_s) if p.eta_s is not None else "--"
        line = (f"{frac * 100:5.1f}% [{'#' * fill}{'-' * (self.width - fill)}] "
                f"{fmt_bytes(p.done)}/{fmt_bytes(p.total)} {fmt_bytes(p.rate_bps)}/s "
                f"ETA {eta}  {p.file}")
        if _isatty(self.stream):
            self.stream.write("\r" + line[:120].ljust(120))
            self._drawn = True
        elif time.monotonic() - self._last_log >= self.log_every_s or p.phase == "done":
            self._last_log = time.monotonic()
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        self.finish()
        self.stream.write(text + "\n")

    def finish(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self._drawn = False


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
