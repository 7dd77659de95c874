"""Routing traces and forced routing: what the benchmark feeds the router's place.

A `RoutingTrace` is the one representation of routing in the code base: per layer, per
token, the chosen experts (best first) with their renormalised weights, and the
prefetcher's guesses for 1..D layers ahead.

    ids      int  [L, T, k]     expert ids, best first
    weights  f32  [L, T, k]     their routing weights (sum 1 per token and layer)
    guesses  int  [D, L, T, m]  guesses[d-1, l, t]: the experts of layer l+d guessed while layer l
                                ran (layer l+d's router on layer l's residual stream); -1 where
                                l+d >= L

File format (version 1): one safetensors file, tensors "ids" (U8, or I16 past 255 experts),
"weights" (F16), "guesses" (same type as ids; the filler -1 is stored as the type's 255 / -1),
and a header "__metadata__" of strings: format, version, num_experts, note.

Forced routing replaces only the router's choice (ids, weights) and the prefetcher's guesses;
attention, experts, copies, the cache and CUDA graphs run as in real decoding. A routing
source is set on `OffloadedMixtral.routing`; the model calls `begin(T)` at the start of each
forward and `choose(model, i, x, weights, ids, guesses)` once per layer, which returns the
(weights, ids, guesses) to use. Sources:
  * `UniformRouting`: each token's top-k per layer drawn uniformly without replacement,
    independent from token to token; weights a softmax of random logits; the guess for layer
    i+d holds each of that layer's true experts with probability R**d, else a wrong expert;
  * `TraceRouting`: a recorded trace replayed token by token (see `map_trace` for traces of
    smaller models);
  * `ModelRouting`: the model's own router, observed (for the guess recall it reaches);
  * `TraceRecorder`: the model's own router, recorded into a RoutingTrace.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeferry.engine.errors import UserError
from moeferry.engine.progress import ProgressLine
from moeferry.engine.runtime.model import expand_units

FORMAT, VERSION = "moeferry-routing-trace", 1


@dataclass
class RoutingTrace:
    ids: np.ndarray
    weights: np.ndarray
    guesses: np.ndarray
    num_experts: int
    note: str = ""

    @property
    def num_layers(self) -> int:
        return self.ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    @property
    def depth(self) -> int:
        return self.guesses.shape[0]

    def guesses_at(self, d: int) -> np.ndarray:
        """[L - d, T, m]: what layer l guessed for layer l + d (locality's layout)."""
        return self.guesses[d - 1, :self.num_layers - d]

    def tokens(self, start: int, stop: int) -> "RoutingTrace":
        return RoutingTrace(self.ids[:, start:stop], self.weights[:, start:stop],
                            self.guesses[:, :, start:stop], self.num_experts, self.note)

    # -- file ---------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        from safetensors.numpy import save_file
        dt = np.uint8 if self.num_experts < 255 else np.int16
        arrays = {"ids": self.ids.astype(dt), "weights": self.weights.astype(np.float16),
                  "guesses": self.guesses.astype(dt)}
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path),
                  metadata={"format": FORMAT, "version": str(VERSION),
                            "num_experts": str(self.num_experts), "note": self.note})

    @classmethod
    def load(cls, path: str | Path) -> "RoutingTrace":
        from safetensors import safe_open
        try:
            with safe_open(str(path), "np") as f:
                meta = f.metadata() or {}
                t = {k: f.get_tensor(k) for k in ("ids", "weights", "guesses")}
        except FileNotFoundError:
            raise UserError(f"{path} does not exist; give a trace written by `moeferry trace`.") from None
        except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
            raise UserError(f"{path} is not a routing trace ({type(e).__name__}); give a file written "
                            f"by `moeferry trace`.") from None
        if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
            raise UserError(f"{path} is not a version-{VERSION} routing trace; record it again with "
                            f"`moeferry trace`.")
        guesses = t["guesses"].astype(np.int64)
        if t["guesses"].dtype == np.uint8:
            guesses[guesses == 255] = -1
        return cls(t["ids"].astype(np.int64), t["weights"].astype(np.float32), guesses,
                   int(meta["num_experts"]), meta.get("note", ""))


# ---------------------------------------------------------------------------------------------
# Mapping a trace onto a model with more layers or experts


def map_trace(trace: RoutingTrace, num_layers: int, num_experts: int, top_k: int, seed: int = 0,
              block: int = 64) -> RoutingTrace:
    """The trace as a model of num_layers x num_experts would see it.

    Layers: target layer l replays source layer l mod L_src with the experts relabelled by a
    fixed random permutation per target layer (the same one for the guesses of that layer), so
    every target layer keeps its source layer's load, LRU hit ratios and guess recall. A guess
    that would cross a repetition (target l+d maps to source layer (l mod L_src)+d >= L_src)
    has no recording; it is made from the true experts with the trace's own recall at distance
    d (`stated_recall_guess`).
    Experts: with E = J * E_src, source expert e becomes e + E_src * j, with j drawn per
    (target layer, block of `block` tokens): each copy carries 1/J of its source expert's load
    on average, within a block locality is kept, and the guesses of the same token and layer use
    the same j, so the guess recall is unchanged.
    """
    L0, E0 = trace.num_layers, trace.num_experts
    if top_k != trace.top_k:
        raise UserError(f"The trace routes {trace.top_k} experts per token and this model {top_k}; "
                        f"record a trace on a model with top-{top_k} routing.")
    if num_experts % E0 or num_layers < 1:
        raise UserError(f"A trace of {E0} experts per layer maps only onto a multiple of {E0} experts "
                        f"(this model has {num_experts}); record a trace on this model.")
    rng = np.random.default_rng(seed)
    J, T, D = num_experts // E0, trace.num_tokens, trace.depth
    blocks = -(-T // block)
    perm = np.stack([rng.permutation(E0) for _ in range(num_layers)])  # [L, E0]
    offset = E0 * np.repeat(rng.integers(0, J, size=(num_layers, blocks)), block, axis=1)[:, :T]  # [L, T]

    def relabel(e: np.ndarray, layer: int) -> np.ndarray:
        return np.where(e < 0, -1, perm[layer][np.maximum(e, 0)] + offset[layer][:, None])

    src = np.arange(num_layers) % L0
    ids = np.stack([relabel(trace.ids[s], l) for l, s in enumerate(src)])
    guesses = np.full((D, num_layers, T, trace.guesses.shape[3]), -1)
    recall = [trace_recall(trace, d) for d in range(1, D + 1)]
    for d in range(1, D + 1):
        for l in range(num_layers - d):
            s = src[l]
            if s + d < L0:
                guesses[d - 1, l] = relabel(trace.guesses[d - 1, s], l + d)
            else:
                guesses[d - 1, l] = stated_recall_guess(ids[l + d], num_experts, recall[d - 1],
                                                        trace.guesses.shape[3], rng)
    weights = np.stack([trace.weights[s] for s in src])
    return RoutingTrace(ids, weights, guesses, num_experts,
                        f"{trace.note} (mapped from {L0} layers x {E0} experts to {num_layers} x {num_experts})")


def stated_recall_guess(true: np.ndarray, num_experts: int, recall: float, m: int, rng) -> np.ndarray:
    """Guesses [T, m] for true experts [T, k]: position j holds true[:, j] with probability
    `recall`, else an expert outside the true set (m > k: the rest wrong too)."""
    T, k = true.shape
    out = np.full((T, m), -1)
    for t in range(T):
        wrong = [e for e in rng.permutation(num_experts) if e not in true[t]]
        for j in range(m):
            out[t, j] = true[t, j] if j < k and rng.random() < recall else wrong.pop()
    return out


# ---------------------------------------------------------------------------------------------
# Measures on expert indices (defined in engine/measure/locality.py's docstring)


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


def decode_hits(selected: np.ndarray, cache_size: int, prompt: int, new: int, held: bool) -> tuple[int, int]:
    """(hits, uses) of one layer's cache over the decoded tokens of conversations cut from
    selected [T, k]: each `prompt` tokens read into a fresh LRU cache, then `new` tokens decoded.
    held: the cache stays as the prompt left it while decoding (a streaming decode's,
    model.stream_misses), else it goes on as an LRU."""
    hits = uses = 0
    rows = selected.tolist()
    for start in range(0, len(rows) - prompt - new + 1, prompt + new):
        cache: list[int] = []  # most recently used first
        for t, experts in enumerate(rows[start:start + prompt + new]):
            if t >= prompt:
                hits += sum(e in cache for e in experts)
                uses += len(experts)
                if held:
                    continue
            cache = (experts + [c for c in cache if c not in experts])[:cache_size]
    return hits, uses


def decode_hit_ratio(selected: np.ndarray, cache_size: int, prompt: int, new: int, held: bool) -> float:
    """decode_hits over every layer of selected [L, T, k]; 0 when no conversation fits."""
    counts = np.array([decode_hits(layer, cache_size, prompt, new, held) for layer in selected])
    return float(counts[:, 0].sum() / counts[:, 1].sum()) if counts[:, 1].sum() else 0.0


def prefetch_recall(guessed: np.ndarray, used: np.ndarray, m: int) -> float:
    """Fraction of the used experts [N, k] found among the first m guesses [N, >= m]."""
    guess = guessed[..., :m]
    found = (used[..., :, None] == guess[..., None, :]).any(-1)  # [N, k]
    return float(found.mean())


def trace_recall(trace: RoutingTrace, d: int, m: int | None = None) -> float:
    """Share of the experts used at layer l+d found among the m (default k) guesses made at l."""
    if d > trace.depth or d >= trace.num_layers:
        return 0.0
    return prefetch_recall(trace.guesses_at(d), trace.ids[d:], m or trace.top_k)


# ---------------------------------------------------------------------------------------------
# Routing sources (OffloadedMixtral.routing)


class GuessScore:
    """Guess recall reached, per distance: true experts of layer l+d found among the guesses
    made at layer l, over decoded tokens."""

    def __init__(self):
        self.found: dict[int, int] = {}
        self.total: dict[int, int] = {}

    def add(self, ids: list[list[int]], guesses: list[list[list[int]]]) -> None:
        """ids[l] the token's experts at layer l; guesses[l][d-1] what layer l guessed for l+d."""
        for l, per_d in enumerate(guesses):
            for d, guess in enumerate(per_d, start=1):
                if l + d < len(ids):
                    self.add_counts(d, len(set(guess) & set(ids[l + d])), len(ids[l + d]))

    def add_counts(self, d: int, found: int, total: int) -> None:
        self.found[d] = self.found.get(d, 0) + int(found)
        self.total[d] = self.total.get(d, 0) + int(total)

    def recall(self) -> dict[int, float]:
        return {d: self.found[d] / self.total[d] for d in sorted(self.total) if self.total[d]}


def found_counts(ids: np.ndarray, guesses: np.ndarray) -> np.ndarray:
    """ids [L, T, k], guesses [L, T, D, k] -> [T, D]: true experts of layer l+d (all l) found
    among the guesses made at layer l."""
    L, T, k = ids.shape
    out = np.zeros((T, guesses.shape[2]), dtype=np.int64)
    for d in range(1, min(guesses.shape[2], L - 1) + 1):
        true, g = ids[d:], guesses[:L - d, :, d - 1]  # [L-d, T, k] each
        out[:, d - 1] = (true[..., :, None] == g[..., None, :]).any(-1).sum((0, 2))
    return out


class TableRouting:
    """A forced routing given as tables that `next_tables(n)` makes for the next n tokens:
    ids [L, n, k], weights [L, n, k], guesses [L, n, D, k]. Decoded tokens are drawn CHUNK at a
    time and sent to the device at once, so a token costs the host only a slice."""

    forces = True
    CHUNK = 64

    def __init__(self, top_k: int, device, units: int = 1):
        """units > 1: the model's experts are cut into units (ModelConfig.expert_units); the
        tables route whole experts and go to the device as units (expand_units), once per chunk."""
        self.k, self.device, self.units = top_k, torch.device(device), units
        self.score = GuessScore()
        self.tokens = 0  # tokens routed so far
        self.chunk = None  # (ids, weights, guesses) on the device, found counts [n, D], next row
        self.row = 0
        self.prompt = None  # a prompt's tables drawn ahead (reserve), and the decode's chunks
        self.ahead: list = []

    def reserve(self, T: int, n: int) -> None:
        """Draw now, in the order begin() would, the tables of a T-token prompt and of the n
        tokens decoded after it: the bench calls this before its clock starts, so that its timed
        tokens pay a slice each and no draw (Qwen3-30B-A3B's shape: 41 ms per chunk of 64 tokens
        on the 2-core box, as much as 14 % of a resident decode)."""
        self.prompt = self.upload(T) if T > 1 else None
        drawn = sum(c[0].shape[1] for c in self.ahead)  # rows already drawn and not yet handed out
        if self.chunk is not None:
            drawn += self.chunk[0].shape[1] - self.row
        n -= drawn
        while n > 0:
            self.ahead.append(self.upload(self.chunk_size()))
            n -= self.ahead[-1][0].shape[1]

    def begin(self, T: int) -> None:
        if T > 1:  # a prompt: its own tables, guesses of its last token
            ready, self.prompt = self.prompt, None
            ids, weights, guesses, _ = ready if ready is not None and ready[0].shape[1] == T else self.upload(T)
            self.ids, self.weights, self.guesses = ids, weights, guesses[:, -1]
        else:
            if self.chunk is None or self.row == self.chunk[0].shape[1]:
                self.chunk, self.row = (self.ahead.pop(0) if self.ahead else self.upload(self.chunk_size())), 0
            ids, weights, guesses, found = self.chunk
            r = self.row
            self.ids, self.weights, self.guesses = ids[:, r:r + 1], weights[:, r:r + 1], guesses[:, r]
            L = ids.shape[0]
            for d in range(1, found.shape[1] + 1):
                if d < L:
                    self.score.add_counts(d, found[r, d - 1], self.k * (L - d))
            self.row += 1
        self.tokens += T

    def upload(self, n: int):
        ids, weights, guesses = self.next_tables(n)
        w, e = expand_units(torch.as_tensor(weights, dtype=torch.float32).to(self.device),
                            torch.as_tensor(ids, dtype=torch.long).to(self.device), self.units)
        g = expand_units(None, torch.as_tensor(np.maximum(guesses, 0), dtype=torch.long).to(self.device), self.units)[1]
        return e, w, g, found_counts(ids, guesses)

    def chunk_size(self) -> int:
        return self.CHUNK

    def recall(self) -> dict[int, float]:
        return self.score.recall()

    def choose(self, model, i: int, x, weights, ids, guesses):
        depth = 0 if guesses is None else guesses.shape[0]
        return self.weights[i], self.ids[i], self.guesses[i, :depth] if depth else None

    def token_table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [L, k], ids [L, k], guesses [L, D, k]) of the one token of this step."""
        return self.weights[:, 0], self.ids[:, 0], self.guesses


class UniformRouting(TableRouting):
    def __init__(self, num_layers: int, num_experts: int, top_k: int, device, recall: float = 0.85,
                 depth: int = 1, seed: int = 0, units: int = 1):
        super().__init__(top_k, device, units)
        self.L, self.E, self.stated, self.D = num_layers, num_experts, recall, max(depth, 1)
        self.rng = np.random.default_rng(seed)

    def next_tables(self, n: int):
        L, E, k, D, rng = self.L, self.E, self.k, self.D, self.rng
        ids = np.argsort(rng.random((L, n, E)), axis=-1)[..., :k]  # k distinct, uniform
        logits = rng.standard_normal((L, n, k))
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w = -np.sort(-(w / w.sum(-1, keepdims=True)), axis=-1)  # best first, like top-k
        # the guess made at layer l for layer l+d: each true expert kept with probability R^d,
        # else replaced by one of the other experts (distinct, in random order)
        target = np.stack([np.roll(ids, -d, axis=0) for d in range(1, D + 1)], axis=2)  # [L, n, D, k]
        perm = np.argsort(rng.random((L, n, D, E)), axis=-1)
        is_true = (perm[..., :, None] == target[..., None, :]).any(-1)
        wrong = np.take_along_axis(perm, np.argsort(is_true, axis=-1, kind="stable"), -1)[..., :k]
        keep = rng.random((L, n, D, k)) < self.stated ** np.arange(1, D + 1)[:, None]
        guesses = np.where(keep, target, wrong)
        for d in range(1, D + 1):
            guesses[L - d:, :, d - 1] = -1  # no layer l+d
        return ids, w, guesses

    def describe(self) -> str:
        return (f"uniform (top-{self.k} of {self.E} drawn uniformly per token and layer; prefetch guesses "
                f"hold each true expert with probability {self.stated:g}^d, d layers ahead)")


class TraceRouting(TableRouting):
    def __init__(self, trace: RoutingTrace, device, path: str = "", units: int = 1):
        super().__init__(trace.top_k, device, units)
        self.trace, self.path = trace, path
        self.drawn = 0  # tokens of the trace handed out (chunks run ahead of `tokens`)

    def chunk_size(self) -> int:
        return max(1, min(self.CHUNK, self.trace.num_tokens - self.drawn))  # a shorter last chunk

    def next_tables(self, n: int):
        tr, t0 = self.trace, self.drawn
        if t0 + n > tr.num_tokens:
            raise UserError(f"The trace holds {tr.num_tokens} tokens and this run needs more; record a "
                            f"longer trace or lower --prompt-len / --new-tokens.")
        self.drawn += n
        guesses = tr.guesses[:, :, t0:t0 + n, :tr.top_k].transpose(1, 2, 0, 3)  # [L, n, D, k]
        return tr.ids[:, t0:t0 + n], tr.weights[:, t0:t0 + n], guesses

    def describe(self) -> str:
        return f"trace {self.path} ({self.trace.note})"


class ModelRouting:
    """The model's own router, unchanged; the guess recall it reaches is counted (one extra
    host read per layer, at the point where dispatch reads the routing anyway)."""

    forces = False

    def __init__(self):
        self.score = GuessScore()
        self.ids: list = []
        self.guesses: list = []

    def begin(self, T: int) -> None:
        self.flush()
        self.decoding = T == 1

    def flush(self) -> None:
        """Score the token whose routing was seen last."""
        if self.ids:
            self.score.add(self.ids, self.guesses)
        self.ids, self.guesses = [], []

    def recall(self) -> dict[int, float]:
        self.flush()
        return self.score.recall()

    def choose(self, model, i: int, x, weights, ids, guesses):
        if self.decoding:
            self.ids.append(ids[-1].tolist())
            self.guesses.append(guesses.tolist() if guesses is not None else [])
        return weights, ids, guesses

    def describe(self) -> str:
        return "model (the random-weight router's own choice: degenerate, a few experts take most tokens)"


class TraceRecorder:
    """Records the model's own routing of every token (and its guesses 1..depth layers ahead,
    for every token, as the prefetcher would make them) into arrays; `trace()` builds the
    RoutingTrace."""

    forces = False

    def __init__(self, depth: int, guesses: int):
        self.depth, self.m = depth, guesses
        self.rows: list[list] = []  # per forward: per layer (ids [T, k], weights, guesses [D, T, m])

    def begin(self, T: int) -> None:
        self.rows.append([])

    def choose(self, model, i: int, x, weights, ids, guesses):
        L = model.cfg.num_moe_layers  # i counts MoE layers (moe_index)
        g = torch.full((self.depth, ids.shape[0], self.m), -1, dtype=torch.long)
        for d in range(1, self.depth + 1):
            if i + d < L:
                g[d - 1] = model.guess_ids(i + d, x, self.m).cpu()
        self.rows[-1].append((ids.cpu().clone(), weights.float().cpu().clone(), g))  # buffers the layers reuse
        return weights, ids, guesses

    def trace(self, num_experts: int, note: str) -> RoutingTrace:
        cat = lambda n, dim: torch.cat([torch.stack([layer[n] for layer in step], 0) for step in self.rows], dim)  # noqa: E731
        return RoutingTrace(cat(0, 1).numpy(), cat(1, 1).numpy(), cat(2, 2).transpose(0, 1).numpy(),
                            num_experts, note)


def parse_routing(text: str, cfg, device, recall: float, depth: int, seed: int = 0):
    """--routing MODE -> a routing source (None for `model` when nothing is to be counted)."""
    units = getattr(cfg, "expert_units", 1)  # a forced routing routes whole experts (expand_units)
    E, k = cfg.num_experts // units, cfg.top_k // units
    if text == "uniform":
        return UniformRouting(cfg.num_layers, E, k, device, recall, depth, seed, units)
    if text == "model":
        return ModelRouting()
    if text.startswith("trace:"):
        path = text[len("trace:"):]
        trace = mapped_trace(path, cfg.num_layers, E, k, seed)
        if depth > trace.depth:
            raise UserError(f"The trace holds guesses for {trace.depth} layers ahead and --prefetch is {depth}; "
                            f"lower --prefetch.")
        return TraceRouting(trace, device, path, units)
    raise UserError(f"Unknown --routing {text!r}; use uniform, model or trace:PATH.")


@functools.lru_cache(maxsize=4)
def mapped_trace(path: str, num_layers: int, num_experts: int, top_k: int, seed: int) -> RoutingTrace:
    """The trace at `path`, mapped onto the model when its shape differs (read once per run)."""
    trace = RoutingTrace.load(path)
    if (trace.num_layers, trace.num_experts) != (num_layers, num_experts):
        trace = map_trace(trace, num_layers, num_experts, top_k, seed)
    return trace


# decode_hit_ratio's conversations in trace_stats: the benchmark's prompt and decode lengths
STATS_PROMPT, STATS_NEW = 128, 64


def trace_stats(trace: RoutingTrace) -> dict:
    """A trace's own statistics: per-layer expert load, LRU hit ratio for 1..E cached, guess
    recall for 1..D layers ahead; and the decoded tokens' hit ratio after a 128-token prompt,
    the cache going on as an LRU or held as the prompt left it (empty when the trace is
    shorter than one such conversation)."""
    E = trace.num_experts
    load = [np.bincount(layer.reshape(-1), minlength=E) / layer.size for layer in trace.ids]
    fits = trace.num_tokens >= STATS_PROMPT + STATS_NEW
    return {"tokens": trace.num_tokens, "layers": trace.num_layers, "num_experts": E,
            "top_k": trace.top_k, "note": trace.note,
            "expert_load": [[round(float(v), 4) for v in row] for row in load],
            "lru_hit_ratio": {c: lru_hit_ratio(trace.ids, c) for c in range(1, E + 1)},
            "decode_hit_ratio": {way: {c: decode_hit_ratio(trace.ids, c, STATS_PROMPT, STATS_NEW, way == "held")
                                       for c in range(1, E + 1)} for way in ("lru", "held")} if fits else {},
            "guess_recall": {d: trace_recall(trace, d) for d in range(1, trace.depth + 1)
                             if d < trace.num_layers}}


def stats_markdown(s: dict) -> str:
    lines = [f"Trace: {s['tokens']} tokens, {s['layers']} layers, {s['num_experts']} experts, top-{s['top_k']}. "
             f"{s['note']}", "",
             "| cached experts per layer | " + " | ".join(str(c) for c in s["lru_hit_ratio"]) + " |",
             "|---|" + "---|" * len(s["lru_hit_ratio"]),
             "| LRU hit ratio | " + " | ".join(f"{v:.3f}" for v in s["lru_hit_ratio"].values()) + " |"]
    if s.get("decode_hit_ratio"):
        lines += [f"| {STATS_NEW} tokens decoded after {STATS_PROMPT}, {name} | "
                  + " | ".join(f"{v:.3f}" for v in s["decode_hit_ratio"][way].values()) + " |"
                  for way, name in (("lru", "LRU"), ("held", "cache held as the prompt left it"))]
    lines += ["", "Guess recall (top-k guessed d layers ahead): "
              + ", ".join(f"d={d}: {v:.3f}" for d, v in s["guess_recall"].items()), "",
              "Expert load per layer (share of routed slots, experts 0..E-1):"]
    lines += [f"  layer {l}: " + " ".join(f"{v:.3f}" for v in row) for l, row in enumerate(s["expert_load"])]
    return "\n".join(lines) + "\n"


def json_stats(s: dict) -> str:
    return json.dumps(s, indent=1)


# ---------------------------------------------------------------------------------------------
# Recording: `moeferry trace`

TRACE_DEPTH, TRACE_GUESSES, TRACE_WINDOW = 3, 3, 512
DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "training" / "data" / "heldout.txt"
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



def record_trace(engine, ids: torch.Tensor, note: str, window: int = TRACE_WINDOW,
                 depth: int = TRACE_DEPTH, progress=None) -> RoutingTrace:
    """Run the engine's model over token ids [N] in windows of `window` tokens (each a fresh
    context, as one prompt) and record its routing: the experts and weights its routers chose,
    and the guesses its prefetcher would make 1..depth layers ahead (the best
    max(top_k, TRACE_GUESSES) of layer l+d's router on the residual stream that enters layer
    l's experts) for every token. progress(fraction, message) after each window."""
    model, cfg = engine.model, engine.config
    depth = min(depth, cfg.num_moe_layers - 1)
    recorder = TraceRecorder(max(depth, 1), min(cfg.num_experts, max(cfg.top_k, TRACE_GUESSES)))
    old, model.routing = model.routing, recorder
    try:
        for start in range(0, len(ids), window):
            chunk = ids[start:start + window].to(engine.device)
            model.setup_kv(len(chunk))
            model.forward(chunk, 0)
            if progress:
                done = min(start + window, len(ids))
                progress(done / len(ids), f"recording the routing: {done} of {len(ids)} tokens")
    finally:
        model.routing = old
        engine.cached_ids = []  # the KV cache holds the last window now
    trace = recorder.trace(cfg.num_experts, note)
    return RoutingTrace(trace.ids, trace.weights, trace.guesses[:depth], trace.num_experts, note)


def cli_trace(store: str, text: str, out: str, max_tokens: int | None, device: str = "auto",
              as_json: bool = False) -> int:
    """`moeferry trace STORE --text FILE --out PATH`: record and save a trace; print its statistics."""
    from moeferry.engine.runtime.generate import load_engine

    text_path(text)  # before the slow part
    if max_tokens is not None and max_tokens < 16:
        raise UserError("--max-tokens must be at least 16.")
    if not Path(out).parent.is_dir():
        raise UserError(f"The folder of {out} does not exist; create it or give another --out.")
    engine = load_engine(store, device=device, cuda_graphs=False)
    ids = load_text_ids(engine.tokenizer, text, max_tokens)
    note = (f"recorded by `moeferry trace` from the store {engine.store.path.name} on the first {len(ids)} "
            f"tokens of {text}, {TRACE_WINDOW}-token windows")
    trace = record_trace(engine, ids, note, progress=ProgressLine())
    trace.save(out)
    s = trace_stats(trace)
    print(json_stats(s) if as_json else stats_markdown(s), end="" if not as_json else "\n")
    print(f"Wrote {out} ({Path(out).stat().st_size / 1e3:.0f} kB).", file=sys.stderr)
    return 0
