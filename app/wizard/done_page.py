"""Wizard page 6: what was set up; Finish opens the chat."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QLabel, QVBoxLayout, QWizardPage


def home_short(path: Path) -> str:
    """The path with the home folder written as ~."""
    try:
        return "~/" + str(Path(path).relative_to(Path.home()))
    except ValueError:
        return str(path)


class DonePage(QWizardPage):
    def __init__(self, wizard):
        super().__init__()
        self.w = wizard
        self.setTitle("Ready")
        self.setSubTitle("Everything is in place.")
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addStretch(1)

    def initializePage(self) -> None:
        w = self.w
        lines = [f"<b>Model:</b> {w.request.name if w.request else 'unchanged'}"]
        if w.store_path:
            lines.append(f"<b>Stored in:</b> {home_short(w.store_path)}")
        if w.cache_experts:
            lines.append(f"<b>Experts cached per layer:</b> {w.cache_experts} "
                         f"(VRAM budget {w.vram_budget_gb:.1f} GB)")
        elif w.vram_budget_gb:
            lines.append(f"<b>Expert cache:</b> as many experts as a VRAM budget of {w.vram_budget_gb:.1f} GB holds")
        else:
            lines.append("<b>Expert cache:</b> automatic")
        lines.append("")
        lines.append("Everything here can be changed later in the Settings panel; the Model menu runs this "
                     "set-up again. Watch the <b>Expert map</b> tab while it answers: it shows which experts "
                     "each layer used and which were already on the GPU.")
        self.summary.setText("<br>".join(lines))
