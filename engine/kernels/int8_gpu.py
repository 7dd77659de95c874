"""The LM head on a GPU rounded to int8 per output row: W[n, k] = q[n, k] * s[n].

A decoded token reads the whole head: Qwen3-30B-A3B's 151936 x 2048 is 622 MB in bfloat16,
gpt-oss-20b's 1.16 GB, Mixtral's 262 MB. In int8 it takes half the GPU memory, which the expert
cache gets instead, and half the reads. llama.cpp's quantizer keeps its heads at 6-8 bits (Q6_K,
Q8_0). On random Gaussian rows per-row int8 moves the logits by about 0.9 % (relative norm;
docs/KERNELS.md).

`quantize` rounds a float matrix; `Int8Rows.matmul` multiplies. A few tokens (a decode step, a
prompt's last token) go through `_int8_rows_kernel`, a Triton GEMV; more tokens dequantize the
rows in blocks and use cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeferry.engine.kernels import hqq_gpu
from moeferry.engine.storage.quant import round_rows_int8

triton, tl = hqq_gpu.triton, hqq_gpu.tl

KERNEL_TOKENS = 8  # up to this many tokens the GEMV kernel, past it cuBLAS on dequantized blocks
BLOCK_ROWS_DEQUANT = 16384  # rows dequantized at once for cuBLAS (64 MB in bfloat16 at K = 2048)
ROUND_ROWS = 8192  # rows rounded at once by quantize (its float32 temporaries)


@dataclass
class Int8Rows:
    q: torch.Tensor  # int8 [N, K]
    s: torch.Tensor  # float32 [N]
    kernel: bool = True  # False: always cuBLAS on dequantized blocks (the kernel failed its probe)

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def cols(self) -> int:
        return self.q.shape[1]

    def nbytes(self) -> int:
        return self.q.numel() + self.s.numel() * 4

    def dequantize(self, dtype=torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        return (self.q[rows].float() * self.s[rows, None]).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> float32 [T, N]."""
        T = x.shape[0]
        y = torch.empty(T, self.rows, device=x.device, dtype=torch.float32)
        if T <= KERNEL_TOKENS and self.kernel and kernel_available(x.device):
            grid = (triton.cdiv(self.rows, BLOCK_N), T)
            _int8_rows_kernel[grid](x, self.q, self.s, y, self.rows, self.cols, x.stride(0), BLOCK_N=BLOCK_N,
                                    BLOCK_K=BLOCK_K, num_warps=4)
            return y
        for r in range(0, self.rows, BLOCK_ROWS_DEQUANT):
            rows = slice(r, r + BLOCK_ROWS_DEQUANT)
            y[:, rows] = F.linear(x, self.dequantize(x.dtype, rows)).float()
        return y


def kernel_available(device) -> bool:
    """Whether the Triton GEMV can run on `device` (CUDA, or the CPU under the interpreter)."""
    return hqq_gpu.fused_available(device)


def quantize(w: torch.Tensor, device=None) -> Int8Rows:
    """w [N, K] float -> symmetric int8 per row on `device` (default w's), rounded there in blocks
    of ROUND_ROWS rows: the float matrix is never whole on the device."""
    return Int8Rows(*round_rows_int8(w, device, ROUND_ROWS))


BLOCK_N, BLOCK_K = 32, 256

if triton is not None:
    @triton.jit
    def _int8_rows_kernel(x_ptr, q_ptr, s_ptr, y_ptr, N, K, x_stride, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        """y[t, n] = s[n] * sum_k q[n, k] x[t, k] for BLOCK_N rows n of token t = program_id(1)."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.program_id(1)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * x_stride + k, mask=k < K, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + n[:, None].to(tl.int64) * K + k[None, :],
                        mask=(n[:, None] < N) & (k[None, :] < K), other=0)
            acc += q.to(tl.float32) * x[None, :]
        s = tl.load(s_ptr + n, mask=n < N, other=0.0)
        tl.store(y_ptr + t.to(tl.int64) * N + n, tl.sum(acc, axis=1) * s, mask=n < N)
