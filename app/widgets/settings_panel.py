"""The settings panel: model variant, speed (prefetch, cache, GPU memory), sampling, theme and text size.

Every change is emitted at once as {Key: value}; the chat applies it from the next message,
and a different model variant is reloaded in the worker with progress in the status bar.
"""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QSignalBlocker, Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from moeferry.app.settings import Key, Settings
from moeferry.app.widgets.local_api_panel import LocalApiPanel

THEMES = [("Follow the system", "system"), ("Light", "light"), ("Dark", "dark")]
CPU_EXPERT_CHOICES = [("Copied to the GPU", "off"), ("On the processor when faster", "auto"),
                      ("Always on the processor", "all")]
BIT_WIDTHS = (2, 3, 4)
SYSTEM_SIZE = 6  # the text-size box's minimum, shown as "System" (the setting 0)


def variant_label(entry: dict) -> str:
    bits = entry.get("expert_bits")
    return f"{bits}-bit experts" if bits else (entry.get("name") or Path(entry.get("path", "")).name)


class SettingsPanel(QScrollArea):
    changed = Signal(dict)              # {Key: value}
    convert_requested = Signal(int)     # expert bits
    setup_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        body = QWidget()
        layout = QVBoxLayout(body)
        layout.setContentsMargins(8, 4, 8, 8)

        model = QGroupBox("Model")
        form = QFormLayout(model)
        self.variant = QComboBox()
        self.variant.setToolTip("The installed variants of the model; switching reloads it")
        self.variant.currentIndexChanged.connect(self._variant_changed)
        form.addRow("Expert bit-width", self.variant)
        convert_row = QHBoxLayout()
        self.convert_bits = QComboBox()
        self.convert_button = QPushButton("Convert…")
        self.convert_button.setToolTip("Make another bit-width from the downloaded checkpoint")
        self.convert_button.clicked.connect(
            lambda: self.convert_requested.emit(int(self.convert_bits.currentData() or 0)))
        convert_row.addWidget(self.convert_bits, 1)
        convert_row.addWidget(self.convert_button)
        self.convert_label = QLabel("New variant")
        form.addRow(self.convert_label, convert_row)
        self.source_gone = QLabel("Other bit-widths: the downloaded checkpoint was deleted after the install. "
                                  "Set the model up again with the download kept to convert more.")
        self.source_gone.setObjectName("muted")
        self.source_gone.setWordWrap(True)
        form.addRow(self.source_gone)
        setup = QPushButton("Set up another model…")
        setup.clicked.connect(self.setup_requested)
        form.addRow(setup)

        self.speed = speed = QGroupBox("Speed")
        self.speed_form = form = QFormLayout(speed)
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)  # a narrow side panel: fields under labels
        self.prefetch = QSpinBox()
        self.prefetch.setRange(0, 4)
        self.prefetch.setToolTip("How many layers ahead experts are guessed and copied early (0 = off)")
        self.cache = QSpinBox()
        self.cache.setRange(0, 8)
        self.cache.setSpecialValueText("Auto")
        self.cache.setToolTip("Experts kept on the GPU per layer; more means more cache hits and more VRAM")
        self.budget = QDoubleSpinBox()
        self.budget.setRange(0, 1024)
        self.budget.setSingleStep(0.5)
        self.budget.setDecimals(1)
        self.budget.setSuffix(" GB")
        self.budget.setSpecialValueText("Auto")
        self.budget.setToolTip("GPU memory the model may use; changing it reloads the model")
        self.cpu_experts = QComboBox()
        for label, value in CPU_EXPERT_CHOICES:
            self.cpu_experts.addItem(label, value)
        # its longest choice would otherwise set the panel's width: the side dock then scrolls sideways
        self.cpu_experts.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.cpu_experts.setMinimumContentsLength(12)
        # rich text (<p>): Qt word-wraps it instead of drawing one line across the screen
        self.cpu_experts.setToolTip("<p>Whether experts that are not on the GPU are computed by the processor "
                                    "instead of being copied to the GPU. \"When faster\" helps most where the "
                                    "GPU's link is slow (PCIe 4 or older): 1.3-1.5x faster than copying on a 25 GB/s link; "
                                    "it keeps processor cores busy while replying. Changing it reloads the model</p>")
        self.cpu_threads = QSpinBox()
        self.cpu_threads.setRange(0, os.cpu_count() or 1)
        self.cpu_threads.setSpecialValueText("Auto")
        self.cpu_threads.setToolTip("<p>How many processor threads compute what runs on the processor: the experts "
                                    "it computes, and everything on a computer without a GPU. Auto: every core; without "
                                    "a GPU, fewer while other programs keep some of them busy (it measures which "
                                    "count replies faster as it goes).</p>")
        form.addRow("Prefetch depth", self.prefetch)
        form.addRow("Experts cached per layer", self.cache)
        form.addRow("GPU memory limit", self.budget)
        form.addRow("Experts not on the GPU", self.cpu_experts)
        form.addRow("Processor threads", self.cpu_threads)

        sampling = QGroupBox("Sampling")
        form = QFormLayout(sampling)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0, 2)
        self.temperature.setSingleStep(0.05)
        self.temperature.setToolTip("0 = always the most likely token")
        self.top_p = QDoubleSpinBox()
        self.top_p.setRange(0.01, 1)
        self.top_p.setSingleStep(0.05)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 32768)
        self.max_tokens.setSingleStep(64)
        self.seed = QSpinBox()
        self.seed.setRange(-1, 2**31 - 1)
        self.seed.setSpecialValueText("Random")
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Max new tokens", self.max_tokens)
        form.addRow("Seed", self.seed)

        look = QGroupBox("Appearance")
        form = QFormLayout(look)
        self.theme = QComboBox()
        for label, value in THEMES:
            self.theme.addItem(label, value)
        form.addRow("Theme", self.theme)
        self.font_size = QSpinBox()
        self.font_size.setRange(SYSTEM_SIZE, 28)  # the minimum reads "System" and is stored as 0
        self.font_size.setSpecialValueText("System")
        self.font_size.setSuffix(" pt")
        self.font_size.setToolTip("The size of all text; Ctrl+wheel over the chat changes it too")
        form.addRow("Text size", self.font_size)

        self.note = QLabel("Changes apply from the next message.")
        self.note.setObjectName("muted")
        self.note.setWordWrap(True)
        self.local_api = LocalApiPanel()
        self.local_api.changed.connect(self.changed)
        for group in (model, speed, sampling, look, self.local_api):
            layout.addWidget(group)
        layout.addWidget(self.note)
        layout.addStretch(1)
        self.setWidget(body)

        self._fields = {
            Key.PREFETCH: (self.prefetch, self.prefetch.valueChanged),
            Key.CACHE_EXPERTS: (self.cache, self.cache.valueChanged),
            Key.VRAM_BUDGET_GB: (self.budget, self.budget.valueChanged),
            Key.CPU_THREADS: (self.cpu_threads, self.cpu_threads.valueChanged),
            Key.TEMPERATURE: (self.temperature, self.temperature.valueChanged),
            Key.TOP_P: (self.top_p, self.top_p.valueChanged),
            Key.MAX_NEW_TOKENS: (self.max_tokens, self.max_tokens.valueChanged),
            Key.SEED: (self.seed, self.seed.valueChanged),
        }
        for key, (_, signal) in self._fields.items():
            signal.connect(lambda value, key=key: self.changed.emit({key: value}))
        self.theme.currentIndexChanged.connect(
            lambda _i: self.changed.emit({Key.THEME: self.theme.currentData()}))
        self.cpu_experts.currentIndexChanged.connect(
            lambda _i: self.changed.emit({Key.CPU_EXPERTS: self.cpu_experts.currentData()}))
        self.font_size.valueChanged.connect(
            lambda v: self.changed.emit({Key.FONT_SIZE: 0.0 if v == SYSTEM_SIZE else float(v)}))

    def load(self, settings: Settings, num_experts: int = 8) -> None:
        """Show `settings` without emitting changes."""
        blockers = [QSignalBlocker(w) for w, _ in self._fields.values()]
        blockers += [QSignalBlocker(self.theme), QSignalBlocker(self.variant), QSignalBlocker(self.font_size),
                     QSignalBlocker(self.cpu_experts)]
        self.cache.setMaximum(num_experts)
        for key, (widget, _) in self._fields.items():
            widget.setValue(settings.get(key))
        self.theme.setCurrentIndex(max(0, self.theme.findData(settings.get(Key.THEME))))
        self.cpu_experts.setCurrentIndex(max(0, self.cpu_experts.findData(settings.get(Key.CPU_EXPERTS))))
        self.font_size.setValue(max(SYSTEM_SIZE, round(settings.get(Key.FONT_SIZE))))
        self.variant.clear()
        installed = settings.get(Key.INSTALLED)
        current = settings.get(Key.STORE_PATH)
        for entry in installed:
            self.variant.addItem(variant_label(entry), entry.get("path"))
            self.variant.setItemData(self.variant.count() - 1, f"{entry.get('name', '')}\n{entry.get('path')}",
                                     Qt.ItemDataRole.ToolTipRole)
        if current and self.variant.findData(current) < 0:
            self.variant.addItem(Path(current).name, current)
        self.variant.setCurrentIndex(max(0, self.variant.findData(current)))
        self.variant.setEnabled(self.variant.count() > 1)
        have = {e.get("expert_bits") for e in installed}
        sources = [e for e in installed if e.get("source_path")]
        self.convert_bits.clear()
        for bits in BIT_WIDTHS:
            if bits not in have:
                self.convert_bits.addItem(f"{bits}-bit experts", bits)
        can_convert = bool(sources) and self.convert_bits.count() > 0
        for w in (self.convert_bits, self.convert_button, self.convert_label):
            w.setVisible(can_convert)
        self.source_gone.setVisible(not sources and any(e.get("source_deleted") for e in installed))
        self.local_api.load(settings)
        del blockers

    def set_on_gpu(self, on_gpu: bool) -> None:
        """On the CPU every expert is in memory: there is no GPU cache, prefetch or memory to set,
        only the processor's threads."""
        for w in (self.prefetch, self.cache, self.budget, self.cpu_experts):
            self.speed_form.setRowVisible(w, on_gpu)

    def _variant_changed(self, _index: int) -> None:
        path = self.variant.currentData()
        if path:
            self.changed.emit({Key.STORE_PATH: path})
