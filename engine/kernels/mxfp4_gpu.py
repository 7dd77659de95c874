"""Fused MXFP4 matrix kernels: y = x @ dequantize(w).T for gpt-oss's experts as imported.

`mxfp4_linear(x, w)` is the entry point the model calls for an Mxfp4Matrix (the format:
engine/storage/mxfp4.py). On a CUDA device with Triton it runs the kernels below, which read
the packed bytes and scales and never materialise the weights; everywhere else (and with
kernels="reference") it dequantizes with `mxfp4.dequantize` and multiplies, which is also the
ground truth the kernels are tested against. The environment checks and the per-stream
workspace are hqq_gpu's (one Triton, one workspace for both kernel families).

Decoding one code: an e2m1 value times two is an integer of at most 12, so the eight
magnitudes (times two) fit one 32-bit constant, four bits each; a code's magnitude is a shift
and a mask of it, its sign bit 3. The factor 1/2 goes into the block's scale, which is the
power of two 2^(e - 127) built from its bits (e8m0 e = 0, 2^-127, reads as 0: below bf16's
weights' contribution). Every product is exact in float32 and summed in float32; the output is
rounded once to x's dtype, as F.linear does.

  T == 1        GEMV: a program owns BR output rows, walks their columns NB blocks of 32 at a
                time (16 bytes and one scale per block per row) and scales each block's sum once.
                float32 x: each code decoded to float32 (a table shift, its sign), times x's
                column, summed in float32 (about a dozen instructions a weight: on an H200 and
                an H100 this loop, not the memory, bounds the kernel).
                bf16/fp16 x (H2): two codes at once, in the two fp16 lanes of a 32-bit word.
                A code's bits go straight into an fp16's sign, exponent and mantissa: e2m1 is
                an fp16 with two exponent bits, so (sign << 15) | (magnitude << 9) is the
                code's value times 2^-14, exact (code 1 is an fp16 subnormal). One fma.rn.f16x2
                then multiplies two weights by two of x's columns (pack_x: x times 2^14 / the
                block's largest |x|, in fp16 pairs) and adds them to a word's fp16 partial sums;
                the four partials of a block are summed in float32 and scaled by the weights'
                and x's block scales. About two instructions a weight; products lie in [-6, 6]
                and a lane sums four, so fp16 keeps 11 bits of each, below the bf16 output's
                rounding.
  T <= 16       GEMM: the same tiles dequantized in registers into [BR, 16 NB] halves (even and
                odd columns) that feed two tl.dot with x's even and odd columns.
  T > 16        dequantized once into the workspace, then cuBLAS.

`moe_decode` runs one token through a layer's routed gpt-oss experts (biases, clamped SwiGLU)
in two launches that read each expert's cache slot on the device, as hqq_gpu.moe_decode does
for HQQ's SwiGLU experts; it rounds where the eager per-expert path rounds.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from moeferry.engine.kernels import hqq_gpu
from moeferry.engine.kernels.hqq_gpu import KERNEL_CHOICES, tl, triton

if triton is not None:
    from moeferry.engine.kernels.hqq_gpu import _at, _pack_h2, _position_of_rank, _routed_offset, _unpack_h2_sum
from moeferry.engine.storage.mxfp4 import BLOCK, Mxfp4Matrix, dequantize

# Set when these kernels failed at run time: "auto" then dequantizes for the rest of the process.
FUSED_FAILURE: str | None = None
# Prefill: the fused GEMM up to this many tokens, dequantize + cuBLAS above.
GEMM_UP_TO_T = 16
# e2m1 magnitudes times two (0, 1, 2, 3, 4, 6, 8, 12), code c & 7 in bits 4c..4c+3, as int32.
TWICE_E2M1 = 0xC8643210 - (1 << 32)


def fused_available(device: torch.device | str | None = None) -> bool:
    """True when the kernels can run on `device` (hqq_gpu.fused_available's conditions)."""
    return FUSED_FAILURE is None and hqq_gpu.fused_available(device)


def mxfp4_linear(x: torch.Tensor, w: Mxfp4Matrix, kernels: str = "auto") -> torch.Tensor:
    """y = x @ W.T for x [..., cols]; returns y [..., rows] in x.dtype.

    kernels: "reference" = mxfp4.dequantize (in x.dtype) then F.linear, the CPU path and the
    ground truth; "fused" = the Triton kernels; "auto" = fused where available.
    """
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, not {kernels!r}")
    if x.shape[-1] != w.cols:
        raise ValueError(f"x has {x.shape[-1]} columns but the matrix is {w.rows}x{w.cols}")
    if kernels == "reference" or (kernels == "auto" and not fused_available(x.device)):
        return F.linear(x, dequantize(w, x.dtype))
    if not fused_available(x.device):
        raise RuntimeError("kernels='fused' needs Triton and a CUDA tensor; use kernels='reference'")
    if kernels == "fused" or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _fused(x, w)
    try:
        return _fused(x, w)
    except Exception as e:  # noqa: BLE001 - any failure of the optional fast path
        global FUSED_FAILURE
        FUSED_FAILURE = f"{type(e).__name__}: {e}"
        warnings.warn(f"MXFP4 kernels unavailable ({FUSED_FAILURE}); dequantizing instead", stacklevel=2)
        return F.linear(x, dequantize(w, x.dtype))


def _fused(x: torch.Tensor, w: Mxfp4Matrix) -> torch.Tensor:
    if not (w.blocks.is_contiguous() and w.scales.is_contiguous()):
        raise ValueError("the MXFP4 kernels need contiguous blocks and scales")
    x2 = x.reshape(-1, w.cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    y = torch.empty((T, w.rows), device=x.device, dtype=x.dtype)
    if T == 1:
        gemv(x2, w, y)
    elif 1 < T <= GEMM_UP_TO_T:
        gemm(x2, w, y)
    elif T > GEMM_UP_TO_T:
        torch.matmul(x2, dequantize_fused(w, x.dtype).T, out=y)
    return y.view(*x.shape[:-1], w.rows)


def gemv_config(rows: int, cols: int, dtype: torch.dtype = torch.bfloat16, br: int = 8, nb: int = 16) -> dict:
    """T == 1: BR rows per program (gpt-oss-20b's 2880 rows: 360 programs), NB blocks of 32
    columns per step; H2 = the fp16-pair loop (bf16/fp16 x), else float32. The fastest launches
    of benchmarks/mxfp4_sweep.py on gpt-oss-20b's layer (2026-12-05: the float32 loop on an H200,
    the fp16-pair loop on an H100): BR 8 / NB 16 / 4 warps for a lone matrix and the up kernel;
    the down kernel, whose programs walk the top-k experts one after another, takes BR 4 / NB 32
    with the fp16-pair loop (moe_decode)."""
    return dict(BR=br, NB=min(nb, triton.next_power_of_2(cols // BLOCK)), num_warps=4, H2=dtype != torch.float32)


def pack_x(x: torch.Tensor, kind: str = "mxfp4_x") -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, cols] -> (pairs int32 [R, cols / 2], block maxima float32 [R, cols / 32]) for the
    H2 loop: column pairs (32b + 8k + p, 32b + 8k + 4 + p) of block b at int32 16b + 4p + k,
    as fp16 lanes of x * 2^14 / max |x| over the block (into hqq_gpu's per-stream scratch)."""
    R, cols = x.shape
    nblk = cols // BLOCK
    pairs = hqq_gpu._scratch.get(kind + "_pairs", R * cols // 2, torch.int32, x.device)[: R * cols // 2]
    amax = hqq_gpu._scratch.get(kind + "_amax", R * nblk, torch.float32, x.device)[: R * nblk]
    nb = min(32, triton.next_power_of_2(nblk))
    _pack_x_kernel[(R, triton.cdiv(nblk, nb))](x, pairs, amax, nblk, x.stride(0), NB=nb, num_warps=4)
    return pairs.view(R, cols // 2), amax.view(R, nblk)


def gemv(x: torch.Tensor, w: Mxfp4Matrix, out: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """out [1, rows] = x [1, cols] @ dequantize(w).T."""
    cfg = cfg or gemv_config(w.rows, w.cols, x.dtype)
    pairs, amax = pack_x(x) if cfg["H2"] else (x, x)
    _gemv_kernel[(triton.cdiv(w.rows, cfg["BR"]),)](x, pairs, amax, out, w.blocks, w.scales, w.rows, w.cols // BLOCK,
                                                    BR=cfg["BR"], NB=cfg["NB"], H2=cfg["H2"],
                                                    num_warps=cfg["num_warps"])
    return out


def gemm(x: torch.Tensor, w: Mxfp4Matrix, out: torch.Tensor) -> torch.Tensor:
    """out [T, rows] = x [T, cols] @ dequantize(w).T for T up to 16, tl.dot on dequantized tiles."""
    T, nb = x.shape[0], min(4, triton.next_power_of_2(w.cols // BLOCK))
    br = 64
    _gemm_kernel[(triton.cdiv(w.rows, br), triton.cdiv(T, 16))](
        x, out, w.blocks, w.scales, T, w.rows, w.cols // BLOCK, x.stride(0), out.stride(0),
        BT=16, BR=br, NB=nb, num_warps=4, num_stages=2)
    return out


def moe_supported(experts: dict) -> bool:
    """True when moe_decode can run these expert views (of one cache slot): MXFP4 w1, w3, w2
    with the biases b1, b3, b2 (gpt-oss's experts as imported)."""
    w1, w3, w2 = (experts.get(m) for m in ("w1", "w3", "w2"))
    return (all(isinstance(w, Mxfp4Matrix) for w in (w1, w3, w2)) and all(b in experts for b in ("b1", "b3", "b2"))
            and (w1.rows, w1.cols) == (w3.rows, w3.cols) == (w2.cols, w2.rows))


def moe_decode(h: torch.Tensor, experts: dict, slot_bytes: int, ids: torch.Tensor, weights: torch.Tensor,
               table: torch.Tensor, out: torch.Tensor, alpha: float, limit: float,
               cfg: tuple[dict, dict] | None = None, host_off: int | None = None,
               fetched: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """One token through its routed experts, no host sync: out [1, H] = sum over k of
    weights[k] * (w2 clamped_swiglu(w1 h + b1, w3 h + b3) + b2) of expert ids[k], added in
    ascending expert order (the eager path's, step for step in out's dtype).

    experts: the views (w1, w3, w2, b1, b3, b2) of cache slot 0 of a layer; the expert in slot s
    lies s * slot_bytes bytes further. table [E] int32 (device): each expert's slot, read with
    ids [k] (device), so one CUDA graph of this serves any routing. cfg: (up, down) launch
    parameters as gemv_config's, to override the defaults (benchmarks/mxfp4_sweep.py).
    With H2, h and then the activations go through pack_x first (four launches, not two).
    host_off, fetched: an expert not in place is read from host memory or from its fetched copy
    (hqq_gpu.moe_decode's).
    """
    w1, w3, w2 = experts["w1"], experts["w3"], experts["w2"]
    topk = ids.numel()
    act = hqq_gpu._scratch.get("mxfp4_act", topk * w1.rows, h.dtype, h.device)[: topk * w1.rows]
    up, down = cfg or (gemv_config(w1.rows, w1.cols, h.dtype), gemv_config(w2.rows, w2.cols, h.dtype, br=4, nb=32))
    pairs, amax = pack_x(h.view(1, -1), "mxfp4_h") if up["H2"] else (h, h)
    guesses, stage_off = fetched or (ids, 0)
    ng = 0 if fetched is None else guesses.numel()
    _moe_up_kernel[(triton.cdiv(w1.rows, up["BR"]), topk)](
        h, pairs, amax, act, ids, table, slot_bytes, host_off or 0, guesses, stage_off, w1.blocks, w1.scales,
        experts["b1"], w3.blocks, w3.scales, experts["b3"], w1.rows, w1.cols // BLOCK, alpha, limit, BR=up["BR"],
        NB=up["NB"], H2=up["H2"], STREAM=host_off is not None, NG=ng, num_warps=up["num_warps"])
    pairs, amax = pack_x(act.view(topk, w2.cols), "mxfp4_act") if down["H2"] else (act, act)
    _moe_down_kernel[(triton.cdiv(w2.rows, down["BR"]),)](
        act, pairs, amax, out, ids, weights, table, slot_bytes, host_off or 0, guesses, stage_off, w2.blocks, w2.scales,
        experts["b2"], w2.rows, w2.cols // BLOCK, TOPK=topk, BR=down["BR"], NB=down["NB"], H2=down["H2"],
        STREAM=host_off is not None, NG=ng, num_warps=down["num_warps"])
    return out


def dequantize_fused(w: Mxfp4Matrix, dtype: torch.dtype) -> torch.Tensor:
    """dequantize(w, dtype) on the GPU, into hqq_gpu's per-stream reusable weight workspace."""
    buf = hqq_gpu._scratch.get("weights", w.rows * w.cols, dtype, w.blocks.device)
    out = buf[: w.rows * w.cols].view(w.rows, w.cols)
    br, nb = 32, min(8, triton.next_power_of_2(w.cols // BLOCK))
    grid = (triton.cdiv(w.rows, br), triton.cdiv(w.cols // BLOCK, nb))
    _dequant_kernel[grid](out, w.blocks, w.scales, w.rows, w.cols // BLOCK, BR=br, NB=nb, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels

if triton is not None:
    _LUT = tl.constexpr(TWICE_E2M1)  # what a kernel reads of the module must be a constexpr
    _B = tl.constexpr(BLOCK)
    _HB = tl.constexpr(BLOCK // 2)  # bytes per block

    @triton.jit
    def _twice_e2m1(code):
        """int32 e2m1 codes 0..15 -> their values times two as float32 (exact, -12..12)."""
        lut = tl.full(code.shape, _LUT, tl.int32)
        mag = ((lut >> ((code & 7) * 4)) & 15).to(tl.float32)
        return tl.where((code & 8) != 0, -mag, mag)

    @triton.jit
    def _half_scale(e):
        """uint8 e8m0 scales -> 2^(e - 127) / 2 as float32 (the 1/2 of _twice_e2m1)."""
        return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 0.5

    @triton.jit
    def _tile(b_ptr, s_ptr, r, b, rows, nblk):
        """The bytes (int32 [BR, NB, 16]) and half scales ([BR, NB]) of rows r, blocks b."""
        j = tl.arange(0, _HB)
        mask = (r[:, None] < rows) & (b[None, :] < nblk)
        off = r.to(tl.int64)[:, None] * nblk + b[None, :]
        byte = tl.load(b_ptr + off[:, :, None] * _HB + j[None, None, :], mask=mask[:, :, None], other=0)
        return byte.to(tl.int32), _half_scale(tl.load(s_ptr + off, mask=mask, other=0))

    @triton.jit
    def _gemv_rows(x_ptr, b_ptr, s_ptr, r, rows, nblk, NB: tl.constexpr):
        """float32 [BR]: x [cols] times rows r of the matrix."""
        j = tl.arange(0, _HB)
        acc = tl.zeros((r.shape[0], NB), tl.float32)
        for b0 in range(0, nblk, NB):
            b = b0 + tl.arange(0, NB)
            byte, scale = _tile(b_ptr, s_ptr, r, b, rows, nblk)
            col = b[:, None] * _B + 2 * j[None, :]  # [NB, 16] the even columns
            xmask = (b < nblk)[:, None]
            xe = tl.load(x_ptr + col, mask=xmask, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + col + 1, mask=xmask, other=0.0).to(tl.float32)
            part = _twice_e2m1(byte & 15) * xe[None] + _twice_e2m1(byte >> 4) * xo[None]
            acc += tl.sum(part, axis=2) * scale
        return tl.sum(acc, axis=1)

    # -- the H2 loop: two codes per fp16x2 instruction ---------------------------------------
    _MAG2 = tl.constexpr(0x0E000E00)  # an fp16 lane's two low exponent bits and top mantissa bit
    _SIGN2 = tl.constexpr(0x80008000 - (1 << 32))  # the lanes' sign bits, as int32

    if hqq_gpu._interpreting():  # no PTX: the same arithmetic lane by lane, rounded to fp16
        from moeferry.engine.kernels.hqq_gpu import _lane

        @triton.jit
        def _fma_h2(a, b, c):
            return _pack_h2(_lane(a, 0) * _lane(b, 0) + _lane(c, 0), _lane(a, 1) * _lane(b, 1) + _lane(c, 1))
    else:
        @triton.jit
        def _fma_h2(a, b, c):
            """a * b + c in each fp16 lane of the int32s (one fma.rn.f16x2)."""
            return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _e2m1_h2(w, P: tl.constexpr):
        """The codes of columns 8k + P and 8k + 4 + P of int32 word w (its nibbles are columns
        8k..8k+7) as fp16 lanes holding their values times 2^-14."""
        if P == 0:
            t = ((w << 9) & _MAG2) | ((w << 12) & _SIGN2)
        elif P == 1:
            t = ((w << 5) & _MAG2) | ((w << 8) & _SIGN2)
        elif P == 2:
            t = ((w << 1) & _MAG2) | ((w << 4) & _SIGN2)
        else:
            t = ((w >> 3) & _MAG2) | (w & _SIGN2)
        return t

    @triton.jit
    def _gemv_rows_h2(pairs_ptr, amax_ptr, b_ptr, s_ptr, r, rows, nblk, NB: tl.constexpr):
        """float32 [BR]: x packed by pack_x (pairs, block maxima) times rows r of the matrix."""
        k = tl.arange(0, 4)
        words_ptr = b_ptr.to(tl.pointer_type(tl.int32))
        acc = tl.zeros((r.shape[0], NB), tl.float32)
        for b0 in range(0, nblk, NB):
            b = b0 + tl.arange(0, NB)
            bmask = b < nblk
            mask = (r[:, None] < rows) & bmask[None, :]
            off = r.to(tl.int64)[:, None] * nblk + b[None, :]
            words = tl.load(words_ptr + off[:, :, None] * 4 + k[None, None, :], mask=mask[:, :, None], other=0)
            part = tl.zeros(words.shape, tl.int32)  # [BR, NB, 4]: each word's two fp16 partial sums
            for p in tl.static_range(4):
                xp = tl.load(pairs_ptr + b[:, None] * 16 + p * 4 + k[None, :], mask=bmask[:, None], other=0)
                part = _fma_h2(_e2m1_h2(words, p), xp[None], part)
            scale = (tl.load(s_ptr + off, mask=mask, other=0).to(tl.int32) << 23).to(tl.float32, bitcast=True)
            amax = tl.load(amax_ptr + b, mask=bmask, other=0.0)
            acc += tl.sum(_unpack_h2_sum(part), axis=2) * scale * amax[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _rows(x_ptr, pairs_ptr, amax_ptr, b_ptr, s_ptr, r, rows, nblk, NB: tl.constexpr, H2: tl.constexpr):
        if H2:
            y = _gemv_rows_h2(pairs_ptr, amax_ptr, b_ptr, s_ptr, r, rows, nblk, NB)
        else:
            y = _gemv_rows(x_ptr, b_ptr, s_ptr, r, rows, nblk, NB)
        return y

    @triton.jit
    def _pack_x_kernel(x_ptr, pairs_ptr, amax_ptr, nblk, stride_x, NB: tl.constexpr):
        """pack_x for row pid 0, blocks [pid 1 NB, +NB)."""
        row = tl.program_id(0)
        b = tl.program_id(1) * NB + tl.arange(0, NB)
        p = tl.arange(0, 4)
        bmask = (b < nblk)[:, None, None]
        col = b[:, None, None] * _B + 8 * tl.arange(0, 4)[None, None, :] + p[None, :, None]  # [NB, p, k]
        lo = tl.load(x_ptr + row * stride_x + col, mask=bmask, other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + row * stride_x + col + 4, mask=bmask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=2), axis=1)  # [NB]
        f = tl.where(amax > 0, 16384.0 / tl.maximum(amax, 1e-30), 0.0)[:, None, None]
        out = row * nblk * 16 + b[:, None, None] * 16 + p[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
        tl.store(pairs_ptr + out, _pack_h2(lo * f, hi * f), mask=bmask)
        tl.store(amax_ptr + row * nblk + b, amax, mask=b < nblk)

    @triton.jit
    def _gemv_kernel(x_ptr, pairs_ptr, amax_ptr, out_ptr, b_ptr, s_ptr, rows, nblk, BR: tl.constexpr,
                     NB: tl.constexpr, H2: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        y = _rows(x_ptr, pairs_ptr, amax_ptr, b_ptr, s_ptr, r, rows, nblk, NB, H2)
        tl.store(out_ptr + r, y.to(out_ptr.dtype.element_ty), mask=r < rows)

    @triton.jit
    def _halves(b_ptr, s_ptr, r, b, rows, nblk, NB: tl.constexpr):
        """The dequantized weights of rows r, blocks b: (even columns, odd columns) float32
        [BR, 16 NB] each."""
        byte, scale = _tile(b_ptr, s_ptr, r, b, rows, nblk)
        scale = scale[:, :, None]
        lo = tl.reshape(_twice_e2m1(byte & 15) * scale, (r.shape[0], NB * _HB))
        hi = tl.reshape(_twice_e2m1(byte >> 4) * scale, (r.shape[0], NB * _HB))
        return lo, hi

    @triton.jit
    def _gemm_kernel(x_ptr, out_ptr, b_ptr, s_ptr, T, rows, nblk, stride_x, stride_out,
                     BT: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr):
        """Tokens [pid_t BT, +BT) x rows [pid_r BR, +BR)."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        t = tl.program_id(1) * BT + tl.arange(0, BT)
        u = tl.arange(0, NB * _HB)  # even column 2u of the step's first block
        acc = tl.zeros((BT, BR), tl.float32)
        for b0 in range(0, nblk, NB):
            lo, hi = _halves(b_ptr, s_ptr, r, b0 + tl.arange(0, NB), rows, nblk, NB)
            col = b0 * _B + 2 * u
            xmask = (t[:, None] < T) & (col[None, :] < nblk * _B)
            xe = tl.load(x_ptr + t[:, None] * stride_x + col[None, :], mask=xmask, other=0.0)
            xo = tl.load(x_ptr + t[:, None] * stride_x + col[None, :] + 1, mask=xmask, other=0.0)
            if xe.dtype == tl.float32:
                acc = tl.dot(xe, tl.trans(lo), acc, input_precision="ieee")
                acc = tl.dot(xo, tl.trans(hi), acc, input_precision="ieee")
            else:  # the weights are exact in bf16/fp16 (one mantissa bit times a power of two)
                acc = tl.dot(xe, tl.trans(lo.to(xe.dtype)), acc)
                acc = tl.dot(xo, tl.trans(hi.to(xo.dtype)), acc)
        mask = (t[:, None] < T) & (r[None, :] < rows)
        tl.store(out_ptr + t[:, None] * stride_out + r[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant_kernel(out_ptr, b_ptr, s_ptr, rows, nblk, BR: tl.constexpr, NB: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        b0 = tl.program_id(1) * NB
        lo, hi = _halves(b_ptr, s_ptr, r, b0 + tl.arange(0, NB), rows, nblk, NB)
        col = b0 * _B + 2 * tl.arange(0, NB * _HB)
        mask = (r[:, None] < rows) & (col[None, :] < nblk * _B)
        off = r.to(tl.int64)[:, None] * (nblk * _B) + col[None, :]
        dt: tl.constexpr = out_ptr.dtype.element_ty
        tl.store(out_ptr + off, lo.to(dt), mask=mask)
        tl.store(out_ptr + off + 1, hi.to(dt), mask=mask)

    # -- one token through a layer's routed experts, with the expert chosen on the device ---------

    @triton.jit
    def _round(v, dt: tl.constexpr):
        return v.to(dt).to(tl.float32)

    @triton.jit
    def _biased(y, bias_ptr, r, mask, dt: tl.constexpr):
        """linear(...) + bias as the eager path rounds: the product in dt, then the sum."""
        return _round(_round(y, dt) + tl.load(bias_ptr + r, mask=mask, other=0.0).to(tl.float32), dt)

    @triton.jit
    def _clamped_swiglu(gate, up, alpha, limit, dt: tl.constexpr):
        """model.clamped_swiglu, each operation's result rounded to dt as in torch."""
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        glu = _round(gate * _round(tl.sigmoid(_round(gate * alpha, dt)), dt), dt)
        return _round(_round(up + 1.0, dt) * glu, dt)

    @triton.jit
    def _moe_up_kernel(x_ptr, pairs_ptr, amax_ptr, act_ptr, ids_ptr, table_ptr, slot_bytes, host_off, guess_ptr,
                       stage_off, b1_ptr, s1_ptr,
                       bias1_ptr, b3_ptr, s3_ptr, bias3_ptr, rows, nblk, alpha, limit, BR: tl.constexpr,
                       NB: tl.constexpr, H2: tl.constexpr, STREAM: tl.constexpr, NG: tl.constexpr):
        """act[kpos] = clamped_swiglu(x W1.T + b1, x W3.T + b3) of the expert at top-k position
        kpos (grid axis 1), rows [pid BR, +BR)."""
        kpos = tl.program_id(1)
        off = _routed_offset(ids_ptr, table_ptr, kpos, slot_bytes, host_off, guess_ptr, stage_off, STREAM, NG)
        dt: tl.constexpr = act_ptr.dtype.element_ty
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        mask = r < rows
        gate = _rows(x_ptr, pairs_ptr, amax_ptr, _at(b1_ptr, off),
                     _at(s1_ptr, off), r, rows, nblk, NB, H2)
        up = _rows(x_ptr, pairs_ptr, amax_ptr, _at(b3_ptr, off),
                   _at(s3_ptr, off), r, rows, nblk, NB, H2)
        gate = _biased(gate, _at(bias1_ptr, off), r, mask, dt)
        up = _biased(up, _at(bias3_ptr, off), r, mask, dt)
        tl.store(act_ptr + kpos * rows + r, _clamped_swiglu(gate, up, alpha, limit, dt).to(dt), mask=mask)

    @triton.jit
    def _moe_down_kernel(act_ptr, pairs_ptr, amax_ptr, out_ptr, ids_ptr, weights_ptr, table_ptr, slot_bytes, host_off,
                         guess_ptr, stage_off,
                         b_ptr, s_ptr, bias_ptr, rows, nblk, TOPK: tl.constexpr, BR: tl.constexpr,
                         NB: tl.constexpr, H2: tl.constexpr, STREAM: tl.constexpr, NG: tl.constexpr):
        """out rows [pid BR, +BR) = the weighted sum over the top-k of act[kpos] W2.T + b2, each
        expert's output rounded to out's dtype, times its weight, rounded, added in ascending
        expert order (the eager path's order: out starts at zero)."""
        dt: tl.constexpr = out_ptr.dtype.element_ty
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        mask = r < rows
        total = tl.zeros((BR,), tl.float32)
        for rank in tl.static_range(TOPK):
            kr = _position_of_rank(ids_ptr, rank, TOPK)
            off = _routed_offset(ids_ptr, table_ptr, kr, slot_bytes, host_off, guess_ptr, stage_off, STREAM, NG)
            y = _rows(act_ptr + kr * (nblk * _B), pairs_ptr + kr * (nblk * 16), amax_ptr + kr * nblk,
                      _at(b_ptr, off), _at(s_ptr, off), r, rows, nblk, NB, H2)
            y = _biased(y, _at(bias_ptr, off), r, mask, dt)
            total = _round(total + _round(y * tl.load(weights_ptr + kr), dt), dt)
        tl.store(out_ptr + r, total.to(dt), mask=mask)
