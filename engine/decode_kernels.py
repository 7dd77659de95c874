"""Fused Triton kernels for the small steps of a batch-1 decode step (CUDA graphs only).

Eagerly, one decoded token's attention and routing is about 45 tiny PyTorch kernels per layer
(the RMS norm alone is 7, RoPE 10, the router 7); inside a CUDA graph each still costs one
dependent launch, 2-3 us on an H200, more than the work. These kernels do the same maths in
4 launches (besides the q, k+v and o GEMVs of kernels.py):

  add_rms_norm     x += delta; h = rms_norm(x) * weight (twice)
  rope_attention   RoPE on q and k at the position held on the device, k and v into the KV
                   cache, and the one query token against all cached positions (GQA, causal,
                   sliding window)
  route_topk       router logits, softmax, top-k, renormalised, as transformers' Mixtral

Each rounds its intermediate results to the model's dtype where the eager path does, so the
two paths agree up to float32 summation order (tests/test_decode_kernels.py). The eager
functions of engine/model.py remain the reference, and what prefill and the CPU run.
"""

from __future__ import annotations

import torch

from engine.kernels import tl, triton


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
               ids: torch.Tensor) -> None:
    """weights [top_k] float32 and ids [top_k] int64 of h [1, H] under router [E, H]."""
    E, H = router.shape
    _route_kernel[(1,)](h, router, weights, ids, H, E=E, BLOCK_E=triton.next_power_of_2(E),
                        TOPK=top_k, BLOCK_H=min(1024, triton.next_power_of_2(H)), num_warps=4)


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
    def _route_kernel(h_ptr, r_ptr, w_ptr, ids_ptr, H, E: tl.constexpr, BLOCK_E: tl.constexpr,
                      TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
        dt: tl.constexpr = h_ptr.dtype.element_ty
        e = tl.arange(0, BLOCK_E)
        acc = tl.zeros((BLOCK_E,), tl.float32)
        for k0 in range(0, H, BLOCK_H):
            k = k0 + tl.arange(0, BLOCK_H)
            x = tl.load(h_ptr + k, mask=k < H, other=0.0).to(tl.float32)
            w = tl.load(r_ptr + e[:, None] * H + k[None, :], mask=(e[:, None] < E) & (k[None, :] < H),
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
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
            tl.store(w_ptr + j, best / total)
            rest = tl.where(e == idx, -1.0, rest)
