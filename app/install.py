"""Download, verify and convert a model into a store, resumable after a restart. No Qt."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

from app.setup_backend import SetupBackend


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


STEP_TITLES = {"download": "Downloading", "verify": "Verifying", "convert": "Converting", "done": "Done"}


def step_title(step: str, req: InstallRequest) -> str:
    return "Importing" if step == "convert" and req.importing else STEP_TITLES[step]


def _attr(obj: Any, *names: str) -> Any:
    for name in names:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if value is not None:
            return value
    return None


def download_progress(p: Any) -> InstallProgress:
    """Adapt the downloader's progress object (bytes done/total, rate, eta) to InstallProgress."""
    done = _attr(p, "bytes_done", "done_bytes", "downloaded", "done")
    total = _attr(p, "bytes_total", "total_bytes", "total")
    rate = _attr(p, "rate_bps", "rate", "bytes_per_s", "speed")
    eta = _attr(p, "eta", "eta_s", "eta_seconds")
    fraction = done / total if done is not None and total else None
    name = _attr(p, "file", "filename", "current_file") or ""
    phase = _attr(p, "phase") or "download"
    message = {"verify": f"checking {name}", "reuse": f"found {name} in the Hugging Face cache"}.get(phase, name)
    return InstallProgress("download", fraction, str(message), done, total, rate, eta)


TOKENIZER_FILES = ["tokenizer*", "special_tokens_map.json", "generation_config.json"]


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()


def _step_callback(step: str, report: Callable[[InstallProgress], None]) -> Callable:
    """A progress(fraction, message) callback, as the engine's long functions take."""
    started = time.monotonic()

    def cb(fraction: float | None = None, message: str = "", *_: Any) -> None:
        if not isinstance(fraction, (int, float)):
            fraction, message = _attr(fraction, "fraction"), str(_attr(fraction, "message") or message)
        eta = None
        if fraction and fraction > 0.01:
            eta = (time.monotonic() - started) * (1 - fraction) / fraction
        report(InstallProgress(step, fraction, message, eta_s=eta))

    return cb


def run_install(req: InstallRequest, backend: SetupBackend, report: Callable[[InstallProgress], None],
                cancel: threading.Event) -> Path:
    """Bring the model of `req` to a verified store and return the store's path.

    The downloader resumes partial files, and a conversion writes to a temporary sibling,
    so running this again after an interruption continues where it stopped.
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
    if req.source == "catalog":
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

    if req.needs_convert and (Path(req.dest) / "manifest.json").is_file():
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

    report(InstallProgress("verify", None, "Checking every file against the manifest"))
    bad = backend.verify(dest)
    if bad:
        from engine.errors import UserError

        raise UserError(f"The model at {dest} failed verification ({'; '.join(bad[:3])}); download it again.", 1)
    report(InstallProgress("done", 1.0, "Ready"))
    return dest
