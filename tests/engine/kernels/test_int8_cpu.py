"""The int8 CPU kernel for a lone token (engine/kernels/int8_cpu.py) against its dequantized matrix."""

import numpy as np
import pytest
import torch

from moeferry.engine.kernels import hqq_cpu, int8_cpu, torch_cpu

pytestmark = pytest.mark.skipif(bool(hqq_cpu.available()), reason="numba with AVX2 is what the kernel runs on")


def int8_input_bound(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|error| each output can take from rounding x to int8 per block of 32 (half a step,
    max |x| / 127 / 2, per input): [1, rows]."""
    K = x.shape[1]
    half_step = (x.abs().view(1, K // 32, 32).amax(-1) / 254).repeat_interleave(32, -1)
    return half_step @ w.abs().T


@pytest.mark.parametrize("rows,cols", [(64, 96), (301, 2048), (7, 32), (1000, 640)])
def test_a_lone_token_matches_the_dequantized_matrix_to_int8_input_rounding(rows, cols):
    g = torch.Generator().manual_seed(rows + cols)
    m = torch_cpu.quantize_int8(torch.randn(rows, cols, generator=g) * 0.05)
    m.packed[0, :32] = -128  # the one code whose magnitude needs the byte's ninth bit
    w = m.packed.float() * m.meta.float()[:, None]
    x = torch.randn(1, cols, generator=g)
    spiky = x.clone()
    spiky[0, 3] *= 30  # an outlier input, as hidden states have
    for inputs in (x, spiky):
        want = inputs @ w.T
        got = torch.from_numpy(int8_cpu.matvec(inputs.numpy(), m.packed.numpy(), m.meta.float().numpy()))
        assert got.shape == (1, rows)
        excess = (got - want).abs() - int8_input_bound(w, inputs)
        assert (excess <= 1e-5 * want.abs().max()).all(), excess.max()
    want = x @ w.T
    assert ((m.matmul(x) - want).norm() / want.norm()).item() < 0.01  # CpuMatrix sends a lone token here
    assert m.lone_token_scales is not None


def test_zero_inputs_prompts_and_other_widths_keep_torchs_kernel():
    m = torch_cpu.quantize_int8(torch.randn(16, 96))
    assert np.array_equal(int8_cpu.matvec(np.zeros((1, 96), np.float32), m.packed.numpy(), m.meta.float().numpy()),
                          np.zeros((1, 16), np.float32))
    x = torch.randn(3, 96)
    want = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), m.packed, m.meta).float()
    assert torch.equal(m.matmul(x), want)  # a prompt: torch's kernel
    odd = torch_cpu.quantize_int8(torch.randn(16, 80))  # 80 inputs: a multiple of torch's 16, not of 32
    assert odd.lone_token_scales is None
    assert odd.matmul(torch.randn(1, 80)).shape == (1, 16)
    with pytest.raises(ValueError, match="multiple of 32"):
        int8_cpu.matvec(np.zeros((1, 80), np.float32), odd.packed.numpy(), odd.meta.float().numpy())
