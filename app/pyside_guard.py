"""Work around PySide6 6.12's extra reference drops on None, True and False under Python < 3.12.

Measured here (PySide6-Essentials 6.12.0, CPython 3.11): every call of a void Qt method
(QLineEdit.setText, QWidget.setEnabled, ...) and every signal delivery to a Python slot
drops one reference to None (a Python isComplete() override drops one to True). Python
3.12+ makes these objects immortal, so nothing happens there; on 3.11 the interpreter
aborts ("none_dealloc") after some tens of thousands of calls, i.e. minutes into a chat.
6.11.x does not do this. Until the dependency pin excludes 6.12 on Python < 3.12, give the
three singletons a reference count no session can drain.
"""

from __future__ import annotations

import ctypes
import sys

_PAD = 1 << 40
_applied = False


def affected(pyside_version: str, python: tuple[int, int]) -> bool:
    return python < (3, 12) and pyside_version.startswith("6.12.")


def guard() -> bool:
    """Apply once when affected; returns whether the guard is in place."""
    global _applied
    if _applied:
        return True
    try:
        import PySide6
    except ImportError:
        return False
    if not affected(PySide6.__version__, sys.version_info[:2]):
        return False
    for obj in (None, True, False):
        # ob_refcnt is the first field of every CPython object
        ctypes.c_ssize_t.from_address(id(obj)).value += _PAD
    _applied = True
    return True
