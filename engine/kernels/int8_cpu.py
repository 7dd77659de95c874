"""int8 matrices (torch_cpu's "int8": W[n, k] = q[n, k] * s[n]) times one token on the CPU.

The CPU engine keeps 8-bit attention and the LM head in that form (generate.move_dense); torch's
_weight_int8pack_mm reads them at about half the RAM's speed for a lone token (13-14 of 25 GB/s
on the 2-core box, bfloat16 activations). Here the token is rounded to int8 per block of 32
inputs, as llama.cpp's Q8_0 activations: x[32 b + i] ~ d[b] * q[32 b + i], d = max |x| / 127
over the block. Each row's product is then an integer dot per block: the weights' magnitudes
multiply the inputs given the weights' signs (psignb) in pmaddubsw, pmaddwd sums the pairs into
int32 lanes, and those go to float32 times d[b]; the row's sum times s[n]. Each block prefetches
the weights two rows ahead. Compiled by numba like engine/kernels/hqq_cpu.py (AVX2). Only the
rounding of x is inexact: about 0.5 % of |y| (rms) for Gaussian inputs
(tests/engine/kernels/test_int8_cpu.py holds it to the exact bound).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from moeferry.engine.kernels.hqq_cpu import array_data, llvm_function, numba_disk_cache, splat_vector, vector_at

_JIT = None
BLOCK = 32  # inputs per int8 block of the token
ROWS_AHEAD = 2  # rows of weights prefetched ahead of the one multiplied


def kernels():
    global _JIT
    if _JIT is None:
        _JIT = _compile()
    return _JIT


def matvec(x: np.ndarray, q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """x float32 [1, K] -> float32 [1, N] = x @ (q * s[:, None]).T for q int8 [N, K] (K a multiple
    of BLOCK), s float32 [N]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[0] != 1 or q.shape[1] % BLOCK or x.shape[1] != q.shape[1]:
        raise ValueError(f"int8_cpu takes one token of {q.shape[1]} inputs, a multiple of {BLOCK}")
    out = np.empty((1, q.shape[0]), dtype=np.float32)
    kernels().matvec(x, q, s, out)
    return out


def _compile():
    global block_products, round_blocks, matvec_kernel
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    cache = numba_disk_cache()
    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    v32i8, v16i16, v8i32, v8f32 = (ir.VectorType(t, n) for t, n in ((i8, 32), (i16, 16), (i32, 8), (f32, 8)))

    @intrinsic
    def block_products(typingctx, row, q, d, nb):
        """sum over blocks b < nb of row[32 b:] . q[32 b:] * d[b] (row, q: int8, d: float32)."""
        def codegen(context, builder, signature, args):
            rp, qp, dp = (array_data(context, builder, t, a) for t, a in zip(signature.args[:3], args[:3]))
            nblocks = args[3]
            n = nblocks.type
            psignb = llvm_function(builder, "llvm.x86.avx2.psign.b", v32i8, [v32i8, v32i8])
            pmaddubsw = llvm_function(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
            pmaddwd = llvm_function(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
            absb = llvm_function(builder, "llvm.abs.v32i8", v32i8, [v32i8, ir.IntType(1)])
            ones = ir.Constant(v16i16, [1] * 16)
            prefetch = llvm_function(builder, "llvm.prefetch.p0", ir.VoidType(), [rp.type, i32, i32, i32])
            ahead = builder.mul(nblocks, n(BLOCK * ROWS_AHEAD))
            acc = cgutils.alloca_once_value(builder, ir.Constant(v8f32, None))
            with cgutils.for_range(builder, nblocks) as loop:
                b = loop.index
                at = builder.mul(b, n(BLOCK))
                builder.call(prefetch, [builder.gep(rp, [builder.add(at, ahead)]), i32(0), i32(3), i32(1)])
                w = builder.load(vector_at(builder, rp, at, v32i8), align=1)
                qv = builder.load(vector_at(builder, qp, at, v32i8), align=1)
                # |w| as unsigned bytes (|-128| = 128 fits), q with w's signs: pairs sum within int16
                pairs = builder.call(pmaddubsw, [builder.call(absb, [w, ir.Constant(ir.IntType(1), 0)]),
                                                 builder.call(psignb, [qv, w])])
                sums = builder.sitofp(builder.call(pmaddwd, [pairs, ones]), v8f32)
                scale = builder.load(builder.gep(dp, [b]))
                builder.store(builder.fadd(builder.load(acc), builder.fmul(sums, splat_vector(builder, scale, v8f32))), acc)
            return builder.call(llvm_function(builder, "llvm.vector.reduce.fadd.v8f32", f32, [f32, v8f32]),
                                [f32(0.0), builder.load(acc)], fastmath=("fast",))
        return types.float32(row, q, d, nb), codegen

    @njit(fastmath=True, nogil=True, cache=cache)
    def round_blocks(x, q, d, evens_first):
        """x float32 [nb * 32] -> q int8 [nb * 32], d [nb]: x ~ d[b] * q per block; with
        evens_first each block's even inputs come first, then its odd ones (MXFP4's nibbles)."""
        for b in range(d.shape[0]):
            top = np.float32(0.0)
            for i in range(BLOCK):
                top = max(top, abs(x[b * BLOCK + i]))
            d[b] = top / np.float32(127.0)
            inv = np.float32(127.0) / top if top > 0 else np.float32(0.0)
            if evens_first:
                for i in range(BLOCK // 2):
                    q[b * BLOCK + i] = np.int8(np.rint(x[b * BLOCK + 2 * i] * inv))
                    q[b * BLOCK + BLOCK // 2 + i] = np.int8(np.rint(x[b * BLOCK + 2 * i + 1] * inv))
            else:
                for i in range(BLOCK):
                    q[b * BLOCK + i] = np.int8(np.rint(x[b * BLOCK + i] * inv))

    @njit(parallel=True, fastmath=True, nogil=True, cache=cache)
    def matvec_kernel(x, w, s, out):
        nb = w.shape[1] // BLOCK
        q = np.empty(nb * BLOCK, dtype=np.int8)
        d = np.empty(nb, dtype=np.float32)
        round_blocks(x[0], q, d, False)
        for r in prange(w.shape[0]):
            out[0, r] = block_products(w[r], q, d, nb) * s[r]

    return SimpleNamespace(matvec=matvec_kernel, round_blocks=round_blocks)
