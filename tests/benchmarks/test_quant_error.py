"""benchmarks/quant_error.py's two quantizers written for comparison: they must be what they claim."""

import torch

from benchmarks.quant_error import l2_search, q2k_layout, rel
from moeferry.engine.storage import quant


def test_the_l2_search_is_the_store_layout_and_beats_min_max():
    """l2_search's matrix is a valid store matrix (the reference dequantizer reads it) whose
    error is below plain min-max's in the same layout (its range 1.0/1.0 is one of the tried)."""
    w = torch.randn(128, 96, generator=torch.Generator().manual_seed(0)) * 0.015
    for g in (16, 32):
        spec = quant.QuantSpec(2, g, 128)
        qm = l2_search(w, spec)
        assert (qm.rows, qm.cols, qm.group_size) == (128, 96, g) and qm.scale.dtype == torch.uint8
        minmax = quant.quantize_matrix(w, spec, optimize=False)
        assert quant.bits_per_weight(qm) == quant.bits_per_weight(minmax)
        assert rel(quant.dequantize(qm), w) < rel(quant.dequantize(minmax), w)


def test_the_q2k_layout_keeps_four_codes_per_block_of_16():
    """Each block of 16 along a row takes at most 4 distinct values (2-bit codes), and the
    error is that of a 2-bit quantizer, neither exact nor broken."""
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(1)) * 0.015
    d = q2k_layout(w)
    assert max(len(torch.unique(b)) for b in d.reshape(-1, 16)) <= 4
    assert 0.15 < rel(d, w) < 0.4
