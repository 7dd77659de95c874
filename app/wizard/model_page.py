"""Wizard page 3: which model, with download size, disk needed, predicted speed and quality."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QSize, Qt
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QPushButton,
                               QVBoxLayout, QWidget, QWizardPage)

from app.catalog import CatalogEntry, folder_kind
from app.hardware_words import pick
from app.install import InstallRequest
from app.paths import models_dir
from app.stats_format import fmt_bytes
from app.wizard.wizard import completion_flag


@dataclass
class Option:
    key: str                          # catalog entry id | demo | folder
    title: str
    details: str
    entry: CatalogEntry | None = None
    enabled: bool = True


def _repo_name(repo_id: str) -> str:
    return repo_id.replace("/", "--")


def catalog_option(entry: CatalogEntry, plan, cached: Path | None, disk_free: int | None) -> Option:
    parts = []
    if cached:
        parts.append("found in your Hugging Face cache, no download needed")
    elif entry.download_bytes:
        parts.append(f"download {fmt_bytes(entry.download_bytes)}")
    if entry.disk_bytes:
        parts.append(f"needs {fmt_bytes(entry.disk_bytes)} of disk")
    speed = plan.predicted_tokens_per_s if plan else None
    parts.append(f"about {speed:.1f} tokens/s here" if speed else "speed here: unknown")
    if entry.quality:
        parts.append(f"quality: {entry.quality}")
    details = " · ".join(parts)
    if entry.raw and entry.raw.get("import"):
        details += "\nImported as it is after the download: nothing to re-quantize."
    elif entry.needs_convert:
        details += "\nConverted on this computer after the download (fast on a GPU, hours on a CPU)."
    if entry.gated:
        details += "\nGated on Hugging Face: accept its licence there and log in with `hf auth login` first."
    if entry.description:
        details += "\n" + entry.description
    if disk_free is not None and entry.disk_bytes and entry.disk_bytes > disk_free:
        details += f"\nNot enough free disk space: {fmt_bytes(disk_free)} free."
    return Option(entry.id, entry.name, details, entry)


class OptionCard(QWidget):
    def __init__(self, option: Option):
        super().__init__()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 8, 10, 8)
        layout.setSpacing(2)
        title = QLabel(f"<b>{option.title}</b>")
        details = QLabel(option.details)
        details.setObjectName("muted")
        details.setWordWrap(True)
        layout.addWidget(title)
        layout.addWidget(details)
        self.setEnabled(option.enabled)


class ModelPage(QWizardPage):
    def __init__(self, wizard):
        super().__init__()
        self.w = wizard
        self.options: list[Option] = []
        self.folder: Path | None = None
        self.folder_kind: str | None = None
        self._complete = completion_flag(self, "model_chosen")
        self.setTitle("Choose the model")
        self.setSubTitle("Sizes and speeds are for this computer; you can add other variants later.")
        self.list = QListWidget()
        self.list.setObjectName("modelOptions")
        self.list.currentRowChanged.connect(self._changed)
        self.browse = QPushButton("Choose a folder…")
        self.browse.clicked.connect(self._browse)
        self.folder_label = QLabel()
        self.folder_label.setWordWrap(True)
        row = QHBoxLayout()
        row.addWidget(self.browse)
        row.addWidget(self.folder_label, 1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.list, 1)
        layout.addLayout(row)

    def initializePage(self) -> None:
        w = self.w
        hw = w.hw or {}
        disk_free = pick(hw, "disk_free_bytes", "disk_free")
        self.options = [catalog_option(e, w.plans.get(e.id), w.hf_cache.get(e.id), disk_free)
                        for e in w.catalog if not e.embedded]
        self.options.append(Option(
            "demo", "Demo model (tiny, included)",
            "Runs on any computer in seconds and shows how the app and the expert map work; "
            "its answers are not useful." if w.demo else "The demo model is not part of this installation.",
            enabled=w.demo is not None))
        self.options.append(Option(
            "folder", "A folder on this computer",
            "A MoE Ferry store, or a Mixtral checkpoint in Hugging Face format (safetensors) to convert."))
        self.list.clear()
        for option in self.options:
            item = QListWidgetItem()
            card = OptionCard(option)
            item.setSizeHint(card.sizeHint().expandedTo(QSize(0, 56)))
            if not option.enabled:
                item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsEnabled & ~Qt.ItemFlag.ItemIsSelectable)
            self.list.addItem(item)
            self.list.setItemWidget(item, card)
        has_gpu = bool(w.verdict and w.verdict.has_gpu)
        default = 0 if (has_gpu and w.catalog) or w.demo is None else len(self.options) - 2
        self.list.setCurrentRow(default)
        self._changed(self.list.currentRow())

    def current(self) -> Option | None:
        row = self.list.currentRow()
        return self.options[row] if 0 <= row < len(self.options) else None

    def select(self, key: str) -> None:
        for i, option in enumerate(self.options):
            if option.key == key:
                self.list.setCurrentRow(i)

    def set_folder(self, path: Path) -> None:
        self.folder = Path(path)
        self.folder_kind = folder_kind(self.folder)
        words = {"store": "a MoE Ferry store, ready to use",
                 "checkpoint": "a Hugging Face checkpoint; it will be converted to 2-bit experts"}
        self.folder_label.setText(f"{self.folder}: {words.get(self.folder_kind, 'not a model folder')}")
        self._complete(self.ready())

    def _browse(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose a model folder", str(Path.home()))
        if path:
            self.set_folder(Path(path))

    def _changed(self, _row: int) -> None:
        option = self.current()
        is_folder = option is not None and option.key == "folder"
        self.browse.setVisible(is_folder)
        self.folder_label.setVisible(is_folder)
        self._complete(self.ready())

    def ready(self) -> bool:
        option = self.current()
        if option is None or not option.enabled:
            return False
        return option.key != "folder" or self.folder_kind is not None

    def build_request(self) -> InstallRequest:
        option = self.current()
        root = models_dir()
        if option.key == "demo":
            return InstallRequest(source="demo", name="Demo model")
        tok = {"tokenizer_repo_id": option.entry.tokenizer_repo_id} if option.entry else {}
        if option.key == "folder":
            if self.folder_kind == "store":
                return InstallRequest(source="folder", name=self.folder.name, src_path=str(self.folder))
            return InstallRequest(source="folder", name=self.folder.name, src_path=str(self.folder),
                                  needs_convert=True, expert_bits=2, attn_bits=4,
                                  dest=str(root / f"{self.folder.name}-2bit"))
        entry = option.entry
        name = _repo_name(entry.repo_id)
        cached = self.w.hf_cache.get(entry.id)
        if cached:
            return InstallRequest(source="hf_cache", name=entry.name, src_path=str(cached), needs_convert=True,
                                  expert_bits=entry.expert_bits, attn_bits=entry.attn_bits,
                                  dest=str(root / f"{name}-{entry.expert_bits}bit"), **tok)
        if entry.needs_convert:
            return InstallRequest(source="catalog", name=entry.name, repo_id=entry.repo_id,
                                  revision=entry.revision, src_path=str(root / "downloads" / name),
                                  needs_convert=True, expert_bits=entry.expert_bits, attn_bits=entry.attn_bits,
                                  dest=str(root / f"{name}-{entry.expert_bits}bit"), **tok)
        return InstallRequest(source="catalog", name=entry.name, repo_id=entry.repo_id, revision=entry.revision,
                              src_path=str(root / name), expert_bits=entry.expert_bits, attn_bits=entry.attn_bits)
