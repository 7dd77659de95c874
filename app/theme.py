"""Light and dark palettes on the Fusion style; "system" follows the desktop's color scheme."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from app.paths import resources_dir

_LIGHT = {
    "Window": "#f4f5f7", "WindowText": "#1d2330", "Base": "#ffffff", "AlternateBase": "#eef0f4",
    "Text": "#1d2330", "Button": "#e8eaef", "ButtonText": "#1d2330", "Highlight": "#2f6fdb",
    "HighlightedText": "#ffffff", "ToolTipBase": "#ffffff", "ToolTipText": "#1d2330",
    "PlaceholderText": "#7a8192", "Link": "#2f6fdb", "Mid": "#c9cdd6", "Midlight": "#dde0e6",
    "Dark": "#9aa1ae", "Light": "#ffffff", "Shadow": "#6b7280",
}
_DARK = {
    "Window": "#1e2128", "WindowText": "#e4e7ee", "Base": "#15171c", "AlternateBase": "#262a33",
    "Text": "#e4e7ee", "Button": "#2b303a", "ButtonText": "#e4e7ee", "Highlight": "#4a86f0",
    "HighlightedText": "#ffffff", "ToolTipBase": "#2b303a", "ToolTipText": "#e4e7ee",
    "PlaceholderText": "#8b93a4", "Link": "#7eaaf7", "Mid": "#3a404c", "Midlight": "#333844",
    "Dark": "#6b7385", "Light": "#3d4350", "Shadow": "#000000",
}


def is_dark(mode: str) -> bool:
    if mode == "dark":
        return True
    if mode == "light":
        return False
    return QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Dark


def make_palette(dark: bool) -> QPalette:
    palette = QPalette()
    for role, color in (_DARK if dark else _LIGHT).items():
        palette.setColor(getattr(QPalette.ColorRole, role), QColor(color))
    disabled = QColor("#6b7280" if dark else "#a0a6b2")
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText, QPalette.ColorRole.WindowText):
        palette.setColor(QPalette.ColorGroup.Disabled, role, disabled)
    return palette


_styled: set[int] = set()  # apps whose style and sheet are set (not QObject.property: PySide 6.12 miscounts it)


def apply_theme(app: QApplication, mode: str) -> bool:
    """Apply `mode` (system | light | dark); returns whether the dark palette is in use."""
    if id(app) not in _styled:  # first call: replacing a style later is costly and risky
        _styled.add(id(app))
        app.setStyle("Fusion")
        qss = resources_dir() / "styles" / "app.qss"
        app.setStyleSheet(qss.read_text(encoding="utf-8") if qss.exists() else "")
    dark = is_dark(mode)
    app.setPalette(make_palette(dark))
    return dark


def follow_system(app: QApplication, get_mode) -> None:
    """Re-apply the theme when the desktop switches between light and dark (mode "system")."""
    def changed(_scheme) -> None:
        if get_mode() == "system":
            apply_theme(app, "system")
    QGuiApplication.styleHints().colorSchemeChanged.connect(changed)
