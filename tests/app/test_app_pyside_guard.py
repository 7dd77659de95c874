"""The guard against PySide6 6.12's reference drops on None (Python < 3.12)."""

import sys

from app.pyside_guard import affected


def test_affected_versions():
    assert affected("6.12.0", (3, 11)) and affected("6.12.1", (3, 10))
    assert not affected("6.12.0", (3, 12)) and not affected("6.11.3", (3, 11))


def test_ten_thousand_void_calls_do_not_drain_none(qapp):
    from PySide6.QtWidgets import QLineEdit

    edit = QLineEdit()
    for i in range(10000):
        edit.setText(str(i % 2))
    assert sys.getrefcount(None) > 1000
