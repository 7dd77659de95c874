"""One decoded token's norms, attention and routing on the CPU in compiled loops (CpuDecodeOps).

Eagerly, a decoded token's layer is about 45 small PyTorch operations besides its matrix
products (the RMS norm alone is 7, RoPE 10, the router 7). Each takes a few microseconds while
the processor's caches hold PyTorch's code and data, and three to four times that right after
an expert kernel has streamed megabytes of weights through them (on the 2-core box: the RMS
norm of 2048 floats 22 us in a loop, 70 us after a 4.4 MB product), which is how a CPU decode
runs: at Qwen3-30B-A3B's shapes the norms, the attention besides its products and the router
took about 0.9 ms of a decoded layer's 6 (2 threads). These functions do the same maths for one
token in a few numba-compiled loops (no compiler needed on the user's machine, as the expert
kernels), in float32, the CPU engine's dtype:

  add_rms_norm    x += delta; out = rms_norm(x) * weight
  rope_attention  the layer's q/k/v preparation (biases, q/k RMSNorm per head or over the whole
                  projection, clipping), RoPE, k and v into the KV cache row, and the token
                  against every cached position (GQA, sliding window, attention sinks; over
                  more than COMPILED_SPAN positions with torch's batched products)
  route_topk      router logits (+ bias), softmax, top-k, renormalised or not

They take the options of engine/kernels/decode.py's GPU kernels and agree with the eager
operations (engine/runtime/model.py, the reference) up to float32 summation order
(tests/engine/kernels/test_decode_cpu.py). A prompt (T > 1) stays eager.
"""

from __future__ import annotations

import numpy as np
import torch

from moeferry.engine.kernels.hqq_cpu import numba_disk_cache
from moeferry.engine.runtime.model import EagerOps, Step, attention_options, expand_units, grouped_attention

_JIT = None
_NONE = np.zeros(1, dtype=np.float32)  # an option that is off (numba compiles one signature)
# Cached positions up to which rope_attention's own loops compute the scores and their sum;
# beyond, torch's batched products are faster where heads share a key/value head (2-core box,
# 2 threads, one call in a loop; ours / torch's: 32 heads on 4 of 128 at 256 positions 106-131 /
# 124-126 us, at 512 241-361 / 222-336, at 1024 456-755 / 321-622; 32 on 8 at 384 294-478 /
# 223-246; 16 heads on 16, ours 8-55 % less time up to 1024 and level at 2048)
COMPILED_SPAN = 384


def kernels():
    """The compiled functions (compiled, or read from numba's disk cache, on first use)."""
    global _JIT
    if _JIT is None:
        _JIT = _compile()
    return _JIT


def use_compiled_decode(model) -> None:
    """Decode a lone token with CpuDecodeOps where the model runs on the CPU in float32 with its
    experts on the numba kernels (model.hybrid: a model too big for the CPU's expert cache). numba
    compiles these functions once per machine (once per run in the frozen app, which cannot
    cache them: seconds), which a small model decoding eagerly (the demo) would not earn back.
    The engine's loader calls this; a model made otherwise decodes eagerly."""
    if model.device.type == "cpu" and model.dtype == torch.float32 and model.hybrid is not None:
        model.decode_ops = CpuDecodeOps(model)


class CpuDecodeOps(EagerOps):
    """EagerOps for one token (T = 1) on the CPU, its norms, attention and routing compiled:
    4 compiled calls for a layer besides its matrix products, instead of about 45 operations."""

    def __init__(self, model):
        super().__init__(model)
        cfg = model.cfg
        self.attn = torch.zeros(1, cfg.num_heads * cfg.head_dim)
        k = cfg.top_k // cfg.expert_units  # the router's choice before expand_units
        self.routed_weights, self.routed_ids = torch.zeros(k), torch.zeros(k, dtype=torch.long)

    def add_norm(self, x, delta, weight, out, bias=None) -> None:  # bias: None (attention adds the o bias)
        add_rms_norm(x, delta, weight, self.m.cfg.rms_norm_eps, out)

    def attention(self, i: int, layer: dict, s: Step) -> torch.Tensor:
        m, cfg = self.m, self.m.cfg
        q, k, v = (m.linear(s.hn, layer[n]) for n in ("q_proj", "k_proj", "v_proj"))  # biases: in the kernel
        rope_attention(q, k, v, s.cos, s.sin, s.start, m.kv.k[i], m.kv.v[i], layer.get("window", cfg.sliding_window),
                       self.attn, **attention_options(layer, cfg.rms_norm_eps))
        return m.project(self.attn, layer, "o_proj")

    def route(self, layer: dict, h, weights, ids) -> None:
        units = self.m.cfg.expert_units
        w, e = (weights[0], ids[0]) if units == 1 else (self.routed_weights, self.routed_ids)
        route_topk(h, layer["router"], len(e), w, e, layer.get("router_bias"),
                   renormalize=layer.get("routing") != "softmax_topk")
        if units > 1:
            w, e = expand_units(w, e, units)
            weights[0].copy_(w)
            ids[0].copy_(e)


def _parallel() -> bool:
    """Whether the attention's and the router's loops take numba's threads: not where the engine
    runs torch on one thread (a small model: the demo), where numba's count may still be every
    core, and spinning threads collapse when another program holds one of them."""
    return torch.get_num_threads() > 1


def _flat(t: torch.Tensor | None) -> np.ndarray:
    """A tensor's values, flat, for reading (_NONE for an option that is off)."""
    return _NONE if t is None else t.numpy().reshape(-1)


def _into(t: torch.Tensor) -> np.ndarray:
    """A tensor the kernels write: a numpy view of its memory, flat (a reshape of a tensor not
    contiguous would copy, and the writes would be lost)."""
    if not t.is_contiguous():
        raise ValueError("decode_cpu writes only contiguous tensors")
    return t.numpy().reshape(-1)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> None:
    """x [1, H] += delta (when given), then out = rms_norm(x) * weight (float32, in place)."""
    kernels().add_rms_norm(_into(x), _flat(delta), delta is not None, _flat(weight), eps, _into(out))


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None,
                   out: torch.Tensor, *, qk_norm: str | None = None, q_norm: torch.Tensor | None = None,
                   k_norm: torch.Tensor | None = None, eps: float = 0.0, clip: float | None = None,
                   q_bias: torch.Tensor | None = None, k_bias: torch.Tensor | None = None,
                   v_bias: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> None:
    """One decoded token's attention at position pos, as engine/kernels/decode.rope_attention
    (the same options) but with cos and sin of that position only ([D] values, any shape):
    q [heads * D], k and v [kv_heads * D] as projected (any shape; not modified); k_cache,
    v_cache [capacity, kv_heads, D], row pos written; out [heads * D]. Over more than
    COMPILED_SPAN positions the scores and their sum are torch's (model.grouped_attention)."""
    kv_heads, D = k_cache.shape[1:]
    if not 0 <= pos < k_cache.shape[0] or k.numel() != kv_heads * D or q.numel() % (kv_heads * D):
        # the compiled loops check no bounds: a row past the cache would be written anyway
        raise IndexError(f"rope_attention: position {pos} in a cache of {k_cache.shape[0]}, "
                         f"q of {q.numel()} and k of {k.numel()} values for {kv_heads} heads of {D}")
    norm = {None: 0, "head": 1, "full": 2}[qk_norm]
    lo = max(0, pos - window + 1) if window else 0
    compiled = pos + 1 - lo <= COMPILED_SPAN
    kernels().rope_attention(
        _flat(q), _flat(k), _flat(v), _flat(q_bias), _flat(k_bias), _flat(v_bias), _flat(q_norm), _flat(k_norm),
        _flat(sinks), norm, q_bias is not None, k_bias is not None, v_bias is not None, sinks is not None,
        clip or 0.0, eps, _flat(cos), _flat(sin), _into(k_cache).reshape(-1, kv_heads, D),
        _into(v_cache).reshape(-1, kv_heads, D), pos, lo, D ** -0.5, _into(out), _parallel(), compiled)
    if not compiled:  # out holds the prepared q
        q_ready = out.reshape(1, q.numel() // D, D)  # read whole before the copy writes out
        out.view(-1).copy_(grouped_attention(q_ready, k_cache[lo:pos + 1], v_cache[lo:pos + 1], None, sinks).view(-1))


def route_topk(h: torch.Tensor, router: torch.Tensor, top_k: int, weights: torch.Tensor, ids: torch.Tensor,
               bias: torch.Tensor | None = None, renormalize: bool = True) -> None:
    """weights [top_k] float32 and ids [top_k] int64 of h [1, H] under router [E, H] (+ bias [E]):
    the top-k of the softmax, renormalised to sum 1 or as they are."""
    kernels().route_topk(_flat(h), router.numpy(), _flat(bias), bias is not None, top_k, renormalize,
                         _into(weights), _into(ids), _parallel())


def _compile():
    # Module globals, not closure variables: numba keys its disk cache on a pickle of the
    # closure, in which a dispatcher has a fresh id in every process (hqq_cpu.py does the same).
    global prange, _add_rms_norm, _rms_norm, _prepared, _head_rope, _rope_attention, _attend, _attend_parallel
    global _attend_group, _exp_in_place, _router_logit, _router_logits, _router_logits_parallel, _route_topk
    from numba import njit, prange

    # reassociation lets the loops over a head or a row run in vector lanes; no other
    # liberties (the results are compared with the eager path's)
    options = dict(fastmath={"reassoc", "contract"}, nogil=True, cache=numba_disk_cache())
    jit, pjit = njit(**options), njit(parallel=True, **options)

    @jit
    def _add_rms_norm(x, delta, has_delta, w, eps, out):
        if has_delta:
            x += delta
        _rms_norm(x, w, eps, out)

    @jit
    def _rms_norm(x, w, eps, out):
        """out = rms_norm(x) * w (out may be x)."""
        total = 0.0  # float64
        for i in range(x.size):
            total += np.float64(x[i]) * x[i]
        r = np.float32(1.0 / np.sqrt(total / x.size + eps))
        for i in range(x.size):
            out[i] = w[i] * (x[i] * r)

    @jit
    def _prepared(x, b, has_bias, w, norm, eps, clip):
        """A projection as model.attention has it before the heads split: a copy, + bias, the
        norm over the whole projection (norm 2), clamped to +-clip."""
        y = x.copy()
        if has_bias:
            y += b
        if norm == 2:
            _rms_norm(y, w, eps, y)
        if clip > 0:
            for i in range(y.size):
                y[i] = min(max(y[i], -clip), clip)
        return y

    @jit
    def _head_rope(x, heads, D, w, norm, eps, cos, sin):
        """Each head of x [heads * D], RMS-normed with w [D] (norm 1), then rotated, in place."""
        half = D // 2
        for h in range(heads):
            row = x[h * D:(h + 1) * D]
            if norm == 1:
                _rms_norm(row, w, eps, row)
            for d in range(half):
                a, b = row[d], row[d + half]
                row[d] = a * cos[d] + (-b) * sin[d]
                row[d + half] = b * cos[d + half] + a * sin[d + half]

    @jit
    def _rope_attention(q, k, v, qb, kb, vb, qn, kn, sinks, norm, q_bias, k_bias, v_bias, has_sinks, clip, eps,
                       cos, sin, kc, vc, pos, lo, scale, out, parallel, attend):
        """rope_attention over cache rows lo..pos; attend False: only the cache row, and the
        prepared q into out."""
        kv_heads, D = kc.shape[1], kc.shape[2]
        heads = q.size // D
        group = heads // kv_heads
        qw = _prepared(q, qb, q_bias, qn, norm, eps, clip)
        kw = _prepared(k, kb, k_bias, kn, norm, eps, clip)
        vw = _prepared(v, vb, v_bias, kn, 0, eps, clip)
        _head_rope(qw, heads, D, qn, norm, eps, cos, sin)
        _head_rope(kw, kv_heads, D, kn, norm, eps, cos, sin)
        for h in range(kv_heads):
            for d in range(D):
                kc[pos, h, d] = kw[h * D + d]
                vc[pos, h, d] = vw[h * D + d]
        if not attend:
            out[:] = qw
        elif parallel:
            _attend_parallel(qw, kc, vc, lo, pos + 1 - lo, group, scale, sinks, has_sinks, out)
        else:
            _attend(qw, kc, vc, lo, pos + 1 - lo, group, scale, sinks, has_sinks, out)

    @jit
    def _attend(qw, kc, vc, lo, n, group, scale, sinks, has_sinks, out):
        """out = softmax(q k^T * scale) v for each query head of qw over cache rows lo..lo+n-1,
        one key/value head after another."""
        for kh in range(kc.shape[1]):
            _attend_group(qw, kc, vc, lo, n, group, scale, sinks, has_sinks, out, kh)

    @pjit
    def _attend_parallel(qw, kc, vc, lo, n, group, scale, sinks, has_sinks, out):
        """_attend with the key/value heads on numba's threads."""
        for kh in prange(kc.shape[1]):
            _attend_group(qw, kc, vc, lo, n, group, scale, sinks, has_sinks, out, kh)

    @jit
    def _attend_group(qw, kc, vc, lo, n, group, scale, sinks, has_sinks, out, kh):
        """The query heads of key/value head kh together: each cached row of k and v read once
        for all of them."""
        D = kc.shape[2]
        q = qw[kh * group * D:(kh + 1) * group * D]
        scores = np.empty((group, n), dtype=np.float32)
        for t in range(n):
            key = kc[lo + t, kh]
            for j in range(group):
                s = np.float32(0.0)
                for d in range(D):
                    s += q[j * D + d] * key[d]
                scores[j, t] = s * scale
        for j in range(group):
            row = scores[j]
            top = sinks[kh * group + j] if has_sinks else row[0]
            for t in range(n):
                top = max(top, row[t])
            for t in range(n):
                row[t] -= top
            _exp_in_place(row)
            total = np.float32(np.exp(sinks[kh * group + j] - top)) if has_sinks else np.float32(0.0)
            for t in range(n):
                total += row[t]
            row /= total
        acc = np.zeros((group, D), dtype=np.float32)
        for t in range(0, n - 1, 2):  # two rows of v per pass over acc
            v0, v1 = vc[lo + t, kh], vc[lo + t + 1, kh]
            for j in range(group):
                p0, p1 = scores[j, t], scores[j, t + 1]
                for d in range(D):
                    acc[j, d] += p0 * v0[d] + p1 * v1[d]
        if n % 2:
            value = vc[lo + n - 1, kh]
            for j in range(group):
                p = scores[j, n - 1]
                for d in range(D):
                    acc[j, d] += p * value[d]
        for j in range(group):
            out[(kh * group + j) * D:(kh * group + j + 1) * D] = acc[j]

    @jit
    def _exp_in_place(x):
        """x = exp(x) for x <= 0, in loops the compiler vectorizes (numba's np.exp calls the C
        library once per value): 2^k times a degree-7 polynomial of the remainder, |r| <= ln 2 / 2,
        within about an ulp; below -87 (e^-87 ~ 1.6e-38) as e^-87."""
        powers = np.empty(x.size, dtype=np.int32)
        for t in range(x.size):
            v = max(x[t], np.float32(-87.0))
            k = np.floor(v * np.float32(1.4426950408889634) + np.float32(0.5))
            r = v - k * np.float32(0.693145751953125) - k * np.float32(1.428606765330187e-06)
            x[t] = np.float32(1.0) + r * (np.float32(1.0) + r * (np.float32(0.5) + r * (
                np.float32(1.0 / 6) + r * (np.float32(1.0 / 24) + r * (np.float32(1.0 / 120) + r * (
                    np.float32(1.0 / 720) + r * np.float32(1.0 / 5040)))))))
            powers[t] = (np.int32(k) + 127) << 23
        x *= powers.view(np.float32)

    @jit
    def _router_logit(h, router, bias, has_bias, e):
        s = np.float32(0.0)
        for i in range(router.shape[1]):
            s += router[e, i] * h[i]
        return s + bias[e] if has_bias else s

    @jit
    def _router_logits(h, router, bias, has_bias, p):
        """p = router h (+ bias)."""
        for e in range(router.shape[0]):
            p[e] = _router_logit(h, router, bias, has_bias, e)

    @pjit
    def _router_logits_parallel(h, router, bias, has_bias, p):
        """_router_logits with the experts' rows on numba's threads (Qwen3's router is 1 MB)."""
        for e in prange(router.shape[0]):
            p[e] = _router_logit(h, router, bias, has_bias, e)

    @jit
    def _route_topk(h, router, bias, has_bias, top_k, renormalize, weights, ids, parallel):
        E = router.shape[0]
        p = np.empty(E, dtype=np.float32)
        if parallel:
            _router_logits_parallel(h, router, bias, has_bias, p)
        else:
            _router_logits(h, router, bias, has_bias, p)
        top = p.max()
        total = np.float32(0.0)
        for e in range(E):
            p[e] = np.exp(p[e] - top)
            total += p[e]
        p /= total
        picked = np.float32(0.0)
        for j in range(top_k):  # the largest left, the lowest index among equals
            best = 0
            for e in range(1, E):
                if p[e] > p[best]:
                    best = e
            ids[j], weights[j] = best, p[best]
            picked += p[best]
            p[best] = -1.0
        if renormalize:
            for j in range(top_k):
                weights[j] /= picked

    from types import SimpleNamespace
    return SimpleNamespace(add_rms_norm=_add_rms_norm, rope_attention=_rope_attention, route_topk=_route_topk)
