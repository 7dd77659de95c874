"""Loading a store and generating text: sampling -> prefill -> decode -> stream -> load.

`load_engine` picks the device, dtype and expert-cache size (from a VRAM budget), and
`Engine.stream` yields text pieces as tokens are decoded; a threading.Event cancels it from
any thread. Stats for every generation land in `Engine.last_stats`, the routing of every
decoded token in `Engine.last_trace` (the GUI's expert map).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F

from moeferry.engine.contract import MAX_SEED, ExpertTrace, GenerationStats, SamplingSettings, TokenPiece  # noqa: F401 - re-exported
from moeferry.engine.errors import UserError
from moeferry.engine.kernels import hqq_cpu, hqq_gpu, int8_gpu, torch_cpu
from moeferry.engine.kernels.decode_cpu import use_compiled_decode
from moeferry.engine.runtime import vram
from moeferry.engine.runtime.decode_graphs import use_cuda_graphs
from moeferry.engine.runtime.expert_cache import ExpertCache
from moeferry.engine.runtime.model import ModelConfig, OffloadedMixtral
from moeferry.engine.storage import quant, store as store_mod
from moeferry.engine.storage.manifest import read_json
from moeferry.engine.units import GB, KB, MB, TB, GiB, KiB, MiB, TiB, fmt_bytes


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


# ---------------------------------------------------------------------------------------------
# Sampling


def generation_config(path: Path) -> dict:
    """A store's generation_config.json ({} when it has none), or one sentence when it is not
    a JSON object."""
    gc = path / "generation_config.json"
    if not gc.is_file():
        return {}
    cfg = read_json(gc)
    if not isinstance(cfg, dict):
        raise UserError(f"{gc} is not a JSON object; correct or delete the checkpoint's generation_config.json "
                        f"and convert the model again.")
    return cfg


def store_sampling_defaults(path: Path, cfg: dict | None = None) -> dict:
    """The repetition controls a store's generation_config.json sets (transformers' key names);
    cfg: that file as generation_config read it, when the caller has."""
    cfg = generation_config(path) if cfg is None else cfg
    penalty, ngram = cfg.get("repetition_penalty") or 1.0, cfg.get("no_repeat_ngram_size") or 0
    if not (is_number(penalty) and 0 < penalty < float("inf")) or not (type(ngram) is int and ngram >= 0):
        raise UserError(f"{path}/generation_config.json sets repetition_penalty {str(penalty)[:40]} and "
                        f"no_repeat_ngram_size {str(ngram)[:40]}, where a number above 0 and a whole number "
                        f"of 0 or more belong; correct them in the checkpoint's generation_config.json and "
                        f"convert the model again.")
    return {"repeat_penalty": float(penalty), "no_repeat_ngram": ngram}


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0
# ExpertCache's CacheStats field -> GenerationStats field (the contract module loads without torch)
CACHE_STAT_NAMES = {"hits": "cache_hits", "misses": "cache_misses", "prefetch_issued": "prefetch_issued",
                    "prefetch_used": "prefetch_used", "bytes_h2d": "bytes_h2d", "misses_cpu": "misses_cpu",
                    "misses_both": "misses_both"}


def check_sampling(s: SamplingSettings) -> None:
    """NaN, infinities and temperatures too small to divide by are refused (0 means greedy)."""
    if not (s.temperature == 0 or MIN_TEMPERATURE <= s.temperature <= MAX_TEMPERATURE):
        raise UserError(f"--temperature must be 0 (greedy) or a number from {MIN_TEMPERATURE:g} to "
                        f"{MAX_TEMPERATURE:g}, not {s.temperature}.")
    if not 0 < s.top_p <= 1:
        raise UserError(f"--top-p must be a number above 0 and at most 1, not {s.top_p}.")
    if s.repeat_penalty is not None and not 0 < s.repeat_penalty < float("inf"):
        raise UserError("--repeat-penalty must be above 0 (1.0 = off; 1.1 is a usual value).")
    if s.repeat_last_n < -1:
        raise UserError("--repeat-last-n must be -1 (the whole context), 0 (off) or more.")
    if s.no_repeat_ngram is not None and s.no_repeat_ngram < 0:
        raise UserError("--no-repeat-ngram must be 0 (off) or more.")
    if s.seed is not None and not 0 <= s.seed <= MAX_SEED:
        raise UserError(f"--seed must be a whole number from 0 to {MAX_SEED}, not {s.seed}.")


class Repetition:
    """The repetition controls' tables for the tokens so far, updated one token at a time: the
    counts of the last repeat_last_n tokens, and for every (n-1)-token prefix the tokens that
    followed it (rebuilding them for every new token costs a pass over the whole context)."""

    def __init__(self, s: SamplingSettings, context: Sequence[int] = ()):
        self.penalty, self.n, self.last_n = s.repeat_penalty or 1.0, s.no_repeat_ngram or 0, s.repeat_last_n
        self.tokens: list[int] = []
        self.window: Counter[int] = Counter()  # token -> times in the penalty's window
        self.followers: dict[tuple[int, ...], set[int]] = {}  # (n-1)-gram -> tokens seen after it
        for tok in context:
            self.add(tok)

    @property
    def inert(self) -> bool:
        """Whether the controls change no logits (no penalty, no n-gram ban)."""
        return self.penalty == 1.0 and self.n < 1

    def add(self, tok: int) -> None:
        self.tokens.append(tok)
        if self.penalty != 1.0 and self.last_n != 0:
            self.window[tok] += 1
            if 0 < self.last_n < len(self.tokens):
                old = self.tokens[-self.last_n - 1]
                self.window[old] -= 1
                if not self.window[old]:
                    del self.window[old]
        if self.n >= 1 and len(self.tokens) >= self.n:
            gram = self.tokens[len(self.tokens) - self.n:]
            self.followers.setdefault(tuple(gram[:-1]), set()).add(gram[-1])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] with the controls applied (a copy; the same tensor when none applies)."""
        ngrams = self.n >= 1 and len(self.tokens) >= self.n
        if self.penalty == 1.0 and not ngrams:
            return logits
        logits = logits.clone()
        if self.penalty != 1.0 and self.window:
            idx = torch.tensor(sorted(self.window), device=logits.device)
            seen = logits[idx]
            logits[idx] = torch.where(seen > 0, seen / self.penalty, seen * self.penalty)
        if ngrams:
            banned = self.followers.get(tuple(self.tokens[len(self.tokens) - self.n + 1:]))
            if banned:
                logits[torch.tensor(sorted(banned), device=logits.device)] = float("-inf")
        return logits


def penalize(logits: torch.Tensor, s: SamplingSettings, context: list[int]) -> torch.Tensor:
    """logits [vocab] with the repetition controls applied to the context's tokens (a copy)."""
    return Repetition(s, context).apply(logits)


NUCLEUS_SPAN = 16.0  # top-p's nucleus is looked for first among the tokens within e^16 of the likeliest


def sample(logits: torch.Tensor, s: SamplingSettings, gen: torch.Generator | None,
           context: Sequence[int] | Repetition = ()) -> int:
    """logits [vocab] float32 -> token id. temperature 0 = greedy. context: the tokens so far, or
    their Repetition tables (kept by the caller, one add() per token). Works where the logits
    lie (the GPU's), and draws one uniform number from gen (on the host) per token: sorting a
    vocabulary of 150-200 thousand on the host took 16-20 ms a token (benchmarks/sampling_cost.py)."""
    logits = (context if isinstance(context, Repetition) else Repetition(s, context)).apply(logits)
    if s.temperature <= 0:
        return int(torch.argmax(logits))
    z = logits.float() / s.temperature
    u = float(torch.rand(1, generator=gen))
    if s.top_p < 1.0:
        ids, p = nucleus(z, s.top_p)
        return int(ids[draw(p, u)])
    return draw(torch.softmax(z, dim=-1), u)


def nucleus(z: torch.Tensor, top_p: float, span: float = NUCLEUS_SPAN) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p's nucleus of softmax(z), on the host: (token ids, their probabilities), likeliest
    first: every token whose likelier tokens hold at most top_p of the probability. Looked for
    among the tokens within `span` of the largest z first (a pass, then a sort of a few), and
    in the whole vocabulary when those hold no more than top_p (the others are then needed)."""
    lse = torch.logsumexp(z, dim=-1)
    ids = torch.nonzero(z > z.max() - span).squeeze(1)
    while True:
        p, order = torch.sort(torch.exp(z[ids] - lse).cpu(), descending=True)
        ids = ids.cpu()[order]
        if ids.numel() == z.numel() or float(p.sum()) > top_p:  # every token left out is not needed
            keep = int(((torch.cumsum(p, dim=-1) - p) <= top_p).sum())
            return ids[:keep], p[:keep]
        ids = torch.arange(z.numel(), device=z.device)


def draw(p: torch.Tensor, u: float) -> int:
    """The index i drawn with probability p[i] / sum(p), for u uniform in [0, 1) (on p's device)."""
    cum = torch.cumsum(p.double(), dim=-1)
    return min(int(torch.searchsorted(cum, cum[-1:] * u, right=True)), p.numel() - 1)


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
        self.last_trace = ExpertTrace(self.config.num_moe_layers, self.config.num_experts)
        self.cached_ids: list[int] = []  # tokens whose keys/values are in the KV cache
        self.lock = threading.Lock()
        gen = generation_config(store.path)  # read once for both
        self.eos_ids = eos_ids(gen, tokenizer)
        self.sampling_defaults = store_sampling_defaults(store.path, gen)
        # the CPU threads load_engine chose (set_cpu_threads(0) goes back to them): torch's, and
        # the count asked for the CPU experts (None: their governor's)
        self.auto_threads = (torch.get_num_threads(), model.hybrid.asked_threads if model.hybrid is not None else None)

    # -- settings applied from the next message --------------------------------------------------

    def set_prefetch(self, depth: int) -> None:
        if depth < 0:
            raise UserError("Prefetch depth must be 0 (off) or more.")
        self.model.prefetch_depth = depth

    def set_cpu_threads(self, n: int) -> None:
        """Threads of the work done on the CPU (experts computed there; on a machine without a
        GPU, everything), 0 for the engine's own choice at load. Call it on the thread that
        then generates: numba's count is per launching thread."""
        if n < 0:
            raise UserError("Processor threads must be 0 (automatic) or more.")
        torch_threads, asked = self.auto_threads
        torch.set_num_threads(n or torch_threads)
        if hqq_cpu.available() == "":
            hqq_cpu.set_threads(n or asked or os.cpu_count() or 1)
        if self.model.hybrid is not None:
            self.model.hybrid.set_threads(n or asked)

    def set_cache_experts(self, k: int) -> None:
        with self.lock:
            check_cache_size(k, self.config)
            check_budget(self.vram_budget, engine_device_bytes(self), k)
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
            raise UserError(f"The prompt has {len(prompt_ids)} tokens, which leaves no room for a reply in this "
                            f"model's context of {self.max_context}; shorten it or start a new conversation.")
        max_new = min(s.max_new_tokens, room)
        check_sampling(s)
        s = replace(s, **{k: v for k, v in self.sampling_defaults.items() if getattr(s, k) is None})
        model, cache = self.model, self.model.cache
        model.setup_kv(min(self.max_context, len(prompt_ids) + max_new))
        gen = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
        before = asdict(cache.stats)
        cpu_before = asdict(model.hybrid.stats) if model.hybrid is not None else None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # LongRoPE's keys depend on how far the forward that made them reached (model.rope): a
        # prompt's would not be the cached ones', so it reuses none
        reuse = common_prefix(self.cached_ids, prompt_ids) if model.rope_long is None else 0
        self.cached_ids = []  # the KV cache is being overwritten
        stats = GenerationStats(prompt_tokens=len(prompt_ids), reused_prompt_tokens=reuse,
                                vram_budget_bytes=self.vram_budget)
        trace = ExpertTrace(self.config.num_moe_layers, self.config.num_experts)
        t0 = time.perf_counter()
        tokens = torch.tensor(prompt_ids[reuse:], device=self.device)
        model.trace = None
        logits = model.forward(tokens, start=reuse)
        repetition = Repetition(s, prompt_ids)
        tok = sample(logits[-1], s, gen, repetition)
        stats.prefill_s = stats.first_token_s = time.perf_counter() - t0
        done = list(prompt_ids)
        model.trace = []
        # greedy with no repetition control: each token's graph queued before the last is read
        ahead = (model.decode_greedy(tok, len(done), max_new - 1)
                 if s.temperature <= 0 and repetition.inert and model.runs_ahead() else None)
        t1 = time.perf_counter()
        try:
            for n in range(max_new):
                stats.new_tokens = n + 1
                yield tok
                if tok in self.eos_ids or n + 1 == max_new or (cancel is not None and cancel.is_set()):
                    break
                if ahead is not None:
                    done.append(tok)
                    tok = next(ahead)
                    continue
                t = time.perf_counter()
                logits = model.forward(torch.tensor([tok]), start=len(done))  # on the host: see GraphedDecode.step
                if model.hybrid is not None:
                    model.hybrid.token_done(time.perf_counter() - t)
                done.append(tok)
                repetition.add(tok)
                tok = sample(logits[-1], s, gen, repetition)
        finally:
            if ahead is not None:
                ahead.close()
            self.cached_ids = done  # keys/values of these positions are valid for reuse
            stats.decode_s = time.perf_counter() - t1
            if stats.new_tokens > 1:
                stats.tokens_per_s = (stats.new_tokens - 1) / max(stats.decode_s, 1e-9)
            if model.graphs is not None:  # a streaming token's counts wait for this
                model.graphs.count_streamed()
            after = asdict(cache.stats)
            for ours, theirs in CACHE_STAT_NAMES.items():
                setattr(stats, theirs, after[ours] - before[ours])
            stats.misses_copied = stats.cache_misses - stats.misses_cpu
            if model.hybrid is not None:
                now = asdict(model.hybrid.stats)
                cpu = type(model.hybrid.stats)(**{k: now[k] - cpu_before[k] for k in now})
                stats.cpu_expert_runs, stats.cpu_s, stats.cpu_wait_s = cpu.experts, cpu.seconds, cpu.seconds
                stats.cpu_gb_per_s = cpu.gb_per_s
            total = stats.prefill_s + stats.decode_s
            stats.h2d_gb_per_s = stats.bytes_h2d / total / 1e9 if total > 0 else 0.0
            stats.peak_vram_bytes = peak_device_bytes(self)
            stats.gpu_memory_used_bytes, stats.gpu_memory_total_bytes = gpu_memory(self.device)
            for step in model.take_trace():
                trace.selected.append([sel for sel, _ in step])
                trace.resident_before.append([res for _, res in step])
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


def eos_ids(gen: dict, tokenizer) -> set[int]:
    """The end-of-sequence ids: generation_config.json's (gen, as generation_config read it) and the tokenizer's."""
    v = gen.get("eos_token_id")
    ids = {i for i in (v if isinstance(v, list) else [v]) if type(i) is int}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def gpu_memory(device) -> tuple[int, int]:
    """(in use, total) bytes of the whole GPU as the driver counts them; (0, 0) off a GPU."""
    if device.type != "cuda":
        return 0, 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free, total


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
    mult = {"": 1, "k": KB, "m": MB, "g": GB, "t": TB, "ki": KiB, "mi": MiB, "gi": GiB, "ti": TiB}[unit]
    return int(float(m.group(1)) * mult)


def device_bytes(cfg: ModelConfig, dense_bytes: int, expert_bytes: int, context: int, dtype,
                 device: torch.device, kernels: str = "auto") -> vram.DeviceBytes:
    """What the model holds on the device besides its expert cache (engine/runtime/vram.py's sizing,
    the planner's too); dense_bytes: move_dense's count, without an embedding in host memory."""
    on_gpu = device.type == "cuda"
    return vram.DeviceBytes(
        dense=dense_bytes,
        kv_cache=vram.kv_cache_bytes(cfg.num_layers, context, cfg.num_kv_heads, cfg.head_dim, dtype.itemsize),
        workspace=vram.workspace_bytes(cfg.hidden_size * cfg.intermediate_size, dtype.itemsize, kernels, on_gpu),
        per_slot=cfg.num_moe_layers * expert_bytes, num_experts=cfg.num_experts, moe_layers=cfg.num_moe_layers)


def engine_device_bytes(engine: "Engine") -> vram.DeviceBytes:
    m = engine.model
    return device_bytes(engine.config, m.dense_bytes, engine.store.expert_bytes, engine.max_context, m.dtype,
                        m.device, m.kernels)


def check_cache_size(k: int, cfg: ModelConfig) -> None:
    if not 1 <= k <= cfg.num_experts:
        raise UserError(f"--cache-experts must be between 1 and {cfg.num_experts} (the experts per layer "
                        f"of this model); got {k}.")


def check_budget(budget: int | None, sizing: vram.DeviceBytes, k: int) -> None:
    if budget is None:
        return
    need = sizing.needed(k)
    if need > budget:
        raise UserError(f"A VRAM budget of {fmt_bytes(budget)} cannot hold this model with {k} cached "
                        f"expert(s) per layer ({fmt_bytes(need)} needed; at least {fmt_bytes(sizing.needed(1))} "
                        f"with 1); raise --vram-budget or lower --cache-experts.")


def make_cache(store: store_mod.Store, host: torch.Tensor, k: int, device, dtype, progress=None,
               extra_slot_layers: int = 0) -> ExpertCache:
    cfg = store.config

    def views(buf):  # views into the slot's bytes: no copy, no allocation per token
        return store_mod.view_expert(buf, store.expert_fields, store.expert_quant, cfg)

    def dequantized(weights):  # the CPU has no fused kernels: dequantize once per load
        return {m: compute_ready(w, dtype) for m, w in weights.items()}

    return ExpertCache(host, k, device, views, progress, decode=dequantized if device.type == "cpu" else None,
                       extra_slot_layers=extra_slot_layers)


def compute_ready(w, dtype):
    """A weight as the CPU computes with it: dequantized (the same values the reference path
    would produce at every product) in the compute dtype."""
    return store_mod.as_float(w, dtype)


EMBEDDING = "model.embed_tokens.weight"


def embedding_on_host(dense: dict, device) -> bool:
    """Whether the token embedding stays in host memory: on a GPU, when the LM head is a matrix
    of its own, as llama.cpp keeps it. A token reads one row of it (gathered on the host:
    OffloadedMixtral.embed_into), so its GPU memory goes to the expert cache instead; a head tied
    to it reads all of it every token, and keeps it on the GPU."""
    return torch.device(device).type != "cpu" and "lm_head.weight" in dense


def int8_head_on_gpu(dense: dict, device, kernels: str = "auto") -> bool:
    """Whether a GPU's LM head is rounded to int8 per row (engine/kernels/int8_gpu.py): a float
    matrix of its own as vram.int8_head allows, with quantized attention, on the fused kernels."""
    head = dense.get("lm_head.weight")
    attn = [w for w in dense.values() if isinstance(w, quant.QMatrix)]
    return (torch.device(device).type == "cuda" and kernels != "reference" and isinstance(head, torch.Tensor)
            and hqq_gpu.fused_available(device) and bool(attn)
            and vram.int8_head(head.numel(), min(w.bits for w in attn)))


def move_dense(dense: dict, device, dtype, in_place: bool = False, int8_head: bool = False) -> tuple[dict, int]:
    """The dense weights on the device, and their bytes there; an embedding that stays in host
    memory (embedding_on_host) in the compute dtype, not counted; with int8_head (int8_head_on_gpu)
    the LM head rounded to int8 per row. On the CPU a quantized matrix is
    dequantized once, unless in_place (the CPU engine that runs every expert on the HQQ kernel):
    then the matrices of a quantized model are read in low-bit forms, for a quarter of
    float32's bytes per token and of its RAM or less: 2-4 bit ones as stored, on the same
    kernel (model.OffloadedMixtral.linear), 8-bit ones (which it does not take) and the LM
    head rounded per row to int8 (torch_cpu: int8_cpu's kernel for a decoded token, torch's for
    a prompt), as llama.cpp's files round theirs. float32, the head is most of what a token
    reads in a small MoE (Qwen3-30B-A3B's is 1.2 GB)."""
    on_cpu = device.type == "cpu"
    low_bit = in_place and on_cpu and any(isinstance(w, quant.QMatrix) for w in dense.values())
    host_embedding = embedding_on_host(dense, device)
    out, nbytes = {}, 0
    for name, w in dense.items():
        if host_embedding and name == EMBEDDING:
            out[name] = w.to(dtype)
            continue
        if int8_head and name == "lm_head.weight":
            out[name] = int8_gpu.quantize(w, device)
        elif low_bit and hqq_cpu.supported(w):
            out[name] = hqq_cpu.from_qmatrix(w)
        elif low_bit and (isinstance(w, quant.QMatrix) or name == "lm_head.weight") and int8_fits(w):
            out[name] = torch_cpu.quantize_int8(compute_ready(w, torch.float32))
        elif isinstance(w, quant.QMatrix) and on_cpu:
            out[name] = compute_ready(w, dtype)
        elif isinstance(w, quant.QMatrix):
            t = {k: v.to(device) for k, v in w.tensors().items()}
            out[name] = quant.QMatrix.from_tensors(w.info(), t)
        else:
            out[name] = w.to(device=device, dtype=dtype)
        nbytes += out[name].nbytes if isinstance(out[name], torch.Tensor) else out[name].nbytes()
    return out, nbytes


def int8_fits(w) -> bool:
    """Whether torch's int8 CPU kernel takes a matrix of w's input size (torch_cpu.INPUT_MULTIPLE)."""
    cols = w.cols if isinstance(w, quant.QMatrix) else w.shape[-1]
    return cols % torch_cpu.INPUT_MULTIPLE["int8"] == 0


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
    from moeferry.engine.kernels.hqq_gpu import KERNEL_CHOICES, fused_available
    if kernels not in KERNEL_CHOICES:
        raise UserError(f"Unknown kernels {kernels!r}; use auto, reference or fused.")
    if kernels == "fused" and dev.type != "cuda":
        raise UserError("--kernels fused runs only on an NVIDIA GPU (Triton kernels); on the CPU "
                        "use --kernels auto, which computes with dequantized weights.")
    if kernels == "fused" and not fused_available(dev):
        raise UserError("--kernels fused needs Triton, which this installation lacks; use "
                        "--kernels auto or install triton.")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TORCH_THREADS = torch.get_num_threads()  # torch's own choice, before any load changes it


def load_engine(store, device: str = "auto", dtype: str | torch.dtype | None = None,
                cache_experts: int | None = None, vram_budget: int | str | None = None,
                prefetch: int = 1, kernels: str = "auto", max_context: int | None = None,
                progress=None, cuda_graphs: bool = True, cpu_experts: str | None = None,
                cpu_format: str | None = None, cpu_threads: int | None = None,
                ram_budget: int | str | None = None, expert_units: int = 1) -> Engine:
    """Open a store and put it on the device. progress(fraction, message).

    cpu_experts "off" | "all" | "auto" (engine/runtime/cpu_experts.py, engine/runtime/placement.py): missed
    experts computed on the CPU, by default ("hqq") from the experts' own bytes in host memory
    where they are HQQ-quantized, else from CPU copies in cpu_format (int4, int8, dense;
    default int4 where the shapes allow) within ram_budget for those copies. On a CPU device without
    cache_experts, every expert runs on the CPU kernels. None: "off" on a GPU and for a model whose
    experts fit the CPU's expert cache whole (the demo), else "all" (default_cpu_experts)."""
    from transformers import AutoTokenizer

    st = store_mod.open_store(store)
    dev = resolve_device(device)
    host = store_mod.experts_array(st)
    if expert_units < 1:
        raise UserError("--expert-units must be 1 (whole experts) or more.")
    if expert_units != 1:  # each expert as units the hybrid can serve part by link, part on the CPU
        from moeferry.engine.runtime import expert_units as units_mod
        st, host = units_mod.split_store(st, host, expert_units, pin=dev.type == "cuda", progress=progress)
    cfg = st.config
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
    if cpu_experts is not None:
        check_cpu_options(cpu_experts, cpu_format, cfg)
    check_kernels(kernels, dev)
    context = min(max_context or 4096, cfg.max_position_embeddings)
    report = progress or (lambda f, m: None)
    report(0.0, "reading the model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(st.path), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad folder
        raise UserError(f"Cannot load the tokenizer from {st.path} ({type(e).__name__}); "
                        f"run `moeferry verify {st.path}`.") from None
    if cpu_experts is None:
        cpu_experts = default_cpu_experts(dev, st, host, cache_experts, cpu_format)
    every_expert = cpu_experts != "off" and dev.type == "cpu" and cache_experts is None
    if dev.type == "cpu" and not cpu_threads:
        # torch's products: the experts' (dequantized cache), or with every expert on the numba
        # kernels a prompt's dense ones, which the head's size stands for; one thread when they
        # are small (vram.cpu_one_thread says why)
        torch_matrix = cfg.vocab_size * cfg.hidden_size if every_expert else cfg.hidden_size * cfg.intermediate_size
        torch.set_num_threads(1 if vram.cpu_one_thread(torch_matrix) else TORCH_THREADS)
    dense = store_mod.read_dense(st)
    dense, dense_b = move_dense(dense, dev, dtype, every_expert and not hqq_cpu.available(),
                                int8_head_on_gpu(dense, dev, kernels))
    sizing = device_bytes(cfg, dense_b, st.expert_bytes, context, dtype, dev, kernels)
    if budget is None and dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        limit = vram.auto_budget(free + dense_b)  # the dense weights are already on the device
    elif budget is None:
        limit = sizing.needed(max(1, vram.cpu_cache_slots(cfg.num_moe_layers, expert_params(cfg), cfg.num_experts)))
    else:
        limit = budget
    k = cache_experts if cache_experts is not None else sizing.slots(limit)
    k = 1 if every_expert else k  # the CPU kernels run every expert: the cache is never read
    if k < 1 or (budget is not None):
        check_budget(limit, sizing, max(k, 1))
    # what the budget leaves after k a layer: one expert more in as many layers (none when k is asked)
    extra = 0 if every_expert or cache_experts is not None or dev.type != "cuda" else sizing.extra_slot_layers(limit, k)
    cache = make_cache(st, host, k, dev, dtype, lambda f, m: report(0.1 + 0.9 * f, m), extra)
    model = OffloadedMixtral(cfg, dense, cache, dev, dtype, kernels)
    model.dense_bytes = dense_b
    if cpu_experts != "off" and (every_expert or k < cfg.num_experts):  # else nothing ever misses
        ram = parse_size(ram_budget) if isinstance(ram_budget, str) else ram_budget
        model.hybrid = make_cpu_experts(st, host, cache, cpu_experts, cpu_format, cpu_threads,
                                        default_ram_budget() if ram is None else ram,
                                        every_expert, lambda f, m: report(0.9 * f, m), dtype)
        if every_expert:
            cache.host = None  # never copied from: the CPU copies are the experts' only home
    model.prefetch_depth = 0 if every_expert else prefetch  # nothing is read from the cache
    model.setup_kv(context)  # allocated once, at full size: budgeted above and graph-friendly
    use_cuda_graphs(model, cuda_graphs)
    use_compiled_decode(model)
    if model.graphs is not None:
        model.graphs.prepare(min(context, 1024), lambda f, m: report(0.9 + 0.1 * f, m))
    note = "" if (cache.pinned or cache.host is None or dev.type != "cuda") else \
        "Pinned memory is unavailable, so expert copies use pageable memory and are slower."
    if model.hybrid is not None and len(model.hybrid.copies) < cfg.num_moe_layers * cfg.num_experts:
        note = (note + " " if note else "") + (
            f"The RAM budget holds CPU copies of {len(model.hybrid.copies)} of the "
            f"{cfg.num_moe_layers * cfg.num_experts} experts; the others are always copied to the GPU.")
    report(1.0, "ready")
    return Engine(st, model, tokenizer, dev, dtype, budget, context, note)


# ---------------------------------------------------------------------------------------------
# Experts computed on the CPU (engine/runtime/cpu_experts.py)


def default_cpu_experts(dev: torch.device, st: store_mod.Store, host: torch.Tensor, cache_experts: int | None,
                        cpu_format: str | None) -> str:
    """--cpu-experts when none is given: on a CPU device, "all" (every expert on the CPU kernel,
    read in place) where the store's experts can run in place and do not all fit the CPU's expert
    cache (vram.CPU_EXPERT_CACHE_BYTES), which would otherwise dequantize most of them again for
    every token. "off" for the demo (one dequantization each, then float32 products, is faster for
    its small matrices), when a cache size or a copy format was asked for, and on a GPU, where the
    hybrid's gain depends on the link and the CPU (docs/BENCHMARKS.md, 2026-12-04: 29-48 % over the
    cache alone on a 25 GB/s link with 8 threads, -6 to +16 % on PCIe 5 with 16) and its threads
    keep cores busy: the user turns it on (--cpu-experts auto, or the app's settings)."""
    if dev.type != "cpu" or cache_experts is not None or cpu_format not in (None, "hqq"):
        return "off"
    cfg = st.config
    if vram.cpu_cache_slots(cfg.num_moe_layers, expert_params(cfg), cfg.num_experts) >= cfg.num_experts:
        return "off"
    return "all" if runs_in_place(st, host) else "off"


def expert_params(cfg: ModelConfig) -> int:
    """Weights of one expert (of one unit where experts are cut into units)."""
    return 3 * cfg.hidden_size * cfg.intermediate_size


def runs_in_place(st: store_mod.Store, host: torch.Tensor) -> bool:
    """Whether the store's experts run on the CPU where they lie (the "hqq" CPU format: HQQ at
    2-4 bits or MXFP4, numba and AVX2 here)."""
    from moeferry.engine.runtime import cpu_experts as ce

    return ce.hqq_supported(store_mod.view_expert(host[0, 0], st.expert_fields, st.expert_quant, st.config))


def check_cpu_options(mode: str, fmt: str | None, cfg: ModelConfig) -> None:
    from moeferry.engine.runtime import cpu_experts as ce

    if mode not in ("off", "auto", "all"):
        raise UserError(f"--cpu-experts must be off, auto or all; got {mode!r}.")
    if fmt is not None and fmt not in ce.FORMATS:
        raise UserError(f"--cpu-format must be one of {', '.join(ce.FORMATS)}; got {fmt!r}.")
    if fmt in ce.COPY_FORMATS and not ce.supported(fmt, cfg.hidden_size, cfg.intermediate_size):
        m = ce.INPUT_MULTIPLE[fmt]
        other = "int8" if fmt == "int4" and ce.supported("int8", cfg.hidden_size, cfg.intermediate_size) else "dense"
        raise UserError(f"--cpu-format {fmt} needs hidden and intermediate sizes that are multiples of {m} "
                        f"(this model: {cfg.hidden_size} and {cfg.intermediate_size}); use --cpu-format {other}.")


def make_cpu_experts(st: store_mod.Store, host: torch.Tensor, cache: ExpertCache, mode: str,
                     fmt: str | None, threads: int | None, ram_budget: int | None, every_expert: bool,
                     progress, dtype):
    """CPU copies of the experts that fit ram_budget, and the CpuExperts that runs them."""
    cfg = st.config
    view = lambda buf: store_mod.view_expert(buf, st.expert_fields, st.expert_quant, cfg)  # noqa: E731
    in_place = fmt in (None, "hqq") and runs_in_place(st, host)
    if not in_place and (st.expert_quant.get("method") == "mxfp4" or cfg.expert_act != "silu"):
        from moeferry.engine.runtime import cpu_experts as ce

        why = ce.hqq_unsupported_reason(view(host[0, 0])) if fmt in (None, "hqq") else ""
        raise UserError(f"--cpu-experts runs this {cfg.family} store's experts only in place, as stored "
                        f"(MXFP4, or HQQ: convert with --expert-bits 2, 3 or 4), in the hqq CPU format"
                        f"{'; ' + why[0].lower() + why[1:-1] if why else ''}; use --cpu-experts off.")
    if cache.host is not None:  # the pinned copy the cache copies from: the experts' home in RAM
        host = cache.host
    copies = cpu_copies_of(cfg, host, view, cache.device, fmt, ram_budget, cache.K, progress, dtype)
    if every_expert and len(copies) < cfg.num_moe_layers * cfg.num_experts:
        raise UserError("The RAM budget cannot hold a CPU copy of every expert; raise --ram-budget.")
    return cpu_experts_for(copies, cfg, host, cache, mode, threads, every_expert)


def default_ram_budget() -> int | None:
    """RAM the CPU copies may take when no --ram-budget is given: what is available now (the
    store's experts already loaded) less the system's share (plan.HOST_RESERVE_BYTES)."""
    from moeferry.engine.setup.hardware import _ram_info
    from moeferry.engine.setup.plan import HOST_RESERVE_BYTES

    available = _ram_info().get("ram_available_bytes")
    return None if available is None else max(0, available - HOST_RESERVE_BYTES)


def cpu_copies_of(cfg: ModelConfig, host: torch.Tensor, view, device: torch.device, fmt: str | None,
                  ram_budget: int | None, slots: int, progress=None, dtype=torch.bfloat16) -> dict:
    """(layer, expert) -> CpuExpert. "hqq" (the default where it applies): every expert, run in
    place from host. Otherwise the experts placement.cpu_copies picks within ram_budget, each
    derived from the dequantized stored expert (dequantized and re-quantized on the compute
    device: minutes on a CPU for Mixtral, seconds on a GPU); dense copies keep the model's
    compute dtype."""
    from moeferry.engine.runtime import cpu_experts as ce, placement

    if fmt in (None, "hqq") and ce.hqq_supported(view(host[0, 0])):  # in place: no copy, no RAM
        copies = {}
        for layer in range(cfg.num_moe_layers):
            copies.update({(layer, e): ce.hqq_expert(view(host[layer, e]), cfg.swiglu_alpha, cfg.swiglu_limit)
                           for e in range(cfg.num_experts)})
        return copies
    if fmt == "hqq":
        raise UserError("--cpu-format hqq runs HQQ experts of 2, 3 or 4 bits in place and needs numba; "
                        "this store's experts are not such, or numba is missing: use --cpu-format int4.")
    fmt = fmt or next(f for f in ("int4", "int8", "dense") if ce.supported(f, cfg.hidden_size, cfg.intermediate_size))
    dtype = dtype if fmt == "dense" else torch.float32  # float32 in, the copy rounds it

    def copy(layer, e):
        w = view(host[layer, e].to(device))
        return ce.make_expert(*(compute_ready(w[m], dtype) for m in ("w1", "w3", "w2")), fmt)

    first = copy(0, 0)
    keys = placement.cpu_copies(cfg.num_moe_layers, cfg.num_experts, first.nbytes(), ram_budget, slots)
    copies = {}
    for n, (layer, e) in enumerate(keys):
        copies[layer, e] = first if (layer, e) == (0, 0) else copy(layer, e)
        if progress:
            progress((n + 1) / len(keys), "making the CPU copies of the experts")
    return copies


def cpu_experts_for(copies: dict, cfg: ModelConfig, host: torch.Tensor, cache: ExpertCache, mode: str,
                    threads: int | None = None, every_expert: bool = False):
    """The CpuExperts over these copies; for "auto", with its costs measured here."""
    from moeferry.engine.runtime import cpu_experts as ce

    params = expert_params(cfg)
    if cache.cuda and not every_expert:
        hqq_cpu.spin_between_layers()  # before the CpuExperts start numba's threads
    hybrid = ce.CpuExperts(copies, mode, None, host.shape[2], params, every_expert, threads)
    hybrid.warm()
    if mode == "auto" and not every_expert and copies:
        # small experts are timed a few to a call, as a decoded layer runs its misses: one at a
        # time their fixed cost per call (Qwen3's on 16 threads: 15.8 GB/s) would keep the
        # cost model from ever trying the CPU, and so from learning its rate
        first = next(iter(copies.values()))
        together = max(1, min(cfg.top_k, SMALL_CALL_BYTES // max(1, first.nbytes())))
        hybrid.costs = measure_costs(hybrid, list(copies.values()), host, cache, together)
    return hybrid


def measure_costs(hybrid, copies: list, host: torch.Tensor, cache: ExpertCache, together: int = 1):
    """The cost model's inputs, measured here on real experts: the CPU kernel as the engine
    calls it (cpu_seconds, `together` experts per call), one copy over the link (on a CPU
    device: the memcpy and the dequantizing a load does), one expert on the compute device."""
    from moeferry.engine.runtime import placement

    copy = copies[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, copy.w2.rows, generator=gen)

    def best(fn, reps=5):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    cpu_s = cpu_seconds(hybrid, copies, x, together)
    many = torch.randn(32, x.shape[1], generator=gen)  # a prompt's worth: the kernel's compute rate
    flops_s = best(lambda: hybrid.run([(copy, many)]), reps=2)
    if cache.cuda:
        from moeferry.engine.setup import hardware
        link = hardware.measure_h2d(torch, cache.device.index or 0, cache.B, 0.2)["h2d_bytes_per_s"]
        gpu_s = 40e-6  # one 2-bit Mixtral expert in moe_decode on the H200 (docs/KERNELS.md)
    else:
        slot = torch.empty_like(host[0, 0])
        link = cache.B / best(lambda: (slot.copy_(host[0, 0]), cache.decode(cache.views[0][0])))
        w = cache.decode(cache.views[0][0]) if cache.decode else cache.views[0][0]
        h = torch.zeros(1, x.shape[1], dtype=w["w1"].dtype)
        gpu_s = best(lambda: F.linear(F.silu(F.linear(h, w["w1"])) * F.linear(h, w["w3"]), w["w2"]))
    return placement.Costs(link_gbps=link / 1e9, cpu_gbps=copy.nbytes() / cpu_s / 1e9, gpu_expert_s=gpu_s,
                           cpu_gflops=2 * hybrid.sizes.params * 32 / flops_s / 1e9,
                           cpu_overhead_s=placement.CUDA_HAND_OFF_S if cache.cuda else 0.0)


COLD_BYTES = 1 << 30  # experts read in turn when timing the CPU: more than any processor's L3
SMALL_CALL_BYTES = 16 << 20  # experts this small are timed several to a call (cpu_experts_for)


def cpu_seconds(hybrid, copies: list, x: torch.Tensor, together: int = 1) -> float:
    """One expert's CPU time as in decoding: the median over different experts read in turn
    (up to COLD_BYTES of them), so that they come from RAM as a miss's does. One expert timed
    again and again is served from the L3 cache (300 MB on the GPU machine's Xeon), about 1.5x
    faster than decoding ever sees. together: experts per call, as a decoded layer's run in one
    (cpu_experts.run_together); the time is per expert. The kernels are compiled and their
    threads started already (CpuExperts.warm, at load)."""
    n = max(1, min(len(copies), COLD_BYTES // max(1, copies[0].nbytes())))
    together = max(1, min(together, n))
    times = []
    order = copies[:n] * (2 if n < 8 else 1)
    for i in range(0, len(order) - together + 1, together):
        t0 = time.perf_counter()
        hybrid.run([(c, x) for c in order[i:i + together]])
        times.append((time.perf_counter() - t0) / together)
    return sorted(times)[len(times) // 2]
