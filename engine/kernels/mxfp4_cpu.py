"""MXFP4 matrices (gpt-oss's experts as released) multiplied on the CPU from their stored bytes.

The layout is engine/storage/mxfp4.py's: per row, blocks of 32 inputs, 16 bytes of FP4 (e2m1)
codes (the low nibble the even input) and one power-of-two scale. The blocks run along the
inputs, so the input is rounded to int8 once per token, per block (as llama.cpp's Q8_0
activations): x[32 b + i] ~ d[b] * q[32 b + i], d = max |x| / 127 over the block. A block's
product is then an integer dot: its 32 codes become twice their FP4 values (integers in
[-12, 12]) by a byte shuffle (pshufb) of a 16-entry table, their magnitudes multiply the
inputs with the codes' signs (psignb) in pmaddubsw, pmaddwd sums the pairs into int32 lanes,
and those go to float32 times the block's scale times d[b] / 2. q is stored with each block's
even inputs first, so the low and the high nibbles of a block's 16 bytes line up with them.
Each block also prefetches the codes and the scale two rows ahead: read from RAM, one 2880x2880
matrix went from 4.0 to 8.7 GB/s on one thread and from 7.0 to 14.4 on two (2-core box).
Compiled by numba like engine/kernels/hqq_cpu.py (no compiler on the user's machine; AVX2).
Only the rounding of x is inexact: about 0.5 % of |y| (rms) for Gaussian inputs
(tests/engine/kernels/test_mxfp4_cpu.py holds it to the exact bound).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from moeferry.engine.kernels import int8_cpu
from moeferry.engine.kernels.hqq_cpu import array_data, llvm_function, numba_disk_cache, splat_vector, vector_at
from moeferry.engine.storage.mxfp4 import BLOCK, Mxfp4Matrix

_JIT = None
TWICE_FP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # 2 x engine/storage/mxfp4.FP4_VALUES
ROWS_AHEAD = 2  # rows of codes prefetched ahead of the one multiplied
SCALES = np.ldexp(np.float32(0.5), np.arange(256) - 127).astype(np.float32)  # 2 ** (e - 127) / 2


def kernels():
    global _JIT
    if _JIT is None:
        _JIT = _compile()
    return _JIT


def matmul(x: np.ndarray, w: Mxfp4Matrix) -> np.ndarray:
    """x float32 [T, cols] -> float32 [T, rows] = x @ W.T, w's tensors in host memory."""
    k = kernels()
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], w.rows), dtype=np.float32)
    k.qmatmul(x, w.blocks.numpy(), w.scales.numpy(), SCALES, out)
    return out


def _compile():
    global block_products, round_blocks, qmatmul
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    cache = numba_disk_cache()
    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    v16i8, v32i8, v16i16, v8i32, v8f32 = (ir.VectorType(t, n) for t, n in
                                          ((i8, 16), (i8, 32), (i16, 16), (i32, 8), (f32, 8)))

    @intrinsic
    def block_products(typingctx, codes, scales, q, d, halves, nb):
        """sum over blocks b < nb of (2 x FP4 codes of block b) . q[32 b:] * halves[scales[b]] * d[b]
        (codes: a row's bytes [nb * 16], scales: its [nb], q: int8 [nb * 32], each block's even
        inputs first, d: float32 [nb], halves: SCALES)."""
        def codegen(context, builder, signature, args):
            cp, sp, qp, dp, hp = (array_data(context, builder, t, a) for t, a in zip(signature.args[:5], args[:5]))
            nblocks = args[5]
            n = nblocks.type
            pshufb = llvm_function(builder, "llvm.x86.avx2.pshuf.b", v32i8, [v32i8, v32i8])
            psignb = llvm_function(builder, "llvm.x86.avx2.psign.b", v32i8, [v32i8, v32i8])
            pmaddubsw = llvm_function(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
            pmaddwd = llvm_function(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
            table = ir.Constant(v32i8, [v & 0xFF for v in TWICE_FP4] * 2)
            magnitude = ir.Constant(v32i8, [abs(v) for v in TWICE_FP4] * 2)
            ones = ir.Constant(v16i16, [1] * 16)
            prefetch = llvm_function(builder, "llvm.prefetch.p0", ir.VoidType(), [cp.type, i32, i32, i32])
            ahead = builder.mul(nblocks, n(16 * ROWS_AHEAD))
            acc = cgutils.alloca_once_value(builder, ir.Constant(v8f32, None))
            with cgutils.for_range(builder, nblocks) as loop:
                b = loop.index
                builder.call(prefetch, [builder.gep(cp, [builder.add(builder.mul(b, n(16)), ahead)]), i32(0), i32(3), i32(1)])
                builder.call(prefetch, [builder.gep(sp, [builder.add(b, builder.mul(nblocks, n(ROWS_AHEAD)))]),
                                        i32(0), i32(3), i32(1)])
                raw = builder.load(vector_at(builder, cp, builder.mul(b, n(16)), v16i8), align=1)
                low = builder.and_(raw, ir.Constant(v16i8, [15] * 16))
                high = builder.lshr(raw, ir.Constant(v16i8, [4] * 16))
                idx = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(i32, 32), list(range(32))))
                w = builder.call(pshufb, [table, idx])
                mag = builder.call(pshufb, [magnitude, idx])
                qv = builder.load(vector_at(builder, qp, builder.mul(b, n(32)), v32i8), align=1)
                pairs = builder.call(pmaddubsw, [mag, builder.call(psignb, [qv, w])])
                sums = builder.sitofp(builder.call(pmaddwd, [pairs, ones]), v8f32)
                e = builder.zext(builder.load(builder.gep(sp, [b])), i32)
                scale = builder.fmul(builder.load(builder.gep(hp, [e])), builder.load(builder.gep(dp, [b])))
                builder.store(builder.fadd(builder.load(acc), builder.fmul(sums, splat_vector(builder, scale, v8f32))), acc)
            return builder.call(llvm_function(builder, "llvm.vector.reduce.fadd.v8f32", f32, [f32, v8f32]),
                                [f32(0.0), builder.load(acc)], fastmath=("fast",))
        return types.float32(codes, scales, q, d, halves, nb), codegen

    round_blocks = int8_cpu.kernels().round_blocks  # x -> int8 blocks, evens first (the nibbles' order)

    @njit(parallel=True, fastmath=True, nogil=True, cache=cache)
    def qmatmul(x, blocks, scales, halves, out):
        rows, nb = scales.shape
        q = np.empty(nb * BLOCK, dtype=np.int8)
        d = np.empty(nb, dtype=np.float32)
        flat = blocks.reshape(rows, nb * (BLOCK // 2))
        for t in range(x.shape[0]):
            round_blocks(x[t], q, d, True)
            for r in prange(rows):
                out[t, r] = block_products(flat[r], scales[r], q, d, halves, nb)

    return SimpleNamespace(qmatmul=qmatmul, numba=numba)
