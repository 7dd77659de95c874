"""MXFP4 matrices, as gpt-oss checkpoints store their experts, imported without re-quantizing.

One matrix W [rows, cols] is two uint8 tensors:
  blocks [rows, cols // 32, 16]: 32 FP4 (e2m1) codes per block, two per byte, the low nibble
                                 first: W[r, 32 b + 2 j] <- blocks[r, b, j] & 15,
                                        W[r, 32 b + 2 j + 1] <- blocks[r, b, j] >> 4
  scales [rows, cols // 32]:     one power-of-two scale per block, biased by 127:
                                 W[r, 32 b + i] = FP4_VALUES[code] * 2 ** (scales[r, b] - 127)
That is 4.25 bits per weight. gpt-oss's stacked experts keep gate and up interleaved (rows
0, 2, 4, ... of gate_up_proj are the gate's): engine/storage/convert.py splits them by row, which
keeps whole blocks, so the import is a byte copy. The dequantization is transformers'
(`integrations/mxfp4.py`), which the tests check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass
class Mxfp4Matrix:
    rows: int
    cols: int
    blocks: torch.Tensor  # uint8 [rows, cols // 32, 16]
    scales: torch.Tensor  # uint8 [rows, cols // 32]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"blocks": self.blocks, "scales": self.scales}

    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()


def field_shapes(rows: int, cols: int) -> dict[str, tuple[torch.dtype, tuple]]:
    if cols % BLOCK:
        raise ValueError(f"an MXFP4 matrix needs a multiple of {BLOCK} columns, not {cols}")
    return {"blocks": (torch.uint8, (rows, cols // BLOCK, BLOCK // 2)),
            "scales": (torch.uint8, (rows, cols // BLOCK))}


def dequantize(m: Mxfp4Matrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows, cols] in dtype, exactly as transformers dequantizes gpt-oss's experts."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=m.blocks.device)
    blocks = m.blocks.reshape(m.rows * (m.cols // BLOCK), BLOCK // 2)
    out = torch.empty(blocks.shape[0], BLOCK, dtype=dtype, device=blocks.device)
    out[:, 0::2] = lut[(blocks & 0x0F).long()]
    out[:, 1::2] = lut[(blocks >> 4).long()]
    exp = m.scales.reshape(-1, 1).to(torch.int32) - 127
    return torch.ldexp(out, exp).to(dtype).reshape(m.rows, m.cols)
