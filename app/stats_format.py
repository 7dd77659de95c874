"""Plain-words formatting of generation stats and sizes for the status bar and the wizard. No Qt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GB = 1e9
GiB = 1024**3  # memory sizes (VRAM) are shown in GiB, written "GB" as GPU makers do


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:
        return "unknown"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {(seconds % 3600) // 60:02d} min"


def _get(stats: Any, name: str, default=None):
    if stats is None:
        return default
    if isinstance(stats, dict):
        return stats.get(name, default)
    return getattr(stats, name, default)


def _ratio(a, b) -> float | None:
    return None if not b else a / b


@dataclass(frozen=True)
class StatItem:
    key: str
    text: str
    tooltip: str


def speed_words(tokens_per_s: float | None) -> str:
    """A predicted or measured speed in words that stay readable when it is very slow."""
    if not tokens_per_s or tokens_per_s <= 0:
        return "speed unknown"
    if tokens_per_s >= 0.95:
        return f"about {tokens_per_s:.1f} tokens/s" if tokens_per_s < 10 else f"about {tokens_per_s:.0f} tokens/s"
    per_token = 1 / tokens_per_s
    if per_token < 120:
        return f"about {per_token:.0f} s per token"
    if per_token < 3600:
        return f"about {per_token / 60:.0f} min per token"
    return f"about {per_token / 3600:.0f} h per token"


def stats_items(stats: Any, on_gpu: bool = True, hit_rate: float | None = None,
                streaming: bool = False) -> list[StatItem]:
    """The status-bar items for one generation's stats (a GenerationStats or its dict).

    `hit_rate`, when given, is the expert map's (from the trace), so both say the same number.
    On the CPU every expert is in memory: the GPU items (cache, prefetch, memory, copy speed) are
    empty. While a reply streams (`streaming`) the numbers of the reply before are not shown.
    """
    dash = "–"
    if streaming:
        stats = None
    tps = _get(stats, "tokens_per_s")
    ttft = _get(stats, "first_token_s")
    hits, misses = _get(stats, "cache_hits", 0) or 0, _get(stats, "cache_misses", 0) or 0
    issued, used = _get(stats, "prefetch_issued", 0) or 0, _get(stats, "prefetch_used", 0) or 0
    peak, budget = _get(stats, "peak_vram_bytes"), _get(stats, "vram_budget_bytes")
    h2d = _get(stats, "h2d_gb_per_s")
    if hit_rate is None:
        hit_rate = _ratio(hits, hits + misses)
    pf_rate = _ratio(used, issued)
    vram = dash
    if peak:
        vram = f"{peak / GiB:.1f} / {budget / GiB:.1f} GB" if budget else f"{peak / GiB:.1f} GB"
    tps_text = "generating…" if streaming else (f"{tps:.1f} tok/s" if tps else f"{dash} tok/s")
    items = [
        StatItem("tps", tps_text, "Tokens (word pieces) generated per second by the last reply"),
        StatItem("ttft", f"first token {ttft:.2f} s" if ttft is not None else f"first token {dash}",
                 "Time from sending to the first token of the reply"),
    ]
    if not on_gpu:
        return items + [StatItem(key, "", "") for key in ("cache", "prefetch", "vram", "h2d")]
    return items + [
        StatItem("cache", f"cache hits {hit_rate:.0%}" if hit_rate is not None else f"cache hits {dash}",
                 "Experts already on the GPU when a token needed them (the expert map's number)"),
        StatItem("prefetch", f"prefetch {pf_rate:.0%}" if pf_rate is not None else f"prefetch {dash}",
                 f"Experts copied early that were then used ({used} of {issued})"),
        StatItem("vram", f"GPU memory {vram}", "Most GPU memory used during the reply / the limit set for it"),
        StatItem("h2d", f"copies to GPU {h2d:.1f} GB/s" if h2d else f"copies to GPU {dash}",
                 "How fast experts were copied from RAM to the GPU"),
    ]


def stats_dict(stats: Any) -> dict | None:
    """A JSON-able copy of the stats, kept with the reply in the database."""
    if stats is None:
        return None
    if isinstance(stats, dict):
        return dict(stats)
    if hasattr(stats, "__dataclass_fields__"):
        return {name: getattr(stats, name) for name in stats.__dataclass_fields__}
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}
