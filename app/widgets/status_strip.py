"""The status bar's live numbers: model state, tokens/s, first token, cache and prefetch hits, VRAM, H2D."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar, QWidget

from app.stats_format import stats_items


class StatusStrip(QStatusBar):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.model_label = QLabel("No model")
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setMaximumWidth(160)
        self.progress.setTextVisible(False)
        self.progress.hide()
        self.addWidget(self.model_label)
        self.addWidget(self.progress)
        self.labels: dict[str, QLabel] = {}
        for item in stats_items(None):
            label = QLabel(item.text)
            label.setToolTip(item.tooltip)
            label.setContentsMargins(6, 0, 6, 0)
            self.labels[item.key] = label
            self.addPermanentWidget(label)

    def set_model_state(self, text: str, fraction: float) -> None:
        self.model_label.setText(text)
        self.progress.setVisible(fraction >= 0)
        if fraction >= 0:
            self.progress.setValue(int(fraction * 1000))

    def set_stats(self, stats) -> None:
        for item in stats_items(stats):
            self.labels[item.key].setText(item.text)
            self.labels[item.key].setToolTip(item.tooltip)
