"""Progress of long operations on the command line (load, convert, serve's model load)."""

from __future__ import annotations

import sys
import time


class ProgressLine:
    """A one-line progress display on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, fraction: float, message: str) -> None:
        now = time.monotonic()
        if fraction < 1.0 and now - self.last < (0.2 if self.tty else 5.0):
            return
        self.last = now
        line = f"{fraction * 100:5.1f}%  {message}"
        if self.tty:
            print("\r" + line[:100].ljust(100), end="" if fraction < 1.0 else "\n", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)
