"""Wizard page 2: the hardware check, in plain words (probed on a worker thread)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QLabel, QProgressBar, QPushButton, QVBoxLayout, QWizardPage

from moeferry.app.hardware_words import describe_hardware
from moeferry.app.task_runner import TaskRunner
from moeferry.app.theme import colors
from moeferry.app.wizard.wizard import completion_flag

LEVEL_COLORS = {"good": "good", "workable": "warning", "poor": "error", "none": "warning"}  # names in theme.colors


def survey(backend) -> dict:
    """Everything the next pages need, gathered off the UI thread."""
    hw = backend.probe()
    catalog = backend.catalog()
    plans = {e.id: backend.plan(hw, e, None) for e in catalog}
    hf_cache: dict[str, Path] = {}
    for e in catalog:
        if e.needs_convert:
            found = backend.find_in_hf_cache(e.repo_id)
            if found:
                hf_cache[e.id] = Path(found)
    return {"hw": hw, "catalog": catalog, "plans": plans, "recommended": backend.recommend(hw, catalog),
            "hf_cache": hf_cache, "demo": backend.demo_path()}


class HardwarePage(QWizardPage):
    def __init__(self, wizard):
        super().__init__()
        self.w = wizard
        self.task: TaskRunner | None = None
        self.done = False
        self._complete = completion_flag(self, "hardware_checked")
        self.setTitle("Your hardware")
        self.setSubTitle("What this computer can do with Mixtral.")
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)
        self.status = QLabel("Looking at the GPU, measuring how fast it receives data, checking memory and disk…")
        self.status.setWordWrap(True)
        self.headline = QLabel()
        self.headline.setObjectName("pageHeadline")
        self.headline.setWordWrap(True)
        self.details = QLabel()
        self.details.setWordWrap(True)
        self.advice = QLabel()
        self.advice.setWordWrap(True)
        self.retry = QPushButton("Check again")
        self.retry.clicked.connect(self._start)
        self.retry.hide()
        layout = QVBoxLayout(self)
        for w in (self.status, self.busy, self.headline, self.details, self.advice):
            layout.addWidget(w)
        layout.addWidget(self.retry)
        layout.addStretch(1)

    def initializePage(self) -> None:
        if not self.done:
            self._start()
        else:
            self._complete(True)  # a restarted wizard resets the page's fields

    def _start(self) -> None:
        self.done = False
        self.retry.hide()
        self.busy.show()
        self.status.show()
        self.headline.clear()
        self.details.clear()
        self.advice.clear()
        backend = self.w.backend
        self.task = TaskRunner(lambda report, cancel: survey(backend), self)
        self.task.finished.connect(self._finished)
        self.task.failed.connect(self._failed)
        self.task.start()
        self._complete(False)

    def _finished(self, result: dict) -> None:
        w = self.w
        w.hw, w.catalog, w.plans, w.recommended = result["hw"], result["catalog"], result["plans"], result["recommended"]
        w.hf_cache, w.demo = result["hf_cache"], result["demo"]
        first = w.catalog[0] if w.catalog else None
        plan = w.plans.get(first.id) if first else None
        verdict = describe_hardware(w.hw, plan, first.expert_bits if first else 2)
        w.verdict = verdict
        self.busy.hide()
        self.status.hide()
        dark = self.palette().color(QPalette.ColorRole.Window).lightness() < 128
        color = colors(dark)[LEVEL_COLORS.get(verdict.level, "warning")]
        self.headline.setText(f"<span style='color:{color}'>{verdict.headline}</span>")
        self.details.setText("<br>".join(verdict.details))
        if not verdict.has_gpu:
            self.advice.setText("You can still go on: the demo model runs on any computer and shows how the "
                                "app works, and the full model can run on the CPU, slowly.")
        self.done = True
        self._complete(True)

    def _failed(self, info) -> None:
        self.busy.hide()
        self.status.setText(f"The hardware check failed: {info.message}")
        self.retry.show()
        # Going on without the check is allowed: the next pages cope with unknown hardware.
        self.w.hw = self.w.hw or {}
        self.done = True
        self._complete(True)

    def stop_tasks(self) -> None:
        if self.task is not None:
            self.task.stop(2000)
