"""The MXFP4 CPU kernel (engine/kernels/mxfp4_cpu.py) against the dequantized matrix."""

import numpy as np
import pytest
import torch

from moeferry.engine.kernels import hqq_cpu, mxfp4_cpu
from moeferry.engine.storage import mxfp4

pytestmark = pytest.mark.skipif(bool(hqq_cpu.available()), reason="numba with AVX2 is what the kernel runs on")


def random_matrix(rows: int, cols: int, seed: int) -> mxfp4.Mxfp4Matrix:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 126, (rows, cols // 32), dtype=torch.uint8, generator=g)
    return mxfp4.Mxfp4Matrix(rows, cols, blocks, scales)


def int8_input_bound(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|error| each output can take from rounding x to int8 per block of 32 (half a step,
    max |x| / 127 / 2, per input): [T, rows]."""
    T, K = x.shape
    half_step = (x.abs().view(T, K // 32, 32).amax(-1) / 254).repeat_interleave(32, -1)  # [T, K]
    return half_step @ w.abs().T


@pytest.mark.parametrize("rows,cols,T", [(64, 96, 1), (45, 2880, 3), (7, 32, 5), (300, 640, 1)])
def test_matmul_matches_the_dequantized_matrix_to_int8_input_rounding(rows, cols, T):
    m = random_matrix(rows, cols, rows + cols)
    w = mxfp4.dequantize(m)
    x = torch.randn(T, cols, generator=torch.Generator().manual_seed(T))
    spiky = x.clone()
    spiky[:, 3] *= 30  # an outlier input, as hidden states have
    for inputs in (x, spiky):
        want = inputs @ w.T
        got = torch.from_numpy(mxfp4_cpu.matmul(inputs.numpy(), m))
        assert got.shape == (T, rows)
        excess = (got - want).abs() - int8_input_bound(w, inputs)
        assert (excess <= 1e-5 * want.abs().max()).all(), excess.max()
    want = x @ w.T
    got = torch.from_numpy(mxfp4_cpu.matmul(x.numpy(), m))
    assert ((got - want).norm() / want.norm()).item() < 0.01


def test_zero_blocks_and_the_extreme_scales():
    """An all-zero input block (its step is 0), a block of the smallest scale (2^-127) and one
    of a large one (2^13; 255 is NaN in the MX format, which checkpoints never hold)."""
    m = random_matrix(16, 96, 1)
    m.scales[:, 1] = 0
    m.scales[:, 2] = 140
    x = torch.randn(2, 96, dtype=torch.float64).float()
    x[0, :32] = 0
    want = x.double() @ mxfp4.dequantize(m, torch.float64).T
    got = torch.from_numpy(mxfp4_cpu.matmul(x.numpy(), m)).double()
    assert np.isfinite(got.numpy()).all()
    assert ((got - want).norm() / want.norm()).item() < 0.01
