"""Model choices for the wizard: catalog entries (engine/setup/catalog.py reads them), installed
stores, local folders. No Qt."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from moeferry.engine.setup.catalog import CatalogEntry, load_catalog  # noqa: F401 - the wizard's names for them
from moeferry.engine.storage.manifest import describe, section


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


@dataclass(frozen=True)
class StoreInfo:
    path: Path
    name: str
    expert_bits: int | None
    attn_bits: int | None
    source: str


def read_store_info(path: Path) -> StoreInfo | None:
    """Describe a MoE Ferry store folder from its manifest; None if it has none."""
    manifest = describe(path)
    if manifest is None:
        return None
    quant, source = manifest["quantization"], manifest["source"]
    source_name = source.get("repo") if isinstance(source.get("repo"), str) else ""
    return StoreInfo(
        path=Path(path),
        name=source_name or Path(path).name,
        expert_bits=_bits(section(quant, "experts").get("bits")),
        attn_bits=_bits(section(quant, "attention").get("bits")),
        source=source_name,
    )


def _bits(value) -> int | None:
    return value if type(value) is int else None


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
