"""Plain-words formatting of generation stats and sizes for the status bar and the wizard. No Qt."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moeferry.engine import units
from moeferry.engine.contract import GenerationStats
from moeferry.engine.units import GiB


def fmt_bytes(n: float | None) -> str:
    """Download and disk sizes, in decimal units as the hub and disk makers count them."""
    return units.fmt_bytes(n, decimal=True)


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


def stats_items(stats: GenerationStats | None, on_gpu: bool = True, hit_rate: float | None = None,
                streaming: bool = False) -> list[StatItem]:
    """The status-bar items for one generation's stats (None: no reply yet, all dashes).

    `hit_rate`, when given, is the expert map's (from the trace), so both say the same number.
    On the CPU every expert is in memory: the GPU items (cache, prefetch, memory, copy speed) are
    empty. While a reply streams (`streaming`) the numbers of the reply before are not shown.
    """
    dash = "–"
    if streaming or stats is None:
        tps = ttft = peak = budget = h2d = None
        hits = misses = issued = used = 0
    else:
        tps, ttft, h2d = stats.tokens_per_s, stats.first_token_s, stats.h2d_gb_per_s
        hits, misses = stats.cache_hits, stats.cache_misses
        issued, used = stats.prefetch_issued, stats.prefetch_used
        peak, budget = stats.peak_vram_bytes, stats.vram_budget_bytes
    card = (f"; the whole card: {stats.gpu_memory_used_bytes / GiB:.1f} of {stats.gpu_memory_total_bytes / GiB:.1f} GB "
            "in use, as nvidia-smi or Task Manager count it (with the CUDA runtime and other programs)"
            if stats is not None and not streaming and stats.gpu_memory_total_bytes else "")
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
        StatItem("vram", f"GPU memory {vram}",
                 "Most GPU memory the engine used during the reply / the limit set for it" + card),
        StatItem("h2d", f"copies to GPU {h2d:.1f} GB/s" if h2d else f"copies to GPU {dash}",
                 "How fast experts were copied from RAM to the GPU"),
    ]


def stats_dict(stats: GenerationStats | None) -> dict | None:
    """A JSON-able copy of the stats, kept with the reply in the database."""
    return None if stats is None else asdict(stats)
