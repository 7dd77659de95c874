"""moeferry.engine.kernels.int8_gpu: a GPU's LM head rounded to int8 per row.

The kernel's tests run on CUDA, or on the CPU under the Triton interpreter (TRITON_INTERPRET=1);
the rounding and the many-token path run everywhere.
"""

import pytest
import torch

from moeferry.engine.kernels import hqq_gpu, int8_gpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_rounding_keeps_each_weight_within_half_its_rows_step():
    w = torch.randn(77, 300) * torch.logspace(-3, 1, 77)[:, None]  # rows of very different ranges
    w[5] = 0  # an all-zero row keeps a positive scale and decodes to zeros
    m = int8_gpu.quantize(w)
    assert m.q.dtype == torch.int8 and m.q.shape == (77, 300) and m.s.shape == (77,)
    assert int(m.q.abs().max()) == 127
    err = (m.dequantize() - w).abs()
    assert (err <= m.s[:, None] / 2 * (1 + 1e-6)).all()
    assert (m.dequantize()[5] == 0).all() and m.s[5] > 0
    assert m.nbytes() == 77 * 300 + 4 * 77


def test_rounding_in_blocks_of_rows_is_rounding_at_once(monkeypatch):
    w = torch.randn(50, 64, dtype=torch.bfloat16)
    whole = int8_gpu.quantize(w)
    monkeypatch.setattr(int8_gpu, "ROUND_ROWS", 7)
    blocks = int8_gpu.quantize(w)
    assert torch.equal(whole.q, blocks.q) and torch.equal(whole.s, blocks.s)


def test_many_tokens_multiply_the_dequantized_rows(monkeypatch):
    """Past KERNEL_TOKENS (or without the kernel) the rows are dequantized in blocks for cuBLAS."""
    monkeypatch.setattr(int8_gpu, "BLOCK_ROWS_DEQUANT", 16)  # several blocks and a partial one
    m = int8_gpu.quantize(torch.randn(77, 96, device=DEVICE))
    x = torch.randn(int8_gpu.KERNEL_TOKENS + 3, 96, device=DEVICE)
    y = m.matmul(x)
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], 77)
    torch.testing.assert_close(y, x @ m.dequantize().T, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not hqq_gpu.fused_available(DEVICE), reason="needs CUDA (or the Triton interpreter)")
@pytest.mark.parametrize("rows,cols", [(77, 300), (4096, 256), (1000, 2880)])  # partial blocks; gpt-oss's width
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_the_dequantized_product(rows, cols, tokens, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(rows + cols)
    m = int8_gpu.quantize(torch.randn(rows, cols, device=DEVICE, generator=gen))
    x = torch.randn(tokens + 2, cols, device=DEVICE, generator=gen).to(dtype)[1:1 + tokens]  # a strided view's rows
    y = m.matmul(x)
    want = x.float() @ m.dequantize().T
    assert y.dtype == torch.float32 and y.shape == (tokens, rows)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-3)


def test_a_head_kernel_that_fails_its_probe_leaves_the_engine_on_dequantized_blocks(tmp_path, monkeypatch):
    """The engine tries the head's kernel once when it loads (model.fast_path_works): under
    kernels=auto a failure is a warning and cuBLAS on dequantized blocks, with the same tokens.
    Here on the CPU, with the int8 head forced and a kernel that cannot build."""
    from moeferry.engine.paths import demo_store_path
    from moeferry.engine.runtime import generate
    from moeferry.engine.runtime.generate import SamplingSettings, load_engine

    monkeypatch.setattr(generate, "int8_head_on_gpu", lambda dense, device, kernels="auto": True)
    settings = SamplingSettings(temperature=0, max_new_tokens=8)
    engine = load_engine(demo_store_path(), device="cpu", cache_experts=2, kernels="reference")
    assert isinstance(engine.model.lm_head, int8_gpu.Int8Rows) and engine.model.lm_head.kernel
    want = list(engine.generate_ids([1, 5, 9, 13], settings))

    def broken(*args, **kwargs):
        raise RuntimeError("cannot build this kernel here")
    monkeypatch.setattr(int8_gpu, "kernel_available", lambda device: True)
    monkeypatch.setattr(int8_gpu, "triton", type("Triton", (), {"cdiv": staticmethod(lambda a, b: -(-a // b))}))
    monkeypatch.setattr(int8_gpu, "_int8_rows_kernel", type("Launcher", (), {"__getitem__": lambda self, grid: broken})(),
                        raising=False)  # CI has no Triton: no kernel defined
    with pytest.warns(UserWarning, match="int8 LM head"):
        engine = load_engine(demo_store_path(), device="cpu", cache_experts=2, kernels="reference")
    assert engine.model.lm_head.kernel is False
    assert list(engine.generate_ids([1, 5, 9, 13], settings)) == want
