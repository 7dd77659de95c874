"""The model catalog (resources/catalog.json), read once for the CLI's probe and the wizard.
Imports nothing heavy.

    {"format": ..., "version": 1, "models": [ENTRY, ...]}
    ENTRY: id, name, kind ("checkpoint" | "paper-checkpoint" | "embedded"), repo_id, revision,
           needs_convert, import (a format converted by import, e.g. "paper-checkpoint"),
           expert_bits, attn_bits, download_bytes, disk_bytes, quality {note, ...},
           description, tokenizer_repo_id, gated, tokenizer_gated,
           sizes / config (moeferry.engine.setup.plan.ModelSizes.from_catalog reads them from `raw`)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moeferry.engine.paths import resources_dir


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    name: str
    repo_id: str
    revision: str | None = None
    needs_convert: bool = False  # converted (or imported) here after the download
    imports: str = ""            # the import format (the paper's checkpoint), "" for none
    expert_bits: int = 2
    attn_bits: int = 4
    download_bytes: int | None = None
    disk_bytes: int | None = None
    quality: str = ""           # plain words, e.g. "WikiText2 perplexity 4.61 (fp16: 3.59)"
    description: str = ""
    tokenizer_repo_id: str = ""  # where the tokenizer comes from when the checkpoint has none
    gated: bool = False          # the hub asks to accept a licence and log in first
    embedded: bool = False       # the demo model shipped with the app (no download)
    raw: dict | None = None     # the entry as read, for the planner and the probe's rows


def entry_from_dict(d: dict) -> CatalogEntry:
    quality = d.get("quality") or {}
    return CatalogEntry(
        id=str(d["id"]),
        name=str(d.get("name") or d["id"]),
        repo_id=str(d.get("repo_id") or ""),
        revision=d.get("revision"),
        needs_convert=bool(d.get("needs_convert") or d.get("import")),
        imports=str(d.get("import") or ""),
        expert_bits=int(d.get("expert_bits") or 2),
        attn_bits=int(d.get("attn_bits") or 4),
        download_bytes=d.get("download_bytes"),
        disk_bytes=d.get("disk_bytes"),
        quality=str(quality.get("note") or ""),
        description=str(d.get("description") or ""),
        tokenizer_repo_id=str(d.get("tokenizer_repo_id") or ""),
        gated=bool(d.get("gated") or d.get("tokenizer_gated")),
        embedded=d.get("kind") == "embedded",
        raw=d,
    )


def catalog_path() -> Path:
    return resources_dir() / "catalog.json"


def load_catalog(path: Path | None = None) -> list[CatalogEntry]:
    """The entries of the catalog; an empty list when it is missing or unreadable."""
    try:
        data = json.loads((path or catalog_path()).read_text(encoding="utf-8"))
        return [entry_from_dict(d) for d in data["models"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
