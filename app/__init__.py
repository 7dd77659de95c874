"""MoE Ferry's desktop app (PySide6). The engine never imports this package."""

from app.pyside_guard import guard as _guard

_guard()
