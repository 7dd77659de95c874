"""The CPU kernel for stored HQQ experts (engine/kernels/hqq_cpu.py) equals the dequantized reference.

It reads the store's own layout (bit planes, 8-bit scales and zeros with float16 metadata),
so each test quantizes with moeferry.engine.storage.quant and compares with quant.dequantize, in float32.
Shapes are odd on purpose: few groups, metadata that wraps inside a row, 1 and 3 tokens.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moeferry.engine.kernels import hqq_cpu
from moeferry.engine.runtime import cpu_experts as ce
from moeferry.engine.storage import quant

SPECS = [quant.QuantSpec(2, 16, 128), quant.QuantSpec(3, 64, 128), quant.QuantSpec(4, 64, 128),
         quant.QuantSpec(2, 32, 48, 80), quant.QuantSpec(3, 16, 7), quant.QuantSpec(4, 8, 1 << 20)]


def qmatrix(rows, cols, spec, seed):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quant.quantize_matrix(w, spec, optimize=False)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.bits}bit-g{s.group_size}-m{s.meta_group}")
@pytest.mark.parametrize("rows,cols,T", [(64, 96, 1), (192, 40, 3), (128, 200, 2)])
def test_matmul_equals_dequantized_reference(spec, rows, cols, T):
    qm = qmatrix(rows, cols, spec, rows + cols + spec.bits)
    x = torch.randn(T, cols, generator=torch.Generator().manual_seed(T))
    want = x @ quant.dequantize(qm).T
    got = torch.from_numpy(hqq_cpu.matmul(x.numpy(), hqq_cpu.from_qmatrix(qm)))
    assert got.shape == (T, rows)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), (got - want).abs().max()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_swiglu_expert_equals_reference_on_the_stored_views(bits):
    """The in-place expert (views of one packed buffer, as the cache's host copy holds it)."""
    H, I, spec = 128, 192, quant.EXPERT_SPECS[bits]
    w = {m: qmatrix(*shape, spec, seed) for seed, (m, shape) in enumerate((("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))))}
    ref = {m: quant.dequantize(q) for m, q in w.items()}
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(bits))
    want = F.linear(F.silu(F.linear(x, ref["w1"])) * F.linear(x, ref["w3"]), ref["w2"])
    assert ce.hqq_supported(w)
    expert = ce.hqq_expert(w)
    got = expert.forward(x)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # it reads the stored bytes (planes, 8-bit scales/zeros) plus float32 metadata: no copy
    stored = sum(q.nbytes() for q in w.values())
    assert stored <= expert.nbytes() < stored * 1.1
    assert np.shares_memory(expert.w1.planes[0], w["w1"].planes[0].numpy())


def test_unsupported_matrices_are_refused():
    assert not hqq_cpu.supported(torch.zeros(4, 4))
    qm = quant.quantize_matrix(torch.randn(64, 32), quant.QuantSpec(8, 64, 256), optimize=False)
    assert not hqq_cpu.supported(qm)  # 8-bit attention matrices are not experts' widths here
    fp16_meta = quant.quantize_matrix(torch.randn(64, 32), quant.QuantSpec(2, 16, 128, meta_bits=16), optimize=False)
    assert not hqq_cpu.supported(fp16_meta)
