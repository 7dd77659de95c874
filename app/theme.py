"""Light and dark palettes on the Fusion style; "system" follows the desktop's color scheme.

Every color the app draws text with is here: the palette roles and the named colors of
`colors()` (chat roles, verdict levels, code highlighting). Each text color has at least
4.5:1 contrast with the backgrounds it is drawn on (WCAG AA), checked by the tests.
A theme or font change re-sets the style sheet, which makes Qt re-polish every widget:
widgets styled by the sheet keep the palette they were polished with otherwise.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from moeferry.app.paths import resources_dir

_LIGHT = {
    "Window": "#f4f5f7", "WindowText": "#1d2330", "Base": "#ffffff", "AlternateBase": "#eef0f4",
    "Text": "#1d2330", "Button": "#e8eaef", "ButtonText": "#1d2330", "Highlight": "#2860c8",
    "HighlightedText": "#ffffff", "ToolTipBase": "#ffffff", "ToolTipText": "#1d2330",
    "PlaceholderText": "#5d6475", "Link": "#2860c8", "Mid": "#c9cdd6", "Midlight": "#dde0e6",
    "Dark": "#9aa1ae", "Light": "#ffffff", "Shadow": "#6b7280",
}
_DARK = {
    "Window": "#1e2128", "WindowText": "#e4e7ee", "Base": "#15171c", "AlternateBase": "#262a33",
    "Text": "#e4e7ee", "Button": "#2b303a", "ButtonText": "#e4e7ee", "Highlight": "#3a6fd6",
    "HighlightedText": "#ffffff", "ToolTipBase": "#2b303a", "ToolTipText": "#e4e7ee",
    "PlaceholderText": "#9aa2b2", "Link": "#7eaaf7", "Mid": "#3a404c", "Midlight": "#333844",
    "Dark": "#6b7385", "Light": "#3d4350", "Shadow": "#000000",
}
# Named text colors, drawn on Window, Base or the code background.
_LIGHT_COLORS = {
    "you": "#2860c8", "assistant": "#0b7a5a", "good": "#146c47", "warning": "#8a5a12", "error": "#b42828",
    "code_bg": "#eef1f5", "badge_bg": "#146c47",
    "keyword": "#8f2a9e", "string": "#146c47", "comment": "#5d6475", "number": "#8a5a12", "name": "#1f55b5",
}
_DARK_COLORS = {
    "you": "#7eaaf7", "assistant": "#4fd1a5", "good": "#5fd39a", "warning": "#e6b450", "error": "#f28b82",
    "code_bg": "#262b35", "badge_bg": "#146c47",
    "keyword": "#d59cf0", "string": "#8fd49d", "comment": "#9aa2b2", "number": "#e6b450", "name": "#8cb8ff",
}


def is_dark(mode: str) -> bool:
    if mode == "dark":
        return True
    if mode == "light":
        return False
    return QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Dark


def palette_colors(dark: bool) -> dict[str, str]:
    return dict(_DARK if dark else _LIGHT)


def colors(dark: bool) -> dict[str, str]:
    """The named colors (chat roles, levels, code) of the light or dark theme."""
    return dict(_DARK_COLORS if dark else _LIGHT_COLORS)


def contrast_ratio(a: str | QColor, b: str | QColor) -> float:
    """WCAG 2 contrast ratio of two colors, 1 to 21."""
    def luminance(c: QColor) -> float:
        def channel(v: float) -> float:
            return v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4
        return 0.2126 * channel(c.redF()) + 0.7152 * channel(c.greenF()) + 0.0722 * channel(c.blueF())
    la, lb = sorted((luminance(QColor(a)), luminance(QColor(b))), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def make_palette(dark: bool) -> QPalette:
    palette = QPalette()
    for role, color in palette_colors(dark).items():
        palette.setColor(getattr(QPalette.ColorRole, role), QColor(color))
    disabled = QColor("#6b7280" if dark else "#a0a6b2")
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText, QPalette.ColorRole.WindowText):
        palette.setColor(QPalette.ColorGroup.Disabled, role, disabled)
    return palette


_state: dict[int, dict[str, float]] = {}  # app id -> its default and current text size (not QObject.property:
                                         # PySide 6.12 miscounts it)


def apply_theme(app: QApplication, mode: str, font_size: float = 0) -> bool:
    """Apply `mode` (system | light | dark) and the text size in points (0 = the system's);
    returns whether the dark palette is in use."""
    if id(app) not in _state:  # first call: replacing a style later is costly and risky
        _state[id(app)] = {"default": app.font().pointSizeF(), "size": 0.0}
        app.setStyle("Fusion")
    state = _state[id(app)]
    state["size"] = font_size
    dark = is_dark(mode)
    app.setPalette(make_palette(dark))
    font = QFont(app.font())
    size = font_size or state["default"]
    font.setPointSizeF(size)
    app.setFont(font)
    qss = resources_dir() / "styles" / "app.qss"
    sheet = qss.read_text(encoding="utf-8") if qss.exists() else ""
    # The headline is a step above the text size, whatever that is.
    app.setStyleSheet(sheet + f"\nQLabel#pageHeadline {{ font-size: {size * 1.15:.1f}pt; }}\n")
    return dark


def follow_system(app: QApplication, get_mode) -> None:
    """Re-apply the theme when the desktop switches between light and dark (mode "system")."""
    def changed(_scheme) -> None:
        if get_mode() == "system":
            apply_theme(app, "system", _state.get(id(app), {}).get("size", 0.0))
    QGuiApplication.styleHints().colorSchemeChanged.connect(changed)
