"""`moeferry bench`: the offloading benchmark on a synthetic full-size Mixtral-8x7B.

Weights are generated directly in packed form (random codes, 8-bit scales/zeros in
realistic ranges), so a run starts in seconds. The experts are in the format users run
(`--expert-format`): MXFP4 as gpt-oss ships them (4.25 bits per weight) for gpt-oss-20b,
HQQ at `--expert-bits` for the others; every report states the format and its bits per weight. In ONE run, on the same weights and prompt,
it measures the paper's Table 2 ladder: naive (every expert copied on demand, synchronously,
no cache), lru (cache, no prefetch), full (cache + prefetch), each with the reference kernels
(dequantize then matmul) and the fused ones, under a VRAM budget that emulates a gaming GPU.
The budget bounds what the engine allocates (peak VRAM); each run also reports the GPU's memory
in use as the driver counts it (CUDA context and the allocator's reserve too), the measure
llama.cpp's figures are compared at.

The bound for each mode: max(bytes moved per token / the link's rate in this run (the pinned
bandwidth measured, or under --h2d-gbps the rate the paced copies reached), resident compute
time per token measured in this run with nothing moving).

Random weights do not route like a trained model, so the router's choice is forced
(engine/measure/routing.py, `--routing`): `uniform` (the default and the headline: no locality, the
cache's worst case; prefetch guesses right with the stated probability `--guess-recall`),
`trace:PATH` (a recorded trace, mapped onto 32 layers if it has fewer) or `model` (the random
router itself, only to show how degenerate it is). `--h2d-gbps` paces the expert copies to a
slower link and `--cpu-threads` limits torch's CPU threads; every report states routing, link
and threads next to its figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from moeferry.engine.errors import UserError
from moeferry.engine.kernels import int8_gpu
from moeferry.engine.measure import routing as routing_mod
from moeferry.engine.measure.bench_shapes import MODEL_SHAPES, family_dense, native_expert_format, shape_config
from moeferry.engine.runtime import vram
from moeferry.engine.runtime.cpu_experts import HqqExpert, Mxfp4Expert
from moeferry.engine.runtime.decode_graphs import use_cuda_graphs
from moeferry.engine.runtime.expert_cache import ExpertCache, pace_cycles, pin, pinned_empty, sleep_cycles_per_s
from moeferry.engine.runtime.generate import (
    EMBEDDING,
    compute_ready,
    cpu_copies_of,
    cpu_experts_for,
    device_bytes,
    embedding_on_host,
    gpu_memory,
    int8_head_on_gpu,
    parse_size,
)
from moeferry.engine.runtime.model import HOST_PHASES, ModelConfig, OffloadedMixtral
from moeferry.engine.storage import mxfp4, quant, store as store_mod
from moeferry.engine.units import GiB, fmt_bytes

EXPERT_FORMATS = ("hqq", "mxfp4")
MIXTRAL = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
               num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, rms_norm_eps=1e-5, rope_theta=1e6,
               max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False)

@dataclass
class ModeResult:
    mode: str
    kernels: str
    cache_experts: int
    prefetch: int
    decode_tokens_per_s: float
    first_token_s: float
    hit_rate: float
    prefetch_precision: float
    prefetch_recall: float
    gb_per_token: float
    h2d_gb_per_s: float
    bound_ms_per_token: float
    achieved_ms_per_token: float
    achieved_over_bound: float
    peak_vram_bytes: int
    under_budget: bool
    guess_recall: dict  # distance -> share of true experts the prefetch guesses held (decode)
    misses_cpu: int = 0  # hybrid: misses computed on the CPU (the rest were copied)
    misses_both: int = 0
    cpu_gb_per_s: float = 0.0  # the CPU experts' bytes over their time, decode only
    cpu_wait_ms_per_token: float = 0.0  # the CPU's share of the critical path
    cpu_decode_experts: int = 0  # experts the CPU ran while decoding
    layer_split: list = field(default_factory=list)  # where a decoded MoE layer's time goes (layer_split)
    # the GPU's memory in use right after the decode as the driver counts it (nvidia-smi's
    # memory.used, what llama.cpp's figures are measured by): peak_vram_bytes plus this process's
    # CUDA context, the allocator's reserve and anything else on the GPU; 0 on the CPU
    device_used_bytes: int = 0


# ---------------------------------------------------------------------------------------------
# Synthetic weights in packed form


def random_mxfp4(rows: int, cols: int, device, gen, exponents: tuple[int, int] = (-8, -6)) -> mxfp4.Mxfp4Matrix:
    """Random codes (their values' std is 2.9) and block scales 2^lo..2^hi (e8m0): the scales
    MXFP4 gives weights of std ~0.01-0.03 (a block's largest weight, ~2.1 std, over the largest
    code 6, rounded down to a power of two), like gpt-oss's experts."""
    f = mxfp4.field_shapes(rows, cols)
    blocks = torch.randint(0, 256, f["blocks"][1], dtype=torch.uint8, device=device, generator=gen)
    scales = torch.randint(127 + exponents[0], 128 + exponents[1], f["scales"][1], dtype=torch.uint8,
                           device=device, generator=gen)
    return mxfp4.Mxfp4Matrix(rows, cols, blocks, scales)


def expert_quantization(expert_format: str, expert_bits: int, group_size: int | None = None) -> dict:
    """The store manifest's expert quantization of a format (MXFP4 as convert.py imports it);
    group_size: HQQ's rows per scale and zero (None = quant.EXPERT_SPECS's)."""
    if expert_format == "mxfp4":
        return {"bits": 4, "method": "mxfp4", "group_size": mxfp4.BLOCK}
    es = quant.EXPERT_SPECS[expert_bits]
    return {"bits": expert_bits, "group_size": group_size or es.group_size, "meta_group": es.meta_group}


def random_matrix(rows: int, cols: int, eq: dict, device, gen):
    """A random expert matrix in the quantization eq (expert_quantization)."""
    if eq.get("method") == "mxfp4":
        return random_mxfp4(rows, cols, device, gen)
    return quant.random_qmatrix(rows, cols, quant.QuantSpec.from_dict(eq), gen, device, plausible=True)


def synthetic_model(cfg: ModelConfig, expert_bits: int, attn_bits: int, device, seed: int = 0,
                    dtype=torch.bfloat16, expert_format: str = "hqq", group_size: int | None = None,
                    int8_head: bool = True):
    """(dense weights, their bytes on the device, host experts uint8 [L, E, stride] (pinned on
    CUDA), expert fields, quantization). The dense weights are on the device but for the
    embedding, which stays in host memory on a GPU as the engine keeps an untied one
    (generate.embedding_on_host). The LM head is rounded to int8 where the engine would round it
    (generate.int8_head_on_gpu), unless int8_head is False."""
    gen = torch.Generator(device=device).manual_seed(seed)
    as_ = quant.ATTN_SPECS[attn_bits]
    eq = expert_quantization(expert_format, expert_bits, group_size)
    dense = {EMBEDDING: torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype, generator=gen) * 0.02,
             "model.norm.weight": torch.ones(cfg.hidden_size, device=device, dtype=dtype),
             "lm_head.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype,
                                           generator=gen) * 0.02}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        dense[p + "input_layernorm.weight"] = torch.ones(cfg.hidden_size, device=device, dtype=dtype)
        dense[p + "post_attention_layernorm.weight"] = torch.ones(cfg.hidden_size, device=device, dtype=dtype)
        dense[p + "block_sparse_moe.gate.weight"] = torch.randn(cfg.num_experts, cfg.hidden_size, device=device,
                                                                dtype=dtype, generator=gen) * 0.02
        for m in store_mod.ATTN_MATRICES:
            dense[p + f"self_attn.{m}.weight"] = quant.random_qmatrix(*store_mod.attn_shape(cfg, m), as_, gen, device, plausible=True)
        dense.update(family_dense(cfg, i, lambda r, c: quant.random_qmatrix(r, c, as_, gen, device, plausible=True), device, gen))
    on_host = embedding_on_host(dense, device)
    if on_host:
        dense[EMBEDDING] = dense[EMBEDDING].cpu()
    if int8_head and int8_head_on_gpu(dense, device):
        dense["lm_head.weight"] = int8_gpu.quantize(dense["lm_head.weight"])
    dense_bytes = sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes()
                      for name, w in dense.items() if not (on_host and name == EMBEDDING))
    if cfg.expert_act == "clamped_swiglu":
        eq["bias_dtype"] = "BF16"
    fields, stride = store_mod.expert_layout(cfg, eq)
    shape = (cfg.num_moe_layers, cfg.num_experts, stride)
    host = pinned_empty(shape) if torch.device(device).type == "cuda" else torch.empty(shape, dtype=torch.uint8)
    for layer in range(cfg.num_moe_layers):
        host[layer].copy_(torch.stack([random_expert(cfg, eq, fields, stride, device, gen)
                                       for _ in range(cfg.num_experts)]))
    return dense, dense_bytes, host, fields, eq


def random_expert(cfg: ModelConfig, eq: dict, fields: list[dict], stride: int, device, gen) -> torch.Tensor:
    """One random expert in the quantization eq, packed as the store lays it out: uint8 [stride]
    on `device`."""
    buf = torch.zeros(stride, dtype=torch.uint8, device=device)
    tensors = {}
    for m in store_mod.EXPERT_MATRICES:
        qm = random_matrix(*store_mod.expert_shape(cfg, m), eq, device, gen)
        tensors.update({f"{m}.{k}": v for k, v in qm.tensors().items()})
    for b in store_mod.EXPERT_BIASES if cfg.expert_act == "clamped_swiglu" else ():  # gpt_oss
        bias = torch.randn(store_mod.expert_shape(cfg, b), device=device, generator=gen) * 0.02
        tensors[f"{b}.bias"] = bias.to(torch.bfloat16)
    for f in fields:
        buf[f["offset"]:f["offset"] + f["nbytes"]] = tensors[f["name"]].contiguous().view(torch.uint8).reshape(-1)
    return buf


class NaiveCache(ExpertCache):
    """The paper's baseline: every use copies the expert synchronously; nothing is kept, nothing
    prefetched."""

    policy = "naive"
    holds_every_expert = False
    in_place_rows = False  # its table keeps the experts of steps gone (the model reads the routing first)

    def _fill(self, progress) -> None:
        if self.cuda:
            self.host, self.pinned = pin(self.host, progress)

    def acquire(self, layer: int, expert: int, keep=()):
        self.stats.misses += 1
        self.lru[layer].clear()  # nothing is kept: every use copies
        # the experts of one step get their own slots: all of them may be read at once
        slot = self._load(layer, expert, keep, list(keep).index(expert) % self.K if expert in keep else 0)
        if self.cuda:
            self.copy_stream.synchronize()
        return self._weights(layer, slot), slot

    def prefetch(self, layer: int, experts: list[int]) -> None:
        pass

    def admit(self, layer: int, expert: int) -> None:
        pass


class NoCopyCache(NaiveCache):
    """The resident compute time, the bound's other half: expert e runs on slot e % K, whose
    weights never change, and nothing moves."""

    policy = "no-copy"
    in_place_rows = True  # every expert has a slot for good: the decode runs hits first, as lru's does

    def _fill(self, progress) -> None:
        self.table_host[:] = torch.arange(self.E, dtype=torch.int32) % self.K
        self.table_dirty.update(range(self.L))
        for layer in range(self.L):
            self.layer_slots[layer].copy_(self.host[layer, :self.K])
            for slot in range(self.K):
                self._decode(layer, slot)
        self.host = None

    def acquire(self, layer: int, expert: int, keep=()):
        self.stats.hits += 1
        return self._weights(layer, expert % self.K), expert % self.K


CACHES = {"lru": ExpertCache, "naive": NaiveCache, "no-copy": NoCopyCache}  # by policy


def expert_views(cfg: ModelConfig, fields: list[dict], eq: dict):
    """buf -> the QMatrix views (w1, w3, w2) of the expert packed in buf (an ExpertCache's make_views)."""
    return lambda buf: store_mod.view_expert(buf, fields, eq, cfg)


def pinned_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Host->device bytes/s from pinned memory (median of 5 copies of 1 GiB)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return nbytes / sorted(times[1:])[2]


def paced_copy_rate(device, nbytes: int, cycles: int) -> float:
    """Bytes/s of back-to-back paced copies of nbytes (copy then spin, as the cache does)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(8):
        dst.copy_(src, non_blocking=True)
        if cycles:
            torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return 8 * nbytes / (start.elapsed_time(end) / 1e3)


# ---------------------------------------------------------------------------------------------
# Running one mode


def cache_size_for(budget: int | None, cfg, dense_bytes, stride, context, device, kernels="fused") -> tuple[int, int]:
    """(cached experts per layer, layers with one more) under the budget, as the engine sizes them."""
    if budget is None:
        return cfg.num_experts, 0
    sizing = device_bytes(cfg, dense_bytes, stride, context, torch.bfloat16, device, kernels)
    k = sizing.slots(budget)
    if k < 1:
        raise UserError(f"A VRAM budget of {fmt_bytes(budget)} cannot hold the resident weights "
                        f"({fmt_bytes(sizing.fixed)}) and one expert per layer; raise --vram-budget.")
    return k, sizing.extra_slot_layers(budget, k)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def head_format(dense: dict) -> str:
    """The LM head's format, for the report: int8 (rounded per row on a GPU) or its dtype."""
    head = dense.get("lm_head.weight", dense[EMBEDDING])
    return "int8" if isinstance(head, int8_gpu.Int8Rows) else str(head.dtype).removeprefix("torch.")


@dataclass
class Synthetic:
    cfg: ModelConfig
    dense: dict
    dense_bytes: int
    host: torch.Tensor
    fields: list
    eq: dict
    device: torch.device
    pinned_bytes_per_s: float
    expert_bits: int
    attn_bits: int
    dtype: torch.dtype = torch.bfloat16
    shape: str = "mixtral-8x7b"  # the MODEL_SHAPES key it was built from
    cpu_copies: dict | None = None  # the hybrid mode's CPU experts (cpu_copies_of), made on first use

    @property
    def host_dense_bytes(self) -> int:
        """The dense weights' bytes in host memory, off the device (the embedding on a GPU)."""
        return sum(w.nbytes for w in self.dense.values()
                   if isinstance(w, torch.Tensor) and w.device.type != self.device.type)

    @property
    def expert_format(self) -> str:
        return "mxfp4" if self.eq.get("method") == "mxfp4" else "hqq"

    def expert_bits_per_weight(self) -> float:
        """Bits the expert matrices take per weight, their scales included (biases not)."""
        matrix_bytes = sum(f["nbytes"] for f in self.fields if f["name"].split(".")[0] in store_mod.EXPERT_MATRICES)
        return matrix_bytes * 8 / (3 * self.cfg.hidden_size * self.cfg.intermediate_size)

    def model(self, policy: str, k: int, prefetch: int, kernels: str, pace: int = 0,
              extra_slot_layers: int = 0) -> OffloadedMixtral:
        # the CPU (tests) dequantizes an expert once per load, as the engine does there
        decode = None if self.device.type == "cuda" else lambda w: {m: compute_ready(v, self.dtype) for m, v in w.items()}
        cache = CACHES[policy](self.host, k, self.device, expert_views(self.cfg, self.fields, self.eq),
                               decode=decode, pace_cycles=pace, extra_slot_layers=extra_slot_layers)
        model = OffloadedMixtral(self.cfg, self.dense, cache, self.device, self.dtype, kernels)
        model.prefetch_depth = prefetch
        return model


MODES = ("naive", "lru", "full", "hybrid", "stream", "fetch")  # the ladder's rows (measure's modes)
SPLIT_TOKENS = 24  # decoded after the timed ones with the layer split's marks on


def run_mode(s: Synthetic, policy, k, prefetch, kernels, prompt, new_tokens, routing=None, pace: int = 0,
             graphs=True, cpu_copies=None, link_gbps=None, extra_slot_layers: int = 0, stream: bool = False):
    """(first token s, decode s, cache stats of the decode, peak device bytes, guess recall by distance).
    stream: decode reads the misses from host memory (model.stream_misses; d["streamed"] says
    whether it could)."""
    device = s.device
    sync(device)
    gc.collect()  # the previous mode's cache and graphs
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = s.model(policy, k, prefetch, kernels, pace, extra_slot_layers)
    model.routing = routing
    if cpu_copies is not None:  # the hybrid: misses computed on the CPU too, chosen by the cost model
        model.hybrid = cpu_experts_for(cpu_copies, s.cfg, s.host, model.cache, "auto", torch.get_num_threads())
        if link_gbps and model.hybrid.costs is not None:  # the paced link is the one it must plan for
            model.hybrid.costs.link_gbps = min(model.hybrid.costs.link_gbps, link_gbps)
    costs_at_load = asdict(model.hybrid.costs) if model.hybrid is not None and model.hybrid.costs else None
    model.stream_misses = stream
    split = 0 if model.cache.holds_every_expert or stream else SPLIT_TOKENS  # a one-graph token has no host marks
    model.setup_kv(len(prompt) + new_tokens + split)
    use_cuda_graphs(model, graphs and kernels == "fused")  # the reference path stays eager, as HQQ's
    if model.graphs is not None:
        model.graphs.prepare(len(prompt) + new_tokens + split)  # captured before the clock starts
    if isinstance(routing, routing_mod.TableRouting):  # a forced routing's tables, drawn before the clock
        routing.reserve(len(prompt), new_tokens - 1)
    t0 = time.perf_counter()
    logits = model.forward(torch.tensor(prompt, device=device), 0)
    tok = int(logits[-1].argmax())
    first = time.perf_counter() - t0
    before = asdict(model.cache.stats)
    cpu0 = replace(model.hybrid.stats) if model.hybrid is not None else None  # a copy
    t1 = time.perf_counter()
    tok = [tok, *model.decode_greedy(tok, len(prompt), new_tokens - 1)][-1]  # as Engine's greedy loop
    sync(device)
    decode = time.perf_counter() - t1
    if model.graphs is not None:
        model.graphs.count_streamed()
    after = asdict(model.cache.stats)
    d = {key: after[key] - before[key] for key in after}
    d["device_used_bytes"] = gpu_memory(device)[0]
    d["streamed"] = model.graphs is not None and model.graphs.streams
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else model.cache.device_bytes()
    recall = routing.recall() if routing is not None else {}
    if model.hybrid is not None:  # the decode's CPU work alone (a prefill job reads its expert once for many tokens)
        cpu = model.hybrid.stats
        seconds = cpu.seconds - cpu0.seconds
        d["cpu_decode_experts"] = cpu.experts - cpu0.experts
        d["cpu_gb_per_s"] = (cpu.bytes_read - cpu0.bytes_read) / seconds / 1e9 if seconds > 0 else 0.0
        d["cpu_wait_s"] = seconds  # the host thread computes them: all of it on the critical path
        if costs_at_load is not None:
            d["costs_at_load"] = {k: round(v, 6) for k, v in costs_at_load.items()}
            d["cpu_gbps_learned"] = model.hybrid.costs.cpu_gbps
            d["cpu_hand_off_ms_learned"] = model.hybrid.costs.cpu_overhead_s * 1e3
    if split:  # where a layer's time goes, from the host's clock marks: they cost it time, so not in the timed tokens
        model.timeline = []
        for n in range(new_tokens - 1, new_tokens - 1 + split):
            tok = int(model.forward(torch.tensor([tok]), len(prompt) + n)[-1].argmax())
        d["layer_split"] = layer_split(model.timeline, split)
    model.graphs = None  # break the model <-> graphs cycle so the slots go now
    del model
    return first, decode, d, peak, recall


def build(layers: int | None = 32, expert_bits: int = 2, attn_bits: int = 4, seed: int = 0, log=print,
          device=None, config: dict | None = None, model: str = "mixtral-8x7b",
          expert_format: str | None = None, group_size: int | None = None, expert_units: int = 1,
          int8_head: bool = True) -> Synthetic:
    """The synthetic model. device None = the CUDA GPU (the command's case); a CPU device with a
    small `config` (ModelConfig fields over the shape's) is for tests. expert_format: "hqq" (at
    expert_bits, in groups of group_size rows; None = quant.EXPERT_SPECS's) or "mxfp4"
    (expert_bits unused); None = the model's own (native_expert_format). int8_head False keeps
    a GPU's LM head in bfloat16 (synthetic_model). The developer benchmarks that build it get
    the engine's allocator settings (vram.use_expandable_segments) as the command line does."""
    vram.use_expandable_segments()
    expert_format = expert_format or native_expert_format(model)
    if expert_format not in EXPERT_FORMATS:
        raise UserError(f"Unknown expert format {expert_format!r}; choose one of {', '.join(EXPERT_FORMATS)}.")
    if device is None:
        if not torch.cuda.is_available():
            raise UserError("moeferry bench measures GPU offloading and needs a CUDA GPU; none is visible.")
        device = torch.device("cuda")
    device = torch.device(device)
    cfg = replace(shape_config(model, layers), **(config or {}))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if expert_format == "mxfp4":
        expert_bits = 4
        if cfg.hidden_size % mxfp4.BLOCK or cfg.intermediate_size % mxfp4.BLOCK:
            raise UserError(f"MXFP4 experts need hidden and intermediate sizes that are multiples of {mxfp4.BLOCK}.")
    label = "MXFP4" if expert_format == "mxfp4" else f"{expert_bits}-bit HQQ"
    if group_size is not None:
        if expert_format == "mxfp4":
            raise UserError("--expert-group-size is for HQQ experts; MXFP4 has blocks of 32.")
        quant.check_group_size(group_size, (cfg.intermediate_size, cfg.hidden_size))
        label += f" (groups of {group_size})"
    log(f"building a synthetic {model} ({cfg.num_layers} layers, {label} experts, {attn_bits}-bit attention)")
    t = time.perf_counter()
    dense, dense_bytes, host, fields, eq = synthetic_model(cfg, expert_bits, attn_bits, device, seed, dtype,
                                                           expert_format, group_size, int8_head)
    if device.type == "cpu":
        dense = {n: compute_ready(w, dtype) for n, w in dense.items()}
    if expert_units > 1:  # as load_engine's --expert-units: each expert cut into units
        from moeferry.engine.runtime.expert_units import split_host
        cfg, fields, host = split_host(cfg, host, fields, eq, expert_units, pin=device.type == "cuda")
        log(f"  each expert cut into {expert_units} units")
    log(f"  built in {time.perf_counter() - t:.1f} s; one expert = {host.shape[2] / 1e6:.1f} MB, "
        f"resident weights {fmt_bytes(dense_bytes)} (LM head {head_format(dense)})")
    bw = pinned_bandwidth(device) if device.type == "cuda" else 0.0
    log(f"  pinned host->device bandwidth: {bw / 1e9:.1f} GB/s")
    return Synthetic(cfg, dense, dense_bytes, host, fields, eq, device, bw, expert_bits, attn_bits, dtype, model)


@dataclass
class Conditions:
    """What the figures depend on besides the engine: routing, link, CPU threads."""

    routing: str = "uniform"  # uniform | model | trace:PATH
    guess_recall: float = 0.85
    h2d_gbps: float | None = None  # pace copies to this rate; None = the link as it is
    seed: int = 0
    cpu_format: str | None = None  # the hybrid's CPU experts: None = hqq in place where it can, else int4

    def routing_source(self, cfg, device, depth: int):
        return routing_mod.parse_routing(self.routing, cfg, device, self.guess_recall, depth, self.seed)


def link_report(s: Synthetic, cond: Conditions, log) -> tuple[int, dict]:
    """(spin cycles per expert copy, the report's link section)."""
    stride = s.host.shape[2]
    link = {"measured_gb_per_s": s.pinned_bytes_per_s / 1e9, "paced_gb_per_s": cond.h2d_gbps}
    if not cond.h2d_gbps:
        return 0, link
    if s.device.type != "cuda":
        raise UserError("--h2d-gbps paces CUDA copies; it needs a CUDA GPU.")
    if cond.h2d_gbps * 1e9 >= s.pinned_bytes_per_s:
        raise UserError(f"--h2d-gbps {cond.h2d_gbps:g} is not below the measured link "
                        f"({s.pinned_bytes_per_s / 1e9:.1f} GB/s); give a lower rate.")
    cycles = pace_cycles(stride, cond.h2d_gbps * 1e9, s.pinned_bytes_per_s, sleep_cycles_per_s(s.device))
    link["achieved_paced_copy_gb_per_s"] = paced_copy_rate(s.device, stride, cycles) / 1e9
    log(f"  copies paced to {cond.h2d_gbps:g} GB/s: {cycles} spin cycles per expert, "
        f"{link['achieved_paced_copy_gb_per_s']:.1f} GB/s achieved on back-to-back copies")
    return cycles, link


def link_bytes_per_s(link: dict) -> float:
    """The link's rate for the bound, from link_report's section: the paced copies' achieved rate
    when pacing, else the measured pinned bandwidth."""
    return (link.get("achieved_paced_copy_gb_per_s") or link["measured_gb_per_s"]) * 1e9


def measure(s: Synthetic, vram_budget: str | None = "12GiB", prompt_len: int = 128, new_tokens: int = 64,
            modes=("naive", "lru", "full"), kernels=("reference", "fused"), prefetch: int = 1, seed: int = 0,
            log=print, cond: Conditions | None = None) -> dict:
    """The ladder under one budget, on the weights of `s`; a report (see markdown_table)."""
    cond = cond or Conditions()
    cfg, device, bw = s.cfg, s.device, s.pinned_bytes_per_s
    budget = parse_size(vram_budget)
    stride = s.host.shape[2]
    # each kernel path gets the cache its workspace leaves room for under the budget
    sizes = {kern: cache_size_for(budget, cfg, s.dense_bytes, stride, prompt_len + new_tokens, device, kern)
             for kern in kernels}
    # streaming with the next layer's guesses fetched: their copies' room (two layers of top-k) comes off the cache
    fetch_sizes = {kern: cache_size_for(budget, cfg, s.dense_bytes + 2 * cfg.top_k * stride, stride,
                                        prompt_len + new_tokens, device, kern) for kern in kernels} if "fetch" in modes else {}
    k, extra = max(sizes.values())
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist()
    cycles, link = link_report(s, cond, log)
    probe = cond.routing_source(cfg, device, prefetch)  # read (and mapped) once, for the report
    log(f"budget {vram_budget}: {sizes} experts cached per layer (and layers with one more), prompt {prompt_len}, "
        f"{new_tokens} new tokens, "
        f"routing {probe.describe()}")
    compute = {}
    for kern in kernels:  # compile (Triton) and warm caches before anything is timed
        run_mode(s, "no-copy", sizes[kern][0], 0, kern, prompt, 4, cond.routing_source(cfg, device, 0))
    for kern in kernels:  # resident compute time per token: nothing moves
        steps = min(new_tokens, 16)
        _, decode, _, _, _ = run_mode(s, "no-copy", sizes[kern][0], 0, kern, prompt, steps,
                                      cond.routing_source(cfg, device, 0))
        compute[kern] = decode / (steps - 1)
        log(f"  resident compute per token ({kern}): {compute[kern] * 1e3:.2f} ms")
    results = []
    for mode in modes:
        for kern in kernels:
            policy = "naive" if mode == "naive" else "lru"
            cached, extra_layers = (fetch_sizes if mode == "fetch" else sizes)[kern]
            kk = cfg.top_k if mode == "naive" else cached
            depth = prefetch if mode in ("full", "hybrid", "fetch") else 0
            if mode == "hybrid" and s.cpu_copies is None:
                log(f"  the CPU experts ({cond.cpu_format or 'default'} format)")
                s.cpu_copies = cpu_copies_of(cfg, s.host, expert_views(cfg, s.fields, s.eq), device,
                                             cond.cpu_format, None, kk)
            first, decode, d, peak, recall = run_mode(s, policy, kk, depth, kern, prompt, new_tokens,
                                                      cond.routing_source(cfg, device, max(depth, 1)), cycles,
                                                      cpu_copies=s.cpu_copies if mode == "hybrid" else None,
                                                      link_gbps=cond.h2d_gbps,
                                                      extra_slot_layers=0 if mode == "naive" else extra_layers,
                                                      stream=mode in ("stream", "fetch"))
            if mode in ("stream", "fetch") and not d["streamed"]:
                log(f"  {mode} {kern}: the experts could not be read from host memory here; the misses were copied")
            recall = {dd: v for dd, v in recall.items() if dd <= depth}  # the guesses prefetch used
            results.append(mode_result(mode, kern, kk, depth, first, decode, d, peak, recall, new_tokens,
                                       link_bytes_per_s(link), compute[kern], budget))
            r = results[-1]
            log(f"  {mode:6s} {kern:9s} {r.decode_tokens_per_s:7.2f} tok/s  first token {first:.2f} s  "
                f"hits {r.hit_rate:.2f}  {r.gb_per_token:.2f} GB/token  peak {fmt_bytes(peak)}"
                + (f" (GPU memory used {fmt_bytes(r.device_used_bytes)})" if r.device_used_bytes else ""))
            for row in r.layer_split:
                log(f"         {row['per_token']:5.2f} layers/token with {row['copied']} copied, {row['on_cpu']} on the CPU: "
                    f"{row['ms']:.3f} ms = host {row['host_ms']:.3f} + CPU kernel {row['kernel_ms']:.3f} "
                    f"+ device wait {row['device_wait_ms']:.3f}")
                if row["host_phases_ms"]:
                    log("             host by step (ms): " + ", ".join(f"{name} {ms:.3f}" for name, ms
                                                                     in row["host_phases_ms"].items()))
            if mode == "hybrid":
                log(f"         costs at load: {d.get('costs_at_load')}; learned by the end: CPU "
                    f"{d.get('cpu_gbps_learned', 0):.1f} GB/s, hand-off {d.get('cpu_hand_off_ms_learned', 0):.2f} ms")
                log(f"         misses on the CPU {r.misses_cpu} (also copied {r.misses_both}), copied "
                    f"{d['misses'] - r.misses_cpu}; CPU {r.cpu_gb_per_s:.1f} GB/s, the host waited on it "
                    f"{r.cpu_wait_ms_per_token:.2f} ms/token")
    routing = {"mode": cond.routing.split(":")[0], "description": probe.describe(),
               "stated_guess_recall": cond.guess_recall if cond.routing == "uniform" else None,
               "uniform_hit_ratio": {kern: (k * cfg.num_moe_layers + extra) / (cfg.num_experts * cfg.num_moe_layers)
                                     for kern, (k, extra) in sizes.items()}}
    if isinstance(probe, routing_mod.TraceRouting):
        routing["trace"] = routing_mod.trace_stats(probe.trace.tokens(0, prompt_len + new_tokens))
    return {
        "date": time.strftime("%Y-%m-%d"), "model": s.shape,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "layers": cfg.num_layers, "vram_budget": vram_budget, "vram_budget_bytes": budget,
        "expert_format": s.expert_format, "expert_bits": s.expert_bits, "expert_group_size": s.eq["group_size"],
        "expert_units": s.cfg.expert_units,
        "expert_bits_per_weight": s.expert_bits_per_weight(), "attn_bits": s.attn_bits, "prompt_len": prompt_len,
        "new_tokens": new_tokens, "expert_bytes": stride, "resident_bytes": s.dense_bytes,
        "lm_head": head_format(s.dense),
        "host_dense_bytes": s.host_dense_bytes,
        "pinned_gb_per_s": bw / 1e9, "cache_experts": k, "extra_slot_layers": extra,
        "routing": routing, "link": link, "cpu_threads": torch.get_num_threads(),
        "cpu_experts": cpu_experts_report(s.cpu_copies, cfg) if "hybrid" in modes else None,
        "resident_compute_ms_per_token": {kk: v * 1e3 for kk, v in compute.items()},
        "results": [asdict(r) for r in results],
    }


def cpu_experts_report(copies: dict | None, cfg) -> dict | None:
    """The hybrid's CPU experts: their format and the bits per weight the CPU reads."""
    if not copies:
        return None
    one = next(iter(copies.values()))
    in_place = isinstance(one, HqqExpert)
    extra = sum(c.copied_bytes() if in_place else c.nbytes() for c in copies.values())
    fmt = ("mxfp4" if isinstance(one, Mxfp4Expert) else "hqq") if in_place else one.w13.fmt
    return {"format": fmt, "experts": len(copies), "extra_ram_bytes": extra,
            "bits_per_weight": one.nbytes() * 8 / (3 * cfg.hidden_size * cfg.intermediate_size)}


def mode_result(mode, kern, kk, depth, first, decode, d, peak, recall, new_tokens, bw, compute, budget):
    steps = new_tokens - 1
    per_tok = decode / steps
    moved = d["bytes_h2d"] / steps
    uses = d["hits"] + d["misses"]
    bound = max(moved / bw, compute) if bw else compute
    return ModeResult(
        mode=mode, kernels=kern, cache_experts=kk, prefetch=depth,
        decode_tokens_per_s=steps / decode, first_token_s=first,
        hit_rate=d["hits"] / uses if uses else 0.0,
        prefetch_precision=d["prefetch_used"] / d["prefetch_issued"] if d["prefetch_issued"] else 0.0,
        prefetch_recall=(d["prefetch_used"] / (d["prefetch_used"] + d["misses"])
                         if d["prefetch_used"] + d["misses"] else 0.0),
        gb_per_token=moved / 1e9, h2d_gb_per_s=d["bytes_h2d"] / decode / 1e9,
        bound_ms_per_token=bound * 1e3, achieved_ms_per_token=per_tok * 1e3,
        achieved_over_bound=per_tok / bound, peak_vram_bytes=peak,
        under_budget=budget is None or peak <= budget, guess_recall=recall,
        misses_cpu=d.get("misses_cpu", 0), misses_both=d.get("misses_both", 0),
        cpu_gb_per_s=d.get("cpu_gb_per_s", 0.0), cpu_wait_ms_per_token=d.get("cpu_wait_s", 0.0) / steps * 1e3,
        cpu_decode_experts=d.get("cpu_decode_experts", 0), layer_split=d.get("layer_split", []),
        device_used_bytes=d.get("device_used_bytes", 0))


def layer_split(times: list, steps: int) -> list[dict]:
    """Where a decoded MoE layer's time goes, by what the layer did (experts copied, experts on
    the CPU): how many such layers per token and, in ms each, the whole layer (its routing sync
    to the next layer's), the host's Python (queuing the device's work and copies, handing the
    CPU experts their input and their results up), the CPU kernel, and the rest: waiting for
    the device (its copies and experts, then the next attention). A token's last MoE layer is
    left out (the head follows it)."""
    rows: dict[tuple, list] = {}
    for a, b in zip(times, times[1:]):
        if b.layer != a.layer + 1:
            continue
        r = rows.setdefault((a.copied, a.on_cpu), [0, 0.0, 0.0, 0.0, {}])
        r[0] += 1
        r[1] += b.routed - a.routed
        r[2] += a.done - a.routed
        r[3] += a.kernel
        for name, s in (a.phases or {}).items():
            r[4][name] = r[4].get(name, 0.0) + s
    return [{"copied": c, "on_cpu": n, "per_token": round(k / steps, 2), "ms": round(w / k * 1e3, 3),
             "host_ms": round((h - kern) / k * 1e3, 3), "kernel_ms": round(kern / k * 1e3, 3),
             "device_wait_ms": round((w - h) / k * 1e3, 3),
             "host_phases_ms": {name: round(ph[name] / k * 1e3, 3) for name in HOST_PHASES if name in ph}}
            for (c, n), (k, w, h, kern, ph) in sorted(rows.items())]


def cached_words(report: dict) -> str:
    k, extra = report["cache_experts"], report.get("extra_slot_layers", 0)
    more = f" ({k + 1} in the first {extra})" if extra else ""
    return f"{k} experts cached per layer{more}"


def markdown_table(report: dict) -> str:
    lines = [f"Budget {report['vram_budget']}, {expert_words(report)} "
             f"({report['expert_bytes'] / 1e6:.1f} MB each), {report['attn_bits']}-bit attention, "
             f"LM head {report.get('lm_head', 'bfloat16')}, "
             f"{report['layers']} layers, P={report['prompt_len']}, T={report['new_tokens']}, "
             f"{cached_words(report)}, pinned H2D {report['pinned_gb_per_s']:.1f} GB/s, "
             f"{report['device']}, {report['date']}.", "", conditions_line(report), "",
             "| mode | kernels | decode tok/s | first token s | hit rate | guess recall | prefetch prec/recall "
             "| GB/token | H2D GB/s | bound ms/tok | achieved ms/tok | achieved/bound | peak VRAM GiB "
             "| GPU memory used GiB | misses on CPU (+copied) | CPU GB/s | CPU wait ms/tok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(
            f"| {r['mode']} | {r['kernels']} | {r['decode_tokens_per_s']:.2f} | {r['first_token_s']:.2f} | "
            f"{r['hit_rate']:.2f} | {recall_text(r['guess_recall'])} | "
            f"{r['prefetch_precision']:.2f}/{r['prefetch_recall']:.2f} | "
            f"{r['gb_per_token']:.2f} | {r['h2d_gb_per_s']:.1f} | {r['bound_ms_per_token']:.1f} | "
            f"{r['achieved_ms_per_token']:.1f} | {r['achieved_over_bound']:.2f} | "
            f"{r['peak_vram_bytes'] / GiB:.2f}{'' if r['under_budget'] else ' (over!)'} | "
            f"{r.get('device_used_bytes', 0) / GiB:.2f} | "
            f"{r['misses_cpu']} (+{r['misses_both']}) | {r['cpu_gb_per_s']:.1f} | {r['cpu_wait_ms_per_token']:.2f} |")
    return "\n".join(lines)


def expert_words(report: dict) -> str:
    """The experts' format and bits per weight (reports from before the format was stated: HQQ)."""
    if report.get("expert_format") == "mxfp4":
        name = "MXFP4 experts"
    else:
        name = f"{report['expert_bits']}-bit HQQ experts"
        if report.get("expert_group_size"):
            name += f" in groups of {report['expert_group_size']}"
        if report.get("expert_units", 1) > 1:
            name += f", each cut into {report['expert_units']} units"
    bpw = report.get("expert_bits_per_weight")
    return name if bpw is None else f"{name}, {bpw:.2f} bits/weight"


def recall_text(recall: dict) -> str:
    return ", ".join(f"{v:.2f}" + (f" (d={d})" if len(recall) > 1 else "") for d, v in recall.items()) or "-"


def conditions_line(report: dict) -> str:
    """Routing, link and threads: what the figures depend on besides the engine."""
    ro, link = report["routing"], report["link"]
    uniform = ", ".join(f"{v:.3f} ({k})" for k, v in ro["uniform_hit_ratio"].items())
    text = f"Routing: {ro['description']}; a cache of K of E experts hits K/E = {uniform} under uniform routing."
    if "trace" in ro:
        t, k = ro["trace"], report["cache_experts"]
        hit = t["lru_hit_ratio"].get(k, t["lru_hit_ratio"].get(str(k)))  # JSON keys are strings
        text += (f" The replayed tokens' own LRU hit ratio at {k} cached: {hit:.3f}; guess recall "
                 + ", ".join(f"{v:.3f} (d={d})" for d, v in t["guess_recall"].items()) + ".")
    text += f" Link: measured {link['measured_gb_per_s']:.1f} GB/s"
    if link.get("paced_gb_per_s"):
        text += (f", copies paced to {link['paced_gb_per_s']:g} GB/s "
                 f"({link['achieved_paced_copy_gb_per_s']:.1f} GB/s achieved on back-to-back copies)")
    return text + f". CPU threads: {report['cpu_threads']}. H2D GB/s in the table = bytes copied / decode time."


def cli_bench(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="moeferry bench")
    p.add_argument("--model", default="mixtral-8x7b", choices=tuple(MODEL_SHAPES),
                   help="the shape of the synthetic model (default mixtral-8x7b)")
    p.add_argument("--layers", type=int, default=None, help="the model's first N layers (default: all)")
    p.add_argument("--vram-budget", default="12GiB",
                   help="what the engine may allocate, e.g. 12GiB, 16GiB, none (the report's GPU memory used adds "
                        "the CUDA runtime's); several, comma-separated, share one build")
    p.add_argument("--expert-format", choices=EXPERT_FORMATS,
                   help="the experts' format: mxfp4 (gpt-oss's own, 4.25 bits/weight) or hqq (at --expert-bits); "
                        "default: the model's own (mxfp4 for gpt-oss-20b, hqq for the others)")
    p.add_argument("--expert-bits", type=int, choices=(2, 3, 4), help="bits per HQQ expert weight (default 2)")
    p.add_argument("--expert-group-size", type=int,
                   help="rows sharing one HQQ scale and zero (default 16 at 2 bits, 64 at 3 and 4); "
                        "32 at 2 bits takes 2.5 bits per weight, near llama.cpp's Q2_K (2.6)")
    p.add_argument("--expert-units", type=int, default=1,
                   help="cut each HQQ expert into this many units along its FFN (exact), so that the hybrid "
                        "serves one miss part over the link and part on the CPU (default 1: whole experts)")
    p.add_argument("--attn-bits", type=int, default=4, choices=(4, 8), help="bits per attention weight")
    p.add_argument("--prompt-len", default="128", help="one or several, comma-separated")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per measurement")
    p.add_argument("--modes", default="naive,lru,full",
                   help="naive, lru, full, hybrid (full + CPU experts), stream (misses read from host memory), "
                        "fetch (stream + the next layer's guessed misses copied ahead)")
    p.add_argument("--kernels", default="reference,fused", help="comma-separated: reference, fused")
    p.add_argument("--prefetch", type=int, default=1, help="layers ahead to prefetch experts (0 = off)")
    p.add_argument("--routing", default="uniform",
                   help="uniform (default: top-k drawn uniformly, no locality), trace:PATH (replay a trace "
                        "of `moeferry trace`, mapped onto this model), model (the random router: degenerate)")
    p.add_argument("--guess-recall", type=float, default=0.85,
                   help="uniform routing: a prefetch guess d layers ahead holds each true expert with "
                        "probability R^d (default 0.85)")
    p.add_argument("--h2d-gbps", type=float, help="pace host->device expert copies to this many GB/s")
    p.add_argument("--cpu-threads", type=int, help="torch CPU threads (default: torch's own)")
    p.add_argument("--cpu-format", choices=("hqq", "int4", "int8"),
                   help="the hybrid's CPU experts (default: hqq, the stored bytes in place)")
    p.add_argument("--json", action="store_true", help="print the report(s) as JSON")
    p.add_argument("--json-dir", help="also write one JSON report per budget and prompt length here")
    a = p.parse_args(argv)
    expert_format = a.expert_format or native_expert_format(a.model)
    if expert_format == "mxfp4" and a.expert_bits is not None:
        raise UserError(f"--expert-bits sets HQQ experts' width, and {a.model}'s experts are MXFP4 here; "
                        f"add --expert-format hqq to bench HQQ experts.")
    expert_bits = a.expert_bits or 2
    if a.new_tokens < 2 or (a.layers is not None and a.layers < 1) or a.expert_units < 1:
        raise UserError("--new-tokens must be 2 or more, --layers and --expert-units 1 or more.")
    if not 0 <= a.guess_recall <= 1 or (a.h2d_gbps is not None and a.h2d_gbps <= 0) \
            or (a.cpu_threads is not None and a.cpu_threads < 1):
        raise UserError("--guess-recall must be in [0, 1], --h2d-gbps above 0 and --cpu-threads 1 or more.")
    cond = Conditions(a.routing, a.guess_recall, a.h2d_gbps, cpu_format=a.cpu_format)
    # a bad --routing (or a trace too short for the run) fails before the build
    source = routing_mod.parse_routing(a.routing, shape_config(a.model, a.layers), "cpu",
                                       a.guess_recall, a.prefetch)
    if unknown := [m for m in a.modes.split(",") if m not in MODES]:
        raise UserError(f"Unknown mode {unknown[0]!r} in --modes; choose from {', '.join(MODES)}.")
    need = max(int(x) for x in str(a.prompt_len).split(",")) + a.new_tokens
    if isinstance(source, routing_mod.TraceRouting) and source.trace.num_tokens < need:
        raise UserError(f"The trace holds {source.trace.num_tokens} tokens and this run needs {need}; record "
                        f"a longer trace or lower --prompt-len / --new-tokens.")
    if a.cpu_threads:
        torch.set_num_threads(a.cpu_threads)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    s = build(a.layers, expert_bits, a.attn_bits, log=log, model=a.model, expert_format=expert_format,
              group_size=a.expert_group_size, expert_units=a.expert_units)
    reports = []
    for budget in a.vram_budget.split(","):  # one set of weights, several budgets: one build
        for plen in (int(x) for x in str(a.prompt_len).split(",")):
            r = measure(s, budget, plen, a.new_tokens, tuple(a.modes.split(",")), tuple(a.kernels.split(",")),
                        a.prefetch, log=log, cond=cond)
            reports.append(r)
            if a.json_dir:
                Path(a.json_dir).mkdir(parents=True, exist_ok=True)
                stem = "bench" if a.model == "mixtral-8x7b" else f"bench-{a.model}"
                experts = "mxfp4" if expert_format == "mxfp4" else f"{expert_bits}bit"
                experts += f"-g{a.expert_group_size}" if a.expert_group_size else ""
                experts += f"-u{a.expert_units}" if a.expert_units > 1 else ""
                name = f"{stem}-{experts}-{budget}-p{plen}-{cond.routing.split(':')[0]}.json"
                (Path(a.json_dir) / name).write_text(json.dumps(r, indent=1))
    if a.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=1))
    else:
        print("\n\n".join(markdown_table(r) for r in reports))
    return 0
