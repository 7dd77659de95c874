"""Expert locality on real text: how well an LRU cache and speculative prefetch would do.

The analogue of Figure 2 of Eliseev & Mazur (2023), measured on a trained model (the demo
model by default) over held-out text:

* LRU hit ratio. Each layer has its own cache of C experts. Tokens arrive in text order;
  token t at layer l needs its top-k experts S = (e1, ..., ek), best first. Hits are the
  experts of S already in the cache (looked up before any update); then the experts of S
  become the most recently used, e1 the most recent of all, and the least recently used
  experts not in S are evicted down to C. So with C = 1 the cache holds the previous
  token's top-1 expert. Hit ratio = hits / (tokens * k), averaged over layers.

* Speculative prefetch recall. While layer l runs, guess the experts of layer l + d by
  applying layer l + d's router (its post-attention RMSNorm, then its gate) to the residual
  stream that enters layer l's experts (after layer l's attention), as the engine's
  prefetcher does, and take the m best. Recall = the fraction of the experts actually used
  at layer l + d that were guessed, over all tokens and all l with l + d < layers.

The measures are moeferry.engine.measure.routing's lru_hit_ratio and prefetch_recall (shared with `moeferry
trace`). The routing comes from moeferry.engine.measure.routing.record_trace (the engine's own forward over the text
in 512-token windows) as a RoutingTrace, the one trace representation; `moeferry trace`
saves the same trace to a file and prints these statistics (moeferry.engine.measure.routing.trace_stats).

* Random routing baseline: every token picks k of E experts uniformly at random,
  independently. In steady state a cache of C experts then hits C / E of the time, and m
  guessed experts recall m / E of the used ones (E[|P & S|] = m * k / E out of k). Exact.

Command: `moeferry demo locality [--store STORE] [--text FILE] [--json] [--plot PNG]`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moeferry.engine.errors import UserError
from moeferry.engine.measure.routing import RoutingTrace, load_text_ids, lru_hit_ratio, lru_hits, prefetch_recall, text_path

CACHE_SIZES = (1, 2, 3, 4)
DISTANCES = (1, 2, 3)
PREFETCH = (1, 2, 3)


@dataclass
class LocalityReport:
    tokens: int
    layers: int
    num_experts: int
    top_k: int
    lru_hit_ratio: dict[int, float]  # cache size -> hit ratio
    lru_hit_ratio_random: dict[int, float]
    prefetch_recall: dict[int, dict[int, float]]  # distance -> experts prefetched -> recall
    prefetch_recall_random: dict[int, float]  # experts prefetched -> recall
    lru_per_layer: dict[int, list[float]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


# ---------------------------------------------------------------------------------------------
# The random-routing baselines (the measures themselves are moeferry.engine.measure.routing's)


def random_lru_hit_ratio(num_experts: int, cache_size: int) -> float:
    return min(cache_size, num_experts) / num_experts


def random_prefetch_recall(num_experts: int, m: int) -> float:
    return min(m, num_experts) / num_experts


def report_from_trace(trace: RoutingTrace, cache_sizes=CACHE_SIZES, distances=DISTANCES,
                      prefetch=PREFETCH) -> LocalityReport:
    sel = trace.ids
    prefetch = tuple(m for m in prefetch if m <= trace.guesses.shape[3])
    recall = {}
    for d in distances:
        if d <= trace.depth and d < trace.num_layers:
            used = sel[d:]  # [L - d, T, k]: layer l + d's experts, indexed by l
            recall[d] = {m: prefetch_recall(trace.guesses_at(d), used, m) for m in prefetch}
    return LocalityReport(
        tokens=trace.num_tokens, layers=trace.num_layers, num_experts=trace.num_experts,
        top_k=sel.shape[2],
        lru_hit_ratio={c: lru_hit_ratio(sel, c) for c in cache_sizes},
        lru_hit_ratio_random={c: random_lru_hit_ratio(trace.num_experts, c) for c in cache_sizes},
        prefetch_recall=recall,
        prefetch_recall_random={m: random_prefetch_recall(trace.num_experts, m) for m in prefetch},
        lru_per_layer={c: [lru_hits(layer, c) / layer.size for layer in sel] for c in cache_sizes},
    )


# ---------------------------------------------------------------------------------------------
# Output: tables and a plot


def markdown_tables(r: LocalityReport) -> str:
    lines = [f"Held-out tokens: {r.tokens}; {r.layers} layers, {r.num_experts} experts, "
             f"top-{r.top_k}.", "",
             "LRU cache hit ratio (per layer cache of C experts):", "",
             "| cache size C | " + " | ".join(str(c) for c in r.lru_hit_ratio) + " |",
             "|---|" + "---|" * len(r.lru_hit_ratio),
             "| trained model | " + " | ".join(f"{v:.3f}" for v in r.lru_hit_ratio.values()) + " |",
             "| random routing | " + " | ".join(f"{v:.3f}" for v in r.lru_hit_ratio_random.values())
             + " |", "",
             "Speculative prefetch recall (experts of layer l+d guessed from the residual stream at layer l):", "",
             "| prefetched experts m | " + " | ".join(str(m) for m in r.prefetch_recall_random)
             + " |",
             "|---|" + "---|" * len(r.prefetch_recall_random)]
    for d, row in r.prefetch_recall.items():
        lines.append(f"| {d} layer{'s' if d > 1 else ''} ahead | "
                     + " | ".join(f"{v:.3f}" for v in row.values()) + " |")
    lines.append("| random routing | "
                 + " | ".join(f"{v:.3f}" for v in r.prefetch_recall_random.values()) + " |")
    return "\n".join(lines) + "\n"


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib; install it with `pip install matplotlib`.") from None
    return plt


def plot_report(r: LocalityReport, path: str | Path, title: str = "") -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    sizes = list(r.lru_hit_ratio)
    a.plot(sizes, list(r.lru_hit_ratio.values()), "o-", label="trained model")
    a.plot(sizes, list(r.lru_hit_ratio_random.values()), "k--", label="random routing")
    a.set(xlabel="experts cached per layer", ylabel="LRU hit ratio", xticks=sizes, ylim=(0, 1),
          title="LRU cache hit ratio")
    a.legend()
    ms = list(r.prefetch_recall_random)
    for d, row in r.prefetch_recall.items():
        b.plot(ms, list(row.values()), "o-", label=f"{d} layer{'s' if d > 1 else ''} ahead")
    b.plot(ms, list(r.prefetch_recall_random.values()), "k--", label="random routing")
    b.set(xlabel="experts prefetched", ylabel="recall", xticks=ms, ylim=(0, 1),
          title="Speculative prefetch recall")
    b.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command


def measure_locality(store: str, text_file: str | None = None, max_tokens: int | None = None,
                     device: str = "cpu", progress=None) -> LocalityReport:
    """Record the routing of a store's model on text (moeferry.engine.measure.routing.record_trace) and report.
    progress(fraction, message) as the windows of text go through the model."""
    from moeferry.engine.measure.routing import record_trace
    from moeferry.engine.runtime.generate import load_engine

    text_path(text_file)  # before the slow part
    engine = load_engine(store, device=device, cuda_graphs=False)
    ids = load_text_ids(engine.tokenizer, text_file, max_tokens)
    report = report_from_trace(record_trace(engine, ids, note="", progress=progress))
    engine.close()
    return report


def cli_locality(store: str, text_file: str | None, json_out: bool, plot: str | None,
                 max_tokens: int | None = None) -> int:
    """`moeferry demo locality`: measure expert locality of a store's model on text."""
    path = text_path(text_file)
    if plot:
        pyplot()  # before the slow part
    from moeferry.engine.progress import ProgressLine

    report = measure_locality(store, str(path), max_tokens, progress=ProgressLine())
    if plot:
        plot_report(report, plot, title=f"Expert locality, {store}, {report.tokens} tokens")
    if json_out:
        print(report.to_json())
    else:
        print(markdown_tables(report), end="")
        if plot:
            print(f"Plot written to {plot}.", file=sys.stderr)
    return 0
