"""MoE Ferry's desktop app (PySide6). The engine never imports this package."""
