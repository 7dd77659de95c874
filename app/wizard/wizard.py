"""The first-run set-up: welcome, hardware check, model choice, install, cache size, done.

Re-runnable from the Model menu. The pages share what they learn through this object;
the settings are written only when the user finishes.

An install stopped with Stop (or by closing the app) is remembered in the settings; the wizard
opened at start-up continues it on the install page, where "Choose another model…" starts over.
A failed install and Cancel forget it (the downloaded files stay: choosing the same model again
continues from them), and the wizard opened from the menu always starts at the beginning.
"""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path
from typing import Callable

from PySide6.QtCore import Signal
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QLineEdit, QWidget, QWizard, QWizardPage

from moeferry.app.catalog import CatalogEntry, read_store_info
from moeferry.app.hardware_words import HardwareVerdict
from moeferry.app.install import InstallRequest
from moeferry.app.paths import resources_dir
from moeferry.app.settings import Key, Settings
from moeferry.app.setup_backend import PlanSummary, SetupBackend


def completion_flag(page: QWizardPage, name: str) -> Callable[[bool], None]:
    """Enable Next through a hidden mandatory field rather than an isComplete() override.

    Qt calls isComplete() very often; a hidden field keeps that check in C++.
    """
    flag = QLineEdit(page)
    flag.hide()
    page.registerField(name + "*", flag)
    return lambda ok: flag.setText("1" if ok else "")


class Page(IntEnum):
    WELCOME = 0
    HARDWARE = 1
    MODEL = 2
    INSTALL = 3
    CACHE = 4
    DONE = 5


class SetupWizard(QWizard):
    installed = Signal()  # the settings now name a model that is ready to load

    def __init__(self, backend: SetupBackend, settings: Settings, parent: QWidget | None = None,
                 start_request: InstallRequest | None = None, resume_pending: bool = True):
        super().__init__(parent)
        from moeferry.app.wizard.cache_page import CachePage
        from moeferry.app.wizard.done_page import DonePage
        from moeferry.app.wizard.hardware_page import HardwarePage
        from moeferry.app.wizard.install_page import InstallPage
        from moeferry.app.wizard.model_page import ModelPage
        from moeferry.app.wizard.welcome_page import WelcomePage

        self.backend = backend
        self.settings = settings
        # What the pages learn
        self.hw: dict | None = None
        self.verdict: HardwareVerdict | None = None
        self.catalog: list[CatalogEntry] = []
        self.plans: dict[str, PlanSummary | None] = {}
        self.recommended: str | None = None  # the catalog id (or "demo") `moeferry probe` recommends too
        self.hf_cache: dict[str, Path] = {}
        self.demo: Path | None = None
        self.entry: CatalogEntry | None = None
        self.request: InstallRequest | None = None
        self.store_path: Path | None = None
        self.download_deleted = False  # the install deleted its downloaded checkpoint
        self.cache_experts = 0
        self.vram_budget_gb = 0.0

        self.setWindowTitle("Set up MoE Ferry")
        icon = resources_dir() / "icons" / "moeferry.svg"
        if icon.exists():
            self.setWindowIcon(QIcon(str(icon)))
            self.setPixmap(QWizard.WizardPixmap.LogoPixmap, QIcon(str(icon)).pixmap(44, 44))
        self.setWizardStyle(QWizard.WizardStyle.ModernStyle)
        self.setOption(QWizard.WizardOption.NoBackButtonOnLastPage, True)
        self.setOption(QWizard.WizardOption.NoCancelButtonOnLastPage, True)
        self.setButtonText(QWizard.WizardButton.FinishButton, "Open the chat")
        self.setMinimumSize(780, 560)
        self.pages = {
            Page.WELCOME: WelcomePage(self), Page.HARDWARE: HardwarePage(self), Page.MODEL: ModelPage(self),
            Page.INSTALL: InstallPage(self), Page.CACHE: CachePage(self), Page.DONE: DonePage(self),
        }
        for pid, page in self.pages.items():
            self.setPage(pid, page)
        pending = settings.get(Key.PENDING_INSTALL) if resume_pending else None
        if start_request is None and pending:
            start_request = InstallRequest.from_dict(pending)
            self.pages[Page.INSTALL].resuming = True
        if start_request is not None:
            self.request = start_request
            self.setStartId(Page.INSTALL)

    def stop_tasks(self) -> None:
        for page in self.pages.values():
            stop = getattr(page, "stop_tasks", None)
            if stop:
                stop()

    def choose_another(self) -> None:
        """Leave the install page for the model choice: forget the pending install and start over."""
        self.remember_pending(None)
        self.pages[Page.INSTALL].resuming = False
        self.setStartId(Page.HARDWARE)
        self.restart()
        if self.pages[Page.HARDWARE].done:  # checked already: on to the model choice, with Back working
            self.next()

    def remember_pending(self, request: InstallRequest | None) -> None:
        self.settings.set(Key.PENDING_INSTALL, request.to_dict() if request else None)
        self.settings.save_in_background()

    def accept(self) -> None:
        """Finish: record the model, its cache size, and that set-up is done."""
        s = self.settings
        if self.store_path is not None:
            path = str(self.store_path)
            info = read_store_info(self.store_path)
            req = self.request
            deleted = self.download_deleted and req is not None
            entry = {"path": path, "name": req.name if req else self.store_path.name,
                     "expert_bits": info.expert_bits if info else (req.expert_bits if req else None),
                     "attn_bits": info.attn_bits if info else (req.attn_bits if req else None),
                     "source_path": req.src_path if req and req.needs_convert and not deleted else ""}
            if deleted:
                entry["source_deleted"] = True
            installed = [e for e in s.get(Key.INSTALLED) if e.get("path") != path]
            if deleted:  # variants converted earlier from the same download lost their source too
                installed = [e | {"source_path": "", "source_deleted": True}
                             if e.get("source_path") == req.src_path else e for e in installed]
            s.set(Key.INSTALLED, installed + [entry])
            s.set(Key.STORE_PATH, path)
        s.set(Key.CACHE_EXPERTS, self.cache_experts)
        s.set(Key.VRAM_BUDGET_GB, self.vram_budget_gb)
        s.set(Key.WIZARD_DONE, True)
        s.set(Key.PENDING_INSTALL, None)
        s.save_in_background()
        self.installed.emit()
        super().accept()

    def reject(self) -> None:
        """Cancel: stop and forget an unfinished install, so the next start does not reopen it."""
        self.stop_tasks()
        if self.settings.get(Key.PENDING_INSTALL) is not None:
            self.remember_pending(None)
        super().reject()
