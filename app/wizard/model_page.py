"""Wizard page 3: which model, with download size, disk needed, predicted speed and quality."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QRadioButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
    QWizardPage,
)

from moeferry.app.catalog import QUALITY_TIP, CatalogEntry, folder_kind, quality_words
from moeferry.app.install import InstallRequest
from moeferry.app.paths import downloads_dir, models_dir
from moeferry.app.stats_format import fmt_bytes, speed_words
from moeferry.app.wizard.wizard import completion_flag


@dataclass
class Option:
    key: str                          # catalog entry id | demo | folder
    title: str
    facts: str                        # sizes, speed, quality on one line
    notes: str = ""                   # what happens after the download, licence
    entry: CatalogEntry | None = None
    enabled: bool = True
    recommended: bool = False
    tooltip: str = ""

    @property
    def details(self) -> str:
        return f"{self.facts}\n{self.notes}".strip()


def _repo_name(repo_id: str) -> str:
    return repo_id.replace("/", "--")


def catalog_option(entry: CatalogEntry, plan, cached: Path | None, disk_free: int | None,
                   recommended: bool = False) -> Option:
    """One catalog entry as a choice; without enough free disk it cannot be chosen."""
    parts = []
    if cached:
        parts.append("in your Hugging Face cache: no download")
    elif entry.download_bytes:
        parts.append(f"download {fmt_bytes(entry.download_bytes)}")
    if entry.disk_bytes:
        parts.append(f"needs {fmt_bytes(entry.disk_bytes)} of disk")
    speed = plan.predicted_tokens_per_s if plan else None
    parts.append(f"{speed_words(speed)} here" if speed else "speed here: unknown")
    quality = quality_words(entry)
    if quality:
        parts.append(quality)
    notes = []
    if entry.imports:
        notes.append("Ready-made: imported as it is, nothing to re-quantize.")
    elif entry.needs_convert:
        notes.append("Converted on this computer after the download (fast on a GPU, hours on a CPU).")
    if entry.gated:
        notes.append("Gated: accept its licence on Hugging Face and log in first.")
    short_of_disk = disk_free is not None and bool(entry.disk_bytes) and entry.disk_bytes > disk_free
    if short_of_disk:
        notes.append(f"Not enough free disk space: it needs {fmt_bytes(entry.disk_bytes)}, "
                     f"{fmt_bytes(disk_free)} is free.")
    recommended = recommended and not short_of_disk
    tooltip = "\n\n".join(t for t in (entry.description, QUALITY_TIP if quality else "") if t)
    return Option(entry.id, entry.name, " · ".join(parts), " ".join(notes), entry, enabled=not short_of_disk,
                  recommended=recommended, tooltip=tooltip)


def downloads_then_converts(option: Option | None, cached: Path | None) -> bool:
    """The option downloads a checkpoint that is only a source: converted or imported into a store."""
    return bool(option and option.entry and option.entry.needs_convert and not cached)


def delete_download_hint(entry: CatalogEntry) -> str:
    """What deleting the download costs, for the checkbox under the model choices."""
    size = fmt_bytes(entry.download_bytes) if entry.download_bytes else "the download"
    if entry.imports:
        return (f"The download ({size}) is only imported: nothing else can be made from it, so it is deleted "
                "once the imported model checks out.")
    return (f"Untick to keep the original weights ({size}) and convert other bit-widths later from "
            "Settings; ticked, that disk space is given back once the converted model checks out.")


class OptionCard(QFrame):
    """One choice: a radio button with the name, then the facts and notes; a click anywhere picks it."""

    def __init__(self, option: Option, group: QButtonGroup):
        super().__init__()
        self.setObjectName("optionCard")
        self.option = option
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 8, 10, 8)
        layout.setSpacing(2)
        self.radio = QRadioButton(option.title)
        font = self.radio.font()
        font.setBold(True)
        self.radio.setFont(font)
        group.addButton(self.radio)
        top = QHBoxLayout()
        top.addWidget(self.radio)
        if option.recommended:
            badge = QLabel("Recommended")
            badge.setObjectName("badge")
            top.addWidget(badge)
        top.addStretch(1)
        layout.addLayout(top)
        for text, muted in ((option.facts, False), (option.notes, True)):
            if text:
                label = QLabel(text)
                label.setWordWrap(True)
                label.setContentsMargins(24, 0, 0, 0)
                if muted:
                    label.setObjectName("muted")
                layout.addWidget(label)
        if option.tooltip:
            self.setToolTip(option.tooltip)
        self.radio.setEnabled(option.enabled)  # the card stays readable: it says why it cannot be chosen
        self.radio.toggled.connect(self._restyle)

    def mousePressEvent(self, event) -> None:
        if self.option.enabled:
            self.radio.setChecked(True)

    def _restyle(self, checked: bool) -> None:
        self.setProperty("selected", "yes" if checked else "no")
        self.style().unpolish(self)
        self.style().polish(self)


class ModelPage(QWizardPage):
    def __init__(self, wizard):
        super().__init__()
        self.w = wizard
        self.options: list[Option] = []
        self.cards: list[OptionCard] = []
        self.folder: Path | None = None
        self.folder_kind: str | None = None
        self._complete = completion_flag(self, "model_chosen")
        self.setTitle("Choose the model")
        self.setSubTitle("Sizes and speeds are for this computer; you can add other variants later.")
        self.group = QButtonGroup(self)
        self.group.buttonToggled.connect(lambda _b, on: on and self._changed())
        self.cards_box = QVBoxLayout()
        self.cards_box.setSpacing(6)
        body = QWidget()
        outer = QVBoxLayout(body)
        outer.setContentsMargins(0, 0, 4, 0)
        outer.addLayout(self.cards_box)
        outer.addStretch(1)
        self.scroll = scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidget(body)
        self.delete_download = QCheckBox("Delete the downloaded copy once the model is ready")
        self.delete_download.setChecked(True)
        self.delete_hint = QLabel()
        self.delete_hint.setObjectName("muted")
        self.delete_hint.setWordWrap(True)
        self.delete_hint.setContentsMargins(24, 0, 0, 0)
        self.browse = QPushButton("Choose a folder…")
        self.browse.clicked.connect(self._browse)
        self.folder_label = QLabel()
        self.folder_label.setWordWrap(True)
        row = QHBoxLayout()
        row.addWidget(self.browse)
        row.addWidget(self.folder_label, 1)
        layout = QVBoxLayout(self)
        layout.addWidget(scroll, 1)
        layout.addWidget(self.delete_download)
        layout.addWidget(self.delete_hint)
        layout.addLayout(row)

    def initializePage(self) -> None:
        w = self.w
        hw = w.hw or {}
        has_gpu = bool(w.verdict and w.verdict.has_gpu)
        disk_free = hw.get("disk_free_bytes")
        models = [catalog_option(e, w.plans.get(e.id), w.hf_cache.get(e.id), disk_free, e.id == w.recommended)
                  for e in w.catalog if not e.embedded]
        demo = Option(
            "demo", "Demo model (tiny, included)",
            "no download · runs on any computer in seconds" if w.demo else "not part of this installation",
            "Shows how the app and the expert map work; its answers are not useful.",
            enabled=w.demo is not None, recommended=w.recommended == "demo" and w.demo is not None)
        # Without a GPU the demo is the sensible start, so it comes first, above the fold.
        self.options = models + [demo] if has_gpu else [demo] + models
        self.options.append(Option(
            "folder", "A folder on this computer",
            "a MoE Ferry store, or a Mixtral checkpoint in Hugging Face format (safetensors) to convert"))
        for card in self.cards:
            self.group.removeButton(card.radio)
            card.deleteLater()
        self.cards = [OptionCard(option, self.group) for option in self.options]
        for card in self.cards:
            self.cards_box.addWidget(card)
        recommended = next((o.key for o in self.options if o.recommended), None)
        first = next((o.key for o in self.options if o.enabled), "folder")
        self.scroll.verticalScrollBar().setValue(0)
        self.select(recommended or first)
        self._changed()

    def current(self) -> Option | None:
        return next((c.option for c in self.cards if c.radio.isChecked()), None)

    def select(self, key: str) -> None:
        for card in self.cards:
            if card.option.key == key and card.option.enabled:
                card.radio.setChecked(True)
                QTimer.singleShot(0, lambda card=card: self.scroll.ensureWidgetVisible(card))  # once laid out

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

    def _changed(self) -> None:
        option = self.current()
        is_folder = option is not None and option.key == "folder"
        self.browse.setVisible(is_folder)
        self.folder_label.setVisible(is_folder)
        # Ticked by default for both kinds of download (see docs/APP.md); reset on each choice.
        offer = downloads_then_converts(option, self.w.hf_cache.get(option.key) if option else None)
        self.delete_download.setVisible(offer)
        self.delete_hint.setVisible(offer)
        if offer:
            self.delete_download.setChecked(True)
            self.delete_hint.setText(delete_download_hint(option.entry))
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
        tok = {"tokenizer_repo_id": option.entry.tokenizer_repo_id,
               "importing": bool(option.entry.imports)} if option.entry else {}
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
                                  revision=entry.revision, src_path=str(downloads_dir() / name),
                                  needs_convert=True, expert_bits=entry.expert_bits, attn_bits=entry.attn_bits,
                                  dest=str(root / f"{name}-{entry.expert_bits}bit"),
                                  delete_download=self.delete_download.isChecked(), **tok)
        return InstallRequest(source="catalog", name=entry.name, repo_id=entry.repo_id, revision=entry.revision,
                              src_path=str(root / name), expert_bits=entry.expert_bits, attn_bits=entry.attn_bits)
