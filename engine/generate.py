"""Loading a store and generating text: sampling -> prefill -> decode -> stream -> load.

`load_engine` picks the device, dtype and expert-cache size (from a VRAM budget), and
`Engine.stream` yields text pieces as tokens are decoded; a threading.Event cancels it from
any thread. Stats for every generation land in `Engine.last_stats`, the routing of every
decoded token in `Engine.last_trace` (the GUI's expert map).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from engine import quant, store as store_mod
from engine.errors import UserError
from engine.expert_cache import ExpertCache
from engine.model import KVCache, ModelConfig, OffloadedMixtral

GiB = 1 << 30


@dataclass
class SamplingSettings:
    """How the next token is chosen. None for a repetition control: the store's default.

    repeat_penalty follows llama.cpp: over the last repeat_last_n tokens of the context
    (prompt included; -1 = all of it, 0 = none) a token's positive logit is divided by the
    penalty and a negative one multiplied (1.0 = off). no_repeat_ngram follows transformers:
    a token that would complete an n-gram already in the context is never chosen (0 = off).
    """
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 512
    seed: int | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int = 64
    no_repeat_ngram: int | None = None


@dataclass
class TokenPiece:
    token_id: int
    text: str


def detokenize(tokenizer, ids: Iterable[int]) -> Iterator[tuple[int, str]]:
    """(token, the text it adds) for each token, decoding only the last few tokens each time.

    Decoding the whole reply per token costs O(n^2); instead two windows that start at the same
    token are decoded (the text already shown, and it plus the new tokens), so whatever a
    tokenizer does at the start of a decode (a dropped leading space) cancels out. A token
    that ends in an unfinished multi-byte character yields nothing until the rest arrives.
    """
    new: list[int] = []
    start = shown = 0  # window start; tokens [start, shown) are the text already given out
    for tok in ids:
        new.append(tok)
        before = tokenizer.decode(new[start:shown], skip_special_tokens=True)
        text = tokenizer.decode(new[start:], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            continue
        yield tok, text[len(before):]
        start, shown = shown, len(new)


@dataclass
class GenerationStats:
    tokens_per_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    bytes_h2d: int = 0
    peak_vram_bytes: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    vram_budget_bytes: int | None = None
    h2d_gb_per_s: float = 0.0

    def contract(self) -> dict:
        """The fields `moeferry generate --json` promises, first, then the rest."""
        d = asdict(self)
        keys = ("tokens_per_s", "prefill_s", "decode_s", "cache_hits", "cache_misses",
                "prefetch_issued", "prefetch_used", "bytes_h2d", "peak_vram_bytes")
        return {**{k: d[k] for k in keys}, **{k: v for k, v in d.items() if k not in keys}}


@dataclass
class ExpertTrace:
    num_layers: int
    num_experts: int
    selected: list = field(default_factory=list)  # [token][layer] -> tuple of expert ids
    resident_before: list = field(default_factory=list)  # [token][layer] -> experts resident then


# ---------------------------------------------------------------------------------------------
# Sampling


def store_sampling_defaults(path: Path) -> dict:
    """The repetition controls a store's generation_config.json sets (transformers' key names)."""
    import json
    gc = path / "generation_config.json"
    cfg = json.loads(gc.read_text()) if gc.is_file() else {}
    return {"repeat_penalty": float(cfg.get("repetition_penalty") or 1.0),
            "no_repeat_ngram": int(cfg.get("no_repeat_ngram_size") or 0)}


def check_sampling(s: SamplingSettings) -> None:
    if s.temperature < 0 or not 0 < s.top_p <= 1:
        raise UserError("--temperature must be 0 or more and --top-p in (0, 1].")
    if s.repeat_penalty is not None and s.repeat_penalty <= 0:
        raise UserError("--repeat-penalty must be above 0 (1.0 = off; 1.1 is a usual value).")
    if s.repeat_last_n < -1:
        raise UserError("--repeat-last-n must be -1 (the whole context), 0 (off) or more.")
    if s.no_repeat_ngram is not None and s.no_repeat_ngram < 0:
        raise UserError("--no-repeat-ngram must be 0 (off) or more.")


def penalize(logits: torch.Tensor, s: SamplingSettings, context: list[int]) -> torch.Tensor:
    """logits [vocab] with the repetition controls applied to the context's tokens (a copy)."""
    penalty, n = s.repeat_penalty or 1.0, s.no_repeat_ngram or 0
    window = context if s.repeat_last_n < 0 else context[-s.repeat_last_n:] if s.repeat_last_n > 0 else []
    if penalty == 1.0 and (n < 1 or len(context) < n):
        return logits
    logits = logits.clone()
    if penalty != 1.0 and window:
        idx = torch.tensor(sorted(set(window)), device=logits.device)
        seen = logits[idx]
        logits[idx] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if n >= 1 and len(context) >= n:
        grams = torch.tensor(context).unfold(0, n, 1)  # [positions, n]
        tail = torch.tensor(context[len(context) - n + 1:], dtype=grams.dtype)
        banned = grams[(grams[:, :-1] == tail).all(dim=1), -1]
        logits[banned.to(logits.device)] = float("-inf")
    return logits


def sample(logits: torch.Tensor, s: SamplingSettings, gen: torch.Generator | None,
           context: Sequence[int] = ()) -> int:
    """logits [vocab] float32 -> token id. temperature 0 = greedy. context: the tokens so far."""
    logits = penalize(logits, s, list(context))
    if s.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / s.temperature, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p > s.top_p  # keep the first past top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen))


# ---------------------------------------------------------------------------------------------
# The engine


class Engine:
    def __init__(self, store: store_mod.Store, model: OffloadedMixtral, tokenizer, device, dtype,
                 budget: int | None, max_context: int, note: str = ""):
        self.store, self.model, self.tokenizer = store, model, tokenizer
        self.config: ModelConfig = store.config
        self.device, self.dtype, self.vram_budget, self.max_context = device, dtype, budget, max_context
        self.note = note  # e.g. "pinned memory unavailable: copies are slower"
        self.last_stats = GenerationStats()
        self.last_trace = ExpertTrace(self.config.num_layers, self.config.num_experts)
        self.cached_ids: list[int] = []  # tokens whose keys/values are in the KV cache
        self.lock = threading.Lock()
        self.eos_ids = eos_ids(store.path, tokenizer)
        self.sampling_defaults = store_sampling_defaults(store.path)

    # -- settings applied from the next message --------------------------------------------------

    def set_prefetch(self, depth: int) -> None:
        if depth < 0:
            raise UserError("Prefetch depth must be 0 (off) or more.")
        self.model.prefetch_depth = depth

    def set_cache_experts(self, k: int) -> None:
        with self.lock:
            check_cache_size(k, self.config)
            fixed = fixed_device_bytes(self.store, self.model, self.max_context)
            check_budget(self.vram_budget, fixed, k, self.config.num_layers * self.store.expert_bytes)
            host = self.model.cache.host if self.model.cache.host is not None else store_mod.experts_array(self.store)
            self.model.cache = None
            self.model.cache = make_cache(self.store, host, k, self.device, self.dtype)

    # -- text in, text out -----------------------------------------------------------------------

    def encode(self, prompt, chat: bool) -> list[int]:
        if isinstance(prompt, list) or chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            if not getattr(self.tokenizer, "chat_template", None):
                raise UserError("This model has no chat template; run without --chat.")
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        # verbose=False: _generate says in one sentence when a prompt is over the context
        return self.tokenizer(prompt, verbose=False)["input_ids"]

    def stream(self, prompt, sampling: SamplingSettings, cancel: threading.Event | None = None,
               chat: bool | None = None) -> Iterator[TokenPiece]:
        """Yield text pieces as tokens are decoded. prompt: text or chat messages."""
        ids = self.encode(prompt, chat if chat is not None else isinstance(prompt, list))
        for tok, piece in detokenize(self.tokenizer, self.generate_ids(ids, sampling, cancel)):
            yield TokenPiece(tok, piece)

    def generate_ids(self, prompt_ids: list[int], sampling: SamplingSettings,
                     cancel: threading.Event | None = None) -> Iterator[int]:
        with self.lock:
            yield from self._generate(prompt_ids, sampling, cancel)

    def _generate(self, prompt_ids, s: SamplingSettings, cancel) -> Iterator[int]:
        if not prompt_ids:
            raise UserError("The prompt is empty; give some text.")
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise UserError(f"The prompt has {len(prompt_ids)} tokens, more than this model's context of "
                            f"{self.max_context}; shorten it or start a new conversation.")
        max_new = min(s.max_new_tokens, room)
        check_sampling(s)
        s = replace(s, **{k: v for k, v in self.sampling_defaults.items() if getattr(s, k) is None})
        model, cache = self.model, self.model.cache
        model.setup_kv(min(self.max_context, len(prompt_ids) + max_new))
        gen = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
        before = asdict(cache.stats)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        reuse = common_prefix(self.cached_ids, prompt_ids)
        self.cached_ids = []  # the KV cache is being overwritten
        stats = GenerationStats(prompt_tokens=len(prompt_ids), reused_prompt_tokens=reuse,
                                vram_budget_bytes=self.vram_budget)
        trace = ExpertTrace(self.config.num_layers, self.config.num_experts)
        t0 = time.perf_counter()
        tokens = torch.tensor(prompt_ids[reuse:], device=self.device)
        model.trace = None
        logits = model.forward(tokens, start=reuse)
        tok = sample(logits[-1], s, gen, prompt_ids)
        stats.prefill_s = stats.first_token_s = time.perf_counter() - t0
        done = list(prompt_ids)
        model.trace = []
        t1 = time.perf_counter()
        try:
            for n in range(max_new):
                stats.new_tokens = n + 1
                yield tok
                if tok in self.eos_ids or n + 1 == max_new or (cancel is not None and cancel.is_set()):
                    break
                logits = model.forward(torch.tensor([tok], device=self.device), start=len(done))
                done.append(tok)
                tok = sample(logits[-1], s, gen, done)
        finally:
            self.cached_ids = done  # keys/values of these positions are valid for reuse
            stats.decode_s = time.perf_counter() - t1
            if stats.new_tokens > 1:
                stats.tokens_per_s = (stats.new_tokens - 1) / max(stats.decode_s, 1e-9)
            after = asdict(cache.stats)
            stats.cache_hits = after["hits"] - before["hits"]
            stats.cache_misses = after["misses"] - before["misses"]
            stats.prefetch_issued = after["prefetch_issued"] - before["prefetch_issued"]
            stats.prefetch_used = after["prefetch_used"] - before["prefetch_used"]
            stats.bytes_h2d = after["bytes_h2d"] - before["bytes_h2d"]
            total = stats.prefill_s + stats.decode_s
            stats.h2d_gb_per_s = stats.bytes_h2d / total / 1e9 if total > 0 else 0.0
            stats.peak_vram_bytes = peak_device_bytes(self)
            for step in model.trace or []:
                trace.selected.append([sel for sel, _ in step])
                trace.resident_before.append([res for _, res in step])
            model.trace = None
            self.last_stats, self.last_trace = stats, trace

    def close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return min(n, len(b) - 1)  # always recompute the last prompt token: its logits are needed


def eos_ids(path: Path, tokenizer) -> set[int]:
    ids = set()
    gc = path / "generation_config.json"
    if gc.is_file():
        import json
        v = json.loads(gc.read_text()).get("eos_token_id")
        ids.update(v if isinstance(v, list) else [v] if v is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def peak_device_bytes(engine: Engine) -> int:
    """The GPU's peak allocation of the last generation; 0 on the CPU (no VRAM is used)."""
    if engine.device.type == "cuda":
        return torch.cuda.max_memory_allocated(engine.device)
    return 0


# ---------------------------------------------------------------------------------------------
# Sizing the expert cache from the VRAM budget


def parse_size(text: str | None) -> int | None:
    """'12GiB', '16GB', '800MiB', '123456', 'none' -> bytes (None = no budget)."""
    if text is None or str(text).lower() in ("none", ""):
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*", str(text).lower())
    if not m:
        raise UserError(f"Cannot read the size {text!r}; write it like 12GiB, 16GB or 800MiB.")
    unit = (m.group(2) or "b").rstrip("b") or ""
    mult = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
            "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}[unit]
    return int(float(m.group(1)) * mult)


def fmt_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def workspace_bytes(cfg: ModelConfig, dtype, device: torch.device, kernels: str = "auto") -> int:
    """Room for activations and transient matrices on the device.

    The fused path dequantizes at most one expert matrix into a workspace for long prompts
    (plus its inputs and outputs); the reference path builds float32 codes, scales and the
    dequantized matrix at every product (measured: ~1 GB for Mixtral's 14336x4096 at once).
    """
    if device.type != "cuda":
        return 0
    per_matrix = cfg.intermediate_size * cfg.hidden_size
    if kernels == "reference":
        return 14 * per_matrix + 256 * (1 << 20)
    return 3 * per_matrix * dtype.itemsize + 256 * (1 << 20)


def fixed_device_bytes(store: store_mod.Store, model: OffloadedMixtral, context: int) -> int:
    """Bytes on the device that do not depend on the expert cache size."""
    return (model.dense_bytes + KVCache.nbytes(store.config, context, model.dtype)
            + workspace_bytes(store.config, model.dtype, model.device, model.kernels))


def check_cache_size(k: int, cfg: ModelConfig) -> None:
    if not 1 <= k <= cfg.num_experts:
        raise UserError(f"--cache-experts must be between 1 and {cfg.num_experts} (the experts per layer "
                        f"of this model); got {k}.")


def check_budget(budget: int | None, fixed: int, k: int, per_slot: int) -> None:
    if budget is None:
        return
    need = fixed + k * per_slot
    if need > budget:
        least = fixed + per_slot
        raise UserError(f"A VRAM budget of {fmt_bytes(budget)} cannot hold this model with {k} cached "
                        f"expert(s) per layer ({fmt_bytes(need)} needed; at least {fmt_bytes(least)} "
                        f"with 1); raise --vram-budget or lower --cache-experts.")


def make_cache(store: store_mod.Store, host: torch.Tensor, k: int, device, dtype, progress=None) -> ExpertCache:
    cfg = store.config

    def views(buf):  # views into the slot's bytes: no copy, no allocation per token
        return store_mod.view_expert(buf, store.expert_fields, store.expert_quant, cfg)

    def dequantized(weights):  # the CPU has no fused kernels: dequantize once per load
        return {m: compute_ready(w, dtype) for m, w in weights.items()}

    return ExpertCache(host, k, device, views, progress, decode=dequantized if device.type == "cpu" else None)


def compute_ready(w, dtype):
    """A weight as the CPU computes with it: dequantized (the same values the reference path
    would produce at every product) in the compute dtype."""
    return quant.dequantize(w, dtype) if isinstance(w, quant.QMatrix) else w.to(dtype)


def move_dense(dense: dict, device, dtype) -> tuple[dict, int]:
    out, nbytes = {}, 0
    for name, w in dense.items():
        if isinstance(w, quant.QMatrix) and device.type == "cpu":
            out[name] = compute_ready(w, dtype)
            nbytes += out[name].numel() * out[name].element_size()
        elif isinstance(w, quant.QMatrix):
            t = {k: v.to(device) for k, v in w.tensors().items()}
            out[name] = quant.QMatrix.from_tensors(w.info(), t)
            nbytes += w.nbytes()
        else:
            out[name] = w.to(device=device, dtype=dtype)
            nbytes += out[name].numel() * out[name].element_size()
    return out, nbytes


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but PyTorch sees no CUDA GPU; use --device cpu "
                        "or install a CUDA build of PyTorch.")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UserError(f"Unknown device {device!r}; use auto, cpu or cuda.")
    return torch.device(device)


def check_kernels(kernels: str, dev: torch.device) -> None:
    from engine.kernels import KERNEL_CHOICES, fused_available
    if kernels not in KERNEL_CHOICES:
        raise UserError(f"Unknown kernels {kernels!r}; use auto, reference or fused.")
    if kernels == "fused" and dev.type != "cuda":
        raise UserError("--kernels fused runs only on an NVIDIA GPU (Triton kernels); on the CPU "
                        "use --kernels auto, which computes with dequantized weights.")
    if kernels == "fused" and not fused_available(dev):
        raise UserError("--kernels fused needs Triton, which this installation lacks; use "
                        "--kernels auto or install triton.")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_engine(store, device: str = "auto", dtype: str | torch.dtype | None = None,
                cache_experts: int | None = None, vram_budget: int | str | None = None,
                prefetch: int = 1, kernels: str = "auto", max_context: int | None = None,
                progress=None, cuda_graphs: bool = True) -> Engine:
    """Open a store and put it on the device. progress(fraction, message)."""
    from transformers import AutoTokenizer

    st = store_mod.open_store(store)
    cfg = st.config
    dev = resolve_device(device)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise UserError(f"Unknown dtype {dtype!r}; use float32, bfloat16 or float16.")
        dtype = DTYPES[dtype]
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    budget = parse_size(vram_budget) if isinstance(vram_budget, str) else vram_budget
    if cache_experts is not None:
        check_cache_size(cache_experts, cfg)
    if prefetch < 0:
        raise UserError("--prefetch must be 0 (off) or more.")
    check_kernels(kernels, dev)
    context = min(max_context or 4096, cfg.max_position_embeddings)
    report = progress or (lambda f, m: None)
    report(0.0, "reading the model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(st.path))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad folder
        raise UserError(f"Cannot load the tokenizer from {st.path} ({type(e).__name__}); "
                        f"run `moeferry verify {st.path}`.") from None
    if dev.type == "cpu" and cfg.hidden_size * cfg.intermediate_size < (1 << 22):
        # Small matrices (the demo) gain nothing from threads, and OpenMP's spinning threads
        # collapse when another process holds a core: measured 1.4 vs 130 tokens/s on 2 cores.
        torch.set_num_threads(1)
    dense, dense_b = move_dense(store_mod.read_dense(st), dev, dtype)
    fixed = dense_b + KVCache.nbytes(cfg, context, dtype) + workspace_bytes(cfg, dtype, dev, kernels)
    per_slot = cfg.num_layers * st.expert_bytes
    if budget is None and dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        limit = free + dense_b - 512 * (1 << 20)  # dense weights are already on the device
    elif budget is None:
        limit = fixed + per_slot * cfg.num_experts if per_slot * cfg.num_experts <= 4 * GiB else fixed + 4 * GiB
    else:
        limit = budget
    k = cache_experts if cache_experts is not None else max(0, min(cfg.num_experts, (limit - fixed) // per_slot))
    if k < 1 or (budget is not None):
        check_budget(limit, fixed, max(k, 1), per_slot)
    host = store_mod.experts_array(st)
    cache = make_cache(st, host, k, dev, dtype, lambda f, m: report(0.1 + 0.9 * f, m))
    model = OffloadedMixtral(cfg, dense, cache, dev, dtype, kernels)
    model.dense_bytes = dense_b
    model.prefetch_depth = prefetch
    model.setup_kv(context)  # allocated once, at full size: budgeted above and graph-friendly
    model.use_cuda_graphs(cuda_graphs)
    if model.graphs is not None:
        model.graphs.prepare(min(context, 1024), lambda f, m: report(0.9 + 0.1 * f, m))
    note = "" if (cache.pinned or cache.host is None or dev.type != "cuda") else \
        "Pinned memory is unavailable, so expert copies use pageable memory and are slower."
    report(1.0, "ready")
    return Engine(st, model, tokenizer, dev, dtype, budget, context, note)
