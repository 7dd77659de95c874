"""Download, verify and convert a model into a store, resumable after a restart. No Qt."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

from moeferry.app.setup_backend import SetupBackend
from moeferry.app.stats_format import fmt_bytes
from moeferry.engine.contract import Progress
from moeferry.engine.setup.download import FetchProgress

log = logging.getLogger(__name__)


class InstallCancelled(Exception):
    pass


@dataclass
class InstallRequest:
    source: str            # catalog | folder | hf_cache | demo
    name: str
    dest: str = ""         # the store folder to create (empty when the source is already a store)
    repo_id: str = ""
    revision: str | None = None
    src_path: str = ""     # local checkpoint or store, or where the download goes
    needs_convert: bool = False
    expert_bits: int = 2
    attn_bits: int = 4
    tokenizer_repo_id: str = ""  # fetched (tokenizer files only) when the checkpoint has no tokenizer
    importing: bool = False      # the "conversion" only imports a pre-quantized checkpoint
    delete_download: bool = False  # delete the app's own download once the store verifies

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "InstallRequest":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class InstallProgress:
    step: str                   # download | verify | convert | done
    fraction: float | None      # 0..1 within the step, None when unknown
    message: str
    bytes_done: int | None = None
    bytes_total: int | None = None
    rate: float | None = None   # bytes per second
    eta_s: float | None = None
    freed_bytes: int | None = None  # done: disk given back by deleting the download
    download_deleted: bool = False  # done: the downloaded checkpoint is gone


STEP_TITLES = {"download": "Downloading", "verify": "Verifying", "convert": "Converting", "done": "Done"}


def step_title(step: str, req: InstallRequest) -> str:
    return "Importing" if step == "convert" and req.importing else STEP_TITLES[step]


def download_progress(p: FetchProgress) -> InstallProgress:
    """The downloader's progress event as the install page shows it."""
    fraction = p.done / p.total if p.total else None
    words = {"verify": f"checking {p.file}", "reuse": f"found {p.file} in the Hugging Face cache"}
    message = words.get(p.phase, p.file)
    return InstallProgress("download", fraction, message, p.done, p.total, p.rate_bps, p.eta_s)


TOKENIZER_FILES = ["tokenizer*", "special_tokens_map.json", "generation_config.json"]


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()


def _step_callback(step: str, report: Callable[[InstallProgress], None]) -> Progress:
    """A progress(fraction, message) callback, as the engine's long functions take."""
    started = time.monotonic()

    def cb(fraction: float, message: str) -> None:
        eta = None
        if fraction and fraction > 0.01:
            eta = (time.monotonic() - started) * (1 - fraction) / fraction
        report(InstallProgress(step, fraction, message, eta_s=eta))

    return cb


def deletable_download(target: Path, downloads_root: Path, keep: list[Path]) -> str | None:
    """Why `target` must not be deleted, or None when it may be.

    Only a real folder strictly inside the app's downloads folder may go; never anything in
    (or holding) the Hugging Face cache, and never a folder that is, holds or lies in one of
    `keep` (the store).
    """
    target = Path(target)
    if target.is_symlink():
        return f"{target} is a link"
    real = Path(os.path.realpath(target))
    root = Path(os.path.realpath(downloads_root))
    if real == root or not real.is_relative_to(root):
        return f"{target} is not inside the app's downloads folder {downloads_root}"
    from moeferry.engine.setup.hf_cache import hf_cache_dir  # the app starts without the engine

    cache = Path(os.path.realpath(hf_cache_dir()))
    if real.is_relative_to(cache) or cache.is_relative_to(real):
        return f"{target} is part of the Hugging Face cache"
    for other in keep:
        other = Path(os.path.realpath(other))
        if real.is_relative_to(other) or other.is_relative_to(real):
            return f"{target} holds or is part of the model {other}"
    return None


def _freed_bytes(folder: Path) -> int:
    """Bytes that deleting `folder` gives back: files hard-linked from elsewhere (the HF cache) free nothing."""
    inodes: dict[tuple[int, int], list[int]] = {}
    for dirpath, _dirs, files in os.walk(folder):  # does not follow links
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(dirpath, name)):
                seen = inodes.setdefault((st.st_dev, st.st_ino), [st.st_size, 0, st.st_nlink])
                seen[1] += 1
    return sum(size for size, links_here, nlink in inodes.values() if links_here >= nlink)


@dataclass(frozen=True)
class Cleanup:
    freed_bytes: int = 0
    deleted: bool = False      # the download was there and is now gone
    missing: bool = False      # there was nothing to delete (already gone)
    notice: str = ""           # what was refused or failed, in one or two sentences

    @property
    def gone(self) -> bool:
        return self.deleted or self.missing

    def words(self) -> str:
        if self.deleted and self.freed_bytes:
            text = f"Ready · Freed {fmt_bytes(self.freed_bytes)}: the downloaded copy was deleted."
        elif self.deleted:
            text = ("Ready · the downloaded copy was deleted (its files were shared with the Hugging Face "
                    "cache, so no space was freed).")
        elif self.missing:
            text = "Ready · the downloaded copy is already gone."
        else:
            text = "Ready."
        return f"{text} {self.notice}".strip()


def delete_download(req: InstallRequest, store: Path, downloads_root: Path) -> Cleanup:
    """Delete the folder the app downloaded `req` into (and the tokenizer it fetched beside it).

    Never raises: the model is ready whatever happens here, so a refusal or a failure
    becomes the notice.
    """
    if req.source != "catalog" or not req.src_path:
        return Cleanup(notice="Only a download made by MoE Ferry is deleted.")
    src = Path(req.src_path)
    if not src.exists() and not src.is_symlink():
        return Cleanup(missing=True)
    freed, deleted, notices = 0, False, []
    for target in (src, Path(f"{src}-tokenizer")):
        if target != src and not target.exists():
            continue
        why = deletable_download(target, downloads_root, [store])
        if why is not None:
            log.warning("not deleting %s: %s", target, why)
            notices.append(f"{target} was kept: {why}.")
            continue
        size = _freed_bytes(target)
        try:
            shutil.rmtree(target)
        except OSError as exc:
            log.warning("deleting %s failed: %s", target, exc)
            freed += size - (_freed_bytes(target) if target.exists() else 0)
            notices.append(f"{target} could not be deleted ({exc.strerror or exc}); delete it yourself to "
                           "give the disk space back.")
            continue
        freed += size
        deleted = deleted or target == src
    return Cleanup(freed_bytes=freed, deleted=deleted, notice=" ".join(notices))


def already_converted(req: InstallRequest) -> bool:
    """A conversion of req finished before a restart: only the store's check is left."""
    return req.needs_convert and (Path(req.dest) / "manifest.json").is_file()


def install_steps(req: InstallRequest) -> list[str]:
    """The steps run_install will report for req, in order, decided before it starts."""
    if req.source == "demo":
        return []
    if already_converted(req):
        return ["verify"]
    fetch = req.source == "catalog" or bool(req.needs_convert and req.tokenizer_repo_id
                                             and not _has_tokenizer(Path(req.src_path)))
    # a conversion verifies the store it writes
    return (["download"] if fetch else []) + (["convert"] if req.needs_convert else ["verify"])


def run_install(req: InstallRequest, backend: SetupBackend, report: Callable[[InstallProgress], None],
                cancel: threading.Event, downloads_root: Path | None = None) -> Path:
    """Bring the model of `req` to a verified store and return the store's path.

    The downloader resumes partial files, and a conversion writes to a temporary sibling,
    so running this again after an interruption continues where it stopped. With
    `req.delete_download`, the app's own download (inside `downloads_root`, by default the
    data folder's models/downloads) is deleted once the store verifies.
    """
    def check() -> None:
        if cancel.is_set():
            raise InstallCancelled()

    if req.source == "demo":
        path = backend.demo_path()
        if path is None:
            raise FileNotFoundError("The demo model is not part of this installation.")
        return Path(path)

    src = Path(req.src_path)
    converted = already_converted(req)
    if req.source == "catalog" and not converted:  # a finished store needs no download (it may be deleted)
        report(InstallProgress("download", 0.0, "Connecting"))
        kwargs: dict = {"revision": req.revision, "progress": lambda p: report(download_progress(p)),
                        "cancel": cancel}
        if backend.endpoint:
            kwargs["endpoint"] = backend.endpoint
        try:
            src = Path(backend.fetch(req.repo_id, src, **kwargs))
        except Exception:
            check()
            raise
        check()

    if converted:
        dest = Path(req.dest)  # converted before a restart; only the check is left
    elif req.needs_convert:
        dest = Path(req.dest)
        tokenizer = None
        if req.tokenizer_repo_id and not _has_tokenizer(src):
            report(InstallProgress("download", None, "Fetching the tokenizer"))
            kwargs = {"progress": lambda p: report(download_progress(p)), "cancel": cancel,
                      "allow_patterns": TOKENIZER_FILES}
            if backend.endpoint:
                kwargs["endpoint"] = backend.endpoint
            try:
                tokenizer = Path(backend.fetch(req.tokenizer_repo_id, Path(f"{src}-tokenizer"), **kwargs))
            except Exception:
                check()
                raise
        report(InstallProgress("convert", 0.0, "Starting the conversion"))
        try:
            backend.convert(src, dest, req.expert_bits, req.attn_bits, tokenizer=tokenizer,
                            progress=_step_callback("convert", report), cancel=cancel)
        except Exception:
            check()
            raise
        check()
    else:
        dest = src

    if converted or not req.needs_convert:  # a conversion hashed its new store before moving it in
        report(InstallProgress("verify", None, "Checking every file against the manifest"))
        bad = backend.verify(dest)
        if bad:
            from moeferry.engine.errors import UserError

            raise UserError(f"The model at {dest} failed verification ({'; '.join(bad[:3])}); download it again.", 1)
    if req.delete_download and req.source == "catalog" and req.needs_convert:
        report(InstallProgress("done", None, "Deleting the downloaded copy"))
        if downloads_root is None:
            from moeferry.app.paths import downloads_dir

            downloads_root = downloads_dir()
        cleanup = delete_download(req, dest, downloads_root)
        report(InstallProgress("done", 1.0, cleanup.words(), freed_bytes=cleanup.freed_bytes,
                               download_deleted=cleanup.gone))
        return dest
    report(InstallProgress("done", 1.0, "Ready"))
    return dest
