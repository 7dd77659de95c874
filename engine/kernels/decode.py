"""The layer's operations for one decoded token on fused kernels (FusedOps), and those kernels.

Eagerly, one decoded token's attention and routing is about 45 tiny PyTorch kernels per layer
(the RMS norm alone is 7, RoPE 10, the router 7); inside a CUDA graph each still costs one
dependent launch, 2-3 us on an H200, more than the work. These kernels do the same maths in
4 launches (besides the q, k+v and o GEMVs of hqq_gpu.py):

  add_rms_norm     x += delta; h = rms_norm(x) * weight (twice)
  rope_attention   the layer's q/k/v preparation (biases, q/k RMSNorm per head or over the
                   whole projection, clipping), RoPE on q and k at the position held on the
                   device, k and v into the KV cache, and the one query token against all
                   cached positions (GQA, causal, sliding window, attention sinks)
  route_topk       router logits (+ bias), softmax, top-k, renormalised or not: each family's
                   router (gpt_oss's softmax over the top-k logits is the renormalised top-k
                   of the softmax)

FusedOps is engine/runtime/model.EagerOps with these kernels. Every family's attention runs on them
(any head size: the kernel masks a non-power-of-two one; an o bias is added after the o GEMV),
so an attention graph depends only on the position on the device. Its `experts` is the grouped
expert kernel (hqq_gpu.moe_decode for HQQ SwiGLU experts, mxfp4_gpu.moe_decode for gpt-oss's
MXFP4 ones), which the graph runner enables when the cache's expert format supports it
(grouped_supported). Each kernel rounds its intermediate results to the model's dtype where
the eager path does, so the two paths agree up to float32 summation order
(tests/engine/kernels/test_decode.py; with sinks the eager path also rounds the softmax's
probabilities, which an online softmax cannot); the eager operations remain the reference,
and what prefill and the CPU run.
"""

from __future__ import annotations

import torch

from moeferry.engine.kernels import hqq_gpu, mxfp4_gpu
from moeferry.engine.kernels.hqq_gpu import tl, triton
from moeferry.engine.runtime import cuda_driver
from moeferry.engine.runtime.model import EagerOps, Step, attention_options, distinct_ids, expand_units
from moeferry.engine.storage.mxfp4 import Mxfp4Matrix


class FusedOps(EagerOps):
    """EagerOps for one token (T = 1) on the fused kernels: 8 launches for a Mixtral layer's
    attention and routing instead of about 45, 2 more per prefetch guess."""

    def __init__(self, model, grouped: bool = False, side: torch.cuda.Stream | None = None,
                 fetcher: torch.cuda.Stream | None = None):
        """side: the stream the k and v GEMVs run on beside q (beside()); None: after q.
        fetcher: the stream fetch_ahead's copies run on (None: at once, on the CPU)."""
        super().__init__(model)
        cfg, dev, dt = model.cfg, model.device, model.dtype
        self.grouped = grouped
        self.stream = False  # experts(): those not in place read where they lie in host memory (GraphedDecode.streams)
        self.attn = torch.zeros(1, cfg.num_heads * cfg.head_dim, dtype=dt, device=dev)
        self.k_new = torch.zeros(1, cfg.num_kv_heads * cfg.head_dim, dtype=dt, device=dev)
        self.v_new = torch.zeros_like(self.k_new)
        self.guess_weights = torch.zeros(cfg.top_k, dtype=torch.float32, device=dev)
        k = cfg.top_k // cfg.expert_units  # the router's choice before expand_units
        self.routed_weights = torch.zeros(k, dtype=torch.float32, device=dev)
        self.routed_ids = distinct_ids((k,), dev)
        # a subset of the top-k (the others on the CPU): its positions, ids and weights; distinct
        # from the start, as the grouped kernels need (distinct_ids)
        self.at_host = distinct_ids((cfg.top_k,), "cpu")
        if dev.type == "cuda":
            self.at_host = self.at_host.pin_memory()
        self.at_np = self.at_host.numpy()
        self.at = distinct_ids((cfg.top_k,), dev)
        self.at_ids = distinct_ids((cfg.top_k,), dev)
        self.at_weights = torch.zeros(cfg.top_k, dtype=torch.float32, device=dev)
        self.picks_host = None  # read_later's page-locked copy of Step.picks
        self.side, self.fetcher = side, fetcher
        # fetch_ahead's copies of the next MoE layer's guessed experts, two layers' worth taking
        # turns [2, k, B] (set by GraphedDecode when it streams with prefetch), and the events
        # each MoE layer's experts wait for
        self.staging: torch.Tensor | None = None
        self.fetched = [torch.cuda.Event() for _ in range(cfg.num_moe_layers)] if fetcher is not None else None
        if dev.type == "cuda":
            self.device_index = dev.index if dev.index is not None else torch.cuda.current_device()
            self.picks_read = cuda_driver.new_event(torch.cuda.current_stream(dev))

    def add_norm(self, x, delta, weight, out, bias=None) -> None:
        add_rms_norm(x, delta, weight, self.m.cfg.rms_norm_eps, out, bias)

    def o_bias(self, layer: dict) -> torch.Tensor | None:
        """attention() leaves the o bias to the norm's kernel (one launch less a layer)."""
        return layer.get("o_proj_bias")

    def span(self, layer: dict, s: Step) -> int:
        return 0  # the fused attention reads the position on the device only

    def attention(self, i: int, layer: dict, s: Step) -> torch.Tensor:
        m, cfg = self.m, self.m.cfg
        pair = hqq_gpu.pair_supported(layer["k_proj"], layer["v_proj"])
        if pair:  # each GEMV alone is too small to fill the GPU: k and v beside q (KV_BESIDE)
            join = self.beside(lambda: hqq_gpu.gemv_pair(s.hn, layer["k_proj"], layer["v_proj"], self.k_new, self.v_new))
        q = m.linear(s.hn, layer["q_proj"]).view(cfg.num_heads, cfg.head_dim)
        if pair:
            join()
            k, v = self.k_new, self.v_new
        else:
            k, v = m.linear(s.hn, layer["k_proj"]), m.linear(s.hn, layer["v_proj"])
        rope_attention(q, k.view(cfg.num_kv_heads, cfg.head_dim), v.view(cfg.num_kv_heads, cfg.head_dim),
                       s.cos, s.sin, s.pos, m.kv.k[i], m.kv.v[i], layer.get("window", cfg.sliding_window),
                       self.attn, **attention_options(layer, cfg.rms_norm_eps))
        return m.linear(self.attn, layer["o_proj"])  # its bias: o_bias, added by add_norm

    def beside(self, fn):
        """Queue fn() on the side stream after the work queued so far, and return the join (the
        current stream waits for it). Captured, the two streams are two branches of the graph
        that the GPU runs at once. Off a GPU fn() just runs."""
        if self.side is None or not KV_BESIDE:
            fn()
            return lambda: None
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            fn()
        return lambda: main.wait_stream(self.side)

    def route(self, layer: dict, h, weights, ids) -> None:
        units = self.m.cfg.expert_units
        w, e = (weights[0], ids[0]) if units == 1 else (self.routed_weights, self.routed_ids)
        route_topk(h, layer["router"], self.m.cfg.top_k // units, w, e, layer.get("router_bias"),
                   renormalize=layer.get("routing") != "softmax_topk")
        if units > 1:
            w, e = expand_units(w, e, units)
            weights[0].copy_(w)
            ids[0].copy_(e)

    def route_forced(self, layer: dict, h, weights, ids, forced) -> None:
        """route() with a forced choice written over it: in the router's own launch (the picks go
        to scratch) where the choice is whole experts."""
        if self.m.cfg.expert_units > 1:
            super().route_forced(layer, h, weights, ids, forced)
            return
        route_topk(h, layer["router"], self.m.cfg.top_k, self.routed_weights, self.routed_ids, layer.get("router_bias"),
                   renormalize=layer.get("routing") != "softmax_topk",
                   forced=(forced[0][0], forced[1][0], weights[0], ids[0]))

    def guess(self, j: int, x, scratch, ids) -> None:
        layer, units = self.m.moe_layers[j], self.m.cfg.expert_units
        add_rms_norm(x, None, layer["moe_norm"], self.m.cfg.rms_norm_eps, scratch)
        e = ids if units == 1 else self.routed_ids
        route_topk(scratch, layer["router"], self.m.cfg.top_k // units, self.guess_weights[:len(e)], e,
                   layer.get("router_bias"))
        if units > 1:
            ids.copy_(expand_units(None, e, units)[1])

    def stage(self, at: list[int]) -> None:
        """Send the top-k positions that experts(n=len(at)) runs (host, outside any graph; the
        buffer is rewritten only after the next routing sync)."""
        self.at_np[:len(at)] = at  # no tensor made per layer and token
        self.at[:len(at)].copy_(self.at_host[:len(at)], non_blocking=True)

    def experts(self, mi: int, s: Step, ids: torch.Tensor, n: int | None = None) -> None:
        """out = the weighted sum of MoE layer mi's routed experts, in two launches that read
        each expert's slot from the cache's device table; n: only the n positions staged.
        Streaming (self.stream), those the cache lacks are read from host memory, or from the
        copies fetch_ahead made of the guesses for this layer."""
        cache = self.m.cache
        ids, weights = ids[0], s.weights[0]
        if n is not None:
            torch.index_select(ids, 0, self.at[:n], out=self.at_ids[:n])
            torch.index_select(weights, 0, self.at[:n], out=self.at_weights[:n])
            ids, weights = self.at_ids[:n], self.at_weights[:n]
        fetched = None
        if self.stream and self.staging is not None and mi > 0:
            if self.fetched is not None:
                torch.cuda.current_stream().wait_event(self.fetched[mi])
            fetched = (s.guesses[mi - 1, 0], cache.offset_to(mi, self.staging[mi % 2]))
        self.moe_decode(s.h, cache.slot_weights(mi, 0), cache.slot_bytes, ids, weights, cache.device_table(mi), s.out,
                        cache.host_offset(mi) if self.stream else None, fetched)

    def fetch_ahead(self, mi: int, s: Step) -> None:
        """Start the copies of MoE layer mi+1's guessed experts (s.guesses[mi, 0]) that the cache
        lacks into staging, on the fetcher stream: the link works while this layer's experts and
        the next attention run. Layer mi+1's experts wait for them (experts())."""
        j = mi + 1
        if self.staging is None or j >= self.m.cfg.num_moe_layers:
            return
        cache = self.m.cache

        staging = self.staging[j % 2]

        def fetch() -> None:
            fetch_experts(s.guesses[mi, 0], cache.device_table(j), staging,
                          cache.host_offset(j) - cache.offset_to(j, staging))
        if self.fetcher is None:
            fetch()
            return
        self.fetcher.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.fetcher):
            fetch()
            self.fetched[j].record()

    def late_experts(self, mi: int, s: Step, n: int) -> None:
        """After experts() ran with some routed experts not in place (-1 in the table): those at
        the n positions staged, now in place, and out from every position's result."""
        cache = self.m.cache
        hqq_gpu.moe_decode(s.h, cache.slot_weights(mi, 0), cache.slot_bytes, s.ids[mi, 0], s.weights[0],
                           cache.device_table(mi), s.out, late=self.at[:n])

    def late_supported(self, experts: dict) -> bool:
        """Whether experts() leaves out alone for experts not in place and late_experts() runs
        them (hqq_gpu.moe_decode's `late`; not MXFP4's kernels)."""
        return not isinstance(experts["w1"], Mxfp4Matrix)

    def read_later(self, picks: torch.Tensor, mi: int, n: int):
        """Queue the copy of MoE layer mi's first n rows of picks (Step.picks) to the host now,
        and return a function that waits for that copy alone (not for the work queued after it)
        and gives the rows as lists."""
        if self.m.device.type != "cuda":
            return picks[mi, :n].tolist
        if self.picks_host is None:
            self.picks_host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
        src, dst = picks[mi, :n], self.picks_host[mi, :n]
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        cuda_driver.copy_to_host(dst.data_ptr(), src.data_ptr(), dst.nbytes, stream)
        cuda_driver.record(self.picks_read.cuda_event, stream)

        def rows() -> list:
            cuda_driver.synchronize(self.picks_read.cuda_event)
            return dst.tolist()
        return rows

    def grouped_supported(self, experts: dict) -> bool:
        """Whether a grouped kernel runs these expert views (of one cache slot) in this family."""
        if isinstance(experts["w1"], Mxfp4Matrix):
            return self.m.cfg.expert_act == "clamped_swiglu" and mxfp4_gpu.moe_supported(experts)
        return self.m.cfg.expert_act == "silu" and hqq_gpu.moe_supported(experts)

    def moe_decode(self, h, experts: dict, slot_bytes: int, ids, weights, table, out, host_off: int | None = None,
                   fetched: tuple | None = None) -> None:
        """The grouped kernel of the experts' format (grouped_supported): out = their weighted sum;
        host_off, fetched: the experts not in place read from host memory or from their fetched
        copies (hqq_gpu.moe_decode's)."""
        if isinstance(experts["w1"], Mxfp4Matrix):
            cfg = self.m.cfg
            mxfp4_gpu.moe_decode(h, experts, slot_bytes, ids, weights, table, out, cfg.swiglu_alpha, cfg.swiglu_limit,
                                 host_off=host_off, fetched=fetched)
        else:
            hqq_gpu.moe_decode(h, experts, slot_bytes, ids, weights, table, out, host_off=host_off, fetched=fetched)



def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """x [1, H] += delta (when given, in x's dtype; delta + bias rounded first, as the eager
    projection adds its bias), then out = rms_norm(x) * weight."""
    H = x.shape[-1]
    _add_rms_norm_kernel[(1,)](x, x if delta is None else delta, weight, out, _given(bias, weight), H, eps,
                               HAS_DELTA=delta is not None, HAS_BIAS=bias is not None,
                               BLOCK=triton.next_power_of_2(H), num_warps=8)


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   window: int | None, out: torch.Tensor, *, qk_norm: str | None = None,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0,
                   clip: float | None = None, q_bias: torch.Tensor | None = None,
                   k_bias: torch.Tensor | None = None, v_bias: torch.Tensor | None = None,
                   sinks: torch.Tensor | None = None) -> None:
    """One decoded token's attention at position pos[0] (a device tensor).

    q [heads, D], k and v [kv_heads, D] as projected; cos, sin [positions, D] tables
    (model.rope_cos_sin); k_cache, v_cache [capacity, kv_heads, D]. Prepares q, k and v as
    model.attention does: + q_bias, k_bias, v_bias (flat); qk_norm "full" (RMSNorm of the whole
    q and k with q_norm [heads * D], k_norm [kv_heads * D]) and then clip (q, k, v clamped to
    +-clip), or "head" (per head, q_norm and k_norm [D]). Rotates q and k, writes k and v into
    cache row pos, and writes out [heads * D] = softmax(q k^T / sqrt(D)) v over rows
    [max(0, pos - window + 1), pos]; sinks [heads] (gpt_oss): one more logit per head in the
    softmax, whose value is zero. q, k and v are not modified.
    """
    heads, D = q.shape
    kv_heads = k.shape[0]
    norm = {None: 0, "head": 1, "full": 2}[qk_norm]
    full = norm == 2
    _rope_attention_kernel[(heads,)](
        q, k, v, _given(q_bias, q), _given(k_bias, k), _given(v_bias, v), _given(q_norm, q), _given(k_norm, k),
        _given(sinks, q), cos, sin, pos, k_cache, v_cache, out, heads // kv_heads, heads * D, kv_heads * D,
        window or 0, D ** -0.5, eps, clip or 0.0, D=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_FULL=min(1024, triton.next_power_of_2(heads * D)) if full else 1, BLOCK_S=64,
        Q_BIAS=q_bias is not None, K_BIAS=k_bias is not None, V_BIAS=v_bias is not None, NORM=norm,
        CLIP=clip is not None, SINKS=sinks is not None, num_warps=4)


def embed_row(table: torch.Tensor, token: torch.Tensor, out: torch.Tensor) -> None:
    """out [1, H] = table [V, H] row token[0] (a device tensor). The table may be page-locked host
    memory, which the GPU reads over the link (5.8 KB a token for gpt-oss-20b): a decoded token's
    embedding without the host knowing the token."""
    H = table.shape[1]
    _embed_row_kernel[(triton.cdiv(H, EMBED_BLOCK),)](table, token, out, H, BLOCK=EMBED_BLOCK, num_warps=4)


EMBED_BLOCK = 1024
# fetch_experts: int32 words a program moves per step, and programs per expert
# (benchmarks/zero_copy.py measures the link's rate against both)
FETCH_BLOCK, FETCH_PROGRAMS = 4096, 32


def fetch_experts(guesses: torch.Tensor, table: torch.Tensor, staging: torch.Tensor, host_off: int,
                  programs: int = FETCH_PROGRAMS) -> None:
    """staging[m] = host expert guesses[m], for each guessed expert the table lacks (-1), by the
    GPU's own loads over the link: a copy whose source the device chooses, so a CUDA graph can
    hold it (the copy engine's addresses are fixed at capture). staging [k, B] (B a multiple of
    4 bytes); the experts' page-locked home lies host_off bytes from staging[0] as kernels
    address it (ExpertCache.host_offset), B bytes apart; programs: per expert, each a
    contiguous chunk."""
    words = staging.shape[1] // 4
    chunk = triton.cdiv(triton.cdiv(words, programs), FETCH_BLOCK) * FETCH_BLOCK
    _fetch_kernel[(guesses.numel(), triton.cdiv(words, chunk))](
        guesses, table, staging.view(torch.int32), host_off // 4, words, chunk, BLOCK=FETCH_BLOCK, num_warps=8)


def _given(t: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """A kernel's optional tensor argument: the tensor, or any valid one when its flag is off."""
    return fallback if t is None else t


def route_topk(h: torch.Tensor, router: torch.Tensor, top_k: int, weights: torch.Tensor,
               ids: torch.Tensor, bias: torch.Tensor | None = None, renormalize: bool = True,
               forced: tuple | None = None) -> None:
    """weights [top_k] float32 and ids [top_k] int64 of h [1, H] under router [E, H] (+ bias [E]):
    the top-k of the softmax, renormalised to sum 1 or as they are. forced (the benchmark's
    routing: weights, ids, out_weights, out_ids, each [top_k]): the picks are made all the same
    (into weights and ids), and the forced choice is copied into out_weights and out_ids by the
    same launch, where two copies would take two more."""
    E, H = router.shape
    block_e = triton.next_power_of_2(E)
    b = router if bias is None else bias
    fw, fi, ow, oi = forced if forced is not None else (weights, ids, weights, ids)
    common = dict(E=E, BLOCK_E=block_e, TOPK=top_k, HAS_BIAS=bias is not None, NORM=renormalize,
                  FORCED=forced is not None, num_warps=4)
    if E <= FUSED_ROUTER_EXPERTS:  # one program reads the router and picks
        block_h = min(1024, triton.next_power_of_2(H), max(16, ROUTE_TILE // block_e))
        _route_kernel[(1,)](h, router, b, weights, ids, H, router, fw, fi, ow, oi, BLOCK_H=block_h, LOGITS=False,
                            **common)
        return
    # many experts (Qwen3's 128): one program read the whole router in 51 us on the H200, its
    # loads one tile after another; the logits by LOGIT_ROWS experts per program, then the pick
    logits = torch.empty(E, dtype=torch.float32, device=h.device)
    _router_logits_kernel[(triton.cdiv(E, LOGIT_ROWS),)](h, router, b, logits, H, E, HAS_BIAS=bias is not None,
                                                          ROWS=LOGIT_ROWS, BLOCK_H=min(1024, triton.next_power_of_2(H)),
                                                          num_warps=4)
    _route_kernel[(1,)](h, router, b, weights, ids, H, logits, fw, fi, ow, oi, BLOCK_H=16, LOGITS=True, **common)


KV_BESIDE = True  # benchmarks/token_anatomy.py turns it off to compare
FUSED_ROUTER_EXPERTS = 16  # routers this small are read and picked from in one program
# experts per program of _router_logits_kernel: 2 took gpt-oss-20b's router (32 x 2880) from 5.8
# to 4.1 us and Qwen3-30B-A3B's (128 x 2048) from 7.0 to 5.7 us against 4, the same picks
# (benchmarks/decode_sweep.py on an H100, 2026-12-05; 1 was within 0.1 us)
LOGIT_ROWS = 2
ROUTE_TILE = 8192  # router weights per tile of _route_kernel (more spill out of registers)


if triton is not None:
    @triton.jit
    def _round(v, dt: tl.constexpr):
        return v.to(dt).to(tl.float32)

    @triton.jit
    def _embed_row_kernel(t_ptr, tok_ptr, out_ptr, H, BLOCK: tl.constexpr):
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        row = tl.load(tok_ptr).to(tl.int64)
        tl.store(out_ptr + cols, tl.load(t_ptr + row * H + cols, mask=cols < H), mask=cols < H)

    @triton.jit
    def _fetch_kernel(guess_ptr, table_ptr, dst, host_off, words, chunk, BLOCK: tl.constexpr):
        """Program (m, c): the c-th chunk of guessed expert m's words, unless the table holds it;
        the host's experts lie host_off words from dst."""
        m, c = tl.program_id(0), tl.program_id(1)
        e = tl.load(guess_ptr + m).to(tl.int64)
        end = tl.where(tl.load(table_ptr + e) < 0, words, 0)  # a cached expert: nothing to move
        start = c.to(tl.int64) * chunk
        src = dst + host_off + e * words
        for off in range(0, chunk, BLOCK):
            o = start + off + tl.arange(0, BLOCK)
            tl.store(dst + m * words + o, tl.load(src + o, mask=o < end), mask=o < end)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, b_ptr, H, eps, HAS_DELTA: tl.constexpr,
                             HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        dt: tl.constexpr = x_ptr.dtype.element_ty
        i = tl.arange(0, BLOCK)
        m = i < H
        x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d = tl.load(d_ptr + i, mask=m, other=0.0).to(tl.float32)
            if HAS_BIAS:
                d = _round(d + tl.load(b_ptr + i, mask=m, other=0.0).to(tl.float32), dt)
            x = _round(x + d, dt)
            tl.store(x_ptr + i, x.to(dt), mask=m)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        y = _round(x * r, dt) * tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _biased(x_ptr, b_ptr, i, m, BIAS: tl.constexpr, dt: tl.constexpr):
        """A projection's values at i, + its bias (as project(): the sum in the model's dtype)."""
        x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
        if BIAS:
            x = _round(x + tl.load(b_ptr + i, mask=m, other=0.0).to(tl.float32), dt)
        return x

    @triton.jit
    def _inv_rms(x_ptr, b_ptr, n, eps, BIAS: tl.constexpr, BLOCK: tl.constexpr, dt: tl.constexpr):
        """1 / rms of a whole projection [n] (+ bias): the "full" q/k norm's factor."""
        total = 0.0
        for i0 in range(0, n, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            x = _biased(x_ptr, b_ptr, i, i < n, BIAS, dt)
            total += tl.sum(x * x, axis=0)
        return 1.0 / tl.sqrt(total / n + eps)

    @triton.jit
    def _prepared(x_ptr, b_ptr, w_ptr, i, m, r, clip, BIAS: tl.constexpr, FULL: tl.constexpr,
                  CLIP: tl.constexpr, dt: tl.constexpr):
        """Values at i of a projection as model.attention has them before the heads split: + bias,
        the "full" norm (factor r, weight w), clamped to +-clip; rms_norm's roundings."""
        x = _biased(x_ptr, b_ptr, i, m, BIAS, dt)
        if FULL:
            x = _round(_round(x * r, dt) * tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32), dt)
        if CLIP:
            x = _round(tl.minimum(tl.maximum(x, -clip), clip), dt)  # the bound as clamp rounds it
        return x

    @triton.jit
    def _rope_head(x_ptr, b_ptr, w_ptr, off, r, eps, clip, c, s, d, half, dm, sign, D: tl.constexpr,
                   BIAS: tl.constexpr, NORM: tl.constexpr, CLIP: tl.constexpr, dt: tl.constexpr):
        """One head [D] of q or k, starting at off, prepared (the "head" norm: weight w [D]) and
        rotated as apply_rope rounds it: x*cos, rotated*sin, their sum. The rotated half is
        prepared from its own loads rather than moved between registers."""
        x = _prepared(x_ptr, b_ptr, w_ptr, off + d, dm, r, clip, BIAS, NORM == 2, CLIP, dt)
        xr = _prepared(x_ptr, b_ptr, w_ptr, off + half, dm, r, clip, BIAS, NORM == 2, CLIP, dt)
        if NORM == 1:
            rh = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            x = _round(_round(x * rh, dt) * tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32), dt)
            xr = _round(_round(xr * rh, dt) * tl.load(w_ptr + half, mask=dm, other=0.0).to(tl.float32), dt)
        return _round(_round(x * c, dt) + _round(xr * sign * s, dt), dt)

    @triton.jit
    def _rope_attention_kernel(q_ptr, k_ptr, v_ptr, qb_ptr, kb_ptr, vb_ptr, qn_ptr, kn_ptr, sink_ptr,
                               cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, out_ptr, group, q_len, row_len,
                               window, scale, eps, clip, D: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_FULL: tl.constexpr, BLOCK_S: tl.constexpr, Q_BIAS: tl.constexpr,
                               K_BIAS: tl.constexpr, V_BIAS: tl.constexpr, NORM: tl.constexpr,
                               CLIP: tl.constexpr, SINKS: tl.constexpr):
        """One query head h. Every program of a key/value group prepares and rotates that group's
        new key itself (D values; the "full" norm's factors over the whole q and k, each
        program for itself) and uses it for position pos from registers; the group's first
        program also writes it (and the value) into the cache, which the others therefore
        never read at row pos. Online softmax over the positions, BLOCK_S at a time, started
        from the sink (a logit whose value is zero) where there is one."""
        dt: tl.constexpr = kc_ptr.dtype.element_ty
        h = tl.program_id(0)
        kh = h // group
        pos = tl.load(pos_ptr)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        half = (d + D // 2) % D  # rotate_half: [-x2, x1]
        sign = tl.where(d < D // 2, -1.0, 1.0)
        c = tl.load(cos_ptr + pos * D + d, mask=dm, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * D + d, mask=dm, other=0.0).to(tl.float32)
        rq = 1.0
        rk = 1.0
        if NORM == 2:
            rq = _inv_rms(q_ptr, qb_ptr, q_len, eps, Q_BIAS, BLOCK_FULL, dt)
            rk = _inv_rms(k_ptr, kb_ptr, row_len, eps, K_BIAS, BLOCK_FULL, dt)
        q = _rope_head(q_ptr, qb_ptr, qn_ptr, h * D, rq, eps, clip, c, s, d, half, dm, sign, D, Q_BIAS, NORM,
                       CLIP, dt)
        if not SINKS:
            q = q * scale  # grouped_attention scales the rounded scores instead
        k_new = _rope_head(k_ptr, kb_ptr, kn_ptr, kh * D, rk, eps, clip, c, s, d, half, dm, sign, D, K_BIAS,
                           NORM, CLIP, dt)
        v_new = _prepared(v_ptr, vb_ptr, v_ptr, kh * D + d, dm, 1.0, clip, V_BIAS, False, CLIP, dt)
        if h % group == 0:
            tl.store(kc_ptr + pos * row_len + kh * D + d, k_new.to(dt), mask=dm)
            tl.store(vc_ptr + pos * row_len + kh * D + d, v_new.to(dt), mask=dm)
        lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
        if SINKS:
            m_i = tl.load(sink_ptr + h).to(tl.float32)
            l_i = 1.0  # exp(sink - m_i)
        else:
            m_i = -float("inf")
            l_i = 0.0
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for s0 in range(lo // BLOCK_S * BLOCK_S, pos + 1, BLOCK_S):
            t = s0 + tl.arange(0, BLOCK_S)
            cached = (t >= lo) & (t < pos)
            off = t[:, None] * row_len + kh * D + d[None, :]
            is_new = (t == pos)[:, None]
            k = tl.load(kc_ptr + off, mask=cached[:, None] & dm[None, :], other=0.0).to(tl.float32)
            k = tl.where(is_new, k_new[None, :], k)
            score = tl.sum(k * q[None, :], axis=1)
            if SINKS:
                score = _round(score, dt) * scale
            score = tl.where(cached | (t == pos), score, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(score, axis=0))
            p = tl.exp(score - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(vc_ptr + off, mask=cached[:, None] & dm[None, :], other=0.0).to(tl.float32)
            v = tl.where(is_new, v_new[None, :], v)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        tl.store(out_ptr + h * D + d, (acc / l_i).to(out_ptr.dtype.element_ty), mask=dm)

    @triton.jit
    def _router_dot(h_ptr, r_ptr, b_ptr, e, H, E, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr):
        """Router logits of experts e (+ bias), rounded as F.linear's output dtype rounds them."""
        acc = tl.zeros(e.shape, tl.float32)
        for k0 in range(0, H, BLOCK_H):
            k = k0 + tl.arange(0, BLOCK_H)
            x = tl.load(h_ptr + k, mask=k < H, other=0.0).to(tl.float32)
            w = tl.load(r_ptr + e[:, None] * H + k[None, :], mask=(e[:, None] < E) & (k[None, :] < H),
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e, mask=e < E, other=0.0).to(tl.float32)
        return _round(acc, h_ptr.dtype.element_ty)

    @triton.jit
    def _router_logits_kernel(h_ptr, r_ptr, b_ptr, out_ptr, H, E, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                              BLOCK_H: tl.constexpr):
        e = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        tl.store(out_ptr + e, _router_dot(h_ptr, r_ptr, b_ptr, e, H, E, HAS_BIAS, BLOCK_H), mask=e < E)

    @triton.jit
    def _route_kernel(h_ptr, r_ptr, b_ptr, w_ptr, ids_ptr, H, l_ptr, fw_ptr, fi_ptr, ow_ptr, oi_ptr,
                      E: tl.constexpr, BLOCK_E: tl.constexpr, TOPK: tl.constexpr, BLOCK_H: tl.constexpr,
                      HAS_BIAS: tl.constexpr, NORM: tl.constexpr, LOGITS: tl.constexpr, FORCED: tl.constexpr):
        """The softmax's top-k of the router's logits: computed here, or (LOGITS) read from l_ptr;
        FORCED: then the forced choice (fw, fi) copied into (ow, oi)."""
        e = tl.arange(0, BLOCK_E)
        if LOGITS:
            logits = tl.load(l_ptr + e, mask=e < E, other=-float("inf"))
        else:
            logits = tl.where(e < E, _router_dot(h_ptr, r_ptr, b_ptr, e, H, E, HAS_BIAS, BLOCK_H), -float("inf"))
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = p / tl.sum(p, axis=0)
        # top-k by repeated argmax (lowest index among equals); twice: the sum of the k
        # probabilities first (in top-k order, as weights.sum()), then the renormalised weights
        total = 0.0
        rest = p
        for j in tl.static_range(TOPK):  # noqa: B007 - Triton unrolls it; j is not needed here
            best = tl.max(rest, axis=0)
            total += best
            rest = tl.where(e == tl.min(tl.where(rest == best, e, BLOCK_E), axis=0), -1.0, rest)
        rest = p
        for j in tl.static_range(TOPK):
            best = tl.max(rest, axis=0)
            idx = tl.min(tl.where(rest == best, e, BLOCK_E), axis=0)
            tl.store(ids_ptr + j, idx.to(tl.int64))
            if NORM:
                tl.store(w_ptr + j, best / total)
            else:
                tl.store(w_ptr + j, best)
            rest = tl.where(e == idx, -1.0, rest)
        if FORCED:
            for j in tl.static_range(TOPK):
                tl.store(oi_ptr + j, tl.load(fi_ptr + j))
                tl.store(ow_ptr + j, tl.load(fw_ptr + j))
