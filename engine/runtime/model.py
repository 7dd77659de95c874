"""The MoE forward with offloaded experts, batch 1, read top to bottom.

forward -> layer (written once) -> attention block / experts (host: dispatch) -> head; then the
eager operations, EagerOps, the per-layer weights, norm and RoPE helpers.
A layer is a few device segments handed to `run(key, fn)` and, for a MoE layer, the host part
between them (routing sync, cache, the CPU hybrid, prefetch: engine/runtime/prefetch.py). It runs on a
set of operations (norm, attention, router, experts): EagerOps here, the fused ones of
engine/kernels/decode.py, or, for a lone token on the CPU, those of engine/kernels/decode_cpu.py;
the CUDA-graph decode (engine/runtime/decode_graphs.py) runs this same layer and captures its
segments. Its buffers are a Step.
Attention, norms, routers and the LM head live on the compute device; experts come from the
ExpertCache (engine/runtime/expert_cache.py), which copies them in from host memory when they miss.
The token embedding lives on the device too, unless it is not tied to the LM head on a GPU: then
it stays in host memory (generate.embedding_on_host) and embed_into copies the tokens' rows in
before layer 0.
The maths follows transformers exactly (Mixtral's router: softmax in float32, top-k,
renormalised; experts summed in ascending index order), which the tests check.

One layer definition serves every family (ModelConfig.family, SUPPORTED_FAMILIES in
engine/storage/store.py); their differences are named options of ModelConfig:
  mixtral    the defaults
  qwen3_moe  RMSNorm of q and k per head; norm_topk_prob; dense MLP layers (mlp_only_layers,
             decoder_sparse_step) that have no experts
  olmoe      RMSNorm of q and k over the whole projection, clip_qkv; norm_topk_prob false
  qwen2_moe  q/k/v biases; a shared expert, always resident, gated by sigmoid(h . gate)
  gpt_oss    biases everywhere; attention sinks; per-layer sliding windows; the router's
             softmax over its top-k logits (+ bias); clamped SwiGLU experts with biases; YaRN
A layer is a dict (layer_weights) of its weights by role and of the options its functions
read: "mlp" for a dense layer, else "router" and "moe_index" (its row in the expert cache and
the store: experts() keeps both, dispatch() takes that row), "routing", "window",
"qk_norm", "clip_qkv", "sinks", "shared" where the family has them. Absent keys mean Mixtral's.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeferry.engine.kernels import hqq_cpu, hqq_gpu
from moeferry.engine.kernels.hqq_gpu import qlinear
from moeferry.engine.kernels.int8_gpu import Int8Rows
from moeferry.engine.kernels.mxfp4_gpu import mxfp4_linear
from moeferry.engine.kernels.torch_cpu import CpuMatrix
from moeferry.engine.runtime.expert_cache import SERIALS
from moeferry.engine.runtime.prefetch import Prefetcher
from moeferry.engine.storage.mxfp4 import Mxfp4Matrix

ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# A prompt's experts run one at a time cost the host about 0.3 ms each (Qwen3-30B-A3B, every
# expert resident on an H100: 1.8-3.1 s to the first token of a 128-token prompt, 48 x 128
# expert calls). Grouped (prompt_experts), each token reads its experts, as decoding it would;
# that wins while those reads take less than the calls' host time, at a gaming card's bandwidth.
PROMPT_HOST_S_PER_EXPERT = 0.3e-3
PROMPT_DEVICE_BYTES_PER_S = 400e9


@dataclass
class ModelConfig:
    """The model's shape and its family's options, from the Hugging Face config.json.

    The defaults are Mixtral's layer; each other family (model_type) sets a few named options
    (family_options below). intermediate_size is the routed experts' FFN width.
    """
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    sliding_window: int | None
    tie_word_embeddings: bool
    family: str = "mixtral"
    moe_layers: tuple[int, ...] | None = None  # layers with routed experts; None = all
    dense_intermediate_size: int = 0  # FFN of the other (dense MLP) layers
    shared_expert_size: int = 0  # FFN of the always-resident shared expert; 0 = none (qwen2_moe)
    qk_norm: str = "none"  # "head": RMSNorm per head (qwen3_moe); "full": over the projection (olmoe)
    clip_qkv: float | None = None  # olmoe: q, k, v clamped to +-clip_qkv
    attn_biases: tuple[str, ...] = ()  # attention projections that have a bias
    sinks: bool = False  # gpt_oss: a learned per-head logit that takes part in attention's softmax
    layer_windows: tuple[int | None, ...] | None = None  # per-layer sliding window; None = sliding_window
    router: str = "softmax_topk"  # or "topk_softmax": softmax over the selected logits (gpt_oss)
    router_bias: bool = False
    norm_topk_prob: bool = True  # renormalise the top-k weights (softmax_topk only)
    expert_act: str = "silu"  # or "clamped_swiglu" (gpt_oss: biases, clamp, (up + 1) * glu)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rope_scaling: dict | None = None  # rope_parameters of a non-default rope type (gpt_oss: yarn)
    expert_units: int = 1  # > 1: each routed expert is this many units (engine/runtime/expert_units.py);
    # num_experts, top_k and intermediate_size are then the units', the router's are divided by it

    @classmethod
    def from_hf(cls, c: dict) -> "ModelConfig":
        rope = rope_parameters(c)
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c.get("moe_intermediate_size") or c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            num_experts=c.get("num_local_experts") or c["num_experts"], top_k=c["num_experts_per_tok"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 1e6)),
            max_position_embeddings=c.get("max_position_embeddings", 32768),
            sliding_window=c.get("sliding_window") if c.get("model_type", "mixtral") == "mixtral" else None,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            **family_options(c),
        )

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return self.moe_layers if self.moe_layers is not None else tuple(range(self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        """Layers that hold experts: the expert cache's and the store's layer count."""
        return len(self.moe_layer_ids)


def family_options(c: dict) -> dict:
    """The ModelConfig options of one family, read from its config.json (see the fields)."""
    kind, layers = c.get("model_type", "mixtral"), c["num_hidden_layers"]
    o: dict = {"family": kind}
    if kind in ("qwen3_moe", "qwen2_moe"):
        step, dense = c.get("decoder_sparse_step") or 1, set(c.get("mlp_only_layers") or ())
        o["moe_layers"] = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        o["dense_intermediate_size"] = c["intermediate_size"]
    if kind in ("qwen3_moe", "qwen2_moe", "olmoe"):
        o["norm_topk_prob"] = bool(c.get("norm_topk_prob", False))
    if kind == "qwen3_moe":
        o["qk_norm"] = "head"
    if kind == "olmoe":
        o["qk_norm"], o["clip_qkv"] = "full", c.get("clip_qkv")
    if kind == "qwen2_moe":
        o["shared_expert_size"] = c.get("shared_expert_intermediate_size") or 0
        o["attn_biases"] = ATTN_PROJECTIONS[:3] if c.get("qkv_bias", True) else ()
    elif c.get("attention_bias"):
        o["attn_biases"] = ATTN_PROJECTIONS
    if kind == "gpt_oss":
        o.update(sinks=True, router="topk_softmax", router_bias=True, expert_act="clamped_swiglu",
                 swiglu_alpha=c.get("swiglu_alpha", 1.702), swiglu_limit=c.get("swiglu_limit", 7.0))
    types = c.get("layer_types") or default_layer_types(c, kind, layers)
    if types and c.get("sliding_window"):
        o["layer_windows"] = tuple(c["sliding_window"] if t == "sliding_attention" else None for t in types)
    elif kind == "qwen3_moe" and c.get("use_sliding_window") and c.get("sliding_window"):
        o["layer_windows"] = (c["sliding_window"],) * layers
    rope = rope_parameters(c)
    if rope.get("rope_type", "default") != "default":
        o["rope_scaling"] = rope
    return o


def default_layer_types(c: dict, kind: str, layers: int) -> list[str] | None:
    """The layer_types transformers' config class fills in where config.json has none: gpt_oss
    slides on every other layer from the first, qwen2_moe (with use_sliding_window) on every
    other one below max_window_layers. None for the other families (one kind of layer)."""
    if kind == "gpt_oss":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if kind == "qwen2_moe" and c.get("use_sliding_window"):
        below = c.get("max_window_layers", 28)
        return ["sliding_attention" if i % 2 == 0 and i < below else "full_attention" for i in range(layers)]
    return None


def rope_parameters(c: dict) -> dict:
    """config.json's RoPE settings as transformers 5 reads them: rope_parameters, or in a config
    written before it (gpt-oss's and Qwen's on the Hub) rope_scaling (whose rope_type may be
    spelled "type") with rope_theta beside it. TypeError when one of them is not a mapping."""
    rope = c.get("rope_parameters")
    if not rope:
        rope = c.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise TypeError("rope_scaling is not a mapping")
        rope = dict(rope)
        if c.get("rope_theta") is not None:
            rope.setdefault("rope_theta", c["rope_theta"])
    if not isinstance(rope, dict):
        raise TypeError("rope_parameters is not a mapping")
    rope = dict(rope)
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    return rope


class KVCache:
    """Keys and values for positions [0, capacity), written in place."""

    def __init__(self, cfg: ModelConfig, capacity: int, device, dtype):
        shape = (cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.serial = next(SERIALS)

    @staticmethod
    def nbytes(cfg: ModelConfig, capacity: int, dtype) -> int:
        return 2 * cfg.num_layers * capacity * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


@dataclass
class Step:
    """The tensors one forward's layers read and write in place (see OffloadedMixtral.layer).

    The eager forward makes one per call, for its T tokens. GraphedDecode keeps one for a single
    token for its whole life: its graphs bake in these addresses, and the token's position is a
    device tensor (pos) so that a graph replays at any position.
    """
    tokens: torch.Tensor  # [T]
    x: torch.Tensor  # the residual stream [T, H]
    hn: torch.Tensor  # attention's input (normed) [T, H]; scratch of the prefetch guesses
    h: torch.Tensor  # the FFN's input (normed) [T, H]
    out: torch.Tensor  # the last FFN's output [T, H], added to x by the next layer or the head
    weights: torch.Tensor  # the current MoE layer's routing weights, float32 [T, k]
    ids: torch.Tensor  # every MoE layer's routed experts [MoE layers, T, k] (a view of picks)
    guesses: torch.Tensor  # each MoE layer's prefetch guesses [MoE layers, D, k] (last token; of picks)
    picks: torch.Tensor  # [MoE layers, T + D, k]: a layer's ids, then its guesses, read in one go
    cos: torch.Tensor  # RoPE at the T positions [T, 1, D]; with pos, the table [P, 1, D]
    sin: torch.Tensor
    start: int = 0  # the first token's position (eager)
    pos: torch.Tensor | None = None  # [1] on the device: the one token's position (CUDA graphs)
    span: int = 0  # with pos: the cached positions an eager attention reads
    resident: bool = False  # MoE layers have no host part: every expert on the device, or the misses streamed
    fetch: bool = False  # with resident (streaming): the next MoE layer's guessed misses fetched ahead (FusedOps.fetch_ahead)
    # a forced routing over the router's, for the graphs: (weights, ids) [MoE layers, k], guesses
    # [MoE layers, D, k], copied in each MoE layer's attention segment (GraphedDecode fills them)
    forced: tuple | None = None


@dataclass
class LayerTimes:
    """One MoE layer of a decoded token on the host clock (OffloadedMixtral.timeline): its routing
    read (the layer's sync: the device has done everything queued before), and the host done
    with the layer (its device work and copies queued, its CPU experts computed and added). The
    device's time shows in the next layer's sync."""
    layer: int
    copied: int  # experts that missed and were copied for this layer
    on_cpu: int  # experts computed on the CPU
    routed: float
    done: float
    kernel: float = 0.0  # seconds of routed..done the CPU experts were computed (the rest: the host's Python)
    phases: dict | None = None  # seconds of routed..done by dispatch's step (HOST_PHASES), "cpu" = kernel


# dispatch's steps on the host after its one read of the routing and guesses, in order: the
# CPU's choice, h sent down, the copies (and an expert at a time's device work) queued, the
# device's experts queued at once, the cache's slots released and the prefetches queued, the
# CPU experts computed, their sum sent up and added
HOST_PHASES = ("choose", "down", "queue", "device", "release", "cpu", "up")


def token_routes(ids_host: list[list[int]], device) -> dict:
    """A prompt's routing [T, k], read on the host -> expert: (its tokens, their top-k positions)
    as index tensors on the device, tokens ascending, in one upload for the layer (a nonzero
    per expert would wait for the device once per expert: 128 times a layer for Qwen3)."""
    by_expert: dict[int, tuple[list, list]] = {}
    for t, row in enumerate(ids_host):
        for k, e in enumerate(row):
            rows, pos = by_expert.setdefault(e, ([], []))
            rows.append(t)
            pos.append(k)
    flat = [v for rows, pos in by_expert.values() for v in rows + pos]
    index = torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)
    routes, at = {}, 0
    for e, (rows, _) in by_expert.items():
        n = len(rows)
        routes[e] = (index[at:at + n], index[at + n:at + 2 * n])
        at += 2 * n
    return routes


def run_now(key: tuple, fn) -> None:
    """The eager forward's `run`: a device segment runs when the layer reaches it."""
    fn()


class OffloadedMixtral:
    def __init__(self, cfg: ModelConfig, dense: dict, cache, device, dtype, kernels: str = "auto"):
        self.cfg, self.cache, self.device, self.dtype, self.kernels = cfg, cache, device, dtype, kernels
        self.prefetcher = Prefetcher()
        self.kv: KVCache | None = None
        self.trace: list | None = None  # set to a list to record routing per decoded token
        self.timeline: list | None = None  # set to a list to record each MoE layer's host times (LayerTimes)
        self.routing = None  # engine/measure/routing.py: forces (or records) the router's choice
        self.graphs = None  # CUDA-graph decode, set by engine/runtime/decode_graphs.py use_cuda_graphs()
        self.hybrid = None  # engine/cpu_experts.CpuExperts: misses computed on the CPU, or None
        # decode reads the experts the cache lacks where they lie in host memory, the whole token
        # one CUDA graph (decode_graphs.STREAM_MISSES); the cache keeps what the prompt left in it
        self.stream_misses = False
        self.embed = dense["model.embed_tokens.weight"]
        self.embed_on_host = self.embed.device.type != device.type
        # a decoded token's row, page-locked so that its copy to the GPU does not wait
        self.staging = (torch.empty(1, cfg.hidden_size, dtype=self.embed.dtype, pin_memory=True)
                        if self.embed_on_host and device.type == "cuda" else None)
        self.staged = torch.cuda.Event() if self.staging is not None else None  # its last copy
        self.norm = dense["model.norm.weight"]
        self.lm_head = dense.get("lm_head.weight", self.embed)
        self.layers = [layer_weights(cfg, dense, i) for i in range(cfg.num_layers)]
        self.moe_layers = [layer for layer in self.layers if "router" in layer]  # by moe_index
        self.inv_freq, self.rope_scale = rope_frequencies(cfg, device)
        self.rope_long = long_rope(cfg, device)
        self.ops = EagerOps(self)
        self.decode_ops = self.ops  # a lone token's, outside CUDA graphs (decode_cpu.use_compiled_decode)
        self.grouped_prompt_kernel: bool | None = None  # prompt_grouped's test of the cache's format, once
        if isinstance(self.lm_head, Int8Rows):  # its kernel tried once; on failure cuBLAS on dequantized blocks
            x = torch.zeros(1, self.lm_head.cols, device=device, dtype=dtype)
            self.lm_head.kernel = self.fast_path_works(lambda: self.lm_head.matmul(x), "the int8 LM head's kernel")

    @property
    def prefetch_depth(self) -> int:
        return self.prefetcher.depth

    @prefetch_depth.setter
    def prefetch_depth(self, depth: int) -> None:
        self.prefetcher.depth = depth

    def setup_kv(self, capacity: int) -> None:
        """Allocate the KV cache; a no-op when the current one is big enough.

        Grows in steps of 256 positions and keeps what it holds (reused prompt prefixes).
        """
        if self.kv is not None and self.kv.capacity >= capacity:
            return
        old, self.kv = self.kv, None
        self.kv = KVCache(self.cfg, -(-capacity // 256) * 256, self.device, self.dtype)
        if old is not None:
            self.kv.k[:, :old.capacity] = old.k
            self.kv.v[:, :old.capacity] = old.v

    def rope(self, pos: torch.Tensor, each: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin [T, 1, D] at positions pos [T] of one forward or, each, of each
        position decoded alone (the CUDA graphs' table). LongRoPE (rope_long) takes its long
        factors for a forward that reaches past original_max_position_embeddings, as
        transformers' dynamic_rope_update does: its last position decides, for every token of it."""
        cos, sin = rope_cos_sin(self.inv_freq, pos, self.dtype, self.rope_scale)
        if self.rope_long is None:
            return cos, sin
        inv, scale, original = self.rope_long
        long_cos, long_sin = rope_cos_sin(inv, pos, self.dtype, scale)
        past = (pos if each else pos.max()).view(-1, 1, 1) + 1 > original
        return torch.where(past, long_cos, cos), torch.where(past, long_sin, sin)

    def new_step(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **options) -> Step:
        """The buffers of one forward of these tokens (options: Step's last fields)."""
        cfg, T, dev = self.cfg, tokens.shape[0], self.device
        x = torch.zeros(T, cfg.hidden_size, dtype=self.dtype, device=dev)
        moe = max(1, cfg.num_moe_layers)
        picks = distinct_ids((moe, T + moe - 1, cfg.top_k), dev)  # guesses reach at most the last layer
        return Step(tokens, x, torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(x),
                    torch.zeros(T, cfg.top_k, dtype=torch.float32, device=dev),
                    picks[:, :T], picks[:, T:], picks, cos, sin, **options)

    # -- one forward, top to bottom ---------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, last_only: bool = True) -> torch.Tensor:
        """tokens [T] at positions start..start+T-1 -> logits [T or 1, vocab] (float32).

        One token with self.graphs goes through the same layers as CUDA graphs (GraphedDecode.step).
        """
        T = tokens.shape[0]
        if T == 1 and self.graphs is not None:
            return self.graphs.step(tokens, start)
        if self.graphs is not None:
            self.graphs.fence()
        tokens = tokens.to(self.device)
        pos = torch.arange(start, start + T, device=self.device)
        s = self.new_step(tokens, *self.rope(pos), start=start)
        if self.embed_on_host:
            self.embed_into(s)
        if self.routing is not None:
            self.routing.begin(T)
        step = [] if self.trace is not None and T == 1 else None
        ops = self.decode_ops if T == 1 else self.ops
        for i in range(self.cfg.num_layers):
            self.layer(i, s, ops, run_now, step)
        if step is not None:
            self.trace.append(step)
        return self.head(s, ops, last_only)

    def decode_greedy(self, token: int, start: int, n: int) -> Iterator[int]:
        """The n tokens that greedy decoding makes after `token` (at position start): on the graphs'
        loop that runs ahead of the host where it can (GraphedDecode.decode_greedy), else one
        forward a token, the token sent from the host."""
        if self.graphs is not None and self.graphs.can_run_ahead():
            yield from self.graphs.decode_greedy(token, start, n)
            return
        for i in range(n):
            token = int(self.forward(torch.tensor([token]), start + i)[-1].argmax())
            yield token

    def runs_ahead(self) -> bool:
        """Whether decode_greedy runs ahead of the host (GraphedDecode.can_run_ahead)."""
        return self.graphs is not None and self.graphs.can_run_ahead()

    def take_trace(self) -> list:
        """The routing traced since self.trace was set to a list, one entry per decoded token (a
        (chosen experts, experts in place) pair per MoE layer); tracing stops. A one-graph token's
        choice stayed on the device until now (GraphedDecode.step), so no token waited to read it."""
        steps = [[(tuple(ids), held) for ids, held in zip(step[0].tolist(), step[1])] if isinstance(step, tuple)
                 else step for step in self.trace or []]
        self.trace = None
        return steps

    def layer(self, i: int, s: Step, ops, run=run_now, step: list | None = None) -> None:
        """Layer i on s's buffers, with the operations `ops` (EagerOps here; the fused ones of
        engine/kernels/decode.py in the CUDA-graph decode).

        The layer is a few device segments, each handed to run(key, fn): the eager forward runs
        fn at once, GraphedDecode captures it once as a CUDA graph and replays it. Between them,
        the host part of a MoE layer (experts) reads the routing and fetches the experts. The
        FFN's output stays in s.out until the next layer adds it (so one fused kernel adds and
        norms); step, when a list, gets this layer's routing (the trace).
        """
        layer = self.layers[i]
        key = ("attention", i, ops.span(layer, s), s.forced is not None)
        run(key, lambda: self.attention_block(i, layer, s, ops))
        if "mlp" in layer:  # a dense layer: no experts
            run(("mlp", i), lambda: s.out.copy_(self.expert(layer["mlp"], s.h)))
        else:
            self.experts(i, layer, s, ops, run, step)
        if "shared" in layer:
            run(("shared", i), lambda: self.shared_expert(layer, s))

    def embed_into(self, s: Step, ids: torch.Tensor | None = None) -> None:
        """x = the tokens' embeddings, from an embedding in host memory (embed_on_host): the rows
        gathered on the host and copied to the device before layer 0, outside any CUDA graph. A
        decoded token's row goes through the pinned staging row without the host waiting for the
        copy; the row is written again once that copy has run (self.staged, recorded after it).
        ids: the tokens on the host, else s.tokens is read (which waits for the device)."""
        ids = s.tokens.cpu() if ids is None else ids
        one = self.staging is not None and ids.numel() == 1
        staged = self.staged if one else None  # None also for the tests' staging row on the CPU
        if staged is not None:
            staged.synchronize()  # at once when the last token's logits were read since
        rows = torch.index_select(self.embed, 0, ids, out=self.staging) if one else F.embedding(ids, self.embed)
        s.x.copy_(rows, non_blocking=one)
        if staged is not None:
            staged.record()

    def attention_block(self, i: int, layer: dict, s: Step, ops) -> None:
        """Layer i up to its FFN (a device segment): x += the last FFN's output (layer 0: x = the
        embeddings, unless embed_into wrote them already); x += attention(norm(x)); h = norm(x);
        for a MoE layer, the router's choice into s.ids and the prefetch guesses into s.guesses."""
        if i == 0 and not self.embed_on_host:
            s.x.copy_(F.embedding(s.tokens, self.embed))
        ops.add_norm(s.x, s.out if i > 0 else None, layer["attn_norm"], s.hn)
        ops.add_norm(s.x, ops.attention(i, layer, s), layer["moe_norm"], s.h, ops.o_bias(layer))
        if "router" in layer:
            mi = layer["moe_index"]
            if s.forced is None:
                ops.route(layer, s.h, s.weights, s.ids[mi])
            else:
                weights, ids, guesses = s.forced
                ops.route_forced(layer, s.h, s.weights, s.ids[mi], (weights[mi:mi + 1], ids[mi:mi + 1]))
            if not s.resident or s.fetch:
                self.prefetcher.guess(self, ops, mi, s)
            if s.forced is not None and (pending := self.prefetcher.pending(self, mi, s)) is not None:
                pending.copy_(guesses[mi, :pending.shape[0]])
            if s.fetch:
                ops.fetch_ahead(mi, s)
            if not ops.grouped:  # the experts are added to out one by one (grouped: written whole)
                s.out.zero_()

    def experts(self, i: int, layer: dict, s: Step, ops, run, step: list | None) -> None:
        """Layer i's routed experts into s.out. The host part: read the routing (the layer's one
        sync, in dispatch), fetch the experts through the cache, run them (a device segment each,
        or one for all with ops.grouped) and prefetch. With ops.hits_first (and no CPU experts)
        the grouped launch of the experts in place comes before that read (hits_first). With
        every expert resident (s.resident, the one-graph token) there is no host part: the
        grouped kernel reads the slot table."""
        mi = layer["moe_index"]
        ids = s.ids[mi]
        if s.resident:
            ops.experts(mi, s, ids)
            return
        if ops.hits_first and self.hybrid is None and (self.routing is None or s.forced is not None):
            self.hits_first(i, s, ops, run, step)
            return
        guesses = self.prefetcher.pending(self, mi, s)
        if self.routing is not None and s.forced is None:  # else the attention segment wrote it
            self.force_routing(mi, s, ids, guesses)
        picks = s.picks[mi, :ids.shape[0] + (0 if guesses is None else guesses.shape[0])]
        if self.prompt_grouped(ids.shape[0]):
            run(("prompt", i), lambda: self.prompt_experts(mi, s, picks))
            return
        io = (s.h, s.weights, s.out)  # for experts run on the CPU (self.hybrid)
        if ops.grouped:
            self.dispatch(mi, picks, ids.shape[0], step, add_all=lambda at: self.grouped_experts(i, s, ops, run, at),
                          io=io)
        else:
            def add_expert(w: dict, slot: int, e: int, k) -> None:
                run(("expert", i, slot, k if isinstance(k, int) else None), lambda: self.add_expert(w, s, e, k))

            self.dispatch(mi, picks, ids.shape[0], step, add_expert, io=io)

    def dispatch(self, i: int, picks: torch.Tensor, T: int, step: list | None,
                 add_expert=None, add_all=None, io: tuple | None = None) -> None:
        """Fetch the routed experts through the cache and run them; then prefetch the guesses.

        picks [T + D, k] device: the T tokens' routing, then the guesses for layers i+1..i+D.
        The one host sync per layer happens here: one read of both decides what to copy.
        Either add_expert(w, slot, e, k) runs one expert at a time (k: its top-k position for
        one token, else token_routes' tokens and positions), or add_all(positions) runs
        the experts at those top-k positions at once once they are in place (the device reads
        their slots from the cache's device table). With self.hybrid, io = (h, weights, out) of
        the layer: the experts it picks run on the CPU meanwhile and are added to out before
        returning. The host computes them once it has queued everything else of the layer (the
        link's copies, the device's experts, which wait for their copies on the device, and the
        prefetches): the link and the device work while the CPU does, and only the CPU's sum
        is left to send up and add after it.
        """
        rows = picks.tolist()
        routed = time.perf_counter()
        marks = [("routed", routed)] if self.timeline is not None else None

        def mark(phase: str) -> None:  # the host clock at the end of each step, for the timeline
            if marks is not None:
                marks.append((phase, time.perf_counter()))

        ids_host, guesses_host = rows[:T], rows[T:]
        needed = sorted({e for row in ids_host for e in row})
        resident = set(self.cache.lru[i]) if self.timeline is not None else set()
        if step is not None:
            step.append((tuple(ids_host[0]), self.cache.resident(i)))
        on_cpu, both, job = {}, [], None
        if self.hybrid is not None and io is not None:
            on_cpu, both = self.hybrid.choose(i, needed, ids_host, self.cache)
            mark("choose")
            if on_cpu:  # h goes down now
                job = self.hybrid.start(i, on_cpu, *io)
                mark("down")
        routes = token_routes(ids_host, picks.device) if add_all is None and T > 1 else None
        for e in (e for e in needed if e not in on_cpu):  # copies and compute queued, waiting for neither
            w, slot = self.cache.acquire(i, e, keep=needed)
            if add_all is None:
                add_expert(w, slot, e, ids_host[0].index(e) if routes is None else routes[e])
        mark("queue")
        if add_all is not None:
            self.cache.sync_table(i)
            add_all([k for k, e in enumerate(ids_host[0]) if e not in on_cpu])
            mark("device")
        self.cache.release(i)
        self.prefetcher.issue(self.cache, i, guesses_host)  # queued behind the demand copies
        for e in both:  # the link's idle time while the CPU works (engine/runtime/placement.py)
            self.cache.admit(i, e)
        mark("release")
        if job is not None:
            job.compute()
            mark("cpu")
            job.add()
            mark("up")
        if marks is not None:
            copied = sum(1 for e in needed if e not in on_cpu and e not in resident)
            phases = {}
            for (_, a), (name, b) in zip(marks, marks[1:]):
                phases[name] = phases.get(name, 0.0) + b - a
            self.timeline.append(LayerTimes(i, copied, len(on_cpu), routed, marks[-1][1],
                                            job.seconds if job is not None else 0.0, phases))

    def hits_first(self, i: int, s: Step, ops, run, step: list | None) -> None:
        """Layer i's routed experts (one token, grouped kernels) without the device waiting for
        the host: the experts already in place run at once, on the routing the device holds
        (the slots the cache sent, send_in_place); only then does the host read the routing and
        guesses (waiting for the router alone), acquire the experts (copying the misses in),
        run those that were not in place (a late launch that also writes out) and prefetch.
        In a layer without a miss the device has all it needs before the host looks."""
        mi, cache = self.layers[i]["moe_index"], self.cache
        guesses = self.prefetcher.pending(self, mi, s)
        # the read first: queued after send_in_place's waits for landing copies, it would hold the
        # routing back until this layer's prefetches land, and the next layer's prefetches with it
        read = ops.read_later(s.picks, mi, 1 + (0 if guesses is None else guesses.shape[0]))
        in_place = cache.send_in_place(mi)
        run(("moe", i), lambda: ops.experts(mi, s, s.ids[mi]))
        rows = read()
        routed = time.perf_counter()
        ids, guesses_host = rows[0], rows[1:]
        resident = set(cache.lru[mi]) if self.timeline is not None else set()
        if step is not None:
            step.append((tuple(ids), cache.resident(mi)))
        for e in ids:
            cache.acquire(mi, e, keep=ids)
        queued = time.perf_counter()
        late = [k for k, e in enumerate(ids) if in_place[e] < 0]
        if late:
            cache.sync_table(mi)
            ops.stage(late)
            run(("late", i, len(late)), lambda: ops.late_experts(mi, s, len(late)))
        launched = time.perf_counter()
        cache.release(mi)
        self.prefetcher.issue(cache, mi, guesses_host)
        if self.timeline is not None:
            done = time.perf_counter()
            self.timeline.append(LayerTimes(mi, sum(e not in resident for e in ids), 0, routed, done, 0.0,
                                            {"queue": queued - routed, "device": launched - queued,
                                             "release": done - launched}))

    def force_routing(self, i: int, s: Step, ids: torch.Tensor, guesses: torch.Tensor | None) -> None:
        """Hand MoE layer i's routing to self.routing (engine/measure/routing.py); what it chooses
        instead is written over the router's, on the device, before dispatch reads it."""
        weights, chosen, g = self.routing.choose(self, i, s.x, s.weights, ids, guesses)
        if chosen is not ids:
            ids.copy_(chosen)
            s.weights.copy_(weights)
        if g is not None and g is not guesses:
            guesses.copy_(g)

    def prompt_grouped(self, T: int) -> bool:
        """Whether a prompt of T tokens runs each layer's routed experts grouped (prompt_experts)
        rather than one at a time: HQQ SwiGLU experts on the fused kernels, none on the CPU, and
        reading every token's experts costs less than the host's per-expert calls would
        (PROMPT_HOST_S_PER_EXPERT)."""
        cfg, cache = self.cfg, self.cache
        if T == 1 or self.hybrid is not None or T * cfg.top_k > 65535:  # the launch grid's third axis
            return False
        if self.grouped_prompt_kernel is None:
            self.grouped_prompt_kernel = (self.kernels != "reference" and hqq_gpu.fused_available(self.device)
                                          and cfg.expert_act == "silu"
                                          and hqq_gpu.moe_supported(cache.slot_weights(0, 0))
                                          and self.fast_path_works(self.probe_prompt_kernel,
                                                                   "the grouped prompt kernel"))
        B = cache.slot_bytes
        return (self.grouped_prompt_kernel
                and T * cfg.top_k * B <= cfg.num_experts * (PROMPT_HOST_S_PER_EXPERT * PROMPT_DEVICE_BYTES_PER_S + B))

    def probe_prompt_kernel(self) -> None:
        """hqq_gpu.moe_prompt once, on slot 0 (whatever expert it holds) and scratch outputs."""
        cache, k = self.cache, self.cfg.top_k
        h = torch.zeros(1, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        y = torch.empty(k, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        hqq_gpu.moe_prompt(h, cache.slot_weights(0, 0), cache.slot_bytes, self.device_ints([0] * k),
                           self.device_ints([0]), k, y)

    def fast_path_works(self, probe, what: str) -> bool:
        """Run probe() once. Under kernels="auto" a failure (Triton cannot build a kernel on
        this machine, say) means the slower path and a warning; under kernels="fused" it is
        raised."""
        if self.kernels == "fused":
            probe()
            return True
        try:
            probe()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return True
        except Exception as e:  # noqa: BLE001 - any failure of the optional fast path
            warnings.warn(f"{what} unavailable ({type(e).__name__}: {e}); using the slower path", stacklevel=2)
            return False

    def prompt_experts(self, mi: int, s: Step, picks: torch.Tensor) -> None:
        """A prompt's routed experts of MoE layer mi in passes (prompt_grouped): the experts the
        cache holds, then the others as many at a time as the layer's slots take, each pass one
        launch pair over its (token, expert) pairs (hqq_gpu.moe_prompt); out = each token's
        weighted sum. An expert is copied in at most once, as running them one at a time would.
        picks [T + D, k]: the routing, then the guesses to prefetch."""
        cache, T, k = self.cache, s.h.shape[0], self.cfg.top_k
        rows = picks.tolist()
        flat = [e for row in rows[:T] for e in row]
        needed = sorted(set(flat))
        held = [e for e in needed if e in cache.lru[mi]]
        fresh = [e for e in needed if e not in cache.lru[mi]]
        K = cache.slots_in(mi)
        y = torch.empty(T * k, self.cfg.hidden_size, dtype=s.h.dtype, device=self.device)
        for group in [held] * bool(held) + [fresh[a:a + K] for a in range(0, len(fresh), K)]:
            slot = {e: cache.acquire(mi, e, keep=group)[1] for e in group}
            at = [p for p, e in enumerate(flat) if e in slot]
            hqq_gpu.moe_prompt(s.h, cache.slot_weights(mi, 0), cache.slot_bytes,
                               self.device_ints([slot.get(e, 0) for e in flat]), self.device_ints(at), k, y)
            cache.release(mi)  # its slots may take the next pass's copies once this pass has run
        s.out.copy_((y.view(T, k, -1).float() * s.weights[..., None]).sum(1))
        self.prefetcher.issue(cache, mi, rows[T:])

    def device_ints(self, values: list[int]) -> torch.Tensor:
        """int32 on the device, sent without the host waiting (from page-locked memory, which
        torch's allocator keeps until the copy has run)."""
        t = torch.tensor(values, dtype=torch.int32)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def grouped_experts(self, i: int, s: Step, ops, run, at: list[int]) -> None:
        """Layer i's routed experts at the top-k positions `at` in one go (the others run on the
        CPU and are added to out later). All k: one segment. Fewer: a segment per count n that
        gathers the n ids and weights first, so no GEMV runs for a CPU expert (a zero weight on
        a valid slot would still read the whole expert). None: out = 0."""
        mi, n = self.layers[i]["moe_index"], len(at)
        if n == self.cfg.top_k:
            run(("moe", i), lambda: ops.experts(mi, s, s.ids[mi]))
        elif n == 0:
            s.out.zero_()
        else:
            ops.stage(at)
            run(("moe", i, n), lambda: ops.experts(mi, s, s.ids[mi], n))

    def add_expert(self, w: dict, s: Step, e: int, k) -> None:
        """out += expert e's output (weights w) times its routing weight: at top-k position k
        (one token: known on the host), or k = (rows, positions): for each token routed to e."""
        out, h, weights = s.out, s.h, s.weights
        if isinstance(k, int):
            out.add_((self.expert(w, h) * weights[:, k:k + 1]).to(out.dtype))
        else:
            rows, pos = k
            y = self.expert(w, h[rows])
            out.index_add_(0, rows, (y * weights[rows, pos, None]).to(out.dtype))

    def shared_expert(self, layer: dict, s: Step) -> None:
        """qwen2_moe: out += sigmoid(h . gate) * shared(h), resident, for every token."""
        gate = torch.sigmoid(F.linear(s.h, layer["shared_gate"]))
        s.out.add_(gate * self.expert(layer["shared"], s.h))

    def head(self, s: Step, ops, last_only: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """The last FFN's output added, the final norm, the LM head: logits float32 [T or 1, vocab]
        (into out when given)."""
        ops.add_norm(s.x, s.out, self.norm, s.hn)
        x = s.hn[-1:] if last_only else s.hn
        # a tensor, or rounded to int8 (a GPU's: int8_gpu.Int8Rows; the CPU engine's: CpuMatrix)
        y = F.linear(x, self.lm_head) if isinstance(self.lm_head, torch.Tensor) else self.lm_head.matmul(x)
        return y.float() if out is None else out.copy_(y)

    # -- the eager operations (EagerOps calls these) ------------------------------------------------

    def attention(self, i: int, layer: dict, h: torch.Tensor, cos, sin, start: int,
                  pos: torch.Tensor | None = None, span: int = 0) -> torch.Tensor:
        """h [T, H] (normed) at positions start.. -> attention output [T, H].

        With `pos` (a device tensor [1], used by CUDA graphs) the one token's position is read on
        the device and attention spans the first `span` cached positions under a mask.
        """
        cfg, T = self.cfg, h.shape[0]
        q, k, v = (self.project(h, layer, n) for n in ("q_proj", "k_proj", "v_proj"))
        if layer.get("qk_norm") == "full":  # olmoe: over the whole projection, before the heads
            q, k = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps), rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
        if layer.get("clip_qkv") is not None:
            q, k, v = (t.clamp(-layer["clip_qkv"], layer["clip_qkv"]) for t in (q, k, v))
        q = q.view(T, cfg.num_heads, cfg.head_dim)
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        if layer.get("qk_norm") == "head":  # qwen3_moe: per head
            q, k = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps), rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        window = layer.get("window", cfg.sliding_window)
        if pos is None:
            end = start + T
            self.kv.k[i, start:end] = k
            self.kv.v[i, start:end] = v
            qpos = torch.arange(start, end, device=h.device)[:, None]
            need_mask = T > 1 or (window and end > window)
        else:
            end, qpos, need_mask = span, pos[:, None], True
            self.kv.k[i].index_copy_(0, pos, k)
            self.kv.v[i].index_copy_(0, pos, v)
        keys, values = self.kv.k[i, :end], self.kv.v[i, :end]  # [S, kvH, D]
        mask = None
        if need_mask:
            kpos = torch.arange(end, device=h.device)[None, :]
            mask = kpos <= qpos
            if window:
                mask = mask & (qpos - kpos < window)
        if "sinks" in layer or h.device.type == "cpu":
            out = grouped_attention(q, keys, values, mask, layer.get("sinks"))
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),  # [heads, S, D]
                attn_mask=mask, enable_gqa=cfg.num_heads != cfg.num_kv_heads).transpose(0, 1)
        out = out.reshape(T, cfg.num_heads * cfg.head_dim)
        return self.project(out, layer, "o_proj")

    def project(self, h: torch.Tensor, layer: dict, name: str) -> torch.Tensor:
        """One attention projection, with its bias where the family has one."""
        y = self.linear(h, layer[name])
        bias = layer.get(name + "_bias")
        return y if bias is None else y + bias

    def route(self, layer: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] (normed) -> (weights float32 [T, k], expert ids [T, k]), as transformers.

        layer["routing"]: "softmax_topk_norm" (the default: Mixtral, norm_topk_prob),
        "softmax_topk" (top-k of the softmax as they are) or "topk_softmax" (gpt_oss: softmax
        over the top-k logits, which include the router's bias).
        """
        kind, units = layer.get("routing", "softmax_topk_norm"), self.cfg.expert_units
        k = self.cfg.top_k // units
        logits = router_logits(layer, h)
        if kind == "topk_softmax":
            top, ids = torch.topk(logits, k, dim=-1)
            return expand_units(torch.softmax(top, dim=-1), ids, units)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if kind == "softmax_topk_norm":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expand_units(weights, ids, units)

    def expert(self, w: dict, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU: w2 (silu(w1 h) * w3 h); with biases (b1, b3, b2: gpt_oss, the one family whose
        experts have them) its clamped variant."""
        if "b1" in w:
            return self.clamped_swiglu_expert(w, h)
        return self.linear(F.silu(self.linear(h, w["w1"])) * self.linear(h, w["w3"]), w["w2"])

    def clamped_swiglu_expert(self, w: dict, h: torch.Tensor) -> torch.Tensor:
        act = clamped_swiglu(self.linear(h, w["w1"]) + w["b1"], self.linear(h, w["w3"]) + w["b3"],
                             self.cfg.swiglu_alpha, self.cfg.swiglu_limit)
        return self.linear(act, w["w2"]) + w["b2"]

    def guess_ids(self, j: int, x: torch.Tensor, m: int | None = None) -> torch.Tensor:
        """Layer j's router on the residual stream x [T, H] (of an earlier layer): its m best
        experts [T, m] (default top_k, as `route` ranks them)."""
        layer, units, m = self.moe_layers[j], self.cfg.expert_units, m or self.cfg.top_k
        h = rms_norm(x, layer["moe_norm"], self.cfg.rms_norm_eps)
        probs = torch.softmax(router_logits(layer, h), dim=-1)
        ids = torch.topk(probs, min(-(-m // units), probs.shape[-1]), dim=-1).indices
        return expand_units(None, ids, units)[1][..., :m]

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        if isinstance(w, Mxfp4Matrix):  # gpt_oss's experts as imported
            return mxfp4_linear(x, w, self.kernels)
        if isinstance(w, hqq_cpu.CpuQMatrix):  # the CPU engine's dense matrices, in place (move_dense)
            y = torch.from_numpy(hqq_cpu.matmul(x.reshape(-1, w.cols).float().numpy(), w))
            return y.reshape(*x.shape[:-1], w.rows).to(x.dtype)
        if isinstance(w, CpuMatrix):  # the same, rounded to int8 (move_dense)
            return w.matmul(x.reshape(-1, w.cols)).reshape(*x.shape[:-1], w.rows).to(x.dtype)
        return qlinear(x, w, self.kernels)


class EagerOps:
    """The operations a layer is made of, in torch, for any number of tokens: the reference,
    what prefill and the CPU run, and what the fused decode (engine/decode_kernels.FusedOps)
    falls back to where a layer's options have no fused kernel. Each writes its result into
    the buffers it is given (the ones CUDA graphs bake in) or returns it."""

    grouped = False  # True: experts(), a layer's routed experts in one launch (FusedOps only)
    hits_first = False  # True: the grouped launch may run before the routing is read (OffloadedMixtral.hits_first)

    def __init__(self, model: OffloadedMixtral):
        self.m = model

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """x += delta (when given; + bias, rounded first, when given); out = rms_norm(x) * weight."""
        if delta is not None:
            x.add_(delta if bias is None else delta + bias)
        rms_norm(x, weight, self.m.cfg.rms_norm_eps, out)

    def o_bias(self, layer: dict) -> torch.Tensor | None:
        """The o projection's bias that attention() left for add_norm to add: none here."""
        return None

    def attention(self, i: int, layer: dict, s: Step) -> torch.Tensor:
        """Layer i's attention on s.hn, its output projection included: [T, H]."""
        if s.pos is None:
            return self.m.attention(i, layer, s.hn, s.cos, s.sin, s.start)
        return self.m.attention(i, layer, s.hn, s.cos[s.pos], s.sin[s.pos], 0, pos=s.pos, span=s.span)

    def span(self, layer: dict, s: Step) -> int:
        """What a CUDA graph of the layer's attention depends on besides the position on the
        device: the span the eager attention reads."""
        return s.span

    def route(self, layer: dict, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
        """The router's choice for h [T, H]: weights [T, k], ids [T, k]."""
        w, e = self.m.route(layer, h)
        weights.copy_(w)
        ids.copy_(e)

    def route_forced(self, layer: dict, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     forced: tuple[torch.Tensor, torch.Tensor]) -> None:
        """route(), then a forced routing's choice (weights, ids) [T, k] written over it: the
        router's work is done all the same (engine/measure/routing.py)."""
        self.route(layer, h, weights, ids)
        weights.copy_(forced[0])
        ids.copy_(forced[1])

    def guess(self, j: int, x: torch.Tensor, scratch: torch.Tensor, ids: torch.Tensor) -> None:
        """MoE layer j's router on the last token of an earlier residual stream x: its top-k
        ids [k] (the prefetcher's guess; scratch [1, H] is free to overwrite)."""
        ids.copy_(self.m.guess_ids(j, x[-1:])[0])


def layer_weights(cfg: ModelConfig, dense: dict, i: int) -> dict:
    """Layer i's weights by their role (store names: engine/storage/store.py) and its per-layer options."""
    p = f"model.layers.{i}."
    layer = {"attn_norm": dense[p + "input_layernorm.weight"],
             "moe_norm": dense[p + "post_attention_layernorm.weight"],
             **{n: dense[p + f"self_attn.{n}.weight"] for n in ATTN_PROJECTIONS},
             **{n + "_bias": dense[p + f"self_attn.{n}.bias"] for n in cfg.attn_biases}}
    if cfg.qk_norm != "none":
        layer.update(qk_norm=cfg.qk_norm, q_norm=dense[p + "self_attn.q_norm.weight"],
                     k_norm=dense[p + "self_attn.k_norm.weight"])
    if cfg.clip_qkv is not None:
        layer["clip_qkv"] = cfg.clip_qkv
    if cfg.sinks:
        layer["sinks"] = dense[p + "self_attn.sinks"]
    if cfg.layer_windows is not None:
        layer["window"] = cfg.layer_windows[i]
    if i not in cfg.moe_layer_ids:
        layer["mlp"] = swiglu_weights(dense, p + "mlp.")
        return layer
    layer["moe_index"] = cfg.moe_layer_ids.index(i)
    layer["router"] = dense[p + "block_sparse_moe.gate.weight"]
    if cfg.router_bias:
        layer["router_bias"] = dense[p + "block_sparse_moe.gate.bias"]
    layer["routing"] = ("topk_softmax" if cfg.router == "topk_softmax" else
                        "softmax_topk_norm" if cfg.norm_topk_prob else "softmax_topk")
    if cfg.shared_expert_size:
        layer["shared"] = swiglu_weights(dense, p + "mlp.shared_expert.")
        layer["shared_gate"] = dense[p + "mlp.shared_expert_gate.weight"]
    return layer


def attention_options(layer: dict, eps: float) -> dict:
    """The attention options of a layer (layer_weights) as the fused decode's rope_attention
    takes them (engine/kernels/decode.py on the GPU, decode_cpu.py on the CPU)."""
    return dict(qk_norm=layer.get("qk_norm"), q_norm=layer.get("q_norm"), k_norm=layer.get("k_norm"), eps=eps,
                clip=layer.get("clip_qkv"), sinks=layer.get("sinks"),
                **{n[0] + "_bias": layer.get(n + "_bias") for n in ATTN_PROJECTIONS[:3]})


def distinct_ids(shape: tuple, device) -> torch.Tensor:
    """Expert ids [..., k] that are a valid routing before any router wrote them: 0..k-1 in each
    row. The grouped expert kernels order a token's experts by id and assume them distinct (as
    top-k makes them); rows of zeros, run while CUDA graphs are prepared, made them read past
    their scratch (gpt-oss-20b's MXFP4 kernel: an illegal memory access)."""
    return torch.arange(shape[-1], device=device).expand(shape).clone()


def swiglu_weights(dense: dict, prefix: str) -> dict:
    """A dense SwiGLU MLP (gate_proj, up_proj, down_proj) as an expert's w1, w3, w2."""
    return {m: dense[prefix + n + ".weight"] for m, n in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))}


ATTENTION_FLOATS = 1 << 24  # scores grouped_attention holds at once (64 MB in float32)


def grouped_attention(q, k, v, mask, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v, each group of query heads on its key/value head, without
    repeating k and v: q [T, heads, D], k/v [S, kv heads, D] (the cache's layout), mask [T, S]
    bool or None -> [T, heads, D]. sinks [heads] (gpt_oss): one more logit per head whose value
    is zero, which only takes probability away from the keys. The scores are float32, a block
    of query tokens at a time (ATTENTION_FLOATS), so a long prompt takes bounded memory.

    On the CPU torch's scaled_dot_product_attention took 10-30x longer for a decoded token
    (0.3 ms at 64 cached tokens, 3 ms at 500, 32 heads on 4; this 25 us and 150 us) and about
    1.4x longer for a prompt (tests/engine/runtime/test_attention.py holds the two equal)."""
    T, H, D = q.shape
    S, kvH = k.shape[:2]
    g = H // kvH
    keys, values = k.permute(1, 2, 0), v.transpose(0, 1)  # [kvH, D, S], [kvH, S, D]
    out = torch.empty(T, kvH, g, D, dtype=v.dtype, device=v.device)
    step = max(1, ATTENTION_FLOATS // (H * S))
    for a in range(0, T, step):
        b = min(T, a + step)
        qg = q[a:b].reshape(b - a, kvH, g, D).transpose(0, 1).reshape(kvH, (b - a) * g, D)
        scores = torch.bmm(qg, keys).float().mul_(D ** -0.5).view(kvH, b - a, g, S)
        if mask is not None:
            scores.masked_fill_(~mask[a:b, None, :], float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.float().view(kvH, 1, g, 1).expand(kvH, b - a, g, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        o = torch.bmm(probs.to(v.dtype).reshape(kvH, (b - a) * g, S), values)  # [kvH, (b - a) * g, D]
        out[a:b] = o.view(kvH, b - a, g, D).transpose(0, 1)
    return out.view(T, H, D)


# -- norm and RoPE helpers ----------------------------------------------------------------------


def expand_units(weights: torch.Tensor | None, ids: torch.Tensor, units: int):
    """Routed experts [..., k] -> their units [..., k * units] (expert e: units e * units + p),
    each unit with its expert's weight (engine/runtime/expert_units.py)."""
    if units == 1:
        return weights, ids
    ids = (ids[..., None] * units + torch.arange(units, device=ids.device)).flatten(-2)
    return None if weights is None else weights[..., None].expand(*weights.shape, units).flatten(-2), ids


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt_oss's expert activation from its gate and up projections (biases added): gate clamped
    above and up both sides at limit, then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def router_logits(layer: dict, h: torch.Tensor) -> torch.Tensor:
    """A MoE layer's router on h [T, H] (normed): float32 [T, E]."""
    return F.linear(h, layer["router"], layer.get("router_bias")).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return torch.mul(weight, xf.to(x.dtype), out=out)


def rope_frequencies(cfg: ModelConfig, device, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies [D/2] and the factor on cos/sin (1 but for YaRN's and LongRoPE's).

    A non-default rope type (gpt_oss's YaRN) is computed by transformers' own function for it,
    so it is the reference's by construction; seq_len as transformers passes it (long_rope).
    """
    if cfg.rope_scaling is None:
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64)
                                        .to(device=device, dtype=torch.float32) / cfg.head_dim))
        return inv, 1.0
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = PretrainedConfig(rope_parameters=dict(cfg.rope_scaling), hidden_size=cfg.hidden_size,
                          num_attention_heads=cfg.num_heads, head_dim=cfg.head_dim,
                          max_position_embeddings=cfg.max_position_embeddings)
    inv, scale = ROPE_INIT_FUNCTIONS[cfg.rope_scaling["rope_type"]](hf, device, seq_len=seq_len)
    return inv.to(device=device, dtype=torch.float32), float(scale)


def long_rope(cfg: ModelConfig, device) -> tuple[torch.Tensor, float, int] | None:
    """LongRoPE's long factors: (inverse frequencies, factor, original_max_position_embeddings),
    which a forward reaching past that many positions uses (OffloadedMixtral.rope); None for
    the other rope types. (Dynamic NTK changes only past max_position_embeddings, beyond the
    engine's context.)"""
    if (cfg.rope_scaling or {}).get("rope_type") != "longrope":
        return None
    original = int(cfg.rope_scaling["original_max_position_embeddings"])
    return (*rope_frequencies(cfg, device, seq_len=original + 1), original)


def rope_cos_sin(inv_freq: torch.Tensor, pos: torch.Tensor, dtype,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = pos.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype)[:, None, :], (emb.sin() * scale).to(dtype)[:, None, :]  # [T, 1, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
