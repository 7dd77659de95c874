"""Wizard page 4: download, verify and convert, with bytes, rate and time left; cancel and resume."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWizardPage

from moeferry.app.install import InstallProgress, InstallRequest, install_steps, run_install, step_title
from moeferry.app.stats_format import fmt_bytes
from moeferry.app.task_runner import TaskRunner
from moeferry.app.theme import colors
from moeferry.app.wizard.wizard import Page, completion_flag
from moeferry.engine.units import fmt_duration


def progress_words(p: InstallProgress) -> str:
    parts = []
    if p.bytes_total:
        parts.append(f"{fmt_bytes(p.bytes_done or 0)} of {fmt_bytes(p.bytes_total)}")
    if p.rate:
        parts.append(f"{fmt_bytes(p.rate)}/s")
    if p.eta_s is not None and p.step != "done":
        parts.append(f"about {fmt_duration(p.eta_s)} left")
    if p.message and not p.bytes_total:
        parts.insert(0, p.message)
    text = " · ".join(parts)
    return f"{text}\n{p.message}" if p.message and p.bytes_total else text


class InstallPage(QWizardPage):
    def __init__(self, wizard):
        super().__init__()
        self.w = wizard
        self.task: TaskRunner | None = None
        self.done = False
        self.resuming = False
        self.last: InstallProgress | None = None
        self.step_list: list[str] = []
        self._complete = completion_flag(self, "installed")
        self.setTitle("Getting the model")
        self.setSubTitle("Downloaded files are checked against the hub; a stopped download continues later.")
        self.what = QLabel()
        self.what.setObjectName("pageHeadline")
        self.what.setWordWrap(True)
        self.steps = QLabel()
        self.steps.setWordWrap(True)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.detail = QLabel()
        self.detail.setWordWrap(True)
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.cancel_button = QPushButton("Stop")
        self.cancel_button.clicked.connect(self.cancel)
        self.resume_button = QPushButton("Resume")
        self.resume_button.clicked.connect(self.start)
        self.other_button = QPushButton("Choose another model…")
        self.other_button.setToolTip("Back to the model choice; what was downloaded stays on disk")
        self.other_button.clicked.connect(self.w.choose_another)
        row = QHBoxLayout()
        row.addWidget(self.other_button)
        row.addStretch(1)
        row.addWidget(self.cancel_button)
        row.addWidget(self.resume_button)
        layout = QVBoxLayout(self)
        for w in (self.what, self.steps, self.bar, self.detail, self.message):
            layout.addWidget(w)
        layout.addLayout(row)
        layout.addStretch(1)

    def initializePage(self) -> None:
        if not self.resuming and Page.MODEL in self.w.visitedIds():
            self.w.request, self.w.entry = self.w.pages[Page.MODEL].build_request(), \
                self.w.pages[Page.MODEL].current().entry
        req = self.w.request
        self.what.setText(("Resuming: " if self.resuming else "") + req.name)
        self.start()

    def cleanupPage(self) -> None:  # going Back cancels; the partial download stays for a resume
        self.cancel()

    def start(self) -> None:
        req: InstallRequest = self.w.request
        self.done = False
        self.last = None
        self.w.store_path = None
        self.w.download_deleted = False
        self.message.clear()
        self.resume_button.hide()
        self.cancel_button.show()
        self.other_button.setVisible(self.resuming)  # Back is off when the wizard opened on this page
        self.step_list = install_steps(req)  # once: the store appearing at the end changes no step
        self._show_steps(None)
        if req.source in ("catalog", "hf_cache") or req.needs_convert:
            self.w.remember_pending(req)
        backend = self.w.backend
        self.task = TaskRunner(lambda report, cancel: run_install(req, backend, report, cancel), self)
        self.task.progress.connect(self._progress)
        self.task.finished.connect(self._finished)
        self.task.failed.connect(self._failed)
        self.task.cancelled.connect(self._cancelled)
        self.task.start()
        self._complete(False)

    def cancel(self) -> None:
        if self.task is not None and self.task.running:
            self.task.cancel()
            self.cancel_button.setEnabled(False)
            self.message.setText("Stopping…")

    def _show_steps(self, current: str | None) -> None:
        words = []
        for step in self.step_list:
            title = step_title(step, self.w.request)
            words.append(f"<b>{title}</b>" if step == current else title)
        self.steps.setText(" → ".join(words))

    def _progress(self, p: InstallProgress) -> None:
        self.last = p
        self._show_steps(p.step)
        if p.fraction is None:
            self.bar.setRange(0, 0)
        else:
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(p.fraction * 1000))
        self.detail.setText(progress_words(p))

    def _finished(self, path) -> None:
        self.w.store_path = Path(path)
        last = self.last if self.last is not None and self.last.step == "done" else None
        self.w.download_deleted = bool(last and last.download_deleted)
        self.w.remember_pending(None)
        self.done = True
        self.bar.setRange(0, 1000)
        self.bar.setValue(1000)
        self._show_steps(None)
        self.detail.setText(f"Ready and verified: {path}")
        cleanup = last.message if last and last.freed_bytes is not None else ""
        self.message.setText((cleanup + "\n" if cleanup else "") + "Press Next to choose how much GPU memory it "
                             "may use.")
        self.cancel_button.hide()
        self._complete(True)

    def _failed(self, info) -> None:
        self.bar.setRange(0, 1000)
        self.detail.clear()
        self.w.remember_pending(None)  # a failed install is not reopened at the next start
        color = colors(self.palette().color(QPalette.ColorRole.Window).lightness() < 128)["error"]
        self.message.setText(f"<span style='color:{color}'>{html.escape(info.message)}</span><br>"
                             "What was downloaded is kept: choosing this model again continues from there.")
        self._stopped("Try again")

    def _cancelled(self) -> None:
        self.bar.setRange(0, 1000)
        self.message.setText("Stopped. What was downloaded is kept: Resume continues from there, now or the "
                             "next time MoE Ferry starts. Cancel forgets this install.")
        self._stopped("Resume")

    def _stopped(self, label: str) -> None:
        self.cancel_button.setEnabled(True)
        self.cancel_button.hide()
        self.resume_button.setText(label)
        self.resume_button.show()
        self.other_button.show()
        self._complete(False)

    def stop_tasks(self) -> None:
        if self.task is not None:
            self.task.stop(3000)
