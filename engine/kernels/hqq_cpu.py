"""HQQ-packed experts multiplied on the CPU, straight from the bytes the GPU cache copies.

The CPU+GPU hybrid (engine/runtime/cpu_experts.py) computes some missed experts on the CPU. This
kernel reads an expert where it already lies, in the host copy of the experts file (the
layout of engine/storage/quant.py, 2, 3 or 4 bits with 8-bit scales and zeros and their float16
metadata): no second copy in RAM, no conversion at load, and at 2 bits it reads 3 bits per
weight where an int4 copy reads 4.25. It is compiled by numba (LLVM, bundled with the wheel:
no compiler needed on the user's machine) the first time it runs, and cached on disk where
numba can cache. It needs AVX2 (available() says so where it is missing).

One matrix W [rows, cols] (groups of g rows n = j, j + G, ..., G = rows / g, share the
scale and zero of column k): W[n, k] = (code[n, k] - z[n % G, k]) * s[n % G, k], so with
xs[j, k] = s[j, k] * x[k] and any constant c (the middle of the code range),
    y[n] = sum_k (code[n, k] - c) * xs[n % G, k]  -  sum_k (z[n % G, k] - c) * xs[n % G, k].
The float16 metadata of s and z is decoded once per product, by all threads (decoded_meta). A thread takes a
few groups j at a time: it computes xs for group j in one pass with each block's max |xs| (for a
prompt, from s and z decoded once for all its tokens), the second sum in float32, and rounds
xs to int8 per block of BLOCK = 32 inputs, as llama.cpp's Q8_0 activations: xs[k] ~ D * m_b *
q[k], D one float per row, m_b <= MMAX an integer per block, |q| <= 127. Then it streams the
group's g rows of codes against q in integers, 32 bytes at a time (64, two blocks, where the CPU has AVX-512BW): pmaddubsw (u8
codes x s8 q, pairs summed into s16) and pmaddwd (x m_b, into s32 lanes), flushed to float32
every FLUSH blocks, while it prefetches the next row it will read; the codes of one
plane byte belong to rows r, r + rows/p, ... (p codes per byte, the same group), so each
byte is loaded once and feeds p accumulators. Only the rounding of xs is inexact: each xs[k]
moves by at most half its block's step (its block's max |xs| / 127, plus D), about 0.5 % of
|y| (rms) for Gaussian inputs (tests/engine/kernels/test_hqq_cpu.py holds it to the exact bound).
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
BLOCK = 32  # inputs per int8 block (one 32-byte vector of codes)
MMAX = 1 << 14  # largest block multiplier
PARALLEL_TABLES = 32768  # table entries of a product from which all threads decode them (decoded_meta)
FLUSH = 16  # blocks summed in int32 lanes before a float32 flush: 4 * 15 * 127 * MMAX * FLUSH < 2**31


# How long numba's OpenMP threads spin (GNU libgomp's GOMP_SPINCOUNT, in pause loops; in time
# it depends on the processor, not measured) before they sleep after a product, in a GPU
# engine's hybrid (spin_between_layers): the value measured in the engine.
SPIN_COUNT = "30000000"


def kernels():
    """The compiled functions (numba is imported on first use: it takes ~0.5 s)."""
    global _JIT
    if _JIT is None:
        _JIT = _compile()
    return _JIT


def spin_between_layers() -> None:
    """Keep numba's threads spinning between products, for the GPU engine's hybrid: it calls the
    kernel once per layer with a CPU expert, a millisecond or two apart, and threads left
    spinning in between made its CPU experts about 15 % faster inside the engine on the GPU
    machine, in the one run that compared them (docs/BENCHMARKS.md, 2026-12-03, later). Not for the CPU engine, whose torch operations
    between the products need the cores the spinning threads would hold (on the 2-core
    development box the test suite slowed several times over). libgomp reads it once, when numba's first parallel call loads it: call this
    before; the user's own setting wins."""
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)


def available() -> str:
    """"" when numba can run the kernel here, else why not (one sentence)."""
    try:
        import numba  # noqa: F401
        from llvmlite import binding
    except ImportError as e:
        return f"numba is not installed ({e})."
    if not binding.get_host_cpu_features().get("avx2"):
        return "the processor has no AVX2 (the kernel's integer dot products)."
    return ""


@dataclass
class CpuQMatrix:
    """A QMatrix's arrays as the kernel takes them: numpy views of the same bytes (the float16
    scale/zero metadata viewed as int16: numba has no float16)."""
    rows: int
    cols: int
    bits: int
    group_size: int
    planes: tuple  # uint8 [rows * w / 8, cols] per plane width w of PLANES[bits]
    scale: np.ndarray  # uint8 [G, cols]
    zero: np.ndarray
    scale_meta: np.ndarray  # int16 [2, M]: float16 bits
    zero_meta: np.ndarray

    def nbytes(self) -> int:
        """Bytes the kernel reads per product."""
        return sum(a.nbytes for a in (*self.planes, self.scale, self.zero, self.scale_meta, self.zero_meta))

    def copied_bytes(self) -> int:
        """RAM taken beyond the stored bytes: none, every array is a view."""
        return 0


def supported(w) -> bool:
    return (isinstance(w, QMatrix) and w.bits in PLANES and w.bits != 8 and w.scale_meta is not None
            and w.zero_meta is not None and w.scale.dtype == torch.uint8 and w.scale_meta.dtype == torch.float16)


def from_qmatrix(w: QMatrix) -> CpuQMatrix:
    """Views of w's tensors (which must lie in host memory)."""
    return CpuQMatrix(w.rows, w.cols, w.bits, w.group_size, tuple(p.numpy() for p in w.planes),
                      w.scale.numpy(), w.zero.numpy(), w.scale_meta.view(torch.int16).numpy(), w.zero_meta.view(torch.int16).numpy())


def _args(w: CpuQMatrix) -> tuple:
    p0 = w.planes[0]
    p1 = w.planes[1] if len(w.planes) > 1 else p0[:0]
    return p0, PLANES[w.bits][0], p1, w.group_size, w.scale, w.scale_meta, w.zero, w.zero_meta


def _chunks(k) -> int:
    """Chunks of groups for the parallel loops: a few per thread, each allocating its buffers once."""
    return 4 * k.numba.get_num_threads()


def matmul(x: np.ndarray, w: CpuQMatrix) -> np.ndarray:
    """x float32 [T, cols] -> float32 [T, rows] = x @ W.T."""
    out = np.empty((x.shape[0], w.rows), dtype=np.float32)
    k = kernels()
    k.qmatmul(np.ascontiguousarray(x, dtype=np.float32), *_args(w), out, _chunks(k))
    return out


def swiglu_expert(x: np.ndarray, w1: CpuQMatrix, w3: CpuQMatrix, w2: CpuQMatrix,
                  addresses: np.ndarray | None = None) -> np.ndarray:
    """w2 (silu(w1 x) * w3 x) for x float32 [T, H]: float32 [T, H], in one call (swiglu_experts
    with one expert; addresses: its expert_addresses, when kept)."""
    if addresses is None:
        addresses = expert_addresses(w1, w3, w2)
    return swiglu_experts(x, [(w1, w3, w2)], addresses[None])[0]


def expert_addresses(w1: CpuQMatrix, w3: CpuQMatrix, w2: CpuQMatrix) -> np.ndarray:
    """Where an expert's arrays lie (int64 [18]: per matrix its two code planes, scale, scale
    meta, zero, zero meta), for swiglu_experts, which reads them with the shapes _dims gives
    (w3's those of w1): checked here, so that it reads nothing beyond them. Valid while the
    views are alive."""
    if not (_dims(w1) == _dims(w3)).all():
        raise ValueError("an expert's w1 and w3 differ in layout")
    out = []
    for w in (w1, w3, w2):
        p0 = w.planes[0]
        p1 = w.planes[1] if len(w.planes) > 1 else p0[:0]
        arrays = (p0, p1, w.scale, w.scale_meta, w.zero, w.zero_meta)
        rows, cols, w0, low, g, ms, mz = (int(v) for v in _dims(w))
        shapes = ((rows * w0 // 8, cols), (rows // 8 if low else 0, cols), (rows // g, cols), (2, ms),
                  (rows // g, cols), (2, mz))
        if any(a.shape != shape or not a.flags.c_contiguous for a, shape in zip(arrays, shapes)):
            raise ValueError("an expert's arrays do not have the shapes of its matrices")
        out += [a.ctypes.data for a in arrays]
    return np.array(out, dtype=np.int64)


def _dims(w: CpuQMatrix) -> np.ndarray:
    return np.array([w.rows, w.cols, PLANES[w.bits][0], len(w.planes) > 1, w.group_size,
                     w.scale_meta.shape[1], w.zero_meta.shape[1]], dtype=np.int64)


def swiglu_experts(x: np.ndarray, experts: list[tuple], addresses: np.ndarray) -> np.ndarray:
    """w2 (silu(w1 x) * w3 x) for several experts of one layout (shapes and quantization) on the
    same x float32 [T, H], in one call: float32 [N, T, H]. Each parallel loop spans every
    expert's groups, so small experts (Qwen3's, OLMoE's) keep all threads busy and start them
    four times per layer instead of per expert: the tables, gate and up, the activation,
    down. addresses: their expert_addresses stacked [N, 18]."""
    w1, w3, w2 = experts[0]
    N, T = len(experts), x.shape[0]
    gate = np.empty((N, T, w1.rows), dtype=np.float32)
    up = np.empty((N, T, w3.rows), dtype=np.float32)
    out = np.empty((N, T, w2.rows), dtype=np.float32)
    k = kernels()
    k.swiglu_many(np.ascontiguousarray(x, dtype=np.float32), addresses, _dims(w1), _dims(w2), gate, up, out,
                  _chunks(k))
    return out


def numba_disk_cache() -> bool:
    """Whether numba may cache the compiled kernels beside their source: a frozen app has no
    source files (it compiles once per run there)."""
    return not getattr(sys, "frozen", False) and os.access(os.path.dirname(__file__), os.W_OK)


# LLVM IR helpers of the numba intrinsics here and in engine/kernels/mxfp4_cpu.py


def llvm_function(builder, name, ret, args):
    """The function `name` (an LLVM intrinsic) of type ret(args), declared in builder's module."""
    from llvmlite import ir
    from numba.core import cgutils

    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def vector_at(builder, p, off, t):
    """Pointer to a vector of type t at element off of p."""
    return builder.bitcast(builder.gep(p, [off]), t.as_pointer())


def splat_vector(builder, v, t):
    """The vector type t with every lane v."""
    from llvmlite import ir

    i32 = ir.IntType(32)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(t, None), v, i32(0)), ir.Constant(t, None),
                                  ir.Constant(ir.VectorType(i32, t.count), None))


def array_data(context, builder, ty, arr):
    """The data pointer of a numba array argument."""
    return context.make_array(ty)(context, builder, arr).data


def _compile():
    # Module globals, not closure variables: numba keys its disk cache on a pickle of the
    # closure, and intrinsics and dispatchers pickle with a fresh uuid in every process.
    global prange, u8_f32, half, block_absmax, scaled_blocks, quantize_blocks, dot_2bit, dot_4bit, dot_1bit
    global decoded_meta, code_center, group_inputs, decoded_group, token_inputs, round_inputs, add_plane, scratch
    global group_rows, decode_meta_range, qmatmul, u8_ptr, i16_ptr, matrix_at, swiglu_many
    import numba
    from llvmlite import binding, ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    cache = numba_disk_cache()
    jit = njit(parallel=True, fastmath=True, nogil=True, cache=cache)
    serial = njit(fastmath=True, nogil=True, cache=cache)
    f32, i1, i8, i16, i32 = ir.FloatType(), ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32)
    wide = bool(binding.get_host_cpu_features().get("avx512bw"))  # 64-byte products where the CPU has them

    def vec(t, n):
        return ir.VectorType(t, n)

    @intrinsic
    def u8_f32(typingctx, b):
        """float32(b) straight from 8 bits: numba's own integer maths widens to 64 bits,
        which keeps LLVM from vectorizing the loops over bytes."""
        def codegen(context, builder, signature, args):
            return builder.uitofp(args[0], f32)
        return types.float32(types.uint8), codegen

    @intrinsic
    def half(typingctx, h):
        """The float16 with bits h (int16) as float32 (vcvtph2ps where LLVM vectorizes it)."""
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), f32)
        return types.float32(types.int16), codegen

    @intrinsic
    def block_absmax(typingctx, xs, b):
        """max |xs[k]| over block b, in vector IR (numba's max loop stays scalar)."""
        def codegen(context, builder, signature, args):
            vf = vec(f32, BLOCK)
            x = builder.load(vector_at(builder, array_data(context, builder, signature.args[0], args[0]),
                                builder.mul(args[1], args[1].type(BLOCK)), vf), align=4)
            x = builder.call(llvm_function(builder, f"llvm.fabs.v{BLOCK}f32", vf, [vf]), [x])
            return builder.call(llvm_function(builder, f"llvm.vector.reduce.fmax.v{BLOCK}f32", f32, [vf]), [x], fastmath=("fast",))
        return types.float32(xs, b), codegen

    @intrinsic
    def scaled_blocks(typingctx, x, sq, zq, s_a, s_b, z_a, z_b, xs, amax, nb):
        """group_inputs' pass over whole blocks b < nb: s = sq * s_a + s_b and z = zq * z_a + z_b
        (the decoded_meta tables, already offset to this group's first input), xs = x * s,
        amax[b] = max |xs| over block b. Returns (sum of xs * z, max of amax), in float32."""
        def codegen(context, builder, signature, args):
            x_p, sq_p, zq_p, sa_p, sb_p, za_p, zb_p, xs_p, amax_p = (
                array_data(context, builder, t, a) for t, a in zip(signature.args[:9], args[:9]))
            half_block = BLOCK // 2
            vf, vb = vec(f32, half_block), vec(i8, half_block)
            fast = ("fast",)
            fmax = llvm_function(builder, f"llvm.maxnum.v{half_block}f32", vf, [vf, vf])
            fabs = llvm_function(builder, f"llvm.fabs.v{half_block}f32", vf, [vf])
            zacc = [cgutils.alloca_once_value(builder, ir.Constant(vf, None)) for _ in range(2)]
            top = cgutils.alloca_once_value(builder, ir.Constant(vf, None))

            def load(p, k, t):
                return builder.load(vector_at(builder, p, k, t), align=1 if t is vb else 4)

            def decoded(q_p, a_p, b_p, k):
                return builder.fadd(builder.fmul(builder.uitofp(load(q_p, k, vb), vf), load(a_p, k, vf), flags=fast),
                                    load(b_p, k, vf), flags=fast)

            def block(b):
                """Block b's xs and zero products; returns its |xs| folded to 16 lanes."""
                biggest = None
                for h in range(2):
                    k = builder.add(builder.mul(b, b.type(BLOCK)), b.type(h * half_block))
                    v = builder.fmul(load(x_p, k, vf), decoded(sq_p, sa_p, sb_p, k), flags=fast)
                    builder.store(v, vector_at(builder, xs_p, k, vf), align=4)
                    builder.store(builder.fadd(builder.load(zacc[h]), builder.fmul(v, decoded(zq_p, za_p, zb_p, k), flags=fast),
                                               flags=fast), zacc[h])
                    v = builder.call(fabs, [v])
                    biggest = v if biggest is None else builder.call(fmax, [biggest, v], fastmath=fast)
                builder.store(builder.call(fmax, [builder.load(top), biggest], fastmath=fast), top)
                return biggest

            def shuffled_max(u, w, lanes):
                return builder.call(fmax, [u, builder.shuffle_vector(w, w, ir.Constant(vec(i32, half_block), lanes))], fastmath=fast)

            # blocks two at a time, their maxima reduced together: 16 lanes, 8 a block, then
            # within each 8 (half the shuffles of reducing each block alone)
            with cgutils.for_range(builder, builder.sdiv(args[9], args[9].type(2))) as pair:
                b = builder.mul(pair.index, pair.index.type(2))
                u, w = block(b), block(builder.add(b, b.type(1)))
                halves = [builder.shuffle_vector(u, w, ir.Constant(vec(i32, half_block), lanes))
                          for lanes in ([*range(8), *range(16, 24)], [*range(8, 16), *range(24, 32)])]
                t = builder.call(fmax, halves, fastmath=fast)
                for step in (4, 2, 1):
                    t = shuffled_max(t, t, [i ^ step for i in range(16)])
                builder.store(builder.extract_element(t, i32(0)), builder.gep(amax_p, [b]))
                builder.store(builder.extract_element(t, i32(8)), builder.gep(amax_p, [builder.add(b, b.type(1))]))
            with builder.if_then(builder.trunc(args[9], ir.IntType(1))):  # an odd block left
                b = builder.sub(args[9], args[9].type(1))
                builder.store(builder.call(llvm_function(builder, f"llvm.vector.reduce.fmax.v{half_block}f32", f32, [vf]),
                                           [block(b)], fastmath=fast), builder.gep(amax_p, [b]))
            zsum = builder.call(llvm_function(builder, f"llvm.vector.reduce.fadd.v{half_block}f32", f32, [f32, vf]),
                                [f32(0.0), builder.fadd(builder.load(zacc[0]), builder.load(zacc[1]), flags=fast)], fastmath=fast)
            peak = builder.call(llvm_function(builder, f"llvm.vector.reduce.fmax.v{half_block}f32", f32, [vf]),
                                [builder.load(top)], fastmath=fast)
            return context.make_tuple(builder, signature.return_type, [zsum, peak])
        return types.UniTuple(types.float32, 2)(x, sq, zq, s_a, s_b, z_a, z_b, xs, amax, nb), codegen

    @intrinsic
    def quantize_blocks(typingctx, xs, q, inv, m, nb):
        """q = round(xs * inv[b]) as int8 for every block b < nb (round to nearest even, as rint;
        |q| <= 127 by the choice of inv, so the packs never saturate); returns sum_b m[b] * sum
        of block b's q (float32, exact per block). AVX2: cvtps2dq, then packssdw and packsswb,
        whose 128-bit lanes leave the dwords in the order 0 4 1 5 2 6 3 7 of the 8 wanted."""
        def codegen(context, builder, signature, args):
            xs_p, q_p, inv_p, m_p = (array_data(context, builder, t, a) for t, a in zip(signature.args[:4], args[:4]))
            v8f32, v8i32, v16i16, v32i8 = vec(f32, 8), vec(i32, 8), vec(i16, 16), vec(i8, 32)
            cvt = llvm_function(builder, "llvm.x86.avx.cvt.ps2dq.256", v8i32, [v8f32])
            packssdw = llvm_function(builder, "llvm.x86.avx2.packssdw", v16i16, [v8i32, v8i32])
            packsswb = llvm_function(builder, "llvm.x86.avx2.packsswb", v32i8, [v16i16, v16i16])
            order = ir.Constant(vec(i32, 8), [0, 4, 1, 5, 2, 6, 3, 7])
            acc = cgutils.alloca_once_value(builder, ir.Constant(v8f32, None))
            with cgutils.for_range(builder, args[4]) as blk:
                b = blk.index
                k = builder.mul(b, b.type(BLOCK))
                scale = splat_vector(builder, builder.load(builder.gep(inv_p, [b])), v8f32)
                c = [builder.call(cvt, [builder.fmul(builder.load(vector_at(builder, xs_p, builder.add(k, k.type(8 * i)), v8f32), align=4),
                                                     scale, flags=("fast",))]) for i in range(4)]
                packed = builder.call(packsswb, [builder.call(packssdw, [c[0], c[1]]), builder.call(packssdw, [c[2], c[3]])])
                packed = builder.bitcast(builder.shuffle_vector(builder.bitcast(packed, v8i32), ir.Constant(v8i32, None), order), v32i8)
                builder.store(packed, vector_at(builder, q_p, k, v32i8), align=1)
                total = builder.add(builder.add(c[0], c[1]), builder.add(c[2], c[3]))
                mb = splat_vector(builder, builder.sitofp(builder.load(builder.gep(m_p, [b])), f32), v8f32)
                builder.store(builder.fadd(builder.load(acc), builder.fmul(builder.sitofp(total, v8f32), mb, flags=("fast",)),
                                           flags=("fast",)), acc)
            return builder.call(llvm_function(builder, "llvm.vector.reduce.fadd.v8f32", f32, [f32, v8f32]),
                                [f32(0.0), builder.load(acc)], fastmath=("fast",))
        return types.float32(xs, q, inv, m, nb), codegen

    def block_dot(width):
        """An intrinsic (row, q, m, ahead, K) -> the 8 // width sums over k < K of code_s[k] * q[k] *
        m[k // BLOCK] (float32: exact integer sums but for the rounding of the float32 flushes),
        code_s the code of slot s in row byte k; q is zero-padded to whole blocks. AVX2's
        pmaddubsw (u8 codes x s8 inputs -> s16 pairs, which never saturate here) and pmaddwd (x
        the block multiplier -> s32); with AVX-512 VNNI, LLVM fuses pmaddwd and its sum into
        vpdpwssd; with AVX-512BW, two blocks per 64-byte product. A row's last partial block is
        read with a masked load (never past K). ahead: the row to prefetch meanwhile (K bytes)."""
        slots = 8 // width
        shifts = [8 - width * (s + 1) for s in range(slots)]
        v8i32, v8f32, v16i16, v32i8 = vec(i32, 8), vec(f32, 8), vec(i16, 16), vec(i8, 32)

        def codegen(context, builder, signature, args):
            row, q, m, ahead = (array_data(context, builder, t, a) for t, a in zip(signature.args[:4], args[:4]))
            K = args[4]
            prefetch = llvm_function(builder, "llvm.prefetch.p0", ir.VoidType(), [row.type, i32, i32, i32])
            n = K.type
            nb = builder.sdiv(K, n(BLOCK))
            pmaddubsw = llvm_function(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
            pmaddwd = llvm_function(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
            acc = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in range(slots)]
            isum = [cgutils.alloca_once_value(builder, ir.Constant(v8i32, None)) for _ in range(slots)]

            def products(codes, qv, mv, isums, ub, wd):
                """isums[s] += wd(ub(the codes of slot s, qv), mv) for every slot s (32 or 64 bytes of codes)."""
                lanes = codes.type.count
                for s in range(slots):
                    c = builder.and_(builder.lshr(codes, ir.Constant(codes.type, [shifts[s]] * lanes)),
                                     ir.Constant(codes.type, [(1 << width) - 1] * lanes))
                    builder.store(builder.add(builder.load(isums[s]), builder.call(wd, [builder.call(ub, [c, qv]), mv])), isums[s])

            def flush_into(accs, isums, lanes):
                """accs[s] += float(isums[s]); isums[s] = 0 (vectors of 8 or 16 lanes)."""
                for s in range(slots):
                    builder.store(builder.fadd(builder.load(accs[s]), builder.sitofp(builder.load(isums[s]), vec(f32, lanes))), accs[s])
                    builder.store(ir.Constant(vec(i32, lanes), None), isums[s])

            def add_block(codes, b):
                """The slot products of block b, whose codes are given."""
                qv = builder.load(vector_at(builder, q, builder.mul(b, n(BLOCK)), v32i8), align=1)
                mv = splat_vector(builder, builder.trunc(builder.load(builder.gep(m, [b])), i16), v16i16)
                products(codes, qv, mv, isum, pmaddubsw, pmaddwd)

            def flush():
                flush_into(acc, isum, 8)

            def whole_block(off, b):
                add_block(builder.load(vector_at(builder, row, off, v32i8), align=1), b)

            def blocks(first, stop, step, add):
                """add(offset, block) for blocks first, first + step, ... < stop, flushed every FLUSH calls."""
                calls = builder.sdiv(builder.sub(stop, first), n(step))
                with cgutils.for_range(builder, builder.sdiv(builder.add(calls, n(FLUSH - 1)), n(FLUSH))) as chunk:
                    start = builder.mul(chunk.index, n(FLUSH))
                    end = builder.add(start, n(FLUSH))
                    with cgutils.for_range(builder, builder.select(builder.icmp_signed("<", end, calls), end, calls), start=start) as i:
                        b = builder.add(first, builder.mul(i.index, n(step)))
                        off = builder.mul(b, n(BLOCK))
                        # the thread's next row, one row ahead: rows are a few KiB apart, and the
                        # hardware prefetcher starts cold on each (on the GPU machine's Xeon this
                        # took 2-bit products from 45 to 56 GB/s on 16 threads)
                        builder.call(prefetch, [builder.gep(ahead, [off]), i32(0), i32(3), i32(1)])
                        add(off, b)
                    (flush_wide if step == 2 else flush)()

            if wide:
                v16i32, v16f32, v32i16, v64i8 = vec(i32, 16), vec(f32, 16), vec(i16, 32), vec(i8, 64)
                pmaddubsw_w = llvm_function(builder, "llvm.x86.avx512.pmaddubs.w.512", v32i16, [v64i8, v64i8])
                pmaddwd_w = llvm_function(builder, "llvm.x86.avx512.pmaddw.d.512", v16i32, [v32i16, v32i16])
                acc_w = [cgutils.alloca_once_value(builder, ir.Constant(v16f32, None)) for _ in range(slots)]
                isum_w = [cgutils.alloca_once_value(builder, ir.Constant(v16i32, None)) for _ in range(slots)]

                def add_pair(off, b):  # blocks b and b + 1 at once: s32 lanes 0-7 are b's, 8-15 b + 1's
                    codes = builder.load(vector_at(builder, row, off, v64i8), align=1)
                    qv = builder.load(vector_at(builder, q, off, v64i8), align=1)
                    m2 = builder.trunc(builder.load(vector_at(builder, m, b, vec(i32, 2)), align=4), vec(i16, 2))
                    mv = builder.shuffle_vector(m2, ir.Constant(vec(i16, 2), None), ir.Constant(vec(i32, 32), [0] * 16 + [1] * 16))
                    products(codes, qv, mv, isum_w, pmaddubsw_w, pmaddwd_w)

                def flush_wide():
                    flush_into(acc_w, isum_w, 16)

                pairs_end = builder.mul(builder.sdiv(nb, n(2)), n(2))
                blocks(n(0), pairs_end, 2, add_pair)
                blocks(pairs_end, nb, 1, whole_block)
            else:
                blocks(n(0), nb, 1, whole_block)
            tail = builder.trunc(builder.sub(K, builder.mul(nb, n(BLOCK))), i8)
            with builder.if_then(builder.icmp_unsigned("!=", tail, i8(0))):
                mask = builder.icmp_unsigned("<", ir.Constant(v32i8, list(range(32))), splat_vector(builder, tail, v32i8))
                masked_load = llvm_function(builder, "llvm.masked.load.v32i8.p0", v32i8, [row.type, i32, vec(i1, 32), v32i8])
                codes = builder.call(masked_load, [builder.gep(row, [builder.mul(nb, n(BLOCK))]), i32(1), mask,
                                                   ir.Constant(v32i8, None)])
                add_block(codes, nb)
                flush()
            sums = []
            for s in range(slots):
                v = builder.load(acc[s])
                total = builder.call(llvm_function(builder, "llvm.vector.reduce.fadd.v8f32", f32, [f32, v8f32]),
                                     [f32(0.0), v], fastmath=("fast",))
                if wide:
                    reduce16 = llvm_function(builder, "llvm.vector.reduce.fadd.v16f32", f32, [f32, vec(f32, 16)])
                    total = builder.fadd(total, builder.call(reduce16, [f32(0.0), builder.load(acc_w[s])],
                                                             fastmath=("fast",)), flags=("fast",))
                sums.append(total)
            return context.make_tuple(builder, signature.return_type, sums)

        @intrinsic
        def dot(typingctx, row, q, m, ahead, K):
            return types.UniTuple(types.float32, slots)(row, q, m, ahead, K), codegen
        return dot

    dot_2bit, dot_4bit, dot_1bit = block_dot(2), block_dot(4), block_dot(1)

    @serial
    def decode_meta_range(meta, offset, a, b, lo, hi):
        """Entries [lo, hi) of a matrix's float32 tables (a, b) of its meta [2, M] (float16 bits):
        value f = j * K + k (group j, input k) with 8-bit q decodes to q * a[f % M] + b[f % M]
        (+ offset, folded into b). The tables are M + K long, entry i holding meta pair i % M,
        so group j's inputs read a[(j * K) % M:] with no wrap. Decoded once per product, not
        per group: the half conversions were most of group_inputs' time."""
        M = meta.shape[1]
        i = lo
        while i < hi:
            s = i % M
            n = min(hi - i, M - s)
            scale, zero, ao, bo = meta[0, s:s + n], meta[1, s:s + n], a[i:i + n], b[i:i + n]
            for d in range(n):
                v = half(scale[d])
                ao[d] = v
                bo[d] = offset - half(zero[d]) * v
            i += n

    @jit
    def decoded_meta(metas, Ks, offsets):
        """The tables (decode_meta_range) of each meta in metas, for inputs Ks and offsets: a
        list of (a, b) pairs. Large ones are decoded by all threads (serially a Mixtral expert's
        take 45 us, 3-4 % of its product on 16 threads); small ones by the calling thread, which
        is quicker than starting the others (about 5 us)."""
        n = len(metas)
        tabs = [(np.empty(metas[t].shape[1] + Ks[t], dtype=np.float32),
                 np.empty(metas[t].shape[1] + Ks[t], dtype=np.float32)) for t in range(n)]
        if sum([a.shape[0] for a, _ in tabs]) < PARALLEL_TABLES:
            for t in range(n):
                a, b = tabs[t]
                decode_meta_range(metas[t], offsets[t], a, b, 0, a.shape[0])
            return tabs
        P = 8  # pieces per table
        for p in prange(n * P):
            t, c = p // P, p % P
            a, b = tabs[t]
            size = a.shape[0]
            decode_meta_range(metas[t], offsets[t], a, b, c * size // P, (c + 1) * size // P)
        return tabs

    @serial
    def code_center(width0, plane1):
        """The middle of the code range (plane1, the 1-bit low plane, is empty but for 3 bits)."""
        return np.float32(((1 << width0) * (2 if plane1.shape[0] > 0 else 1) - 1) / 2)

    @serial
    def group_inputs(x, t, j, scale, zero, s_meta, z_meta, center, xs, amax, q, m):
        """xs = s[j, :] * x[t, :] in float32, and per block of BLOCK inputs in int8: xs[k] ~
        D * m[k // BLOCK] * q[k], D for the whole row, m the block's multiplier (<= MMAX),
        |q| <= 127. s_meta, z_meta: decoded_meta's tables of scale and zero (the zero's offset
        -center). Returns (sum_k (z[j, k] - center) * xs[k] + center * sum_k D * m * q, D)."""
        K = x.shape[1]
        s_a, s_b = s_meta
        z_a, z_b = z_meta
        si, zi = (j * K) % (s_a.shape[0] - K), (j * K) % (z_a.shape[0] - K)
        s_a, s_b, z_a, z_b = s_a[si:si + K], s_b[si:si + K], z_a[zi:zi + K], z_b[zi:zi + K]
        xrow, srow, zrow = x[t], scale[j], zero[j]
        whole = K // BLOCK
        zsum, top = scaled_blocks(xrow, srow, zrow, s_a, s_b, z_a, z_b, xs, amax, whole)
        if whole * BLOCK < K:  # the last, partial block
            peak = np.float32(0.0)
            for k in range(whole * BLOCK, K):
                v = xrow[k] * (u8_f32(srow[k]) * s_a[k] + s_b[k])
                xs[k] = v
                zsum += v * (u8_f32(zrow[k]) * z_a[k] + z_b[k])
                peak = max(peak, abs(v))
            amax[whole] = peak
            top = max(top, peak)
        return round_inputs(xs, zsum, top, center, amax, q, m)

    @serial
    def decoded_group(j, scale, zero, s_meta, z_meta, s_out, z_out):
        """Group j's scales s[j, :] and zeros z[j, :] - center in float32, as group_inputs
        decodes them: a prompt's tokens all use them (group_rows decodes them once)."""
        K = s_out.shape[0]
        s_a, s_b = s_meta
        z_a, z_b = z_meta
        si, zi = (j * K) % (s_a.shape[0] - K), (j * K) % (z_a.shape[0] - K)
        s_a, s_b, z_a, z_b = s_a[si:si + K], s_b[si:si + K], z_a[zi:zi + K], z_b[zi:zi + K]
        srow, zrow = scale[j], zero[j]
        for k in range(K):
            s_out[k] = u8_f32(srow[k]) * s_a[k] + s_b[k]
            z_out[k] = u8_f32(zrow[k]) * z_a[k] + z_b[k]

    @serial
    def token_inputs(x, t, s_dec, z_dec, center, xs, amax, q, m):
        """group_inputs for one token of a prompt, from its group's decoded_group."""
        xrow = x[t]
        zsum = np.float32(0.0)
        for k in range(xrow.shape[0]):
            v = xrow[k] * s_dec[k]
            xs[k] = v
            zsum += v * z_dec[k]
        top = np.float32(0.0)
        for b in range(amax.shape[0]):
            amax[b] = block_absmax(xs, b)
            top = max(top, amax[b])
        return round_inputs(xs, zsum, top, center, amax, q, m)

    @serial
    def round_inputs(xs, zsum, top, center, amax, q, m):
        """The int8 blocks of xs (group_inputs says how), given each block's max |xs| (amax) and
        their max (top); returns (zsum + center * sum_k D * m * q, D)."""
        nb = amax.shape[0]
        D = top / np.float32(127 * MMAX)
        per_top = np.float32(MMAX) / top if top > 0 else np.float32(0.0)
        for b in range(nb):  # vectorized: amax becomes 1 / (D * m)
            mb = min(np.ceil(amax[b] * per_top), np.float32(MMAX))
            m[b] = np.int32(mb)
            amax[b] = np.float32(1.0) / (D * mb) if mb > 0 else np.float32(0.0)
        return zsum + center * D * quantize_blocks(xs, q, amax, m, nb), D

    @serial
    def add_plane(plane, width, mult, j, G, q, m, D, out, t):
        """The rows of group j held by one plane of codes of this width: byte (r, k) holds
        the codes of rows r, r + stride, ... (stride = the plane's row count)."""
        stride, K = plane.shape
        o = out[t]
        last = min(G, stride)
        for r in range(j, stride, G):
            nxt = r + G if r + G < stride else (j + 1 if j + 1 < last else r)
            if width == 2:
                c = dot_2bit(plane[r], q, m, plane[nxt], K)
                for s in range(4):
                    o[r + s * stride] += mult * D * c[s]
            elif width == 4:
                c2 = dot_4bit(plane[r], q, m, plane[nxt], K)
                for s in range(2):
                    o[r + s * stride] += mult * D * c2[s]
            else:
                c8 = dot_1bit(plane[r], q, m, plane[nxt], K)
                for s in range(8):
                    o[r + s * stride] += mult * D * c8[s]

    @serial
    def scratch(K, T):
        """One thread's buffers for group_inputs: xs (its padding to whole blocks stays 0), amax,
        q, m; for T > 1 tokens also decoded_group's scales and zeros."""
        nb = (K + BLOCK - 1) // BLOCK
        dec = K if T > 1 else 0
        return (np.zeros(nb * BLOCK, dtype=np.float32), np.empty(nb, dtype=np.float32),
                np.empty(nb * BLOCK, dtype=np.int8), np.empty(nb, dtype=np.int32),
                np.empty(dec, dtype=np.float32), np.empty(dec, dtype=np.float32))

    @serial
    def group_rows(x, j, plane0, width0, plane1, group_size, scale, zero, s_meta, z_meta, out, buf):
        """Rows j, j + G, ... of out [T, rows] = x [T, K] @ W.T (one group of rows).
        plane1 (the 1-bit low plane) is empty but for 3 bits. A prompt's tokens share the
        group's decoded scales and zeros (decoded_group); a lone token decodes them as it goes."""
        G = scale.shape[0]
        rows = G * group_size
        low = plane1.shape[0] > 0
        mult0 = np.float32(2.0) if low else np.float32(1.0)  # 3 bits: code = 2 * high + low
        center = code_center(width0, plane1)
        xs, amax, q, m, s_dec, z_dec = buf
        if x.shape[0] > 1:
            decoded_group(j, scale, zero, s_meta, z_meta, s_dec, z_dec)
        for t in range(x.shape[0]):
            if x.shape[0] > 1:
                shared, D = token_inputs(x, t, s_dec, z_dec, center, xs, amax, q, m)
            else:
                shared, D = group_inputs(x, t, j, scale, zero, s_meta, z_meta, center, xs, amax, q, m)
            for n in range(j, rows, G):
                out[t, n] = -shared
            add_plane(plane0, width0, mult0, j, G, q, m, D, out, t)
            if low:
                add_plane(plane1, 1, np.float32(1.0), j, G, q, m, D, out, t)

    @jit
    def qmatmul(x, plane0, width0, plane1, group_size, scale, smeta, zero, zmeta, out, chunks):
        G = scale.shape[0]
        K = x.shape[1]
        t = decoded_meta((smeta, zmeta), (K, K), (np.float32(0.0), -code_center(width0, plane1)))
        s_meta, z_meta = t[0], t[1]
        nc = min(G, chunks)
        for c in prange(nc):
            buf = scratch(x.shape[1], x.shape[0])
            for j in range(c * G // nc, (c + 1) * G // nc):
                group_rows(x, j, plane0, width0, plane1, group_size, scale, zero, s_meta, z_meta, out, buf)

    def pointer_to(t):
        @intrinsic
        def ptr(typingctx, addr):
            """The int64 address of an array's data as a pointer numba.carray takes."""
            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
            return types.CPointer(t)(types.int64), codegen
        return ptr

    u8_ptr, i16_ptr = pointer_to(types.uint8), pointer_to(types.int16)

    @serial
    def matrix_at(addrs, e, m, dims):
        """Matrix m (0: w1, 1: w3, 2: w2) of expert e as arrays: expert_addresses' row e, and
        dims = (rows, cols, width of plane 0, has the 1-bit plane, group size, M of scale
        meta, M of zero meta)."""
        rows, cols, w0, low, g, ms, mz = dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6]
        a, G = 6 * m, rows // g
        return (numba.carray(u8_ptr(addrs[e, a]), (rows * w0 // 8, cols)),
                numba.carray(u8_ptr(addrs[e, a + 1]), (rows // 8 if low else 0, cols)),
                numba.carray(u8_ptr(addrs[e, a + 2]), (G, cols)),
                numba.carray(i16_ptr(addrs[e, a + 3]), (2, ms)),
                numba.carray(u8_ptr(addrs[e, a + 4]), (G, cols)),
                numba.carray(i16_ptr(addrs[e, a + 5]), (2, mz)))

    @jit
    def swiglu_many(x, addrs, d13, d2, gate, up, out, chunks):
        """swiglu_experts: N experts of one layout on the same x; gate, up [N, T, I], out [N, T, H]."""
        N, K, Kc = addrs.shape[0], x.shape[1], gate.shape[2]
        # decoded_meta's tables: ts[m, 0:2] matrix m's scale (a, b), ts[m, 2:4] its zero's;
        # every table of every expert in P pieces, one parallel loop
        ts = np.empty((3, 4, N, max(d13[5], d13[6], d2[5], d2[6]) + max(K, Kc)), dtype=np.float32)
        P = 4
        for p in prange(N * 6 * P):
            e, tab, c = p // (6 * P), (p // P) % 6, p % P
            m, z = tab // 2, tab % 2  # matrix, and 0 for its scale, 1 for its zero
            d, k = (d2, Kc) if m == 2 else (d13, K)
            p0, p1, sc, sm, ze, zm = matrix_at(addrs, e, m, d)
            size = d[5 + z] + k
            a, b = ts[m, 2 * z, e, :size], ts[m, 2 * z + 1, e, :size]
            if z == 0:
                decode_meta_range(sm, np.float32(0.0), a, b, c * size // P, (c + 1) * size // P)
            else:
                decode_meta_range(zm, -code_center(d[2], p1), a, b, c * size // P, (c + 1) * size // P)
        G = d13[0] // d13[4]  # groups of w1 (and of w3)
        work = N * 2 * G
        nc = min(work, chunks)
        for c in prange(nc):
            buf = scratch(K, x.shape[0])
            for p in range(c * work // nc, (c + 1) * work // nc):
                e, j = p // (2 * G), p % (2 * G)
                m = 0 if j < G else 1
                p0, p1, sc, sm, ze, zm = matrix_at(addrs, e, m, d13)
                dst = gate[e] if m == 0 else up[e]
                group_rows(x, j - m * G, p0, d13[2], p1, d13[4], sc, ze, (ts[m, 0, e, :d13[5] + K], ts[m, 1, e, :d13[5] + K]),
                           (ts[m, 2, e, :d13[6] + K], ts[m, 3, e, :d13[6] + K]), dst, buf)
        T = gate.shape[1]
        pieces = max(1, chunks // (N * T))  # of each token's row: a lone token's spread over the threads
        for p in prange(N * T * pieces):
            e, t, c = p // (T * pieces), (p // pieces) % T, p % pieces
            for n in range(c * Kc // pieces, (c + 1) * Kc // pieces):
                g = gate[e, t, n]
                gate[e, t, n] = g / (np.float32(1.0) + np.exp(-g)) * up[e, t, n]
        Gc = d2[0] // d2[4]
        work = N * Gc
        nc = min(work, chunks)
        for c in prange(nc):
            buf = scratch(Kc, x.shape[0])
            for p in range(c * work // nc, (c + 1) * work // nc):
                e, j = p // Gc, p % Gc
                p0, p1, sc, sm, ze, zm = matrix_at(addrs, e, 2, d2)
                group_rows(gate[e], j, p0, d2[2], p1, d2[4], sc, ze, (ts[2, 0, e, :d2[5] + Kc], ts[2, 1, e, :d2[5] + Kc]),
                           (ts[2, 2, e, :d2[6] + Kc], ts[2, 3, e, :d2[6] + Kc]), out[e], buf)

    return SimpleNamespace(qmatmul=qmatmul, swiglu_many=swiglu_many, numba=numba)


def set_threads(n: int) -> None:
    """numba's threads for launches from the calling thread (1..numba's pool size), for this
    kernel and the others numba compiles (engine/kernels/int8_cpu.py, mxfp4_cpu.py). torch's own
    count is kept: numba's OpenMP layer, starting its pool on first use, sets OpenMP's count to the
    whole pool, which is the count torch reads."""
    import numba
    torch_threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    torch.set_num_threads(torch_threads)
