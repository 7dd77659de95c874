"""torch's prebuilt weight-only CPU kernels (AVX2 / AVX-512; no compiler on the user's machine),
for CPU copies of weights in their own layout: the hybrid's int4 / int8 / dense experts
(engine/runtime/cpu_experts.py) and the CPU engine's int8 head (generate.move_dense).

Derived from the dequantized weight (the store's HQQ layout groups along OUTPUT rows, these
kernels group along the INPUT dimension). One CpuMatrix W [N, K] (N outputs, K inputs) is one of:

  "int4"  torch.ops.aten._weight_int4pack_mm_for_cpu: codes q in [0, 16), groups of g input
          columns (g = 128 where K allows, else 64 or 32), scale and zero per (group, row):
              W[n, k] = (q[n, k] - 8) * s[k // g, n] + z[k // g, n]
          `packed` = _convert_weight_to_int4pack_for_cpu(q int32 [N, K]) (uint8 [N, K / 2]),
          `meta` = scales_and_zeros [K / g, N, 2] in bfloat16.
          HQQ's (q - zh) * s is the same form with z = (8 - zh) * s.
  "int8"  torch.ops.aten._weight_int8pack_mm: W[n, k] = q[n, k] * s[n], q int8 [N, K]
          symmetric per output row, `meta` = s [N] in bfloat16; a lone token goes through
          engine/kernels/int8_cpu.py instead (1.4-2.1x torch's rate on the 2-core box).
  "dense" the weight itself (the GPU copy's dequantized values: exact), `packed` [N, K] in
          the model's compute dtype.
int4 and int8 take bfloat16 activations: that is their fast path (measured on 2 cores, one
14336x4096 matrix: int4 1.1 ms with bfloat16, 57 ms with float32 or float16 activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from moeferry.engine.kernels import hqq_cpu, int8_cpu
from moeferry.engine.storage.quant import round_rows_int8

FORMATS = ("int4", "int8", "dense")
GROUPS = (128, 64, 32)  # int4 groups used, largest (fewest bytes) first; the kernel also takes 256
CLIPS = (1.0, 0.96, 0.92, 0.88, 0.84)  # int4 range shrink factors tried per group


@dataclass
class CpuMatrix:
    fmt: str
    rows: int  # N (outputs)
    cols: int  # K (inputs)
    packed: torch.Tensor
    meta: torch.Tensor | None = None
    group_size: int = 0

    @cached_property
    def lone_token_scales(self) -> np.ndarray | None:
        """The row scales in float32 where int8_cpu multiplies a lone token through this matrix
        (int8, numba and AVX2, inputs in its blocks), else None."""
        if self.fmt != "int8" or self.cols % int8_cpu.BLOCK or hqq_cpu.available():
            return None
        return self.meta.float().numpy()

    def nbytes(self) -> int:
        meta = 0 if self.meta is None else self.meta.numel() * self.meta.element_size()
        return self.packed.numel() * self.packed.element_size() + meta

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype inside the kernel."""
        return self.packed.dtype if self.fmt == "dense" else torch.bfloat16

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> float32 [T, N]. A lone token through an int8 matrix takes int8_cpu's
        kernel where numba runs: torch's reads it at about half the RAM's speed."""
        if x.shape[0] == 1 and self.lone_token_scales is not None:
            return torch.from_numpy(int8_cpu.matvec(x.float().numpy(), self.packed.numpy(), self.lone_token_scales))
        x = x.to(self.dtype)
        if self.fmt == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.meta)
        elif self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.packed, self.meta)
        else:
            y = F.linear(x, self.packed)
        return y.float()


# Inputs per row each format needs a multiple of: int4's groups; int8's because torch's
# _weight_int8pack_mm corrupts memory and crashes the process (a segmentation fault, torch 2.13
# on an AVX-512 Xeon) for inputs not a multiple of 16 once 4 or more rows go through it (a
# prompt): 8, 24, 40, 56 crashed, every multiple of 16 tried ran, whatever the rows before.
INPUT_MULTIPLE = {"int4": 32, "int8": 16, "dense": 1}


def int4_group(cols: int) -> int:
    g = next((g for g in GROUPS if cols % g == 0), None)
    if g is None:
        raise ValueError(f"an int4 CPU copy needs the input size {cols} to be a multiple of 32")
    return g


def int4_codes(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int32 [N, K] in [0, 16), s [N, K / g], z [N, K / g]) with
    W ~ (q - 8) * s + z per group of g input columns (asymmetric); s and z are float32
    holding bfloat16 values.

    Per group the range [lo, hi] is shrunk about its centre by each factor of CLIPS and the
    one with the least squared error is kept (clipping a few outliers beats a wide grid).
    Rows go in blocks of 4 MB: the search keeps no full-size temporaries (a Mixtral matrix is
    235 MB in float32).
    """
    N, K = w.shape
    g = group_size
    wg = w.detach().float().reshape(N, K // g, g)
    rows = max(1, (1 << 20) // K)  # 4 MB of float32 per block
    s, a = (torch.cat(part) for part in zip(*(_best_range(wg[r:r + rows]) for r in range(0, N, rows))))
    # scale and zero as the kernel reads them (bfloat16), then the codes that fit those
    s, z = s.bfloat16().float(), (a + 8 * s).bfloat16().float()  # (q - 8) * s + z == q * s + a
    q = ((wg - z) / s + 8).round().clamp(0, 15)
    return q.reshape(N, K).to(torch.int32), s.reshape(N, K // g), z.reshape(N, K // g)


def _best_range(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """wg [n, groups, g] -> (scale, low end) [n, groups, 1] of the CLIPS factor with least error."""
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    mid, half = (hi + lo) / 2, (hi - lo) / 2
    best = None
    for c in CLIPS:
        a = mid - half * c
        s = (2 * half * c / 15).clamp(min=1e-10)
        err = ((((wg - a) / s).round().clamp(0, 15) * s + a - wg) ** 2).sum(-1, keepdim=True)
        if best is None:
            best = (err, s, a)
        else:
            take = err < best[0]
            best = tuple(torch.where(take, new, old) for new, old in zip((err, s, a), best))
    return best[1], best[2]


def quantize_int4(w: torch.Tensor, group_size: int | None = None) -> CpuMatrix:
    N, K = w.shape
    g = group_size or int4_group(K)
    q, s, z = int4_codes(w, g)
    q = q.to(torch.uint8).cpu().to(torch.int32)  # a quarter of the bytes when q is on a GPU
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    meta = torch.stack([s.T, z.T], dim=-1).bfloat16().cpu().contiguous()  # [K / g, N, 2]
    return CpuMatrix("int4", N, K, packed, meta, g)


def quantize_int8(w: torch.Tensor) -> CpuMatrix:
    if w.shape[1] % INPUT_MULTIPLE["int8"]:
        raise ValueError(f"an int8 CPU copy needs the input size {w.shape[1]} to be a multiple of "
                         f"{INPUT_MULTIPLE['int8']}")
    q, s = round_rows_int8(w.detach(), "cpu")
    return CpuMatrix("int8", *w.shape, q.contiguous(), s.bfloat16())


def make_matrix(w: torch.Tensor, fmt: str) -> CpuMatrix:
    if fmt == "int4":
        return quantize_int4(w)
    if fmt == "int8":
        return quantize_int8(w)
    if fmt == "dense":
        return CpuMatrix("dense", *w.shape, w.detach().cpu().contiguous())
    raise ValueError(f"unknown CPU matrix format {fmt!r}; use one of {', '.join(FORMATS)}")
