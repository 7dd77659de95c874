"""The status bar's live numbers: model state, tokens/s, first token, cache and prefetch hits, GPU memory
and copy speed (the GPU items are hidden when the model runs on the CPU).

The numbers never make the window wider: when the bar is narrow (a small window, a large text
size) the items at the end are hidden first, and the model state is elided.
"""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar, QWidget

from moeferry.app.stats_format import stats_items
from moeferry.app.widgets.elided_label import ElidedLabel

MODEL_MIN_W = 140  # room kept for the model state before any number is shown


class StatusStrip(QStatusBar):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.model_label = ElidedLabel("No model")
        self.model_label.setMinimumWidth(60)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setMaximumWidth(160)
        self.progress.setTextVisible(False)
        self.progress.hide()
        self.addWidget(self.model_label, 1)
        self.addWidget(self.progress)
        self.labels: dict[str, QLabel] = {}
        self._wanted: dict[str, bool] = {}  # has something to say (before fitting the width)
        for item in stats_items(None):
            label = QLabel(item.text)
            label.setToolTip(item.tooltip)
            label.setContentsMargins(6, 0, 6, 0)
            self.labels[item.key] = label
            self._wanted[item.key] = True
            self.addPermanentWidget(label)

    def set_model_state(self, text: str, fraction: float) -> None:
        self.model_label.setText(text)
        self.progress.setVisible(fraction >= 0)
        if fraction >= 0:
            self.progress.setValue(int(fraction * 1000))
        self._fit()

    def set_stats(self, stats, on_gpu: bool = True, hit_rate: float | None = None, streaming: bool = False) -> None:
        for item in stats_items(stats, on_gpu, hit_rate, streaming):
            label = self.labels[item.key]
            label.setText(item.text)
            label.setToolTip(item.tooltip)
            self._wanted[item.key] = bool(item.text)
        self._fit()

    def shown_keys(self) -> list[str]:
        return [key for key, label in self.labels.items() if not label.isHidden()]

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit()

    def minimumSizeHint(self):
        hint = super().minimumSizeHint()
        hint.setWidth(MODEL_MIN_W)
        return hint

    def _fit(self) -> None:
        room = self.width() - MODEL_MIN_W - (self.progress.sizeHint().width() if self.progress.isVisibleTo(self)
                                             else 0)
        for key, label in self.labels.items():  # in order of importance: tokens/s first
            need = label.sizeHint().width() + 8
            show = self._wanted[key] and need <= room
            if show:
                room -= need
            label.setVisible(show)
