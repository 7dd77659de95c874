"""The plan: from the hardware probe and a model's sizes, pick the expert cache size (and the
expert bit-width) under a VRAM budget, and predict decode speed.

Decode cost model, per generated token (batch 1):

    misses   = layers * top_k * (1 - hit_rate(cache experts per layer))
    transfer = misses * expert_bytes / host->device bandwidth
    compute  = layers * (layer overhead + bytes the layer reads / (GPU bandwidth * kernel efficiency))
    time     = max(hidden * transfer, compute) + (1 - hidden) * transfer
               + misses * per-miss overhead + per-token overhead

`hidden` is the share of the misses that prefetching starts early enough to hide behind
compute (the paper's prefetch recall times how well copies really overlap). Every
coefficient lives in `Coefficients`, with where its default comes from, and
`fit_coefficients` refits them to measured benchmark runs. Without a usable NVIDIA GPU the
plan is a CPU plan whose speed comes from the CPU's measured matrix-vector rate.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from moeferry.engine.runtime import vram
from moeferry.engine.storage.manifest import read_manifest, section
from moeferry.engine.storage.safetensors_io import FormatError, read_header
from moeferry.engine.units import GiB

# The routing assumption, the same as `moeferry bench`'s default (engine/measure/routing.py): uniform,
# independent from token to token, so a per-layer LRU cache of k of E experts hits k/E (the
# cache's worst case), unless a recorded trace's own LRU hit ratios are given
# (moeferry.engine.measure.routing.trace_stats(...)["lru_hit_ratio"]), like the paper's on real Mixtral text:
# Eliseev & Mazur 2023, Figure 2 (left), about 0.2 at k=1 rising to about 0.6 at k=4; k=2,3 read
# between those points, k=5..7 interpolated linearly to 1.0 at k=8 (all experts resident).
PAPER_LRU_HIT_RATIO = {1: 0.20, 2: 0.34, 3: 0.47, 4: 0.60, 5: 0.70, 6: 0.80, 7: 0.90}
# Same paper, Figure 2 (right): speculative loading one layer ahead recalls about 0.6-0.9 of
# the experts the next layer will use; 0.75 is the middle of that range.
PREFETCH_RECALL_1_AHEAD = 0.75

# PCIe payload rate per lane in GB/s, by generation (after line encoding).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.877}

# HQQ store formats: {bits: group size}; 8-bit scale and zero per group, and an fp16
# (scale, zero) pair per META_GROUP of those (mirrors engine/storage/quant.py's EXPERT/ATTN specs).
EXPERT_GROUP = {2: 16, 3: 64, 4: 64}
ATTN_GROUP = {4: 64, 8: 64}
EXPERT_META_GROUP, ATTN_META_GROUP = 128, 256

DEFAULT_CONTEXT_TOKENS = 4096
DEFAULT_PROMPT_TOKENS = 128
# Host RAM that the OS, Python, torch and the app need besides the model's weights.
HOST_RESERVE_BYTES = 3 * GiB
# A plan is "slower but better" worth recommending if it keeps this share of the best speed.
# Offloaded decode is bound by the expert copies, so more expert bits stay inside it when they
# leave the cache as large (3-bit costs ~7.5 % more bytes per expert) and fall outside when the
# bigger experts cost a cached expert per layer (3-bit on a 15 GB card keeps ~75 %).
SPEED_TOLERANCE = 0.85


@dataclass(frozen=True)
class Coefficients:
    """The tunable constants of the cost model (refit them with `fit_coefficients`).

    The GPU defaults are `fit_coefficients(paper_calibration())`, rounded: the paper's code
    on an H200 (7.9 / 4.8 / 4.2 tok/s with 8 / 4 / 3 experts cached) and the paper's Table 2
    (A100 3.1, RTX 3080 Mobile 2.7, RTX 3060 2.3, T4 2.1 tok/s); RMS error about 10 %, the
    A100 the worst (+26 %). They describe that code's kernels and Python overhead; refit
    with MoE Ferry's own benchmark rows when it has them.
    """
    prefetch_recall: float = PREFETCH_RECALL_1_AHEAD
    overlap_efficiency: float = 0.1  # share of recalled copies really hidden behind compute
    gpu_layer_overhead_s: float = 3.0e-3  # launches, attention, router, Python, per layer
    gpu_kernel_efficiency: float = 0.1  # share of GPU memory bandwidth low-bit GEMV reaches
    miss_overhead_s: float = 1.6e-3  # per expert copy: issue, events, cache bookkeeping
    token_overhead_s: float = 25e-3  # sampling, embedding, lm_head, per token
    prefill_token_layer_s: float = 1e-5  # GPU prefill per prompt token per layer (H200: 0.79 s)
    pcie_efficiency: float = 0.8  # measured/theoretical PCIe rate when bandwidth is not measured
    default_gpu_mem_bytes_per_s: float = 300e9  # when the GPU's memory bandwidth is unknown
    # CPU cost per weight of an expert that is not in the CPU's expert cache (dequantized at
    # every load) / the probe's fp32 matvec cost. Measured on 2 cores for the engine's CPU
    # path (quant.dequantize + F.linear, 4096x4096, 2- and 4-bit): 30-54x. Cached experts and
    # the dense weights are kept dequantized and cost one fp32 matvec per weight.
    cpu_kernel_factor: float = 35.0
    # Per layer on the CPU: torch operator dispatch and Python (attention, router, norms,
    # expert bookkeeping): the demo model on 2 idle cores decodes at 225 tokens/s, 4.4 ms a
    # token of which 1.7 ms are its 8.1M active weights at the probe's 4.9 G weights/s.
    cpu_layer_overhead_s: float = 0.3e-3
    hit_rate_scale: float = 1.0  # multiplies the hit rate of `hit_rate` (fit to measured hit rates)


PAPER_CODE = Coefficients()  # the paper's released code: fit on paper_calibration()

# MoE Ferry's own engine, fit by hand on its `moeferry bench` runs (docs/bench/*.json: H200,
# 2-bit, budgets 8/12/16 GiB and none, 2026-11-30, third session): a token costs the resident
# compute (fused kernels at ~33 % of HBM bandwidth; ~0.03 ms per layer of routing sync and
# graph launches: a blend, as the model charges it whether or not experts move, while a fully
# resident cache really runs without the sync) plus the expert copies at the measured
# pinned rate; the copies were not hidden behind compute there (prefetch on random-weight
# routing bought no time), so almost no overlap is assumed.
DEFAULT = replace(PAPER_CODE, overlap_efficiency=0.02, gpu_layer_overhead_s=0.03e-3,
                  gpu_kernel_efficiency=0.33, miss_overhead_s=0.0, token_overhead_s=0.3e-3,
                  prefill_token_layer_s=3.5e-5)


@dataclass
class ModelSizes:
    """What the planner needs to know about a model (one store variant)."""
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int  # one packed expert: the unit copied host->device
    dense_bytes: int  # everything but the experts (on a GPU: gpu_dense_bytes of it there, the rest in RAM)
    kv_bytes_per_token: int
    expert_params: int = 0
    dense_params: int = 0  # of which embed_params are only looked up, not read per token
    embed_params: int = 0
    embed_bytes: int = 0
    head_params: int = 0  # the LM head's (0 when tied to the embedding)
    expert_bits: int | None = None
    attn_bits: int | None = None
    name: str = ""
    moe_layers: int = 0  # layers with experts; 0 = all of them
    ffn_matrix_params: int = 0  # one expert matrix, hidden x FFN width; 0 = a third of expert_params
    max_context: int | None = None  # the model's max_position_embeddings, when known

    @property
    def num_moe_layers(self) -> int:
        return self.moe_layers or self.num_layers

    @property
    def all_expert_bytes(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_bytes

    @property
    def store_bytes(self) -> int:
        return self.all_expert_bytes + self.dense_bytes

    @property
    def host_dense_bytes(self) -> int:
        """The dense bytes the engine keeps in RAM on a GPU: an embedding not tied to the LM
        head, of which a token reads one row (generate.embedding_on_host)."""
        return self.embed_bytes if self.head_params else 0

    @property
    def int8_head_saving(self) -> int:
        """Bytes the GPU saves by rounding the LM head to int8 (vram.int8_head): a byte a weight,
        less its row scales (a fraction of a percent, left out)."""
        return self.head_params if vram.int8_head(self.head_params, self.attn_bits) else 0

    @property
    def gpu_dense_bytes(self) -> int:
        return self.dense_bytes - self.host_dense_bytes - self.int8_head_saving

    @property
    def active_params(self) -> int:
        """Weights read for one token: all dense but the embedding, top_k experts per layer."""
        return self.dense_params - self.embed_params + self.num_layers * self.top_k * self.expert_params

    @classmethod
    def from_config(cls, config: dict, expert_bits: int, attn_bits: int, name: str = "") -> "ModelSizes":
        """Sizes of a store converted from a Hugging Face config.json (analytic; Mixtral's
        layout, which the other families' experts share: num_experts and moe_intermediate_size
        are their spellings)."""
        L, E = config["num_hidden_layers"], config.get("num_local_experts") or config["num_experts"]
        H, V = config["hidden_size"], config["vocab_size"]
        F = config.get("moe_intermediate_size") or config["intermediate_size"]
        nh = config["num_attention_heads"]
        nkv = config.get("num_key_value_heads", nh)
        hd = config.get("head_dim") or H // nh
        expert_params = 3 * H * F
        attn_params = L * (2 * H * nh * hd + 2 * H * nkv * hd)
        embed = V * H
        head = 0 if config.get("tie_word_embeddings") else V * H
        small = L * 2 * H + H + L * E * H  # norms and routers, kept in fp16
        attn_bytes = sum(_matrix_bytes(r, c, attn_bits, ATTN_GROUP, ATTN_META_GROUP) * L
                         for r, c in ((nh * hd, H), (nkv * hd, H), (nkv * hd, H), (H, nh * hd)))
        expert_bytes = (2 * _matrix_bytes(F, H, expert_bits, EXPERT_GROUP, EXPERT_META_GROUP)
                        + _matrix_bytes(H, F, expert_bits, EXPERT_GROUP, EXPERT_META_GROUP))
        return cls(num_layers=L, num_experts=E, top_k=config["num_experts_per_tok"],
                   expert_bytes=expert_bytes, dense_bytes=attn_bytes + 2 * (embed + head + small),
                   kv_bytes_per_token=vram.kv_cache_bytes(L, 1, nkv, hd), expert_params=expert_params,
                   dense_params=attn_params + embed + head + small, embed_params=embed,
                   embed_bytes=2 * embed, head_params=head, expert_bits=expert_bits, attn_bits=attn_bits, name=name,
                   moe_layers=_moe_layer_count(config), ffn_matrix_params=H * F,
                   max_context=config.get("max_position_embeddings"))

    def device_bytes(self, context_tokens: int) -> vram.DeviceBytes:
        """What the engine holds on the GPU besides the cache, at its defaults (bfloat16,
        fused kernels), for a context of `context_tokens` (capped at the model's maximum)."""
        return vram.DeviceBytes(
            dense=self.gpu_dense_bytes, kv_cache=self.kv_bytes_per_token * self.context(context_tokens),
            workspace=vram.workspace_bytes(self.ffn_matrix_params or self.expert_params // 3),
            per_slot=self.num_moe_layers * self.expert_bytes, num_experts=self.num_experts,
            moe_layers=self.num_moe_layers)

    def context(self, context_tokens: int) -> int:
        """The KV cache's positions: the engine's, min(asked, the model's maximum)."""
        return min(context_tokens, self.max_context) if self.max_context else context_tokens

    @classmethod
    def from_catalog(cls, entry: dict) -> "ModelSizes":
        """From a resources/catalog.json entry (its "sizes", or its config + bits; the
        embedded demo model's from its store). ValueError when the sizes cannot be known."""
        if entry.get("kind") == "embedded":
            store = demo_store_path()
            if store is None:
                raise ValueError("the demo model is not built into this install")
            return replace(cls.from_store(store), name=entry.get("name", "demo"))
        if "sizes" in entry:
            known = {k: v for k, v in entry["sizes"].items() if k in cls.__dataclass_fields__}
            if "config" in entry:  # the shape's fields the sizes leave out
                shape = cls.from_config(entry["config"], entry["expert_bits"], entry["attn_bits"])
                known = dict(moe_layers=shape.moe_layers, ffn_matrix_params=shape.ffn_matrix_params,
                             max_context=shape.max_context, head_params=shape.head_params) | known
            return cls(**known, expert_bits=entry.get("expert_bits"),
                       attn_bits=entry.get("attn_bits"), name=entry.get("name", entry.get("id", "")))
        return cls.from_config(entry["config"], entry["expert_bits"], entry["attn_bits"],
                               name=entry.get("name", entry.get("id", "")))

    @classmethod
    def from_store(cls, path) -> "ModelSizes":
        """From a MoE Ferry store folder: its config.json, manifest.json (read as the loader reads it:
        UserError for one it refuses) and dense weights' header."""
        path, manifest = read_manifest(path)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        quant = section(manifest, "quantization")
        bits = lambda key: section(quant, key).get("bits", 16)  # noqa: E731
        sizes = cls.from_config(config, bits("experts"), bits("attention"), name=path.name)
        stride = section(manifest, "experts").get("stride")
        if type(stride) is int and stride > 0:
            sizes.expert_bytes = stride
        try:
            header, _ = read_header(path / "dense.safetensors")
        except FormatError as e:
            raise ValueError(str(e)) from None
        sizes.dense_bytes = vram.dense_bytes(header)
        return sizes


def _moe_layer_count(config: dict) -> int:
    """Layers with routed experts (engine/runtime/model.py's family_options: qwen's decoder_sparse_step
    and mlp_only_layers; every layer elsewhere)."""
    layers = config["num_hidden_layers"]
    if config.get("model_type") not in ("qwen3_moe", "qwen2_moe"):
        return layers
    step, dense = config.get("decoder_sparse_step") or 1, set(config.get("mlp_only_layers") or ())
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def demo_store_path() -> Path | None:
    """The embedded demo model's store folder, if this install has one."""
    from moeferry.engine.paths import demo_store_path as find

    path = find()
    return path if (path / "manifest.json").is_file() and (path / "config.json").is_file() else None


def _matrix_bytes(rows: int, cols: int, bits: int, groups: dict, meta_group: int) -> int:
    params = rows * cols
    if bits >= 16:
        return 2 * params
    g = groups[bits]
    n_meta = params // g  # scale values (and as many zeros)
    pairs = n_meta // meta_group if n_meta % meta_group == 0 and n_meta >= meta_group else 1
    return params * bits // 8 + 2 * n_meta + 2 * pairs * 2 * 2


def bits_per_param(sizes: ModelSizes) -> float:
    return 8 * sizes.expert_bytes / sizes.expert_params if sizes.expert_params else float("nan")


@dataclass
class Plan:
    device: str  # "cuda" or "cpu"
    cache_experts_per_layer: int
    vram_budget_bytes: int | None
    predicted_tokens_per_s: float
    predicted_first_token_s: float
    bound: str  # "pcie", "compute" or "cpu"
    verdict: str
    fits: bool
    expert_bits: int | None = None
    hit_rate: float = 0.0
    misses_per_token: float = 0.0
    bytes_h2d_per_token: float = 0.0
    vram_needed_bytes: int = 0  # dense + cache + headroom (engine/runtime/vram.py)
    headroom_bytes: int = 0  # kv cache + workspace
    kv_cache_bytes: int = 0
    workspace_bytes: int = 0
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    host_ram_needed_bytes: int = 0
    h2d_bytes_per_s: float | None = None
    model: str = ""
    notes: list[str] = field(default_factory=list)
    # with missed experts computed on the CPU too (`--cpu-experts auto`, predict_hybrid)
    predicted_hybrid_tokens_per_s: float | None = None
    extra_slot_layers: int = 0  # the first layers that cache one expert more (vram.DeviceBytes)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Hardware numbers the model needs


def hit_rate(k: int, num_experts: int, coeffs: Coefficients = DEFAULT,
             trace_hit_ratio: dict | None = None) -> float:
    """LRU hit rate with k cached experts per layer: k/E under uniform routing, or a trace's
    own LRU hit ratio at k ({cached experts: ratio}, keys int or str as JSON gives them)."""
    if k >= num_experts:
        return 1.0
    if k <= 0:
        return 0.0
    rate = k / num_experts
    if trace_hit_ratio:
        rate = float(trace_hit_ratio.get(k, trace_hit_ratio.get(str(k), rate)))
    return min(1.0, rate * coeffs.hit_rate_scale)


def h2d_bytes_per_s(hw: dict, coeffs: Coefficients = DEFAULT) -> float | None:
    """Measured pinned host->device rate, else the PCIe link's theoretical rate * efficiency."""
    if hw.get("h2d_bytes_per_s"):
        return float(hw["h2d_bytes_per_s"])
    gen = hw.get("pcie_gen_max") or hw.get("pcie_gen")
    width = hw.get("pcie_width_max") or hw.get("pcie_width")
    if gen and width and int(gen) in PCIE_LANE_GBPS:
        return PCIE_LANE_GBPS[int(gen)] * 1e9 * int(width) * coeffs.pcie_efficiency
    return None


def has_cuda_gpu(hw: dict) -> bool:
    return bool(hw.get("gpu_name")) and bool(hw.get("torch_cuda_available", True))


def default_vram_budget(hw: dict) -> int | None:
    """The engine's budget when none is given (engine/runtime/vram.py's auto_budget of the free VRAM)."""
    free = hw.get("vram_free_bytes") or hw.get("vram_total_bytes")
    return vram.auto_budget(int(free)) if free else None


# ---------------------------------------------------------------------------------------------
# Predictions


def predict_gpu(hw: dict, m: ModelSizes, k: int, coeffs: Coefficients = DEFAULT,
                prefetch_depth: int = 1, prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
                measured_hit_rate: float | None = None, trace_hit_ratio: dict | None = None,
                extra_slot_layers: int = 0) -> dict:
    """Decode tokens/s and first-token latency with k cached experts per layer, k + 1 in the
    first extra_slot_layers (routing: see `hit_rate`)."""
    bw = h2d_bytes_per_s(hw, coeffs) or 12e9
    gpu_bw = float(hw.get("gpu_mem_bandwidth_bytes_per_s") or coeffs.default_gpu_mem_bytes_per_s)
    k = min(k, m.num_experts)
    h = measured_hit_rate
    if h is None:
        h = hit_rate(k, m.num_experts, coeffs, trace_hit_ratio)
        if extra_slot_layers and k < m.num_experts:
            more = hit_rate(k + 1, m.num_experts, coeffs, trace_hit_ratio)
            h += (more - h) * extra_slot_layers / m.num_moe_layers
    misses = m.num_layers * m.top_k * (1.0 - h)
    transfer = misses * m.expert_bytes / bw
    read = (m.dense_bytes - m.embed_bytes - m.int8_head_saving) + m.num_layers * m.top_k * m.expert_bytes
    compute = m.num_layers * coeffs.gpu_layer_overhead_s + read / (gpu_bw * coeffs.gpu_kernel_efficiency)
    hidden = coeffs.prefetch_recall * coeffs.overlap_efficiency if prefetch_depth > 0 else 0.0
    t = (max(hidden * transfer, compute) + (1 - hidden) * transfer
         + misses * coeffs.miss_overhead_s + coeffs.token_overhead_s)
    # Prefill touches nearly every expert of every layer once; all but the cached ones load.
    touched = m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** max(prompt_tokens, 1))
    loads = max(m.num_layers * max(touched - k, 0.0) - extra_slot_layers, 0.0)
    first = (loads * (m.expert_bytes / bw + coeffs.miss_overhead_s)
             + m.num_layers * (coeffs.gpu_layer_overhead_s + prompt_tokens * coeffs.prefill_token_layer_s)
             + t)
    bound = "pcie" if transfer + misses * coeffs.miss_overhead_s > compute else "compute"
    return {"tokens_per_s": 1.0 / t, "first_token_s": first, "hit_rate": h, "misses": misses,
            "bytes_h2d": misses * m.expert_bytes, "bound": bound, "h2d_bytes_per_s": bw}


CPU_INT4_BITS = 4.25  # the CPU copies of 16-bit stores: int4 in groups of 128, bfloat16 scale + zero
CPU_INT4_OF_RAM = 0.9  # the int4 kernel's share of RAM read speed (issue 16: 68-78 of 80-83 GB/s)
# the in-place HQQ kernel's share of RAM read speed, 2 bits: on the GPU machine's Xeon a whole
# expert reads 46.9 GB/s on 16 threads and 30.1 on 8 (docs/BENCHMARKS.md, 2026-12-03 evening),
# against RAM reads of 115.9 and 84.8 GB/s measured the day before: 0.40 and 0.35 (the lower
# kept: a desktop has 8 threads or fewer for it)
HQQ_CPU_OF_RAM = 0.35
IN_PLACE_BITS = (2, 3, 4)  # widths the HQQ CPU kernel runs (engine/kernels/hqq_cpu.py)
LOW_BIT_ATTN_BITS = IN_PLACE_BITS + (8,)  # attention the CPU engine reads in place or as int8 (generate.move_dense)
# Inside a GPU decode the CPU experts do worse than alone (docs/BENCHMARKS.md, 2026-12-03: the
# kernel at 0.45-1.0 of its own rate, and a layer that runs one spends 0.1-0.6 ms more on the
# host); the hybrid's prediction takes both, so it does not promise what the engine misses.
CPU_IN_DECODE_OF_ALONE = 0.6  # near the low end of that range: a figure most measured runs reached


def cpu_cache_experts(m: ModelSizes) -> int:
    """Experts per layer the CPU engine keeps dequantized (all of them for the demo model)."""
    return vram.cpu_cache_slots(m.num_moe_layers, m.expert_params, m.num_experts)


def predict_cpu(hw: dict, m: ModelSizes, coeffs: Coefficients = DEFAULT,
                prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> dict:
    """Decode on the CPU. A quantized model whose experts do not all fit the CPU's expert cache
    (Mixtral) runs them on the in-place kernel (generate.default_cpu_experts): each routed
    expert's stored bytes read at the kernel's share of RAM speed, and so its dense matrices in
    their low-bit forms (generate.move_dense: 2-4 bit attention as stored, 8-bit attention and
    the head in int8; 16-bit attention stays fp32 matvecs). Otherwise (the demo, 16-bit stores)
    every active weight is one fp32 matvec from RAM, and an expert that misses the CPU's expert
    cache is dequantized first."""
    cores = hw.get("cpu_cores_physical") or hw.get("cpu_cores_logical") or 2
    rate = hw.get("cpu_matvec_params_per_s") or 0.5e9 * cores  # fp32 weights per second
    kernels = on_cpu_kernels(m)
    if not kernels and vram.cpu_one_thread(m.expert_params // 3) and hw.get("cpu_small_matvec_params_per_s"):
        rate = hw["cpu_small_matvec_params_per_s"]  # one thread over small matrices, as the engine runs it
    flops = hw.get("cpu_matmul_flops") or 15e9 * cores
    uses = m.num_moe_layers * m.top_k
    overhead = m.num_layers * coeffs.cpu_layer_overhead_s + coeffs.token_overhead_s
    if kernels:
        kernel = HQQ_CPU_OF_RAM * 4.0 * rate  # bytes/s
        if m.attn_bits in IN_PLACE_BITS:  # the dense bytes as stored, the head's bfloat16 halved
            dense_s = (m.dense_bytes - m.embed_bytes - m.head_params) / kernel
        elif m.attn_bits == 8:  # int8 copies of the attention and the head: a byte per weight
            dense_s = (m.dense_params - m.embed_params) / kernel
        else:
            dense_s = (m.active_params - uses * m.expert_params) / rate
        t = uses * m.expert_bytes / kernel + dense_s + overhead
        h, misses = 0.0, 0.0
    else:
        h = hit_rate(max(1, cpu_cache_experts(m)), m.num_experts, coeffs)
        misses = uses * (1.0 - h)
        t = (m.active_params + misses * m.expert_params * (coeffs.cpu_kernel_factor - 1)) / rate + overhead
    first = t + 2.0 * m.active_params * prompt_tokens / flops
    return {"tokens_per_s": 1.0 / t, "first_token_s": first, "hit_rate": h, "misses": misses,
            "bytes_h2d": 0.0, "bound": "cpu", "h2d_bytes_per_s": None}


def predict_hybrid(hw: dict, m: ModelSizes, k: int, coeffs: Coefficients = DEFAULT,
                   prefetch_depth: int = 1, extra_slot_layers: int = 0) -> dict:
    """predict_gpu's decode speed when each layer's misses are split between the link and the
    CPU by engine/runtime/placement.py's model (misses per layer binomial at the LRU hit rate). The CPU
    runs a quantized store's experts in place (it reads what the link would copy, at the HQQ
    kernel's speed) and a 16-bit store's from int4 copies, as the engine does by default, at the
    rate and host cost measured inside a decode (CPU_IN_DECODE_OF_ALONE, placement.CUDA_HAND_OFF_S)."""
    from math import comb

    from moeferry.engine.runtime import placement

    base = predict_gpu(hw, m, k, coeffs, prefetch_depth, extra_slot_layers=extra_slot_layers)
    ram = 4.0 * (hw.get("cpu_matvec_params_per_s") or 0.5e9 * (hw.get("cpu_cores_physical") or 2))
    stored = in_place(m)
    alone = (HQQ_CPU_OF_RAM if stored else CPU_INT4_OF_RAM) * ram
    costs = placement.Costs(link_gbps=base["h2d_bytes_per_s"] / 1e9, cpu_gbps=CPU_IN_DECODE_OF_ALONE * alone / 1e9,
                            gpu_expert_s=0.0, cpu_overhead_s=placement.CUDA_HAND_OFF_S)
    cpu_bytes = m.expert_bytes if stored else int(m.expert_params * CPU_INT4_BITS / 8)
    sizes = placement.ExpertSizes(m.expert_bytes, cpu_bytes, m.expert_params)
    miss = 1.0 - base["hit_rate"]
    per_layer = {n: comb(m.top_k, n) * miss ** n * (1 - miss) ** (m.top_k - n) for n in range(m.top_k + 1)}
    copy_only = sum(p * n * placement.copy_s(costs, sizes) for n, p in per_layer.items())
    hybrid = sum(p * placement.predicted_miss_s(costs, sizes, n, m.top_k - n)[1] for n, p in per_layer.items())
    t = 1.0 / base["tokens_per_s"] - m.num_layers * (copy_only - hybrid)
    return {"tokens_per_s": 1.0 / t, "cpu_bytes_per_s": costs.cpu_gbps * 1e9, "cpu_expert_bytes": sizes.cpu_bytes,
            "extra_ram_bytes": 0 if stored else m.all_expert_bytes * CPU_INT4_BITS / bits_per_param(m)}


# ---------------------------------------------------------------------------------------------
# Plans


def make_plan(hw: dict, model, vram_budget_bytes: int | None = None, *,
              coeffs: Coefficients = DEFAULT, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
              prefetch_depth: int = 1, prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
              cache_experts_per_layer: int | None = None, trace_hit_ratio: dict | None = None) -> Plan:
    """The plan for one model on this hardware: cache size, fit, predicted speed, verdict.

    `model` is a ModelSizes or a catalog entry dict. The cache gets what the VRAM budget
    (default: the engine's, from the free VRAM) leaves after the dense weights, the KV cache
    for `context_tokens` and the workspace: engine/runtime/vram.py's sizing, the engine's own.
    Routing: uniform (hit rate k/E) unless `trace_hit_ratio` gives a trace's own LRU hit ratios.
    """
    m = model if isinstance(model, ModelSizes) else ModelSizes.from_catalog(model)
    context_tokens = m.context(context_tokens)
    sizing = m.device_bytes(context_tokens)
    kv, headroom = sizing.kv_cache, sizing.kv_cache + sizing.workspace
    budget = vram_budget_bytes if vram_budget_bytes is not None else default_vram_budget(hw)
    ram_total = hw.get("ram_total_bytes")
    host_needed = m.all_expert_bytes + m.host_dense_bytes + HOST_RESERVE_BYTES
    common = dict(vram_budget_bytes=budget, expert_bits=m.expert_bits, kv_cache_bytes=kv,
                  headroom_bytes=headroom, workspace_bytes=sizing.workspace,
                  context_tokens=context_tokens, model=m.name)
    gib = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731

    gpu_reason = None
    if not has_cuda_gpu(hw):
        gpu_reason = ("an NVIDIA GPU is present but this PyTorch has no CUDA support"
                      if hw.get("gpu_name") else "no usable NVIDIA GPU was found")
    elif budget is None or sizing.slots(budget) < 1:
        gpu_reason = (f"the GPU's {gib(budget or 0)} budget is below the {gib(sizing.needed(1))} that the "
                      f"dense weights, KV cache, workspace and one cached expert per layer need")
    if gpu_reason:
        return _cpu_plan(hw, m, gpu_reason, coeffs, prompt_tokens, common)

    k = sizing.slots(budget)
    extra = sizing.extra_slot_layers(budget, k)  # the engine's: what the budget leaves after k a layer
    if cache_experts_per_layer is not None:
        k, extra = min(cache_experts_per_layer, m.num_experts), 0
    p = predict_gpu(hw, m, k, coeffs, prefetch_depth, prompt_tokens, trace_hit_ratio=trace_hit_ratio,
                    extra_slot_layers=extra)
    vram_needed = sizing.needed(k) + extra * m.expert_bytes
    ram_ok = ram_total is None or ram_total >= host_needed
    fits = vram_needed <= budget and ram_ok
    more = f" + {extra} more in the first layers" if extra else ""
    notes = [f"VRAM: {gib(m.gpu_dense_bytes)} dense weights + {k} x {m.num_moe_layers}{more} cached experts "
             f"({gib(k * sizing.per_slot + extra * m.expert_bytes)}) + headroom {gib(headroom)} (KV cache for "
             f"{context_tokens} tokens {gib(kv)}, workspace {gib(sizing.workspace)})."]
    if not ram_ok:
        verdict = (f"Not enough RAM: the model needs {gib(host_needed)} of host memory with the "
                   f"system's share, and this machine has {gib(ram_total)}; use fewer bits or the "
                   f"demo model.")
    elif k >= m.num_experts:
        verdict = (f"All experts fit on the GPU: about {p['tokens_per_s']:.1f} tokens/s, no "
                   f"offloading needed.")
    else:
        link = "host->GPU copies (PCIe)" if p["bound"] == "pcie" else "GPU compute"
        first = f" ({k + 1} in the first {extra} layers)" if extra else ""
        verdict = (f"Keep {k} expert{'s' if k != 1 else ''} per layer{first} on the GPU and the rest in "
                   f"RAM: about {p['tokens_per_s']:.1f} tokens/s, first token after about "
                   f"{p['first_token_s']:.1f}\u00a0s, limited by {link}.")  # no line break inside "0.6 s"
    hybrid = (predict_hybrid(hw, m, k, coeffs, prefetch_depth, extra) if k < m.num_experts and runs_on_cpu(m)
              else None)
    if hybrid is not None:
        ram_note = (f"int4 copies taking {gib(hybrid['extra_ram_bytes'])} more RAM" if hybrid["extra_ram_bytes"]
                    else "from the experts already in RAM")
        notes.append(f"With missed experts computed on the CPU too (--cpu-experts auto, {ram_note}): "
                     f"about {hybrid['tokens_per_s']:.1f} tokens/s.")
    return Plan(device="cuda", cache_experts_per_layer=k, extra_slot_layers=extra,
                predicted_tokens_per_s=p["tokens_per_s"],
                predicted_hybrid_tokens_per_s=hybrid["tokens_per_s"] if hybrid else None,
                predicted_first_token_s=p["first_token_s"], bound=p["bound"], verdict=verdict,
                fits=fits, hit_rate=p["hit_rate"], misses_per_token=p["misses"],
                bytes_h2d_per_token=p["bytes_h2d"], vram_needed_bytes=vram_needed,
                host_ram_needed_bytes=host_needed, h2d_bytes_per_s=p["h2d_bytes_per_s"],
                notes=notes, **common)


def _cpu_plan(hw: dict, m: ModelSizes, reason: str, coeffs: Coefficients, prompt_tokens: int,
              common: dict) -> Plan:
    p = predict_cpu(hw, m, coeffs, prompt_tokens)
    ram_total = hw.get("ram_total_bytes")
    needed = cpu_ram_bytes(m) + HOST_RESERVE_BYTES
    fits = ram_total is None or ram_total >= needed
    speed = p["tokens_per_s"]
    big = m.store_bytes > 4 * GiB
    verdict = f"Runs on the CPU because {reason}: about {_speed_words(speed)}"
    if not fits:
        verdict += (f", but the model needs {needed / GiB:.1f} GiB of RAM and this machine has "
                    f"{ram_total / GiB:.1f} GiB")
    verdict += ("; that is slow for full Mixtral, so start with the demo model." if big else ".")
    return Plan(device="cpu", cache_experts_per_layer=0, predicted_tokens_per_s=speed,
                predicted_first_token_s=p["first_token_s"], bound="cpu", verdict=verdict,
                fits=fits, hit_rate=p["hit_rate"], host_ram_needed_bytes=needed,
                notes=[cpu_note(m, coeffs)], **common)


def cpu_ram_bytes(m: ModelSizes) -> int:
    """RAM the CPU engine takes for the model: its stored experts, its dense weights as it
    computes with them and its expert cache's float32. With every expert on the kernel and the
    attention quantized, the dense weights stay at most as stored (generate.move_dense) but for
    the embedding, float32 (twice its stored bytes); otherwise all of them are float32, and so
    are the cached experts."""
    if on_cpu_kernels(m) and m.attn_bits in LOW_BIT_ATTN_BITS:
        return m.all_expert_bytes + m.dense_bytes + m.embed_bytes
    cache = cpu_cache_experts(m) * m.num_moe_layers * m.expert_params * 4
    return m.all_expert_bytes + 4 * m.dense_params + cache


def in_place(m: ModelSizes) -> bool:
    """Whether the model's experts run on a CPU kernel as stored: HQQ at 2-4 bits, or gpt-oss's
    MXFP4 kept as released (expert_bits 16 at 4.25 bits a weight)."""
    return m.expert_bits in IN_PLACE_BITS or (m.expert_bits == 16 and bits_per_param(m) < 16)


def runs_on_cpu(m: ModelSizes) -> bool:
    """Whether --cpu-experts can run the model's experts on the CPU: in place, or 16-bit ones
    from int4 copies (not HQQ at 8 bits, which no CPU kernel takes)."""
    return in_place(m) or bits_per_param(m) >= 16


def on_cpu_kernels(m: ModelSizes) -> bool:
    """Whether a CPU-only engine runs this model's experts on an in-place kernel (as
    generate.default_cpu_experts decides: in place, and too big for the CPU's expert cache)."""
    return in_place(m) and cpu_cache_experts(m) < m.num_experts


def cpu_note(m: ModelSizes, coeffs: Coefficients) -> str:
    """How predict_cpu priced this model, in one sentence."""
    if on_cpu_kernels(m):
        return (f"CPU speed estimated from the measured fp32 matrix-vector rate: the experts run on the CPU "
                f"kernel, reading {m.top_k} experts per layer"
                f"{' and the attention' if m.attn_bits in LOW_BIT_ATTN_BITS else ''} at {HQQ_CPU_OF_RAM:g} of "
                f"the RAM's read speed.")
    return ("CPU speed estimated from the measured fp32 matrix-vector rate, "
            f"{coeffs.cpu_kernel_factor:g}x for dequantizing an expert that is not "
            f"cached and {coeffs.cpu_layer_overhead_s * 1e3:g} ms per layer.")


def _speed_words(tokens_per_s: float) -> str:
    if tokens_per_s >= 1:
        return f"{tokens_per_s:.1f} tokens/s"
    per = 1 / tokens_per_s
    return f"{per:.0f} s per token" if per < 120 else f"{per / 60:.0f} minutes per token"


def recommend(plans: list[Plan], extra_cost: list[float] | None = None) -> int:
    """Index of the plan to recommend among variants of one model with different expert bits.

    Among the plans that fit: the most expert bits whose predicted speed is within
    SPEED_TOLERANCE of the fastest; ties go to the lowest `extra_cost` (for example the
    download size). When nothing fits: the plan needing the least memory.
    """
    cost = extra_cost or [0.0] * len(plans)
    fitting = [i for i, p in enumerate(plans) if p.fits]
    if not fitting:
        return min(range(len(plans)), key=lambda i: (plans[i].host_ram_needed_bytes, cost[i]))
    fastest = max(plans[i].predicted_tokens_per_s for i in fitting)
    good = [i for i in fitting if plans[i].predicted_tokens_per_s >= SPEED_TOLERANCE * fastest]
    return max(good, key=lambda i: (plans[i].expert_bits or 0, -cost[i]))


# ---------------------------------------------------------------------------------------------
# Calibration against measured runs


def predict_observation(obs: dict, coeffs: Coefficients) -> float:
    """Predicted tokens/s for one measured run: {"hw", "model", "cache_experts_per_layer",
    "prefetch_depth"?, "measured_hit_rate"?, "device"?} (the form fit_coefficients takes)."""
    m = obs["model"] if isinstance(obs["model"], ModelSizes) else ModelSizes.from_catalog(obs["model"])
    if obs.get("device") == "cpu":
        return predict_cpu(obs["hw"], m, coeffs)["tokens_per_s"]
    return predict_gpu(obs["hw"], m, obs["cache_experts_per_layer"], coeffs,
                       obs.get("prefetch_depth", 1), obs.get("prompt_tokens", DEFAULT_PROMPT_TOKENS),
                       obs.get("measured_hit_rate"), obs.get("trace_hit_ratio"))["tokens_per_s"]


FIT_NAMES = ("gpu_layer_overhead_s", "gpu_kernel_efficiency", "miss_overhead_s",
             "overlap_efficiency", "token_overhead_s")


# Shares, fitted in (0, 1]; every fitted coefficient stays in [_FIT_MIN, _FIT_MAX], and one
# driven to _FIT_MIN is effectively 0.
_UNIT_NAMES = ("prefetch_recall", "overlap_efficiency", "gpu_kernel_efficiency", "pcie_efficiency")
_FIT_MIN, _FIT_MAX = 1e-12, 1e6


def log_errors(observations: list[dict], c: Coefficients) -> list[float]:
    """log(predicted / measured) per run with "measured_tokens_per_s"."""
    return [math.log(predict_observation(o, c) / o["measured_tokens_per_s"]) for o in observations]


def rms(values: list[float]) -> float:
    return math.sqrt(sum(e * e for e in values) / len(values))


def fit_coefficients(observations: list[dict], names: tuple[str, ...] = FIT_NAMES,
        start: Coefficients = DEFAULT, rounds: int = 200) -> tuple[Coefficients, float]:
    """Refit `names` to runs with "measured_tokens_per_s"; returns (coefficients, RMS log error).

    Levenberg-Marquardt on the log errors, in log space of the coefficients (so they stay
    positive; the shares in `_UNIT_NAMES` also stay at most 1), with a numerical Jacobian.
    The cost model has kinks (the max of hidden transfer and compute) and nearly collinear
    coefficients (per-layer and per-token overhead), and a coefficient at 0 cannot move in log
    space, so it starts from several points: `start`; `start` with its zero coefficients taken
    from PAPER_CODE (or DEFAULT); PAPER_CODE's and DEFAULT's values of `names`; and 8 spreads of
    each coefficient e^1.5 up or down. A short run from each, the best two to convergence,
    then any coefficient driven to ~0 is kicked back up while that helps. The result is never
    worse than `start`. `rounds` bounds the iterations of one run (0: `start` and its error).
    Pure Python; about 0.1 s for a few dozen runs and 5 names.
    """
    def residuals(c: Coefficients) -> list[float]:
        return log_errors(observations, c)

    best, best_loss = start, rms(residuals(start))
    if rounds <= 0 or not names or not observations:
        return best, best_loss
    seeds = [start]
    for source in (PAPER_CODE, DEFAULT):
        seeds.append(replace(start, **{n: getattr(start, n) if getattr(start, n) > 0 else getattr(source, n)
                                       for n in names}))
        seeds.append(replace(start, **{n: getattr(source, n) for n in names}))
    # and spreads around them: each coefficient e^1.5 up or down, in 8 sign patterns
    middle = seeds[1]
    for row in range(1, 9):
        signs = [1 if bin(row & (j + 1)).count("1") % 2 else -1 for j in range(len(names))]
        seeds.append(replace(middle, **{n: getattr(middle, n) * math.exp(1.5 * s)
                                        for n, s in zip(names, signs)}))
    # A short run from every seed, then the best two run to convergence.
    runs, tried = [], []
    for seed in seeds:
        theta = [math.log(min(max(getattr(seed, n), _FIT_MIN), 1.0 if n in _UNIT_NAMES else _FIT_MAX))
                 for n in names]
        if theta not in tried:
            tried.append(theta)
            runs.append(_levenberg_marquardt(residuals, rms, start, names, theta, min(rounds, 10)))
    for c, _ in sorted(runs, key=lambda r: r[1])[:2]:
        theta = [math.log(max(getattr(c, n), _FIT_MIN)) for n in names]
        c, loss = _levenberg_marquardt(residuals, rms, start, names, theta, rounds)
        if loss < best_loss:
            best, best_loss = c, loss
    # A coefficient driven to ~0 cannot come back in log space: kick it back to its largest
    # seed value and go on from there while that helps.
    for _ in range(len(names)):
        stuck = [n for n in names if getattr(best, n) < 1e3 * _FIT_MIN]
        if not stuck:
            break
        kicked = replace(best, **{n: max(getattr(s, n) for s in seeds) for n in stuck})
        theta = [math.log(max(getattr(kicked, n), _FIT_MIN)) for n in names]
        c, loss = _levenberg_marquardt(residuals, rms, start, names, theta, rounds)
        if loss >= best_loss - 1e-12:
            break
        best, best_loss = c, loss
    return best, best_loss


def _levenberg_marquardt(residuals, rms, base: Coefficients, names: tuple[str, ...],
                         theta: list[float], rounds: int) -> tuple[Coefficients, float]:
    lo = math.log(_FIT_MIN)
    hi = [0.0 if n in _UNIT_NAMES else math.log(_FIT_MAX) for n in names]

    def at(th: list[float]) -> Coefficients:
        return replace(base, **{n: math.exp(t) for n, t in zip(names, th)})

    theta = [min(max(t, lo), h) for t, h in zip(theta, hi)]
    c = at(theta)
    r = residuals(c)
    loss = rms(r)
    lam, n, eps = 1e-2, len(names), 1e-6
    for _ in range(rounds):
        if loss < 1e-9:
            break
        jac = []  # columns: d residuals / d theta_j, one-sided away from the upper bound
        for j in range(n):
            h = eps if theta[j] + eps <= hi[j] else -eps
            th = list(theta)
            th[j] += h
            jac.append([(a - b) / h for a, b in zip(residuals(at(th)), r)])
        a = [[sum(x * y for x, y in zip(jac[i], jac[j])) for j in range(n)] for i in range(n)]
        g = [sum(x * y for x, y in zip(jac[i], r)) for i in range(n)]
        improved, gain = False, 0.0
        while lam < 1e8:
            damped = [[a[i][j] + (lam * (a[i][i] + 1e-9) if i == j else 0.0) for j in range(n)]
                      for i in range(n)]
            step = _solve(damped, [-x for x in g])
            trial = [min(max(t + d, lo), h) for t, d, h in zip(theta, step, hi)]
            trial_c = at(trial)
            trial_r = residuals(trial_c)
            trial_loss = rms(trial_r)
            if trial_loss < loss:
                gain = loss - trial_loss
                theta, c, r, loss, improved = trial, trial_c, trial_r, trial_loss, True
                lam = max(lam / 3, 1e-12)
                break
            lam *= 4
        if not improved or gain < 1e-6 * loss:  # converged, or crawling along a kink
            break
    return c, loss


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a small dense system); 0 for a null pivot."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(m[i][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for i in range(col + 1, n):
            f = m[i][col] / m[col][col]
            for j in range(col, n + 1):
                m[i][j] -= f * m[col][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        if abs(m[i][i]) < 1e-300:
            continue
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


MIXTRAL_8X7B_CONFIG = {
    "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
    "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 32000,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
}


def paper_calibration() -> list[dict]:
    """Measured runs the defaults were fitted to (2-bit experts, 4-bit attention).

    H200 rows: the paper's released code, random weights and random routing (so the hit
    rate is k/8), pinned 55 GB/s, HBM 4.8 TB/s. Table 2 rows: the paper, real
    routing (its Figure 2 hit ratios, PAPER_LRU_HIT_RATIO); cache sizes (4 on 16 GB cards and the A100, 2 on the 12 GB RTX 3060) and
    link rates (PCIe 4: 20-25 GB/s, T4 on PCIe 3: 11 GB/s) are our assumptions.
    """
    m = ModelSizes.from_config(MIXTRAL_8X7B_CONFIG, 2, 4, name="Mixtral-8x7B 2-bit")
    hw = lambda h2d, mem: {"gpu_name": "calibration", "h2d_bytes_per_s": h2d,  # noqa: E731
                           "gpu_mem_bandwidth_bytes_per_s": mem}
    rows = [dict(hw=hw(55e9, 4.8e12), model=m, cache_experts_per_layer=k, measured_hit_rate=k / 8,
                 measured_tokens_per_s=t, source="paper code on H200")
            for k, t in ((3, 4.23), (4, 4.83), (8, 7.86))]
    rows += [dict(hw=hw(h2d, mem), model=m, cache_experts_per_layer=k, measured_tokens_per_s=t,
                  trace_hit_ratio=PAPER_LRU_HIT_RATIO, source=f"paper Table 2, {gpu}")
             for gpu, h2d, mem, k, t in (("A100", 25e9, 1.555e12, 4, 3.061),
                                         ("RTX 3080 Mobile", 20e9, 448e9, 4, 2.655),
                                         ("RTX 3060", 20e9, 360e9, 2, 2.278),
                                         ("T4", 11e9, 320e9, 4, 2.092))]
    return rows
