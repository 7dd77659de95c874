"""Wizard page 5: how much GPU memory the model may use, and so how many experts stay cached."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFormLayout, QHBoxLayout, QLabel, QSlider, QSpinBox, QVBoxLayout, QWidget, QWizardPage

from moeferry.app.stats_format import speed_words
from moeferry.engine.units import GiB

STEP_GB = 0.5
RUNTIME_GB = 1.0  # kept off the slider: the CUDA runtime's share and a little room


class CachePage(QWizardPage):
    def __init__(self, wizard):
        super().__init__()
        self.w = wizard
        self.user_edited = False
        self.setTitle("GPU memory")
        self.setSubTitle("More memory keeps more experts on the GPU: more cache hits, faster replies.")
        self.intro = QLabel()
        self.intro.setWordWrap(True)
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.valueChanged.connect(self._budget_changed)
        self.budget_label = QLabel()
        self.budget_label.setMinimumWidth(90)
        self.cache = QSpinBox()
        self.cache.setRange(1, 8)
        self.cache.setMaximumWidth(90)
        self.cache.valueChanged.connect(self._cache_edited)
        self.predicted = QLabel()
        self.predicted.setWordWrap(True)
        self.form_widget = QWidget()
        form = QFormLayout(self.form_widget)
        row = QHBoxLayout()
        row.addWidget(self.slider, 1)
        row.addWidget(self.budget_label)
        form.addRow("GPU memory limit", row)
        form.addRow("Experts cached per layer", self.cache)
        layout = QVBoxLayout(self)
        layout.addWidget(self.intro)
        layout.addWidget(self.form_widget)
        layout.addWidget(self.predicted)
        layout.addStretch(1)

    def initializePage(self) -> None:
        hw = self.w.hw or {}
        vram = hw.get("vram_total_bytes")
        has_gpu = bool(hw.get("gpu_name")) and bool(vram)
        self.form_widget.setVisible(has_gpu)
        if not has_gpu:
            self.intro.setText("No NVIDIA GPU was found, so the model runs on the CPU, where everything is in "
                               "memory already: there is no cache to size. You can change this later in "
                               "Settings.")
            self.predicted.clear()
            self.w.cache_experts, self.w.vram_budget_gb = 0, 0.0
            return
        total_gb = vram / GiB
        self.intro.setText(f"Your GPU has {total_gb:.0f} GB. The budget is what MoE Ferry's model takes; the GPU's "
                           "runtime needs about 0.7 GB more, and the desktop and other programs some too. The "
                           "default keeps about 1.5 GB free.")
        # the budget counts the engine's allocations; the CUDA runtime (context, cuBLAS, kernels) took
        # 0.7-0.8 GB more on the GPU machine (docs/BENCHMARKS.md), so a budget near the whole card runs out
        steps = max(1, int((total_gb - RUNTIME_GB) / STEP_GB))
        self.slider.setRange(min(steps, max(1, int(4 / STEP_GB))), steps)
        self.slider.setValue(max(self.slider.minimum(), steps - int(0.5 / STEP_GB)))
        self._budget_changed(self.slider.value())

    def _budget_changed(self, value: int) -> None:
        budget_gb = value * STEP_GB
        self.budget_label.setText(f"{budget_gb:.1f} GB")
        self.w.vram_budget_gb = budget_gb
        plan = None
        for model in (self.w.store_path, self.w.entry):  # the installed store knows its sizes best
            if model is not None and plan is None:
                plan = self.w.backend.plan(self.w.hw or {}, model, int(budget_gb * GiB))
        if plan and plan.cache_experts_per_layer and not self.user_edited:
            self.cache.blockSignals(True)
            self.cache.setValue(plan.cache_experts_per_layer)
            self.cache.blockSignals(False)
        # unless edited, the engine sizes the cache from the budget as the plan did, and gives what
        # is left after that many a layer to the first layers (one expert more each)
        self.w.cache_experts = self.cache.value() if self.user_edited else 0
        self._explain(plan)

    def _explain(self, plan) -> None:
        speed = plan.predicted_tokens_per_s if plan else None
        lines = []
        if speed:
            hits = f", about {plan.hit_rate:.0%} of expert look-ups already on the GPU" if plan.hit_rate else ""
            lines.append(f"<b>Predicted: {speed_words(speed)}</b>{hits}.")
        if plan and plan.verdict:
            lines.append(plan.verdict)
        lines.append("More cached experts mean fewer copies over PCIe; the expert map in the chat window "
                     "shows the hits and misses of every reply.")
        self.predicted.setText("<br><br>".join(lines))

    def _cache_edited(self, value: int) -> None:
        self.user_edited = True
        self.w.cache_experts = value
        plan = None
        for model in (self.w.store_path, self.w.entry):
            if model is not None and plan is None:
                plan = self.w.backend.plan(self.w.hw or {}, model, int(self.w.vram_budget_gb * GiB),
                                           cache_experts=value)
        self._explain(plan)
