"""The layer's operations for one decoded token on fused kernels (FusedOps), and those kernels.

Eagerly, one decoded token's attention and routing is about 45 tiny PyTorch kernels per layer
(the RMS norm alone is 7, RoPE 10, the router 7); inside a CUDA graph each still costs one
dependent launch, 2-3 us on an H200, more than the work. These kernels do the same maths in
4 launches (besides the q, k+v and o GEMVs of kernels.py):

  add_rms_norm     x += delta; h = rms_norm(x) * weight (twice)
  rope_attention   RoPE on q and k at the position held on the device, k and v into the KV
                   cache, and the one query token against all cached positions (GQA, causal,
                   sliding window)
  route_topk       router logits (+ bias), softmax, top-k, renormalised or not: each family's
                   router (gpt_oss's softmax over the top-k logits is the renormalised top-k
                   of the softmax)

FusedOps is engine/model.EagerOps with these kernels wherever a layer's options allow them:
attention only without q/k norms, clipping, biases or sinks and with a power-of-two head
size; the others run the eager operation, inside the same graph. Its `experts` is the grouped
expert kernel (hqq_gpu.moe_decode for HQQ SwiGLU experts, mxfp4_gpu.moe_decode for gpt-oss's
MXFP4 ones), which the graph runner enables when the cache's expert format supports it
(grouped_supported). Each kernel rounds its intermediate results to the model's dtype where
the eager path does, so the two paths agree up to float32 summation order
(tests/engine/kernels/test_decode.py); the eager operations remain the reference, and what prefill
and the CPU run.
"""

from __future__ import annotations

import torch

from moeferry.engine.kernels import hqq_gpu, mxfp4_gpu
from moeferry.engine.kernels.hqq_gpu import tl, triton
from moeferry.engine.runtime.model import ATTN_PROJECTIONS, EagerOps, Step
from moeferry.engine.storage.mxfp4 import Mxfp4Matrix


class FusedOps(EagerOps):
    """EagerOps for one token (T = 1) on the fused kernels: 8 launches for a Mixtral layer's
    attention and routing instead of about 45, 2 more per prefetch guess."""

    def __init__(self, model, grouped: bool = False):
        super().__init__(model)
        cfg, dev, dt = model.cfg, model.device, model.dtype
        self.grouped = grouped
        self.attn = torch.zeros(1, cfg.num_heads * cfg.head_dim, dtype=dt, device=dev)
        self.k_new = torch.zeros(1, cfg.num_kv_heads * cfg.head_dim, dtype=dt, device=dev)
        self.v_new = torch.zeros_like(self.k_new)
        self.guess_weights = torch.zeros(cfg.top_k, dtype=torch.float32, device=dev)
        # a subset of the top-k (the others on the CPU): its positions, ids and weights
        self.at_host = torch.zeros(cfg.top_k, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.at = torch.zeros(cfg.top_k, dtype=torch.long, device=dev)
        self.at_ids = torch.zeros(cfg.top_k, dtype=torch.long, device=dev)
        self.at_weights = torch.zeros(cfg.top_k, dtype=torch.float32, device=dev)

    def add_norm(self, x, delta, weight, out) -> None:
        add_rms_norm(x, delta, weight, self.m.cfg.rms_norm_eps, out)

    def fused_attention(self, layer: dict) -> bool:
        D = self.m.cfg.head_dim
        plain = not any(k in layer for k in ("qk_norm", "clip_qkv", "sinks")) and \
            not any(n + "_bias" in layer for n in ATTN_PROJECTIONS)
        return plain and D & (D - 1) == 0

    def span(self, layer: dict, s: Step) -> int:
        return 0 if self.fused_attention(layer) else s.span  # the fused one reads pos only

    def attention(self, i: int, layer: dict, s: Step) -> torch.Tensor:
        if not self.fused_attention(layer):
            return super().attention(i, layer, s)
        m, cfg = self.m, self.m.cfg
        q = m.linear(s.hn, layer["q_proj"]).view(cfg.num_heads, cfg.head_dim)
        if hqq_gpu.pair_supported(layer["k_proj"], layer["v_proj"]):
            hqq_gpu.gemv_pair(s.hn, layer["k_proj"], layer["v_proj"], self.k_new, self.v_new)
            k, v = self.k_new, self.v_new
        else:
            k, v = m.linear(s.hn, layer["k_proj"]), m.linear(s.hn, layer["v_proj"])
        rope_attention(q, k.view(cfg.num_kv_heads, cfg.head_dim), v.view(cfg.num_kv_heads, cfg.head_dim),
                       s.cos, s.sin, s.pos, m.kv.k[i], m.kv.v[i], layer.get("window", cfg.sliding_window),
                       self.attn)
        return m.linear(self.attn, layer["o_proj"])

    def route(self, layer: dict, h, weights, ids) -> None:
        route_topk(h, layer["router"], self.m.cfg.top_k, weights[0], ids[0], layer.get("router_bias"),
                   renormalize=layer.get("routing") != "softmax_topk")

    def guess(self, j: int, x, scratch, ids) -> None:
        layer = self.m.moe_layers[j]
        add_rms_norm(x, None, layer["moe_norm"], self.m.cfg.rms_norm_eps, scratch)
        route_topk(scratch, layer["router"], self.m.cfg.top_k, self.guess_weights, ids, layer.get("router_bias"))

    def stage(self, at: list[int]) -> None:
        """Send the top-k positions that experts(n=len(at)) runs (host, outside any graph; the
        buffer is rewritten only after the next routing sync)."""
        for j, p in enumerate(at):  # no tensor made per layer and token
            self.at_host[j] = p
        self.at[:len(at)].copy_(self.at_host[:len(at)], non_blocking=True)

    def experts(self, mi: int, s: Step, ids: torch.Tensor, n: int | None = None) -> None:
        """out = the weighted sum of MoE layer mi's routed experts, in two launches that read
        each expert's slot from the cache's device table; n: only the n positions staged."""
        cache = self.m.cache
        ids, weights = ids[0], s.weights[0]
        if n is not None:
            torch.index_select(ids, 0, self.at[:n], out=self.at_ids[:n])
            torch.index_select(weights, 0, self.at[:n], out=self.at_weights[:n])
            ids, weights = self.at_ids[:n], self.at_weights[:n]
        self.moe_decode(s.h, cache.slot_weights(mi, 0), cache.slot_bytes, ids, weights, cache.device_table(mi), s.out)

    def grouped_supported(self, experts: dict) -> bool:
        """Whether a grouped kernel runs these expert views (of one cache slot) in this family."""
        if isinstance(experts["w1"], Mxfp4Matrix):
            return self.m.cfg.expert_act == "clamped_swiglu" and mxfp4_gpu.moe_supported(experts)
        return self.m.cfg.expert_act == "silu" and hqq_gpu.moe_supported(experts)

    def moe_decode(self, h, experts: dict, slot_bytes: int, ids, weights, table, out) -> None:
        """The grouped kernel of the experts' format (grouped_supported): out = their weighted sum."""
        if isinstance(experts["w1"], Mxfp4Matrix):
            cfg = self.m.cfg
            mxfp4_gpu.moe_decode(h, experts, slot_bytes, ids, weights, table, out, cfg.swiglu_alpha, cfg.swiglu_limit)
        else:
            hqq_gpu.moe_decode(h, experts, slot_bytes, ids, weights, table, out)



def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> None:
    """x [1, H] += delta (when given, in x's dtype), then out = rms_norm(x) * weight."""
    H = x.shape[-1]
    _add_rms_norm_kernel[(1,)](x, x if delta is None else delta, weight, out, H, eps,
                               HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(H),
                               num_warps=8)


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   window: int | None, out: torch.Tensor) -> None:
    """One decoded token's attention at position pos[0] (a device tensor).

    q [heads, D], k and v [kv_heads, D] as projected; cos, sin [positions, D] tables
    (model.rope_cos_sin); k_cache, v_cache [capacity, kv_heads, D]. Rotates q and k, writes k
    and v into cache row pos, and writes out [heads * D] = softmax(q k^T / sqrt(D)) v over rows
    [max(0, pos - window + 1), pos]. q is not modified.
    """
    heads, D = q.shape
    kv_heads = k.shape[0]
    _rope_attention_kernel[(heads,)](q, k, v, cos, sin, pos, k_cache, v_cache, out, heads // kv_heads,
                                     kv_heads * D, window or 0, D ** -0.5, D=D, BLOCK_S=64, num_warps=4)


def route_topk(h: torch.Tensor, router: torch.Tensor, top_k: int, weights: torch.Tensor,
               ids: torch.Tensor, bias: torch.Tensor | None = None, renormalize: bool = True) -> None:
    """weights [top_k] float32 and ids [top_k] int64 of h [1, H] under router [E, H] (+ bias [E]):
    the top-k of the softmax, renormalised to sum 1 or as they are."""
    E, H = router.shape
    _route_kernel[(1,)](h, router, router if bias is None else bias, weights, ids, H, E=E,
                        BLOCK_E=triton.next_power_of_2(E), TOPK=top_k,
                        BLOCK_H=min(1024, triton.next_power_of_2(H)), HAS_BIAS=bias is not None,
                        NORM=renormalize, num_warps=4)


if triton is not None:
    @triton.jit
    def _round(v, dt: tl.constexpr):
        return v.to(dt).to(tl.float32)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, H, eps, HAS_DELTA: tl.constexpr,
                             BLOCK: tl.constexpr):
        dt: tl.constexpr = x_ptr.dtype.element_ty
        i = tl.arange(0, BLOCK)
        m = i < H
        x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
        if HAS_DELTA:
            x = _round(x + tl.load(d_ptr + i, mask=m, other=0.0).to(tl.float32), dt)
            tl.store(x_ptr + i, x.to(dt), mask=m)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        y = _round(x * r, dt) * tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rope(x_ptr, c, s, d, half, sign, dt: tl.constexpr):
        """apply_rope of one head [D], rounded as the eager path: x*cos, rotated*sin, their sum."""
        x = tl.load(x_ptr + d).to(tl.float32)
        xr = tl.load(x_ptr + half).to(tl.float32) * sign
        return _round(_round(x * c, dt) + _round(xr * s, dt), dt)

    @triton.jit
    def _rope_attention_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, out_ptr,
                               group, row_len, window, scale, D: tl.constexpr, BLOCK_S: tl.constexpr):
        """One query head h. Every program of a key/value group rotates that group's new key
        itself (D values) and uses it for position pos from registers; the group's first program
        also writes it (and the value) into the cache, which the others therefore never read
        at row pos. Online softmax over the positions, BLOCK_S at a time."""
        dt: tl.constexpr = kc_ptr.dtype.element_ty
        h = tl.program_id(0)
        kh = h // group
        pos = tl.load(pos_ptr)
        d = tl.arange(0, D)
        half = (d + D // 2) % D  # rotate_half: [-x2, x1]
        sign = tl.where(d < D // 2, -1.0, 1.0)
        c = tl.load(cos_ptr + pos * D + d).to(tl.float32)
        s = tl.load(sin_ptr + pos * D + d).to(tl.float32)
        q = _rope(q_ptr + h * D, c, s, d, half, sign, dt) * scale
        k_new = _rope(k_ptr + kh * D, c, s, d, half, sign, dt)
        v_new = tl.load(v_ptr + kh * D + d).to(tl.float32)
        if h % group == 0:
            tl.store(kc_ptr + pos * row_len + kh * D + d, k_new.to(dt))
            tl.store(vc_ptr + pos * row_len + kh * D + d, v_new.to(dt))
        lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
        m_i = -float("inf")
        l_i = 0.0
        acc = tl.zeros((D,), tl.float32)
        for s0 in range(lo // BLOCK_S * BLOCK_S, pos + 1, BLOCK_S):
            t = s0 + tl.arange(0, BLOCK_S)
            cached = (t >= lo) & (t < pos)
            off = t[:, None] * row_len + kh * D + d[None, :]
            is_new = (t == pos)[:, None]
            k = tl.load(kc_ptr + off, mask=cached[:, None], other=0.0).to(tl.float32)
            k = tl.where(is_new, k_new[None, :], k)
            score = tl.where(cached | (t == pos), tl.sum(k * q[None, :], axis=1), -float("inf"))
            m_new = tl.maximum(m_i, tl.max(score, axis=0))
            p = tl.exp(score - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(vc_ptr + off, mask=cached[:, None], other=0.0).to(tl.float32)
            v = tl.where(is_new, v_new[None, :], v)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        tl.store(out_ptr + h * D + d, (acc / l_i).to(out_ptr.dtype.element_ty))

    @triton.jit
    def _route_kernel(h_ptr, r_ptr, b_ptr, w_ptr, ids_ptr, H, E: tl.constexpr, BLOCK_E: tl.constexpr,
                      TOPK: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr):
        dt: tl.constexpr = h_ptr.dtype.element_ty
        e = tl.arange(0, BLOCK_E)
        acc = tl.zeros((BLOCK_E,), tl.float32)
        for k0 in range(0, H, BLOCK_H):
            k = k0 + tl.arange(0, BLOCK_H)
            x = tl.load(h_ptr + k, mask=k < H, other=0.0).to(tl.float32)
            w = tl.load(r_ptr + e[:, None] * H + k[None, :], mask=(e[:, None] < E) & (k[None, :] < H),
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e, mask=e < E, other=0.0).to(tl.float32)
        logits = tl.where(e < E, _round(acc, dt), -float("inf"))  # F.linear's output dtype
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
