"""What the wizard needs from the engine, behind one injectable object. No Qt.

The engine modules (hardware probe, planner, downloader, converter, store, demo model) are
imported only when a function is called, so the app starts without them and tests pass fakes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moeferry.engine.errors import UserError
from moeferry.engine.paths import demo_store_path
from moeferry.engine.setup.catalog import CatalogEntry, load_catalog


@dataclass(frozen=True)
class PlanSummary:
    cache_experts_per_layer: int | None
    predicted_tokens_per_s: float | None
    verdict: str = ""
    hit_rate: float | None = None


@dataclass
class SetupBackend:
    probe: Callable[[], dict]
    catalog: Callable[[], list[CatalogEntry]]
    plan: Callable[..., PlanSummary | None]  # plan(hw, entry or store path, vram budget[, cache_experts])
    recommend: Callable[[dict, list[CatalogEntry]], str | None]  # the catalog id to recommend (or "demo")
    # fetch(repo_id, dest, revision=, endpoint=, progress=(FetchProgress -> None), cancel=[, allow_patterns=])
    fetch: Callable[..., Path]
    find_in_hf_cache: Callable[[str], Path | None]
    convert: Callable[..., Any]         # convert(src, dest, expert_bits, attn_bits, tokenizer=, progress=, cancel=)
    verify: Callable[[Path], list[str]]
    demo_path: Callable[[], Path | None]
    endpoint: str | None = None         # hub address for fetch (None = the real hub)
    options: dict = field(default_factory=dict)


def real_probe() -> dict:
    from moeferry.engine.setup.hardware import probe

    return probe(measure_bandwidth=True)


def real_plan(hw: dict, model: CatalogEntry | Path | None, vram_budget: int | None,
              cache_experts: int | None = None) -> PlanSummary | None:
    """The planner's cache size and speed for a catalog entry or an installed store; None if unknown."""
    from moeferry.engine.setup.plan import ModelSizes, make_plan

    try:
        if isinstance(model, CatalogEntry) and model.raw and ("sizes" in model.raw or "config" in model.raw):
            sizes = ModelSizes.from_catalog(model.raw)
        elif isinstance(model, Path) and (model / "manifest.json").is_file():
            sizes = ModelSizes.from_store(model)
        else:
            return None
        plan = make_plan(hw, sizes, vram_budget_bytes=vram_budget, cache_experts_per_layer=cache_experts)
    except (KeyError, ValueError, TypeError, OSError, UserError):  # UserError: a store the loader refuses
        return None
    return PlanSummary(plan.cache_experts_per_layer, plan.predicted_tokens_per_s, plan.verdict, plan.hit_rate)


def real_recommend(hw: dict, catalog: list[CatalogEntry]) -> str | None:
    """`moeferry probe`'s recommendation (moeferry.engine.setup.hardware.recommend_model) for these entries."""
    from moeferry.engine.setup.hardware import catalog_plans

    rows = catalog_plans(hw, entries=[e.raw for e in catalog if e.raw])
    return next((r["id"] for r in rows if r["recommended"]), None)


def real_fetch(repo_id: str, dest: Path, **kwargs) -> Path:
    from moeferry.engine.setup.download import fetch_repo

    return fetch_repo(repo_id, dest, **kwargs)


def real_find_in_hf_cache(repo_id: str) -> Path | None:
    from moeferry.engine.setup.hf_cache import find_in_hf_cache

    return find_in_hf_cache(repo_id)


def real_convert(src: Path, dest: Path, expert_bits: int, attn_bits: int, tokenizer=None, progress=None,
                 cancel=None) -> Any:
    """A Hugging Face checkpoint is quantized; the paper's pre-quantized checkpoint is imported as is."""
    from moeferry.engine.storage.convert import convert_checkpoint, detect_format

    if detect_format(src) == "paper":
        from moeferry.engine.storage.paper_format import import_paper_checkpoint

        return import_paper_checkpoint(src, dest, tokenizer=tokenizer, progress=progress, cancel=cancel)
    return convert_checkpoint(src, dest, expert_bits, attn_bits, device="auto", tokenizer=tokenizer,
                              progress=progress, cancel=cancel)


def real_verify(path: Path) -> list[str]:
    from moeferry.engine.storage.store import verify_store

    return verify_store(path)


def real_demo_path() -> Path | None:
    """The embedded demo store; None when this install has none."""
    path = demo_store_path()
    return path if path.exists() else None


def real_setup_backend() -> SetupBackend:
    return SetupBackend(
        probe=real_probe, catalog=load_catalog, plan=real_plan, recommend=real_recommend, fetch=real_fetch,
        find_in_hf_cache=real_find_in_hf_cache, convert=real_convert, verify=real_verify,
        demo_path=real_demo_path, endpoint=os.environ.get("HF_ENDPOINT") or None,
    )
