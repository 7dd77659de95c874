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
  applying layer l + d's router (its post-attention RMSNorm, then its gate) to layer l's
  input hidden state (the residual stream), and take the m best. Recall = the fraction of
  the experts actually used at layer l + d that were guessed, over all tokens and all l
  with l + d < layers.

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

import numpy as np
import torch

from engine.errors import UserError

CACHE_SIZES = (1, 2, 3, 4)
DISTANCES = (1, 2, 4)
PREFETCH = (1, 2, 3)
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "training" / "data" / "heldout.txt"


@dataclass
class RoutingTrace:
    """What the router chose on a token sequence, and what a look-ahead would have guessed."""

    selected: np.ndarray  # [L, T, k] experts used at each layer, best first
    guesses: dict[int, np.ndarray]  # d -> [L - d, T, m]: layer l+d's router on layer l's input
    num_experts: int

    @property
    def num_layers(self) -> int:
        return self.selected.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.selected.shape[1]


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
# The measures (pure functions on expert indices)


def lru_hits(selected: np.ndarray, cache_size: int) -> int:
    """Hits of a per-layer LRU cache of `cache_size` experts over tokens [T, k] (best first)."""
    cache: list[int] = []  # most recently used first
    hits = 0
    for experts in selected.tolist():
        hits += sum(e in cache for e in experts)
        cache = (experts + [c for c in cache if c not in experts])[:cache_size]
    return hits


def lru_hit_ratio(selected: np.ndarray, cache_size: int) -> float:
    """Mean over layers of the LRU hit ratio; selected is [L, T, k]."""
    per_layer = [lru_hits(layer, cache_size) / layer.size for layer in selected]
    return float(np.mean(per_layer))


def prefetch_recall(guessed: np.ndarray, used: np.ndarray, m: int) -> float:
    """Fraction of the used experts [N, k] found among the first m guesses [N, >= m]."""
    guess = guessed[..., :m]
    found = (used[..., :, None] == guess[..., None, :]).any(-1)  # [N, k]
    return float(found.mean())


def random_lru_hit_ratio(num_experts: int, cache_size: int) -> float:
    return min(cache_size, num_experts) / num_experts


def random_prefetch_recall(num_experts: int, m: int) -> float:
    return min(m, num_experts) / num_experts


def report_from_trace(trace: RoutingTrace, cache_sizes=CACHE_SIZES, distances=DISTANCES,
                      prefetch=PREFETCH) -> LocalityReport:
    sel = trace.selected
    recall = {}
    for d in distances:
        if d in trace.guesses:
            used = sel[d:]  # [L - d, T, k]: layer l + d's experts, indexed by l
            recall[d] = {m: prefetch_recall(trace.guesses[d], used, m) for m in prefetch}
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
# Tracing a transformers MixtralForCausalLM


@torch.no_grad()
def trace_routing(model, input_ids: torch.Tensor, window: int = 512,
                  distances=DISTANCES, max_guess: int = max(PREFETCH)) -> RoutingTrace:
    """Run `model` over input_ids [N] in windows of `window` tokens (fresh context each).

    hidden_states[l] of transformers' output is the input of decoder layer l (the embedding
    for l = 0); router_logits[l] is layer l's gate output, [tokens, experts].
    """
    cfg = model.config
    k, n_exp, n_layers = cfg.num_experts_per_tok, cfg.num_local_experts, cfg.num_hidden_layers
    layers = model.model.layers
    selected, guesses = [], {d: [] for d in distances if d < n_layers}
    for start in range(0, len(input_ids), window):
        ids = input_ids[start:start + window][None]
        out = model(input_ids=ids, output_hidden_states=True, output_router_logits=True,
                    use_cache=False)
        logits = torch.stack([r.reshape(-1, n_exp).float() for r in out.router_logits])  # [L, T, E]
        selected.append(logits.topk(k, dim=-1).indices)  # ties: same order as transformers
        for d in guesses:
            g = []
            for l in range(n_layers - d):
                target = layers[l + d]
                h = target.post_attention_layernorm(out.hidden_states[l][0])  # [T, H]
                g.append((h @ target.mlp.gate.weight.T).float().topk(max_guess, dim=-1).indices)
            guesses[d].append(torch.stack(g))  # [L - d, T, m]
    return RoutingTrace(
        selected=torch.cat(selected, dim=1).numpy(),
        guesses={d: torch.cat(v, dim=1).numpy() for d, v in guesses.items()},
        num_experts=n_exp,
    )


def measure_locality(model, input_ids: torch.Tensor, window: int = 512) -> LocalityReport:
    return report_from_trace(trace_routing(model, input_ids, window))


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
             "Speculative prefetch recall (experts of layer l+d guessed from layer l's input):", "",
             "| prefetched experts m | " + " | ".join(str(m) for m in r.prefetch_recall_random)
             + " |",
             "|---|" + "---|" * len(r.prefetch_recall_random)]
    for d, row in r.prefetch_recall.items():
        lines.append(f"| {d} layer{'s' if d > 1 else ''} ahead | "
                     + " | ".join(f"{v:.3f}" for v in row.values()) + " |")
    lines.append("| random routing | "
                 + " | ".join(f"{v:.3f}" for v in r.prefetch_recall_random.values()) + " |")
    return "\n".join(lines) + "\n"


def plot_report(r: LocalityReport, path: str | Path, title: str = "") -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib; install it with `pip install matplotlib`.") from None
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


DEFAULT_MAX_TOKENS = 131072


def text_path(text_file: str | None) -> Path:
    """The text to measure on: text_file, else the demo corpus' held-out text; it must exist."""
    path = Path(text_file).expanduser() if text_file else DEFAULT_TEXT
    if not path.is_file():
        if text_file:
            raise UserError(f"{path} is not a file; give a UTF-8 text file with --text.")
        raise UserError("The held-out text of the demo corpus (training/data/heldout.txt) is not "
                        "installed; give a UTF-8 text file with --text.")
    return path


def load_text_ids(tokenizer, text_file: str | None, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids of the text (the demo's held-out text by default), at most max_tokens
    (default DEFAULT_MAX_TOKENS)."""
    max_tokens = max_tokens or DEFAULT_MAX_TOKENS
    path = text_path(text_file)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; give a UTF-8 text file with --text.") from None
    docs = [d for d in text.split("\n\n") if d.strip()]
    tokenizer.model_max_length = 1 << 30  # we window the text ourselves
    ids: list[int] = []
    for d in docs:  # plain paragraphs, each opened by <s> like the training text
        ids += tokenizer(d + "\n\n")["input_ids"]
        if len(ids) >= max_tokens:
            break
    if len(ids) < 16:
        raise UserError(f"{path} holds too little text to measure anything; give a longer file.")
    return torch.tensor(ids[:max_tokens])


def cli_locality(store: str, text_file: str | None, json_out: bool, plot: str | None,
                 max_tokens: int | None = None) -> int:
    """`moeferry demo locality`: measure expert locality of a store's model on text."""
    from transformers import AutoTokenizer

    from engine.store import load_dequantized_hf_model, resolve_store_path

    text_path(text_file)  # before the slow part
    path = resolve_store_path(store)
    model = load_dequantized_hf_model(store)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise UserError(f"Cannot load the tokenizer of {path} ({e}); run `moeferry verify {path}`.") from None
    ids = load_text_ids(tokenizer, text_file, max_tokens)
    report = measure_locality(model, ids)
    if plot:
        plot_report(report, plot, title=f"Expert locality, {path.name}, {report.tokens} tokens")
    if json_out:
        print(report.to_json())
    else:
        print(markdown_tables(report), end="")
        if plot:
            print(f"Plot written to {plot}.", file=sys.stderr)
    return 0
