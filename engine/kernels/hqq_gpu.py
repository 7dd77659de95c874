"""Fused low-bit matrix kernels: y = x @ dequantize(w).T without materialising the weights.

`qlinear(x, w)` is the one entry point the model calls. On a CUDA device with Triton it runs
the fused kernels below; everywhere else (and with kernels="reference") it dequantizes with
`quant.dequantize` and multiplies, which is also the ground truth the kernels are tested
against. Design and measurements: docs/KERNELS.md.

The weight format is `quant.QMatrix` (HQQ axis-0 groups, bit planes, 8-bit or plain
scale/zero); see quant.py. What matters for the kernels:
  * output row n belongs to group j = n % G (G = rows // g): rows j, j+G, ..., j+(g-1)G share
    scale[j, k] and zero[j, k] for every column k;
  * a plane of width w packs p = 8 // w codes per byte; byte row r of the plane holds rows
    r + s * rows // p (s = 0..p-1), and since rows // p = (g // p) * G those rows are again in
    group r % G.
So a program takes BJ groups and the g rows of each (or 1/NQ of them): byte rows j + i' * G
of every plane and scale/zero row j, decoded once for all those rows. A tile of codes is a
tensor [p, byte rows, BJ, k...] whose first two axes flatten to the row index i of j + i * G.

Decode (T == 1) is a GEMV, bound by instruction issue as much as by bandwidth, so the inner
loop avoids every conversion instruction: a code is masked in place (byte & (mask << shift))
and ORed into the mantissa of a power of two chosen so that one float subtraction leaves the
exact code; x * scale is computed once per (group, column) and shared by the rows, and the
zero point is subtracted once per group after the loop:
  y[j + i G] = sum_k (x_k s_jk) c_(j+iG)k - sum_k x_k s_jk z_jk.
For bf16/fp16 activations the same trick runs on two fp16 lanes at once (inline PTX: lop3,
sub.f16x2, fma.rn.f16x2: two weights per instruction; partial sums in fp16 per thread, summed
in float32 at the end); float32 activations keep the float32 loop (gemv_config's H2).
When G alone gives too few programs the columns are split; the last program of a group block
(an atomic counter) sums the partials in a fixed order, so one launch does it all and the
result is deterministic.

Prefill (T > 1): up to 16 tokens a Triton GEMM that dequantizes each [g*BJ, BK] tile in
registers and feeds tl.dot; from 17 tokens the matrix is dequantized once into a reusable
per-stream workspace and multiplied by cuBLAS (which wins from about 32 tokens on an H200).
A fine-grained MoE's prompt runs its routed experts through `moe_prompt` instead: the decode
kernels over (token, expert) pairs, which saves the host a call per expert.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.nn.functional as F

from moeferry.engine.storage.quant import PLANES, QMatrix, dequantize

try:  # Triton is optional: CPU-only machines (CI) run the reference path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = tl = None

KERNEL_CHOICES = ("auto", "reference", "fused")


def _interpreting() -> bool:
    """TRITON_INTERPRET=1 runs the Triton kernels on the CPU (tests on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# Set when the fused kernels failed at run time (for example Triton finds no C compiler to
# build its launcher): "auto" then uses the reference path for the rest of the process.
FUSED_FAILURE: str | None = None


def fused_available(device: torch.device | str | None = None) -> bool:
    """True when the fused kernels can run on `device` (CUDA and Triton importable)."""
    if triton is None or FUSED_FAILURE is not None:
        return False
    if device is not None and torch.device(device).type != "cuda":
        return _interpreting()
    return torch.cuda.is_available() or _interpreting()


def fused_supported(w: QMatrix) -> bool:
    """Formats the fused kernels handle: a power-of-two group size that every plane's
    codes-per-byte divides (true for all of quant.py's specs), rows a multiple of 8."""
    g = w.group_size
    return (w.bits in PLANES and g & (g - 1) == 0 and w.rows % 8 == 0
            and all(g % (8 // width) == 0 for width in PLANES[w.bits]))


def qlinear(x: torch.Tensor, w: QMatrix | torch.Tensor, kernels: str = "auto",
            out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T for x [..., cols]; returns y [..., rows] in x.dtype.

    w: a QMatrix (dequantized on the fly) or a plain weight tensor [rows, cols] (F.linear).
    kernels: "reference" = quant.dequantize (in x.dtype) then matmul, the CPU path and the
    ground truth; "fused" = the Triton kernels (CUDA); "auto" = fused where available.
    out: optional preallocated contiguous y (fused decode then allocates nothing).
    """
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, not {kernels!r}")
    if not isinstance(w, QMatrix):
        y = F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))
        return y if out is None else out.copy_(y)
    if x.shape[-1] != w.cols:
        raise ValueError(f"x has {x.shape[-1]} columns but the matrix is {w.rows}x{w.cols}")
    fused = kernels == "fused" or (kernels == "auto" and fused_available(x.device)
                                   and fused_supported(w))
    if not fused:
        y = F.linear(x, dequantize(w, x.dtype))
        return y if out is None else out.copy_(y)
    if not fused_available(x.device):
        raise RuntimeError("kernels='fused' needs Triton and a CUDA tensor; use kernels='reference'")
    if not fused_supported(w):
        raise ValueError(f"the fused kernels do not handle {w.bits}-bit groups of {w.group_size} "
                         f"rows; use kernels='reference'")
    if kernels == "fused" or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _fused(x, w, out)
    try:
        return _fused(x, w, out)
    except Exception as e:  # noqa: BLE001 - any failure of the optional fast path
        global FUSED_FAILURE
        FUSED_FAILURE = f"{type(e).__name__}: {e}"
        warnings.warn(f"fused kernels unavailable ({FUSED_FAILURE}); using the reference path", stacklevel=2)
        y = F.linear(x, dequantize(w, x.dtype))
        return y if out is None else out.copy_(y)


def _fused(x: torch.Tensor, w: QMatrix, out: torch.Tensor | None) -> torch.Tensor:
    x2 = x.reshape(-1, w.cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    if out is None:
        y = torch.empty((T, w.rows), device=x.device, dtype=x.dtype)
    else:
        if out.dtype != x.dtype or out.numel() != T * w.rows or not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor of x.dtype with x.shape[:-1] + (rows,)")
        y = out.view(T, w.rows)
    if T == 0:
        pass
    elif T == 1:
        gemv(x2, w, y)
    elif T < DEQUANT_CUBLAS_FROM_T:
        gemm(x2, w, y)
    else:
        torch.matmul(x2, dequantize_fused(w, x.dtype).T, out=y)
    return y.view(*x.shape[:-1], w.rows) if out is None else out


# ---------------------------------------------------------------------------------------------
# Host side: launch parameters and per-stream scratch

# Prefill: the fused GEMM below this many tokens, dequantize + cuBLAS from it (measured on an
# H200: fused 55-78 us vs 82-93 at T = 8, 100-145 vs 84-95 at T = 32; docs/KERNELS.md).
DEQUANT_CUBLAS_FROM_T = 17


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number
    return torch.cuda.get_device_properties(device).multi_processor_count


def _meta_mode(meta: torch.Tensor | None, cols: int, bk: int) -> int:
    """How the kernel finds value f's meta pair f % M: 0 no meta (float scale/zero),
    1 contiguous within a tile (M and cols multiples of the tile width), 2 wraps at most
    once per tile (any M), 3 a single pair (M == 1)."""
    if meta is None:
        return 0
    m = meta.shape[1]
    if m == 1:
        return 3
    return 1 if (m % bk == 0 and cols % bk == 0 and bk % 8 == 0) else 2


def _plane_widths(bits: int) -> tuple[int, int]:
    """Widths of the first and the second plane (0: none)."""
    widths = PLANES[bits]
    return widths[0], (widths[1] if len(widths) > 1 else 0)


def _common_args(w: QMatrix):
    """The matrix's tensors in kernel order; an absent plane or meta is replaced by a tensor
    the kernel never reads."""
    p0 = w.planes[0]
    p1 = w.planes[1] if len(w.planes) > 1 else p0
    sm = w.scale_meta if w.scale_meta is not None else w.scale
    zm = w.zero_meta if w.zero_meta is not None else w.zero
    for t in (p0, p1, w.scale, w.zero, sm, zm):
        if not t.is_contiguous():
            raise ValueError("the fused kernels need contiguous QMatrix tensors")
    return p0, p1, w.scale, w.zero, sm, zm


def _meta_len(meta: torch.Tensor | None) -> int:
    return 1 if meta is None else meta.shape[1]


class _Scratch:
    """Per (device, stream) buffers: split-K partials, tile counters (zero between launches:
    the last program of a tile resets its counter), the dequantized-weight workspace.
    Keyed by stream so that kernels running on two streams never share a counter. Grown, never
    shrunk; allocate before capturing a CUDA graph (run the shapes once)."""

    def __init__(self):
        self.bufs: dict[tuple, torch.Tensor] = {}

    def get(self, kind: str, numel: int, dtype: torch.dtype, device: torch.device,
            zero: bool = False) -> torch.Tensor:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (kind, dtype, device.type, device.index, stream)
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = (torch.zeros if zero else torch.empty)(max(numel, 1), dtype=dtype, device=device)
            self.bufs[key] = buf
        return buf


_scratch = _Scratch()


def _split(cols: int, bk: int, n_tiles: int, target_programs: int, max_split: int = 64):
    """Columns per split (a multiple of bk) and the number of splits, so that
    n_tiles * splits is about target_programs."""
    want = max(1, min(max_split, -(-target_programs // n_tiles), -(-cols // bk)))
    k_per_split = -(-cols // (want * bk)) * bk
    return k_per_split, -(-cols // k_per_split)


def gemv_config(rows: int, cols: int, bits: int, group_size: int, sms: int = 132,
                exact: bool = False) -> dict:
    """Launch parameters for one T == 1 matrix (tuned on an H200: docs/KERNELS.md).
    BKO = 32 * num_warps: each thread owns one KV-wide column strip of every row of its group.
    H2: the packed fp16 inner loop (its rounding, ~5e-4 relative, is below bf16's); `exact`
    (float32 activations) keeps the float32 loop."""
    warps = 4
    kv = 8 if cols % 8 == 0 else 4
    # ~16 rows per thread (fewer registers, more warps); 8-bit decodes its 8-bit scales for
    # only 1 code per byte, so splitting rows (decoding NQ times) costs it more than it gains.
    nq = 1 if bits == 8 else min(_max_nq(bits, group_size), max(1, group_size // 16))
    return dict(BJ=1, BKO=32 * warps, KV=kv, NQ=nq, programs=4 * sms, num_warps=warps,
                H2=_h2_fits(cols, kv) and not exact)


def _h2_fits(cols: int, kv: int) -> bool:
    """The packed-fp16 inner loop reads each row's 8 columns of a thread as one 64-bit word."""
    return cols % 8 == 0 and kv == 8


def _max_nq(bits: int, group_size: int) -> int:
    """Row parts must split the byte rows of the plane with the most codes per byte."""
    return group_size // (8 // PLANES[bits][-1])


@functools.lru_cache(maxsize=4096)
def _gemv_launch(rows, cols, bits, group_size, sms, cfg_items, matrices=1, exact=False):
    """Grid and constants of a GEMV over `matrices` same-shape matrices launched together
    (the routed experts of a token): the programs target is shared among them. cfg_items
    override gemv_config's defaults; the packed loop only where its 8-column words fit."""
    cfg = {**gemv_config(rows, cols, bits, group_size, sms, exact), **dict(cfg_items or ())}
    G = rows // group_size
    nq = min(cfg["NQ"], _max_nq(bits, group_size))
    n_j = -(-G // cfg["BJ"]) * nq  # programs per column split
    bk = cfg["BKO"] * cfg["KV"]
    k_per_split, split = _split(cols, bk, n_j, cfg["programs"] // matrices)
    even = G % cfg["BJ"] == 0 and cols % bk == 0  # (k_per_split is a multiple of bk)
    consts = dict(BJ=cfg["BJ"], BKO=cfg["BKO"], KV=cfg["KV"], NQ=nq, EVEN=even, num_warps=cfg["num_warps"],
                  num_stages=cfg.get("num_stages", 1), H2=cfg["H2"] and _h2_fits(cols, cfg["KV"]))
    return n_j, split, k_per_split, bk, consts


# A lone 4-bit matrix in groups of 64 of at most SMALL_WEIGHTS weights (gpt-oss-20b's and
# Qwen3-30B-A3B's q and o projections) in NQ row parts: 2 took them from 12.9-13.5 to 10.5-11.1 us
# (gpt-oss) and from 8.7-8.9 to 7.9-8.1 us (Qwen3) against gemv_config's 4, the best or within
# 0.7 us of the best of 36 variants (benchmarks/decode_sweep.py on an H100, 2026-12-05); 0 = off.
SMALL_GEMV_NQ = 2
SMALL_WEIGHTS = 12 * 2**20


def gemv(x: torch.Tensor, w: QMatrix, out: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """out [1, rows] = x [1, cols] @ dequantize(w).T, one launch (the fused GEMV)."""
    if cfg is None and SMALL_GEMV_NQ and w.bits == 4 and w.group_size == 64 and w.rows * w.cols <= SMALL_WEIGHTS:
        cfg = {"NQ": SMALL_GEMV_NQ}
    n_j, split, k_per_split, bk, consts = _gemv_launch(
        w.rows, w.cols, w.bits, w.group_size, _sm_count(x.device),
        tuple(sorted(cfg.items())) if cfg else None, 1, x.dtype == torch.float32)
    if split > 1:
        ws = _scratch.get("partials", split * w.rows, torch.float32, x.device)
        cnt = _scratch.get("counters", n_j, torch.int32, x.device, zero=True)
    else:
        ws, cnt = out, out  # not read
    _gemv_kernel[(n_j, split)](x, out, *_common_args(w), ws, cnt, *_sizes(w), k_per_split, split,
                               SPLIT=split > 1, **_format(w, bk), **consts)
    return out


def _sizes(w: QMatrix) -> tuple:
    """The GEMV kernels' size arguments: G, rows, cols, Ms, Mz."""
    return w.groups, w.rows, w.cols, _meta_len(w.scale_meta), _meta_len(w.zero_meta)


def _format(w: QMatrix, bk: int) -> dict:
    """The GEMV kernels' constexprs that describe w's format (for k tiles of bk columns)."""
    w0, w1 = _plane_widths(w.bits)
    return dict(W0=w0, W1=w1, GS=w.group_size, SMODE=_meta_mode(w.scale_meta, w.cols, bk),
                ZMODE=_meta_mode(w.zero_meta, w.cols, bk))


def pair_supported(a, b) -> bool:
    """True when the fused kernels can read a and b in one loop: the same format throughout."""
    return (all(isinstance(w, QMatrix) and fused_supported(w) for w in (a, b))
            and (a.rows, a.cols, a.bits, a.group_size) == (b.rows, b.cols, b.bits, b.group_size)
            and _common_dtypes(a) == _common_dtypes(b))


def moe_supported(experts: dict) -> bool:
    """True when moe_decode can run these expert views (w1, w3, w2 of one slot)."""
    return pair_supported(experts["w1"], experts["w3"]) and fused_supported(experts["w2"])


def _common_dtypes(w: QMatrix):
    return tuple(t.dtype for t in _common_args(w)), _meta_len(w.scale_meta), _meta_len(w.zero_meta)


def gemv_pair(x: torch.Tensor, a: QMatrix, b: QMatrix, out_a: torch.Tensor, out_b: torch.Tensor) -> None:
    """out_a [1, rows] = x @ A.T and out_b = x @ B.T in one launch (pair_supported(a, b)):
    a token's key and value projections."""
    n_j, split, k_per_split, bk, consts = _gemv_launch(a.rows, a.cols, a.bits, a.group_size,
                                                       _sm_count(x.device), None, 2,
                                                       x.dtype == torch.float32)
    ws = _scratch.get("partials", split * 2 * a.rows, torch.float32, x.device)
    cnt = _scratch.get("counters", n_j, torch.int32, x.device, zero=True)
    _gemv_pair_kernel[(n_j, split)](x, out_a, out_b, *_common_args(a), *_common_args(b), ws, cnt,
                                    *_sizes(a), k_per_split, split, SPLIT=split > 1, **_format(a, bk),
                                    **consts)


def moe_decode(h: torch.Tensor, experts: dict, slot_bytes: int, ids: torch.Tensor,
               weights: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
               cfg: tuple[dict, dict] | None = None, late: torch.Tensor | None = None,
               host_off: int | None = None, fetched: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """One token through its routed experts in two launches, with no host sync:
    out [1, H] = sum_k weights[k] * w2(silu(w1 h) * w3 h) of expert ids[k].

    experts: the QMatrix views (w1, w3, w2) of cache slot 0 of a layer; the expert in slot s
    lies s * slot_bytes bytes further. table [E] int32 (device): the slot of each expert, read
    by the kernels with ids [k] (device), so a CUDA graph of this serves any routing. The
    result equals the eager per-expert path's rounding step for step (see _moe_down_kernel).
    cfg: (up, down) launch parameters as gemv_config's, to override the defaults (tuning).

    An expert whose table entry is -1 (not in place yet) is read from slot 0 instead, and out
    is then left as it is: the layer's "hits first" launch (engine/runtime/model.py) runs before
    the host has read the routing. `late` [n] (device) then runs only the experts at those top-k
    positions, now in place, and writes out from every position's result: the others' stayed in
    the down kernel's partials since that launch, so out is summed in the same order either way.
    With host_off (bytes from slot 0 to expert 0 of the layer's page-locked home in host memory,
    whose experts lie slot_bytes apart) an expert not in place is read there instead, over the
    link (expert_cache.ExpertCache.host_offset), and out is always written; with fetched =
    (guesses [NG] (device), stage_off) too, one of the guesses is read from the copy that
    decode.fetch_experts made of it, stage_off + m * slot_bytes bytes from slot 0 for guess m.
    """
    w1, w3, w2 = experts["w1"], experts["w3"], experts["w2"]
    topk = ids.numel()
    launched = topk if late is None else late.numel()  # programs along grid axis 2
    at = ids if late is None else late  # not read without LATE
    sms = _sm_count(h.device)
    x = h.reshape(-1)
    act = _scratch.get("act", topk * w1.rows, h.dtype, h.device)
    # up: silu(w1 x) * w3 x for every routed expert, into act [k, F]
    up_cfg, down_cfg = (tuple(sorted(c.items())) for c in cfg) if cfg else (None, None)
    n_j, split, k_per_split, bk, consts = _gemv_launch(
        w1.rows, w1.cols, w1.bits, w1.group_size, sms, up_cfg, 2 * topk, h.dtype == torch.float32)
    ws = _scratch.get("partials", topk * split * 2 * w1.rows, torch.float32, h.device)
    cnt = _scratch.get("counters", topk * n_j, torch.int32, h.device, zero=True)
    stream = host_off is not None
    guesses, stage_off = fetched or (ids, 0)
    ng = 0 if fetched is None else guesses.numel()
    _moe_up_kernel[(n_j, split, launched)](x, act, ids, at, table, slot_bytes, host_off or 0, guesses, stage_off,
                                           *_common_args(w1),
                                           *_common_args(w3), ws, cnt, *_sizes(w1), k_per_split, split,
                                           TOPK=topk, SPLIT=split > 1, LATE=late is not None, **_format(w1, bk),
                                           STREAM=stream, NG=ng, **consts)
    # down: the weighted sum of w2 act[k]; its partials outlive the launch (for `late`)
    n_j, split, k_per_split, bk, consts = _gemv_launch(
        w2.rows, w2.cols, w2.bits, w2.group_size, sms, down_cfg, topk, h.dtype == torch.float32)
    ws = _scratch.get("down_partials", topk * split * w2.rows, torch.float32, h.device)
    cnt = _scratch.get("counters", n_j, torch.int32, h.device, zero=True)
    _moe_down_kernel[(n_j, split, launched)](act, out, ids, at, weights, table, slot_bytes, host_off or 0,
                                             guesses, stage_off, *_common_args(w2), ws, cnt, *_sizes(w2), k_per_split, split,
                                             launched * split, TOPK=topk, LATE=late is not None, PAIRS=False,
                                             SPLIT=split > 1, STREAM=stream, NG=ng, **_format(w2, bk), **consts)
    return out


def moe_prompt(h: torch.Tensor, experts: dict, slot_bytes: int, slots: torch.Tensor, at: torch.Tensor,
               topk: int, y: torch.Tensor) -> torch.Tensor:
    """A prompt's routed experts, the pairs `at` of them, in two launches:
    y[p] = w2(silu(w1 h[t]) * w3 h[t]) of the expert in cache slot slots[p], t = p // topk, for
    each position p (token t, top-k place p % topk) in at [n] (device). h [T, H]; slots
    [T * topk] int32 (device; read at the positions in `at` only); y [T * topk, H]: its other
    rows are left as they are. Each pair reads its expert, as decoding the token would, so a
    layer's experts can run in a few launches, as many as are in the cache at a time."""
    w1, w3, w2 = experts["w1"], experts["w3"], experts["w2"]
    n, pairs = at.numel(), slots.numel()
    sms = _sm_count(h.device)
    exact = h.dtype == torch.float32
    positions = _positions(pairs, h.device)  # ids = positions: the kernels' table[ids[p]] is slots[p]
    act = _scratch.get("act", pairs * w1.rows, h.dtype, h.device)
    n_j, split, k_per_split, bk, consts = _gemv_launch(
        w1.rows, w1.cols, w1.bits, w1.group_size, sms, None, 2 * n, exact)
    ws, cnt = _split_scratch("partials", split, pairs * 2 * w1.rows, pairs * n_j, h.device)
    _moe_up_kernel[(n_j, split, n)](h, act, positions, at, slots, slot_bytes, 0, at, 0, *_common_args(w1),
                                    *_common_args(w3),
                                    ws, cnt, *_sizes(w1), k_per_split, split, TOPK=topk, SPLIT=split > 1,
                                    LATE=True, STREAM=False, NG=0, **_format(w1, bk), **consts)
    n_j, split, k_per_split, bk, consts = _gemv_launch(
        w2.rows, w2.cols, w2.bits, w2.group_size, sms, None, n, exact)
    ws, cnt = _split_scratch("down_partials", split, pairs * w2.rows, pairs * n_j, h.device)
    _moe_down_kernel[(n_j, split, n)](act, y, positions, at, slots, slots, slot_bytes, 0, at, 0, *_common_args(w2), ws, cnt,
                                      *_sizes(w2), k_per_split, split, 0, TOPK=topk, LATE=True, PAIRS=True, SPLIT=split > 1,
                                      STREAM=False, NG=0, **_format(w2, bk), **consts)
    return y


def _split_scratch(kind: str, split: int, partials: int, counters: int, device: torch.device):
    """Split-K's partials (split x `partials` floats) and tile counters; none without a split
    (the kernels do not read them then: a prompt's many pairs need no split)."""
    if split == 1:
        partials = counters = 1
    return (_scratch.get(kind, split * partials, torch.float32, device),
            _scratch.get("counters", counters, torch.int32, device, zero=True))


_position_tables: dict = {}


def _positions(n: int, device: torch.device) -> torch.Tensor:
    """0..n-1 (int32) on the device: a view of one table per device, grown when too short."""
    key = (device.type, device.index)
    table = _position_tables.get(key)
    if table is None or table.numel() < n:
        table = _position_tables[key] = torch.arange(max(n, 4096), dtype=torch.int32, device=device)
    return table[:n]


def gemm_config(T: int, rows: int, cols: int, bits: int, group_size: int, sms: int = 132) -> dict:
    """Launch parameters of the fused GEMM. For T <= 16, where qlinear uses it, the fastest
    tiles of the H200 sweep (docs/KERNELS.md, prefill): 128 output rows per program."""
    bj = max(1, 128 // group_size)
    if T <= 16:
        if bits == 4 or bits == 8:
            return dict(BT=16, BJ=bj, BK=128, programs=sms, num_warps=8, num_stages=3)
        return dict(BT=16, BJ=bj, BK=128 if bits == 2 else 64, programs=2 * sms, num_warps=4,
                    num_stages=2)
    return dict(BT=32 if T <= 32 else 64, BJ=max(1, 64 // group_size), BK=64, programs=sms,
                num_warps=8, num_stages=3)


def gemm(x: torch.Tensor, w: QMatrix, out: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """out [T, rows] = x [T, cols] @ dequantize(w).T with the fused (tl.dot) GEMM."""
    T = x.shape[0]
    sms = _sm_count(x.device)
    cfg = cfg or gemm_config(T, w.rows, w.cols, w.bits, w.group_size, sms)
    try:
        _launch_gemm(x, w, out, cfg, sms)
    except triton.runtime.errors.OutOfResources:
        # a smaller GPU (e.g. 64 KB of shared memory on a T4): 2 stages of 64 columns
        _launch_gemm(x, w, out, dict(cfg, BK=64, num_warps=4, num_stages=2), sms)
    return out


def _launch_gemm(x, w, out, cfg, sms):
    T = x.shape[0]
    n_j, n_t = -(-w.groups // cfg["BJ"]), -(-T // cfg["BT"])
    bk = cfg["BK"]
    k_per_split, split = _split(w.cols, bk, n_j * n_t, cfg.get("programs", 2 * sms),
                                max_split=max(1, w.cols // (4 * bk)))
    if split > 1:
        ws = _scratch.get("partials", split * T * w.rows, torch.float32, x.device)
        cnt = _scratch.get("counters", n_j * n_t, torch.int32, x.device, zero=True)
    else:
        ws, cnt = out, out
    w0, w1 = _plane_widths(w.bits)
    _gemm_kernel[(n_j, n_t, split)](
        x, out, *_common_args(w), ws, cnt,
        T, w.groups, w.rows, w.cols, x.stride(0), out.stride(0),
        _meta_len(w.scale_meta), _meta_len(w.zero_meta), k_per_split, split,
        W0=w0, W1=w1, GS=w.group_size, SPLIT=split > 1,
        SMODE=_meta_mode(w.scale_meta, w.cols, bk), ZMODE=_meta_mode(w.zero_meta, w.cols, bk),
        BT=cfg["BT"], BJ=cfg["BJ"], BK=bk, num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 2))


def dequantize_fused(w: QMatrix, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize(w, dtype) on the GPU, into `out` or a per-stream reusable workspace."""
    if out is None:
        buf = _scratch.get("weights", w.rows * w.cols, dtype, w.planes[0].device)
        out = buf[: w.rows * w.cols].view(w.rows, w.cols)
    bj, bk = max(1, 64 // w.group_size), 128
    w0, w1 = _plane_widths(w.bits)
    grid = (-(-w.groups // bj), -(-w.cols // bk))
    _dequant_kernel[grid](
        out, *_common_args(w), w.groups, w.cols, _meta_len(w.scale_meta), _meta_len(w.zero_meta),
        W0=w0, W1=w1, GS=w.group_size,
        SMODE=_meta_mode(w.scale_meta, w.cols, bk), ZMODE=_meta_mode(w.zero_meta, w.cols, bk),
        BJ=bj, BK=bk, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels

if triton is not None:
    @triton.jit
    def _as_float(v):
        """int32 v in [0, 2**23) -> float32 v, without a conversion instruction."""
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _scale_or_zero(q_ptr, meta_ptr, off, row_base, kk, mask, M, MODE: tl.constexpr):
        """Scale or zero as float32, shaped like `off` (offsets into [G, cols]).
        row_base = (j * cols + k0) % M per group row, kk = k - k0 (for MODE 2: kk % M);
        value f = j * cols + k has meta pair f % M = row_base + kk (wrapped once for MODE 2)."""
        if MODE == 0:  # plain float tensor
            return tl.load(q_ptr + off, mask=mask, other=0.0).to(tl.float32)
        q = _as_float(tl.load(q_ptr + off, mask=mask, other=0).to(tl.int32))
        if MODE == 3:
            m0 = tl.load(meta_ptr).to(tl.float32)
            m1 = tl.load(meta_ptr + 1).to(tl.float32)
        else:
            if MODE == 1:  # row_base is a multiple of the tile width: contiguous, aligned
                row_base = row_base // 8 * 8  # (tells the compiler; a no-op here)
            idx = row_base + kk
            if MODE == 2:
                idx = tl.where(idx >= M, idx - M, idx)
            m0 = tl.load(meta_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            m1 = tl.load(meta_ptr + M + idx, mask=mask, other=0.0).to(tl.float32)
        return (q - m1) * m0

    @triton.jit
    def _finish(y, offs_out, offs_ws, mask, out_ptr, ws_ptr, ws_slice, cnt_ptr, pid_k, n_split,
                SPLIT: tl.constexpr):
        """Write a tile result; with split-K the last program of the tile sums all partials
        (fixed order) and resets the tile's counter for the next launch on this stream."""
        if not SPLIT:
            tl.store(out_ptr + offs_out, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ws_ptr + pid_k * ws_slice + offs_ws, y, mask=mask)
            tl.debug_barrier()  # every thread's partial is stored before the counter moves
            done = tl.atomic_add(cnt_ptr, 1)  # acq_rel, gpu scope
            if done == n_split - 1:
                tot = tl.load(ws_ptr + offs_ws, mask=mask, other=0.0, cache_modifier=".cg")
                for s in range(1, n_split):
                    tot += tl.load(ws_ptr + s * ws_slice + offs_ws, mask=mask, other=0.0,
                                   cache_modifier=".cg")
                tl.store(out_ptr + offs_out, tot.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr, 0)

    @triton.jit
    def _plane_rows(q, G, cols, j, GS: tl.constexpr, W: tl.constexpr, NBB: tl.constexpr,
                    NQ: tl.constexpr):
        """Element offsets [BJ, 1, 1, g/p/NQ] of the byte rows that program part q of NQ reads
        from a plane of width W: byte rows j + i'*G with i' = t*NBB + q*NBB/NQ + a (t < g/p/NBB,
        a < NBB/NQ), NBB = byte rows per group of the plane with the most codes per byte. So
        all planes of one program hold the same output rows (see _gemv_rows)."""
        NBQ: tl.constexpr = GS // (8 // W) // NQ
        r = tl.arange(0, NBQ)
        i = (r // (NBB // NQ)) * NBB + q * (NBB // NQ) + r % (NBB // NQ)
        return ((i[None, :] * G + j[:, None]) * cols)[:, None, None, :]

    # -- packed half2 arithmetic (decode GEMV): two fp16 lanes per 32-bit register ------------
    # One fma.rn.f16x2 handles two weights; the interpreter (CPU tests) has no PTX, so there
    # the same arithmetic is spelled out lane by lane in float32, rounded to fp16 as the GPU does.
    if _interpreting():
        @triton.jit
        def _lane(v, i: tl.constexpr):
            return ((v >> (16 * i)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

        @triton.jit
        def _pack_h2(lo, hi):
            lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            return lo16 | (hi16 << 16)

        @triton.jit
        def _h2_code_fma(w, mask, magic, xs2, acc):
            t = (w & mask) | magic
            lo = (_lane(t, 0) - _lane(magic, 0)) * _lane(xs2, 0) + _lane(acc, 0)
            hi = (_lane(t, 1) - _lane(magic, 1)) * _lane(xs2, 1) + _lane(acc, 1)
            return _pack_h2(lo, hi)
    else:
        @triton.jit
        def _pack_h2(lo, hi):
            """float32 lo, hi -> int32 holding fp16(lo) in its low and fp16(hi) in its high half."""
            return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi],
                                             dtype=tl.int32, is_pure=True, pack=1)

        @triton.jit
        def _h2_code_fma(w, mask, magic, xs2, acc):
            """Per fp16 lane: acc + code * xs2, where code = the bits `mask` of w's lane, read
            exactly by OR-ing them into the mantissa of `magic` and subtracting it (one LOP3,
            one HADD2, one HFMA2 for two weights)."""
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $1, $2, $3, 0xea; sub.rn.f16x2 t, t, $3; "
                "fma.rn.f16x2 $0, t, $4, $5; }",
                "=r,r,r,r,r,r", [w, mask, magic, xs2, acc], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _unpack_h2_sum(acc):
        """float32 sum of the two fp16 lanes of int32 acc."""
        lo = (acc & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (acc >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo + hi

    @triton.jit
    def _gemv_plane_h2(acc, plane_ptr, row_off, kw, mask_w, xs2, HIGH: tl.constexpr, W: tl.constexpr):
        """_gemv_plane in packed fp16 for KV = 8: acc [p, R, BJ, BKO] int32 (two fp16 partial
        sums each), kw [2, BKO] offsets of a thread's two 32-bit words, mask_w [BJ, 2, BKO],
        xs2 = _pack_xs(xs). A word holds columns c..c+3: bytes 0 and 2 sit in the low bits of the
        two fp16 lanes (times xs of c, c+2), bytes 1 and 3 do after a shift by 8 (c+1, c+3)."""
        P: tl.constexpr = 8 // W
        words = plane_ptr.to(tl.pointer_type(tl.int32)) + row_off // 4
        b = tl.load(words + kw[None, :, :, None], mask=mask_w[:, :, :, None], other=0)  # [BJ, 2, BKO, R]
        lo, hi = tl.split(tl.permute(b, (3, 0, 2, 1)))  # [R, BJ, BKO] each
        lo = lo[None]
        hi = hi[None]
        shift = (8 - W * (tl.arange(0, P) + 1))[:, None, None, None]
        mask = ((1 << W) - 1) << shift
        magic = (25 + HIGH - shift) << 10  # fp16 2**(10 + HIGH - shift): LSB weighs 2**(HIGH - shift)
        mask = mask | (mask << 16)
        magic = magic | (magic << 16)
        e0, o0, e1, o1 = xs2
        acc = _h2_code_fma(lo, mask, magic, e0[None, None], acc)
        acc = _h2_code_fma(lo >> 8, mask, magic, o0[None, None], acc)
        acc = _h2_code_fma(hi, mask, magic, e1[None, None], acc)
        return _h2_code_fma(hi >> 8, mask, magic, o1[None, None], acc)

    @triton.jit
    def _pack_xs(xs, BJ: tl.constexpr, BKO: tl.constexpr):
        """xs [BJ, 8, BKO] float32 -> the four fp16 pairs of _gemv_plane_h2, [BJ, BKO] each:
        column 4w + 2h + par goes to lane h of pair (w, par)."""
        x5 = tl.permute(tl.reshape(xs, (BJ, 2, 2, 2, BKO)), (0, 4, 1, 2, 3))  # [BJ, BKO, w, h, par]
        ev, od = tl.split(x5)
        e_lo, e_hi = tl.split(ev)  # [BJ, BKO, w]
        o_lo, o_hi = tl.split(od)
        e = _pack_h2(e_lo, e_hi)
        o = _pack_h2(o_lo, o_hi)
        e0, e1 = tl.split(e)
        o0, o1 = tl.split(o)
        return e0, o0, e1, o1

    @triton.jit
    def _gemv_plane(acc, plane_ptr, row_off, k, mask, xs, opaque_zero, HIGH: tl.constexpr,
                    W: tl.constexpr):
        """acc [p, R, BJ, BKO] += sum over the KV axis of (code << HIGH) * xs, R byte rows.
        row_off [BJ, 1, 1, R] byte-row offsets, k [KV, BKO], xs [BJ, KV, BKO]."""
        P: tl.constexpr = 8 // W
        # Loaded as [BJ, KV, BKO, R] so that Triton's coalescing gives each thread a KV-byte
        # vector and spreads the threads over BKO (it breaks ties between strided axes by
        # axis order), then permuted for free to [R, BJ, KV, BKO].
        b = tl.load(plane_ptr + row_off + k[None, :, :, None], mask=mask[:, :, :, None], other=0)
        b = tl.permute(b.to(tl.int32), (3, 0, 1, 2))[None]  # [1, R, BJ, KV, BKO]
        shift = (8 - W * (tl.arange(0, P) + 1))[:, None, None, None, None]  # code s: bits shift..
        # OR the masked bits into the mantissa of 2**(23 + HIGH - shift), whose mantissa LSB
        # weighs 2**(HIGH - shift): the float is 2**(23+HIGH-shift) + code * 2**HIGH, exactly.
        # (opaque_zero is 0 at run time but not to the compiler: the magic then lives in a
        # register and ptxas fuses the AND and the OR into one LOP3.)
        magic = ((127 + 23 + HIGH - shift) << 23) + opaque_zero
        big = (b & (((1 << W) - 1) << shift) | magic).to(tl.float32, bitcast=True)
        code = big - magic.to(tl.float32, bitcast=True)  # [p, R, BJ, KV, BKO]
        return acc + tl.sum(code * xs[None, None], axis=3)

    @triton.jit
    def _gemv_step(acc0, acc1, zacc, x, k, k0, mask, kw, mask_w, j3, kks, kkz, rows0, rows1, opaque_zero,
                   p0_ptr, p1_ptr, s_ptr, z_ptr, sm_ptr, zm_ptr, cols, Ms, Mz,
                   W0: tl.constexpr, W1: tl.constexpr, SMODE: tl.constexpr, ZMODE: tl.constexpr,
                   H2: tl.constexpr, BJ: tl.constexpr, KV: tl.constexpr, BKO: tl.constexpr):
        """One k tile of one matrix into its accumulators (see _gemv_tiles)."""
        off = j3 * cols + k[None]  # into [G, cols]
        scale = _scale_or_zero(s_ptr, sm_ptr, off, (j3 * cols + k0) % Ms, kks[None], mask, Ms, SMODE)
        zero = _scale_or_zero(z_ptr, zm_ptr, off, (j3 * cols + k0) % Mz, kkz[None], mask, Mz, ZMODE)
        xs = x[None] * scale  # [BJ, KV, BKO]
        zacc += tl.sum(xs * zero, axis=1)
        if H2:
            xs2 = _pack_xs(xs, BJ, BKO)
            acc0 = _gemv_plane_h2(acc0, p0_ptr, rows0, kw, mask_w, xs2, W1, W0)
            if W1 > 0:
                acc1 = _gemv_plane_h2(acc1, p1_ptr, rows1, kw, mask_w, xs2, 0, W1)
        else:
            acc0 = _gemv_plane(acc0, p0_ptr, rows0, k, mask, xs, opaque_zero, W1, W0)  # high plane: << W1
            if W1 > 0:
                acc1 = _gemv_plane(acc1, p1_ptr, rows1, k, mask, xs, opaque_zero, 0, W1)
        return acc0, acc1, zacc

    @triton.jit
    def _plane_sum(acc, H2: tl.constexpr):
        """[p, R, BJ] float32 row sums of a plane's accumulator."""
        if H2:  # fp16 pairs
            y = tl.sum(_unpack_h2_sum(acc), axis=3)
        else:
            y = tl.sum(acc, axis=3)
        return y

    @triton.jit
    def _gemv_sum(acc0, acc1, zacc, W1: tl.constexpr, GS: tl.constexpr, NQ: tl.constexpr,
                  BJ: tl.constexpr, H2: tl.constexpr):
        y = tl.reshape(_plane_sum(acc0, H2), (GS // NQ, BJ))
        if W1 > 0:
            y += tl.reshape(_plane_sum(acc1, H2), (GS // NQ, BJ))
        return y - tl.sum(zacc, axis=1)[None, :]

    @triton.jit
    def _gemv_tiles(x_ptr, a0, a1, a_s, a_z, a_sm, a_zm, b0, b1, b_s, b_z, b_sm, b_zm,
                    G, cols, Ms, Mz, k_per_split, part, pid_k,
                    TWO: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, GS: tl.constexpr,
                    SMODE: tl.constexpr, ZMODE: tl.constexpr,
                    BJ: tl.constexpr, BKO: tl.constexpr, KV: tl.constexpr, NQ: tl.constexpr,
                    H2: tl.constexpr, EVEN: tl.constexpr):
        """x [cols] times one matrix a (and with TWO a second matrix b of the same format, in
        the same loop: twice the loads in flight) for one program's output rows: groups j in
        [pid*BJ, +BJ), 1/NQ of the GS rows of each (row part q), the columns of split pid_k.
        Returns (y_a, y_b, n, j): y [GS/NQ, BJ] float32 for output rows n [GS/NQ, BJ]
        (y_b is y_a without TWO).
        A k tile is [KV, BKO] with k = k0 + ko*KV + kv: Triton's default layout puts BKO on the
        threads (choose BKO = 32 * num_warps) and KV in each thread's registers, which is both a
        KV-byte vector load per thread and an in-thread reduction over KV (no shuffles). Every
        thread accumulates all GS/NQ rows of its columns: NQ > 1 trades decoding each scale and
        zero NQ times (by NQ programs) for fewer registers, hence more warps in flight."""
        pid_j = part // NQ
        q = part % NQ
        BK: tl.constexpr = BKO * KV
        P0: tl.constexpr = 8 // W0
        NBB: tl.constexpr = GS // (8 // W1) if W1 > 0 else GS // P0  # byte rows of the base plane
        j = pid_j * BJ + tl.arange(0, BJ)  # [BJ]
        j3 = j[:, None, None]  # [BJ, 1, 1]
        kk = tl.arange(0, KV)[:, None] + tl.arange(0, BKO)[None, :] * KV  # [KV, BKO]
        kks = kk % Ms if SMODE == 2 else kk
        kkz = kk % Mz if ZMODE == 2 else kk
        rows0 = _plane_rows(q, G, cols, j, GS, W0, NBB, NQ)
        kw = tl.arange(0, 2)[:, None] + tl.arange(0, BKO)[None, :] * 2  # [2, BKO] (H2: KV = 8)
        if H2:
            acc_a0 = tl.zeros((P0, GS // P0 // NQ, BJ, BKO), tl.int32)
        else:
            acc_a0 = tl.zeros((P0, GS // P0 // NQ, BJ, BKO), tl.float32)
        acc_b0 = acc_a0
        rows1 = rows0
        acc_a1 = tl.zeros((1, 1, 1, 1), tl.float32)  # no second plane
        if W1 > 0:
            rows1 = _plane_rows(q, G, cols, j, GS, W1, NBB, NQ)
            if H2:
                acc_a1 = tl.zeros((8 // W1, NBB // NQ, BJ, BKO), tl.int32)
            else:
                acc_a1 = tl.zeros((8 // W1, NBB // NQ, BJ, BKO), tl.float32)
        acc_b1 = acc_a1
        zacc_a = tl.zeros((BJ, BKO), tl.float32)
        zacc_b = zacc_a
        opaque_zero = k_per_split >> 31  # 0: k_per_split > 0
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, cols)
        for k0 in range(k_lo, k_hi, BK):
            k = k0 + kk  # [KV, BKO]
            kw0 = k0 // 4 + kw  # 32-bit word offsets (H2: cols % 8 == 0)
            if EVEN:  # every tile whole: constant masks, which the compiler drops
                kmask = tl.full((KV, BKO), 1, tl.int1)
                mask = tl.full((BJ, KV, BKO), 1, tl.int1)
                mask_w = tl.full((BJ, 2, BKO), 1, tl.int1)
            else:
                kmask = k < cols
                mask = (j3 < G) & kmask[None]  # [BJ, KV, BKO]
                mask_w = (j3 < G) & (kw0 * 4 < cols)[None]
            x = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            acc_a0, acc_a1, zacc_a = _gemv_step(acc_a0, acc_a1, zacc_a, x, k, k0, mask, kw0, mask_w, j3,
                                                kks, kkz, rows0, rows1, opaque_zero, a0, a1, a_s, a_z,
                                                a_sm, a_zm, cols, Ms, Mz, W0, W1, SMODE, ZMODE,
                                                H2, BJ, KV, BKO)
            if TWO:
                acc_b0, acc_b1, zacc_b = _gemv_step(acc_b0, acc_b1, zacc_b, x, k, k0, mask, kw0, mask_w,
                                                    j3, kks, kkz, rows0, rows1, opaque_zero, b0, b1,
                                                    b_s, b_z, b_sm, b_zm, cols, Ms, Mz, W0, W1, SMODE,
                                                    ZMODE, H2, BJ, KV, BKO)
        y_a = _gemv_sum(acc_a0, acc_a1, zacc_a, W1, GS, NQ, BJ, H2)
        y_b = y_a
        if TWO:
            y_b = _gemv_sum(acc_b0, acc_b1, zacc_b, W1, GS, NQ, BJ, H2)
        # Flattened (s, t, a) = u, every plane alike: output row j + i*G with
        # i = (u // (NBB/NQ)) * NBB + q * NBB/NQ + u % (NBB/NQ).
        u = tl.arange(0, GS // NQ)
        i = (u // (NBB // NQ)) * NBB + q * (NBB // NQ) + u % (NBB // NQ)
        n = i[:, None] * G + j[None, :]  # [GS/NQ, BJ] output rows
        return y_a, y_b, n, j

    @triton.jit
    def _gemv_kernel(x_ptr, out_ptr, p0_ptr, p1_ptr, s_ptr, z_ptr, sm_ptr, zm_ptr, ws_ptr, cnt_ptr,
                     G, rows, cols, Ms, Mz, k_per_split, n_split,
                     W0: tl.constexpr, W1: tl.constexpr, GS: tl.constexpr, SPLIT: tl.constexpr,
                     SMODE: tl.constexpr, ZMODE: tl.constexpr,
                     BJ: tl.constexpr, BKO: tl.constexpr, KV: tl.constexpr, NQ: tl.constexpr,
                     H2: tl.constexpr, EVEN: tl.constexpr):
        """out = x @ W.T for one matrix; grid (groups/BJ * NQ, column splits)."""
        pid_k = tl.program_id(1)
        y, _, n, j = _gemv_tiles(x_ptr, p0_ptr, p1_ptr, s_ptr, z_ptr, sm_ptr, zm_ptr,
                                 p0_ptr, p1_ptr, s_ptr, z_ptr, sm_ptr, zm_ptr,
                                 G, cols, Ms, Mz, k_per_split, tl.program_id(0), pid_k,
                                 False, W0, W1, GS, SMODE, ZMODE, BJ, BKO, KV, NQ, H2, EVEN)
        _finish(y, n, n, (j < G)[None, :], out_ptr, ws_ptr, rows, cnt_ptr + tl.program_id(0), pid_k,
                n_split, SPLIT)

    @triton.jit
    def _store_pair(ya, yb, n, mask, out_a, out_b, SWIGLU: tl.constexpr):
        if SWIGLU:
            tl.store(out_a + n, _swiglu(ya, yb, out_a.dtype.element_ty), mask=mask)
        else:
            tl.store(out_a + n, ya.to(out_a.dtype.element_ty), mask=mask)
            tl.store(out_b + n, yb.to(out_b.dtype.element_ty), mask=mask)

    @triton.jit
    def _finish_pair(ya, yb, n, mask, out_a, out_b, ws_ptr, cnt_ptr, pid_k, n_split, rows,
                     SPLIT: tl.constexpr, SWIGLU: tl.constexpr):
        """_finish for two matrices' results (ws: [split, 2, rows]); with SWIGLU out_a gets
        silu(y_a) * y_b instead of the two results."""
        if not SPLIT:
            _store_pair(ya, yb, n, mask, out_a, out_b, SWIGLU)
        else:
            tl.store(ws_ptr + pid_k * 2 * rows + n, ya, mask=mask)
            tl.store(ws_ptr + pid_k * 2 * rows + rows + n, yb, mask=mask)
            tl.debug_barrier()
            if tl.atomic_add(cnt_ptr, 1) == n_split - 1:
                ta = tl.load(ws_ptr + n, mask=mask, other=0.0, cache_modifier=".cg")
                tb = tl.load(ws_ptr + rows + n, mask=mask, other=0.0, cache_modifier=".cg")
                for s in range(1, n_split):
                    ta += tl.load(ws_ptr + s * 2 * rows + n, mask=mask, other=0.0, cache_modifier=".cg")
                    tb += tl.load(ws_ptr + s * 2 * rows + rows + n, mask=mask, other=0.0,
                                  cache_modifier=".cg")
                _store_pair(ta, tb, n, mask, out_a, out_b, SWIGLU)
                tl.atomic_xchg(cnt_ptr, 0)

    @triton.jit
    def _gemv_pair_kernel(x_ptr, out_a, out_b, a0, a1, a_s, a_z, a_sm, a_zm, b0, b1, b_s, b_z, b_sm, b_zm,
                          ws_ptr, cnt_ptr, G, rows, cols, Ms, Mz, k_per_split, n_split,
                          W0: tl.constexpr, W1: tl.constexpr, GS: tl.constexpr, SPLIT: tl.constexpr,
                          SMODE: tl.constexpr, ZMODE: tl.constexpr,
                          BJ: tl.constexpr, BKO: tl.constexpr, KV: tl.constexpr, NQ: tl.constexpr,
                          H2: tl.constexpr, EVEN: tl.constexpr):
        """out_a = x @ A.T and out_b = x @ B.T for two matrices of one format, in one loop."""
        pid_k = tl.program_id(1)
        ya, yb, n, j = _gemv_tiles(x_ptr, a0, a1, a_s, a_z, a_sm, a_zm, b0, b1, b_s, b_z, b_sm, b_zm,
                                   G, cols, Ms, Mz, k_per_split, tl.program_id(0), pid_k,
                                   True, W0, W1, GS, SMODE, ZMODE, BJ, BKO, KV, NQ, H2, EVEN)
        _finish_pair(ya, yb, n, (j < G)[None, :], out_a, out_b, ws_ptr, cnt_ptr + tl.program_id(0),
                     pid_k, n_split, rows, SPLIT, False)

    # -- one token through a layer's routed experts, with the expert chosen on the device ---------

    @triton.jit
    def _at(ptr, off):
        """The same field `off` bytes further (in another cache slot, or in host memory)."""
        return ptr + off // (ptr.dtype.element_ty.primitive_bitwidth // 8)

    @triton.jit
    def _routed_offset(ids_ptr, table_ptr, kpos, slot_bytes, host_off, guess_ptr, stage_off,
                       STREAM: tl.constexpr, NG: tl.constexpr):
        """Bytes from cache slot 0 to the expert at top-k position kpos (int64): to its slot,
        table[ids[kpos]] (slots lie slot_bytes apart). An expert not in place (-1) is read from
        slot 0, and its result not used; with STREAM it is read where it lies in host memory
        instead (page-locked, over the link): expert e lies host_off + e * slot_bytes bytes
        from slot 0; or, when it is one of the NG guesses at guess_ptr (the m-th), from the copy
        fetch_experts made of it, stage_off + m * slot_bytes bytes from slot 0."""
        e = tl.load(ids_ptr + kpos).to(tl.int64)
        slot = tl.load(table_ptr + e).to(tl.int64)
        if STREAM:
            off = tl.where(slot >= 0, slot, e) * slot_bytes + tl.where(slot >= 0, 0, host_off)
            for m in tl.static_range(NG):
                fetched = (slot < 0) & (tl.load(guess_ptr + m).to(tl.int64) == e)
                off = tl.where(fetched, stage_off + m * slot_bytes, off)
            return off
        return tl.maximum(slot, 0) * slot_bytes

    @triton.jit
    def _position(at_ptr, LATE: tl.constexpr):
        """The top-k position of this program (grid axis 2): itself, or with LATE the one at[it]."""
        if LATE:
            return tl.load(at_ptr + tl.program_id(2)).to(tl.int32)
        return tl.program_id(2)

    @triton.jit
    def _all_in_place(ids_ptr, table_ptr, TOPK: tl.constexpr, STREAM: tl.constexpr):
        """Whether every routed expert has a slot in the table (none is -1), or is read from
        host memory (STREAM)."""
        ok = True
        if not STREAM:
            for m in tl.static_range(TOPK):
                ok = ok & (tl.load(table_ptr + tl.load(ids_ptr + m)) >= 0)
        return ok

    @triton.jit
    def _swiglu(a, b, dt: tl.constexpr):
        """silu(a) * b rounded as the eager path rounds: each product's output in dt."""
        a = a.to(dt).to(tl.float32)
        s = (a / (1.0 + tl.exp(-a))).to(dt).to(tl.float32)
        return (s * b.to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _moe_up_kernel(x_ptr, act_ptr, ids_ptr, at_ptr, table_ptr, slot_bytes, host_off, guess_ptr,
                       stage_off, a0, a1, a_s, a_z, a_sm, a_zm, b0, b1, b_s, b_z, b_sm, b_zm, ws_ptr, cnt_ptr,
                       G, rows, cols, Ms, Mz, k_per_split, n_split,
                       W0: tl.constexpr, W1: tl.constexpr, GS: tl.constexpr, TOPK: tl.constexpr,
                       SPLIT: tl.constexpr, LATE: tl.constexpr, SMODE: tl.constexpr, ZMODE: tl.constexpr,
                       BJ: tl.constexpr, BKO: tl.constexpr, KV: tl.constexpr, NQ: tl.constexpr,
                       H2: tl.constexpr, EVEN: tl.constexpr, STREAM: tl.constexpr, NG: tl.constexpr):
        """act[kpos] = silu(x @ W1.T) * (x @ W3.T) for the expert at position kpos (_position)
        of the routing [tokens, TOPK], x its token's row (a decoded token's: kpos < TOPK); W1
        and W3 are read in the same loop. Split-K as _finish, per kpos."""
        pid_k, kpos = tl.program_id(1), _position(at_ptr, LATE)
        off = _routed_offset(ids_ptr, table_ptr, kpos, slot_bytes, host_off, guess_ptr, stage_off, STREAM, NG)
        ya, yb, n, j = _gemv_tiles(
            x_ptr + (kpos // TOPK) * cols, _at(a0, off), _at(a1, off),
            _at(a_s, off), _at(a_z, off),
            _at(a_sm, off), _at(a_zm, off),
            _at(b0, off), _at(b1, off),
            _at(b_s, off), _at(b_z, off),
            _at(b_sm, off), _at(b_zm, off),
            G, cols, Ms, Mz, k_per_split, tl.program_id(0), pid_k,
            True, W0, W1, GS, SMODE, ZMODE, BJ, BKO, KV, NQ, H2, EVEN)
        cnt = cnt_ptr + kpos * tl.num_programs(0) + tl.program_id(0)
        _finish_pair(ya, yb, n, (j < G)[None, :], act_ptr + kpos * rows, act_ptr,
                     ws_ptr + kpos * n_split * 2 * rows, cnt, pid_k, n_split, rows, SPLIT, True)

    @triton.jit
    def _position_of_rank(ids_ptr, r, TOPK: tl.constexpr):
        """The top-k position of the expert with the r-th smallest id (ids distinct)."""
        kr = 0
        for m in tl.static_range(TOPK):
            rank = 0
            for m2 in tl.static_range(TOPK):
                rank += (tl.load(ids_ptr + m2) < tl.load(ids_ptr + m)).to(tl.int32)
            kr += tl.where(rank == r, m, 0)
        return kr

    @triton.jit
    def _moe_down_kernel(act_ptr, out_ptr, ids_ptr, at_ptr, weights_ptr, table_ptr, slot_bytes, host_off,
                         guess_ptr, stage_off,
                         p0, p1, s_ptr, z_ptr, sm_ptr, zm_ptr, ws_ptr, cnt_ptr,
                         G, rows, cols, Ms, Mz, k_per_split, n_split, parts,
                         W0: tl.constexpr, W1: tl.constexpr, GS: tl.constexpr,
                         SMODE: tl.constexpr, ZMODE: tl.constexpr, TOPK: tl.constexpr, LATE: tl.constexpr,
                         PAIRS: tl.constexpr, SPLIT: tl.constexpr, BJ: tl.constexpr, BKO: tl.constexpr, KV: tl.constexpr,
                         NQ: tl.constexpr, H2: tl.constexpr, EVEN: tl.constexpr, STREAM: tl.constexpr,
                         NG: tl.constexpr):
        """out = sum over the top-k of weight[kpos] * (act[kpos] @ W2.T), kpos from _position.
        Every (split, kpos) program stores a partial; the last of the `parts` programs of a row
        tile adds up all TOPK positions' partials as the eager path does: each expert's output
        rounded to out's dtype, times its weight, rounded, added in ascending expert order
        (transformers' order). It writes out only when every routed expert was in place.
        PAIRS (moe_prompt): out[kpos] = act[kpos] @ W2.T instead, each position's own row."""
        pid_k, kpos = tl.program_id(1), _position(at_ptr, LATE)
        off = _routed_offset(ids_ptr, table_ptr, kpos, slot_bytes, host_off, guess_ptr, stage_off, STREAM, NG)
        y, _, n, j = _gemv_tiles(
            act_ptr + kpos * cols, _at(p0, off), _at(p1, off),
            _at(s_ptr, off), _at(z_ptr, off),
            _at(sm_ptr, off), _at(zm_ptr, off),
            p0, p1, s_ptr, z_ptr, sm_ptr, zm_ptr,
            G, cols, Ms, Mz, k_per_split, tl.program_id(0), pid_k,
            False, W0, W1, GS, SMODE, ZMODE, BJ, BKO, KV, NQ, H2, EVEN)
        mask = (j < G)[None, :]
        if PAIRS:
            _finish(y, n, n, mask, out_ptr + kpos * rows, ws_ptr + kpos * n_split * rows, rows,
                    cnt_ptr + kpos * tl.num_programs(0) + tl.program_id(0), pid_k, n_split, SPLIT)
            return
        tl.store(ws_ptr + (kpos * n_split + pid_k) * rows + n, y, mask=mask)
        tl.debug_barrier()
        cnt = cnt_ptr + tl.program_id(0)
        if tl.atomic_add(cnt, 1) == parts - 1:
            if _all_in_place(ids_ptr, table_ptr, TOPK, STREAM):
                dt: tl.constexpr = out_ptr.dtype.element_ty
                total = tl.zeros(y.shape, tl.float32)
                for r in tl.static_range(TOPK):
                    kr = _position_of_rank(ids_ptr, r, TOPK)
                    ye = tl.load(ws_ptr + kr * n_split * rows + n, mask=mask, other=0.0, cache_modifier=".cg")
                    for s in range(1, n_split):
                        ye += tl.load(ws_ptr + (kr * n_split + s) * rows + n, mask=mask, other=0.0,
                                      cache_modifier=".cg")
                    ye = ye.to(dt).to(tl.float32) * tl.load(weights_ptr + kr)
                    total = (total + ye.to(dt).to(tl.float32)).to(dt).to(tl.float32)
                tl.store(out_ptr + n, total.to(dt), mask=mask)
            tl.atomic_xchg(cnt, 0)

    @triton.jit
    def _codes(plane_ptr, row_off, k, mask, W: tl.constexpr, GS: tl.constexpr, BJ: tl.constexpr,
               BK: tl.constexpr):
        """Exact codes of one plane as float32 [GS, BJ, BK]; row_off [g/p, BJ, 1], k [BK]."""
        P: tl.constexpr = 8 // W
        b = tl.load(plane_ptr + row_off + k[None, None, :], mask=mask[None], other=0)
        shift = 8 - W * (tl.arange(0, P) + 1)
        c = (b.to(tl.int32)[None] >> shift[:, None, None, None]) & ((1 << W) - 1)
        return tl.reshape(_as_float(c), (GS, BJ, BK))  # row i = s * g/p + i'

    @triton.jit
    def _weight_tile(p0_ptr, p1_ptr, s_ptr, z_ptr, sm_ptr, zm_ptr, j, k0, k, cols, G, Ms, Mz,
                     W0: tl.constexpr, W1: tl.constexpr, GS: tl.constexpr,
                     SMODE: tl.constexpr, ZMODE: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr):
        """Dequantized weights [GS, BJ, BK] fp32 of rows j + i*G, columns k (k0 = k[0])."""
        j2 = j[:, None]
        mask = (j2 < G) & (k < cols)[None, :]  # [BJ, BK]
        off = j2 * cols + k[None, :]
        kk = k - k0
        kks = kk % Ms if SMODE == 2 else kk
        kkz = kk % Mz if ZMODE == 2 else kk
        scale = _scale_or_zero(s_ptr, sm_ptr, off, (j2 * cols + k0) % Ms, kks[None, :], mask, Ms, SMODE)
        zero = _scale_or_zero(z_ptr, zm_ptr, off, (j2 * cols + k0) % Mz, kkz[None, :], mask, Mz, ZMODE)
        NB0: tl.constexpr = GS // (8 // W0)
        rows0 = ((tl.arange(0, NB0)[:, None] * G + j[None, :]) * cols)[:, :, None]
        c = _codes(p0_ptr, rows0, k, mask, W0, GS, BJ, BK)
        if W1 > 0:
            NB1: tl.constexpr = GS // (8 // W1)
            rows1 = ((tl.arange(0, NB1)[:, None] * G + j[None, :]) * cols)[:, :, None]
            c = c * (1 << W1) + _codes(p1_ptr, rows1, k, mask, W1, GS, BJ, BK)
        return (c - zero[None]) * scale[None]

    @triton.jit
    def _gemm_kernel(x_ptr, out_ptr, p0_ptr, p1_ptr, s_ptr, z_ptr, sm_ptr, zm_ptr, ws_ptr, cnt_ptr,
                     T, G, rows, cols, stride_x, stride_out, Ms, Mz, k_per_split, n_split,
                     W0: tl.constexpr, W1: tl.constexpr, GS: tl.constexpr, SPLIT: tl.constexpr,
                     SMODE: tl.constexpr, ZMODE: tl.constexpr,
                     BT: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr):
        """One program: tokens [pid_t*BT, +BT) x groups [pid_j*BJ, +BJ) (GS*BJ rows), one split."""
        pid_j = tl.program_id(0)
        pid_t = tl.program_id(1)
        pid_k = tl.program_id(2)
        j = pid_j * BJ + tl.arange(0, BJ)
        t = pid_t * BT + tl.arange(0, BT)
        acc = tl.zeros((BT, GS * BJ), tl.float32)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, cols)
        for k0 in range(k_lo, k_hi, BK):
            k = k0 + tl.arange(0, BK)
            xt = tl.load(x_ptr + t[:, None] * stride_x + k[None, :],
                         mask=(t[:, None] < T) & (k[None, :] < cols), other=0.0)  # [BT, BK]
            wt = _weight_tile(p0_ptr, p1_ptr, s_ptr, z_ptr, sm_ptr, zm_ptr, j, k0, k, cols, G, Ms, Mz,
                              W0, W1, GS, SMODE, ZMODE, BJ, BK)
            wt = tl.reshape(wt, (GS * BJ, BK)).to(xt.dtype)  # row i*BJ + jj <-> n = j + i*G
            if xt.dtype == tl.float32:
                acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)
        n = tl.reshape(tl.arange(0, GS)[:, None] * G + j[None, :], (GS * BJ,))
        nmask = tl.reshape((tl.arange(0, GS)[:, None] >= 0) & (j[None, :] < G), (GS * BJ,))
        mask = (t[:, None] < T) & nmask[None, :]
        tile = pid_t * tl.num_programs(0) + pid_j
        _finish(acc, t[:, None] * stride_out + n[None, :], t[:, None] * rows + n[None, :], mask,
                out_ptr, ws_ptr, T * rows, cnt_ptr + tile, pid_k, n_split, SPLIT)

    @triton.jit
    def _dequant_kernel(out_ptr, p0_ptr, p1_ptr, s_ptr, z_ptr, sm_ptr, zm_ptr, G, cols, Ms, Mz,
                        W0: tl.constexpr, W1: tl.constexpr, GS: tl.constexpr,
                        SMODE: tl.constexpr, ZMODE: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr):
        j = tl.program_id(0) * BJ + tl.arange(0, BJ)
        k0 = tl.program_id(1) * BK
        k = k0 + tl.arange(0, BK)
        wt = _weight_tile(p0_ptr, p1_ptr, s_ptr, z_ptr, sm_ptr, zm_ptr, j, k0, k, cols, G, Ms, Mz,
                          W0, W1, GS, SMODE, ZMODE, BJ, BK)  # [GS, BJ, BK]
        n = tl.arange(0, GS)[:, None, None] * G + j[None, :, None]
        mask = (j[None, :, None] < G) & (k[None, None, :] < cols)
        tl.store(out_ptr + n * cols + k[None, None, :], wt.to(out_ptr.dtype.element_ty), mask=mask)
