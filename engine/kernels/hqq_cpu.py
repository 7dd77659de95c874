"""HQQ-packed experts multiplied on the CPU, straight from the bytes the GPU cache copies.

The CPU+GPU hybrid (engine/runtime/cpu_experts.py) computes some missed experts on the CPU. This
kernel reads an expert where it already lies, in the host copy of the experts file (the
layout of engine/storage/quant.py, 2, 3 or 4 bits with 8-bit scales and zeros): no second copy of
the codes in RAM, no conversion at load, and at 2 bits it reads 3 bits per weight where an int4 copy
reads 4.25. It is compiled by numba (LLVM, bundled with the wheel: no compiler needed on
the user's machine) the first time it runs, and cached on disk where numba can cache.

One matrix W [rows, cols] (groups of g rows n = j, j + G, ..., G = rows / g, share the
scale and zero of column k): W[n, k] = (code[n, k] - z[n % G, k]) * s[n % G, k], so
    y[n] = sum_k code[n, k] * xs[n % G, k]  -  sum_k z[n % G, k] * xs[n % G, k]
with xs[j, k] = s[j, k] * x[k]. A thread takes a few groups j at a time: it decodes s and z
of group j once (a row of K values), then streams the group's g rows of codes against it.
The codes of one plane byte belong to rows r, r + rows/p, ... (p codes per byte, the same
group), so each byte is loaded once and feeds p accumulators.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from moeferry.engine.storage.quant import PLANES, QMatrix

_JIT = None


def kernels():
    """The compiled functions (numba is imported on first use: it takes ~0.5 s)."""
    global _JIT
    if _JIT is None:
        _JIT = _compile()
    return _JIT


def available() -> str:
    """"" when numba can run here, else why not (one sentence)."""
    try:
        import numba  # noqa: F401
    except ImportError as e:
        return f"numba is not installed ({e}); the CPU experts use torch's int4 kernel instead."
    return ""


@dataclass
class CpuQMatrix:
    """A QMatrix's arrays as the kernel takes them: numpy views of the same bytes, but for the
    float16 scale/zero metadata, copied as float32 (numba has no float16): about 2 % of the
    stored bytes at 2 bits."""
    rows: int
    cols: int
    bits: int
    group_size: int
    planes: tuple  # uint8 [rows * w / 8, cols] per plane width w of PLANES[bits]
    scale: np.ndarray  # uint8 [G, cols]
    zero: np.ndarray
    scale_meta: np.ndarray  # float32 [2, M]
    zero_meta: np.ndarray

    def nbytes(self) -> int:
        """Bytes the kernel reads per product."""
        return sum(a.nbytes for a in (*self.planes, self.scale, self.zero, self.scale_meta, self.zero_meta))

    def copied_bytes(self) -> int:
        """The float32 metadata: RAM taken beyond the stored bytes."""
        return self.scale_meta.nbytes + self.zero_meta.nbytes


def supported(w) -> bool:
    return (isinstance(w, QMatrix) and w.bits in PLANES and w.bits != 8 and w.scale_meta is not None
            and w.zero_meta is not None and w.scale.dtype == torch.uint8)


def from_qmatrix(w: QMatrix) -> CpuQMatrix:
    """Views of w's tensors (which must lie in host memory)."""
    return CpuQMatrix(w.rows, w.cols, w.bits, w.group_size, tuple(p.numpy() for p in w.planes),
                      w.scale.numpy(), w.zero.numpy(), w.scale_meta.float().numpy(), w.zero_meta.float().numpy())


def _args(w: CpuQMatrix) -> tuple:
    p0 = w.planes[0]
    p1 = w.planes[1] if len(w.planes) > 1 else p0[:0]
    return p0, PLANES[w.bits][0], p1, w.group_size, w.scale, w.scale_meta, w.zero, w.zero_meta


def matmul(x: np.ndarray, w: CpuQMatrix) -> np.ndarray:
    """x float32 [T, cols] -> float32 [T, rows] = x @ W.T."""
    out = np.empty((x.shape[0], w.rows), dtype=np.float32)
    kernels().qmatmul(np.ascontiguousarray(x, dtype=np.float32), *_args(w), out)
    return out


def swiglu_expert(x: np.ndarray, w1: CpuQMatrix, w3: CpuQMatrix, w2: CpuQMatrix) -> np.ndarray:
    """w2 (silu(w1 x) * w3 x) for x float32 [T, H]: float32 [T, H], in one call."""
    T = x.shape[0]
    gate = np.empty((T, w1.rows), dtype=np.float32)
    up = np.empty((T, w3.rows), dtype=np.float32)
    out = np.empty((T, w2.rows), dtype=np.float32)
    kernels().swiglu(np.ascontiguousarray(x, dtype=np.float32), *_args(w1), *_args(w3), *_args(w2), gate, up, out)
    return out


def _compile():
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.extending import intrinsic

    # A frozen app has no source files for numba's cache; compile once per run there.
    cache = not getattr(sys, "frozen", False) and os.access(os.path.dirname(__file__), os.W_OK)
    jit = njit(parallel=True, fastmath=True, nogil=True, cache=cache)
    serial = njit(fastmath=True, nogil=True, cache=cache, inline="always")

    @intrinsic
    def code(typingctx, b, shift, mask):
        """float32((b >> shift) & mask) on 8-bit lanes: numba's own integer maths widens to
        64 bits, which keeps LLVM from vectorizing the loops over bytes (about 3x slower on
        the CI box)."""
        def codegen(context, builder, signature, args):
            return builder.uitofp(builder.and_(builder.lshr(args[0], args[1]), args[2]), ir.FloatType())
        return types.float32(types.uint8, types.uint8, types.uint8), codegen

    zero8, all8 = np.uint8(0), np.uint8(255)

    @serial
    def group_inputs(x, t, j, scale, smeta, zero, zmeta, xs):
        """xs = s[j, :] * x[t, :]; returns sum_k z[j, k] * xs[k]. Value f = j * K + k of
        scale and zero has its meta pair at f % M: runs of k without a wrap are vectorized."""
        K = x.shape[1]
        ms, mz = smeta.shape[1], zmeta.shape[1]
        si, zi = (j * K) % ms, (j * K) % mz
        srow, zrow, xrow = scale[j], zero[j], x[t]
        s_scale, s_zero, z_scale, z_zero = smeta[0], smeta[1], zmeta[0], zmeta[1]
        zsum = np.float32(0.0)
        k0 = 0
        while k0 < K:
            n = min(K - k0, ms - si, mz - zi)
            sq, zq, xk, out = srow[k0:k0 + n], zrow[k0:k0 + n], xrow[k0:k0 + n], xs[k0:k0 + n]
            ss, so, zs, zo = s_scale[si:si + n], s_zero[si:si + n], z_scale[zi:zi + n], z_zero[zi:zi + n]
            for d in range(n):  # slices, so that indices are known non-negative (no gathers)
                v = xk[d] * ((code(sq[d], zero8, all8) - so[d]) * ss[d])
                out[d] = v
                zsum += v * ((code(zq[d], zero8, all8) - zo[d]) * zs[d])
            k0 += n
            si = (si + n) % ms
            zi = (zi + n) % mz
        return zsum

    # One function per code width, each with its accumulators written out: LLVM vectorizes the
    # loop over a row's bytes only when the per-code sums are plain scalars.
    @serial
    def rows_2bit(row, xs):
        a0 = a1 = a2 = a3 = np.float32(0.0)
        m = np.uint8(3)
        for k in range(xs.shape[0]):
            b, v = row[k], xs[k]
            a0 += code(b, np.uint8(6), m) * v
            a1 += code(b, np.uint8(4), m) * v
            a2 += code(b, np.uint8(2), m) * v
            a3 += code(b, zero8, m) * v
        return a0, a1, a2, a3

    @serial
    def rows_4bit(row, xs):
        a0 = a1 = np.float32(0.0)
        m = np.uint8(15)
        for k in range(xs.shape[0]):
            b, v = row[k], xs[k]
            a0 += code(b, np.uint8(4), m) * v
            a1 += code(b, zero8, m) * v
        return a0, a1

    @serial
    def rows_1bit(row, xs):
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        m = np.uint8(1)
        for k in range(xs.shape[0]):
            b, v = row[k], xs[k]
            a0 += code(b, np.uint8(7), m) * v
            a1 += code(b, np.uint8(6), m) * v
            a2 += code(b, np.uint8(5), m) * v
            a3 += code(b, np.uint8(4), m) * v
            a4 += code(b, np.uint8(3), m) * v
            a5 += code(b, np.uint8(2), m) * v
            a6 += code(b, np.uint8(1), m) * v
            a7 += code(b, zero8, m) * v
        return a0, a1, a2, a3, a4, a5, a6, a7

    @serial
    def add_plane(plane, width, mult, j, G, xs, out, t):
        """The rows of group j held by one plane of codes of this width: byte (r, k) holds
        the codes of rows r, r + stride, ... (stride = the plane's row count)."""
        stride = plane.shape[0]
        o = out[t]
        for r in range(j, stride, G):
            if width == 2:
                c = rows_2bit(plane[r], xs)
                for s in range(4):
                    o[r + s * stride] += mult * c[s]
            elif width == 4:
                c2 = rows_4bit(plane[r], xs)
                for s in range(2):
                    o[r + s * stride] += mult * c2[s]
            else:
                c8 = rows_1bit(plane[r], xs)
                for s in range(8):
                    o[r + s * stride] += mult * c8[s]

    @serial
    def group_rows(x, j, plane0, width0, plane1, group_size, scale, smeta, zero, zmeta, out, xs):
        """Rows j, j + G, ... of out [T, rows] = x [T, K] @ W.T (one group of rows).
        plane1 (the 1-bit low plane) is empty but for 3 bits."""
        G = scale.shape[0]
        rows = G * group_size
        low = plane1.shape[0] > 0
        mult0 = np.float32(2.0) if low else np.float32(1.0)  # 3 bits: code = 2 * high + low
        for t in range(x.shape[0]):
            zsum = group_inputs(x, t, j, scale, smeta, zero, zmeta, xs)
            for n in range(j, rows, G):
                out[t, n] = -zsum
            add_plane(plane0, width0, mult0, j, G, xs, out, t)
            if low:
                add_plane(plane1, 1, np.float32(1.0), j, G, xs, out, t)

    @jit
    def qmatmul(x, plane0, width0, plane1, group_size, scale, smeta, zero, zmeta, out):
        for j in prange(scale.shape[0]):
            xs = np.empty(x.shape[1], dtype=np.float32)
            group_rows(x, j, plane0, width0, plane1, group_size, scale, smeta, zero, zmeta, out, xs)

    @jit
    def swiglu(x, a0, aw, a1, ag, a_s, a_sm, a_z, a_zm, b0, bw, b1, bg, b_s, b_sm, b_z, b_zm,
               c0, cw, c1, cg, c_s, c_sm, c_z, c_zm, gate, up, out):
        """out = w2 (silu(w1 x) * w3 x): a = w1, b = w3, c = w2 (planes, width, low plane,
        group size, scale, its meta, zero, its meta). Three parallel loops in one call: gate
        and up, the activation, down."""
        Ga = a_s.shape[0]
        for j in prange(Ga + b_s.shape[0]):
            xs = np.empty(x.shape[1], dtype=np.float32)
            if j < Ga:
                group_rows(x, j, a0, aw, a1, ag, a_s, a_sm, a_z, a_zm, gate, xs)
            else:
                group_rows(x, j - Ga, b0, bw, b1, bg, b_s, b_sm, b_z, b_zm, up, xs)
        for n in prange(gate.shape[1]):
            for t in range(gate.shape[0]):
                g = gate[t, n]
                gate[t, n] = g / (np.float32(1.0) + np.exp(-g)) * up[t, n]
        for j in prange(c_s.shape[0]):
            xs = np.empty(gate.shape[1], dtype=np.float32)
            group_rows(gate, j, c0, cw, c1, cg, c_s, c_sm, c_z, c_zm, out, xs)

    return SimpleNamespace(qmatmul=qmatmul, swiglu=swiglu, numba=numba)


def set_threads(n: int) -> None:
    """numba's threads for launches from the calling thread (1..numba's pool size)."""
    k = kernels()
    k.numba.set_num_threads(max(1, min(n, k.numba.config.NUMBA_NUM_THREADS)))
