"""Model choices for the wizard: catalog entries, installed stores, local folders. No Qt."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.paths import resources_dir


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    name: str
    repo_id: str
    revision: str | None = None
    needs_convert: bool = False  # True: a Hugging Face checkpoint that is converted after download
    expert_bits: int = 2
    attn_bits: int = 4
    download_bytes: int | None = None
    disk_bytes: int | None = None
    quality: str = ""           # plain words, e.g. "WikiText2 perplexity 4.61 (fp16: 3.59)"
    description: str = ""
    tokenizer_repo_id: str = ""  # where the tokenizer comes from when the checkpoint has none
    gated: bool = False          # the hub asks to accept a licence and log in first
    embedded: bool = False       # the demo model shipped with the app (no download)
    raw: dict | None = None     # the entry as read, for the planner


def _first(d: dict, *names: str, default: Any = None) -> Any:
    for name in names:
        if d.get(name) is not None:
            return d[name]
    return default


def entry_from_dict(d: dict) -> CatalogEntry:
    """Read one catalog entry, accepting the few spellings a catalog may use."""
    quality = _first(d, "quality", "quality_note", default="")
    if isinstance(quality, (int, float)):
        quality = f"WikiText2 perplexity {quality:g}"
    elif isinstance(quality, dict):
        quality = quality.get("note") or ", ".join(f"{k} {v}" for k, v in quality.items())
    kind = str(_first(d, "kind", "format", default="")).lower()
    needs_convert = bool(_first(d, "needs_convert", "convert", default=kind in ("checkpoint", "hf", "huggingface")))
    needs_convert = needs_convert or bool(d.get("import"))  # e.g. the paper's checkpoint is imported
    return CatalogEntry(
        id=str(_first(d, "id", "key", "name", default="model")),
        name=str(_first(d, "name", "title", "id", default="Model")),
        repo_id=str(_first(d, "repo_id", "repo", default="")),
        revision=_first(d, "revision"),
        needs_convert=needs_convert,
        expert_bits=int(_first(d, "expert_bits", default=2)),
        attn_bits=int(_first(d, "attn_bits", "attention_bits", default=4)),
        download_bytes=_first(d, "download_bytes", "download_size_bytes", "size_bytes"),
        disk_bytes=_first(d, "disk_bytes", "disk_needed_bytes", "store_bytes"),
        quality=str(quality),
        description=str(_first(d, "description", "notes", default="")),
        tokenizer_repo_id=str(d.get("tokenizer_repo_id") or ""),
        gated=bool(d.get("gated") or d.get("tokenizer_gated")),
        embedded=kind == "embedded",
        raw=d,
    )


def quality_words(entry: CatalogEntry) -> str:
    """The entry's quality without jargon: its score next to the original model's, lower is better."""
    found = re.search(r"perplexity ([\d.]+)(?: \(fp16: ([\d.]+)\))?", entry.quality)
    if found and found.group(2):
        return f"quality score {found.group(1)} (the original model: {found.group(2)}; lower is better)"
    if found:
        return f"quality score {found.group(1)} (lower is better)"
    if entry.quality:
        return f"quality: {entry.quality}"
    return ""


QUALITY_TIP = ("The quality score is the model's perplexity on Wikipedia text (WikiText2): how surprised it is "
               "by real text. Lower is better; the original model in full 16-bit precision sets the mark.")


def load_catalog(path: Path | None = None) -> list[CatalogEntry]:
    """Entries of `resources/catalog.json`; an empty list when it is missing or unreadable."""
    path = path or resources_dir() / "catalog.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    items = data.get("models", data.get("entries", [])) if isinstance(data, dict) else data
    return [entry_from_dict(d) for d in items if isinstance(d, dict)]


@dataclass(frozen=True)
class StoreInfo:
    path: Path
    name: str
    expert_bits: int | None
    attn_bits: int | None
    source: str


def read_store_info(path: Path) -> StoreInfo | None:
    """Describe a MoE Ferry store folder from its manifest; None if it is not one."""
    try:
        manifest = json.loads((Path(path) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    quant = manifest.get("quantization") or {}
    source = manifest.get("source") or {}
    source_name = source.get("repo_id") or source.get("repo") or "" if isinstance(source, dict) else str(source)
    return StoreInfo(
        path=Path(path),
        name=source_name or Path(path).name,
        expert_bits=(quant.get("experts") or {}).get("bits"),
        attn_bits=(quant.get("attention") or {}).get("bits"),
        source=str(source_name),
    )


def folder_kind(path: Path) -> str | None:
    """'store' for a MoE Ferry store, 'checkpoint' for a Hugging Face safetensors folder, else None."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return "store"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "checkpoint"
    return None


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
