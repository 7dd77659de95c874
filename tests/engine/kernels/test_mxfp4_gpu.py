"""moeferry.engine.kernels.mxfp4_gpu: the MXFP4 kernels against mxfp4.dequantize then F.linear.

The fused tests run on CUDA (bf16 and float32) or, without it, under TRITON_INTERPRET=1 on the
CPU (float32: the interpreter's bf16 truncates). On the GPU machine:
`pytest -m gpu tests/engine/kernels/test_mxfp4_gpu.py`.
"""

import pytest
import torch
import torch.nn.functional as F

from benchmarks.kernel_bench import rel_err
from moeferry.engine.kernels import mxfp4_gpu as M
from moeferry.engine.measure.bench import random_mxfp4
from moeferry.engine.storage import mxfp4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the Triton interpreter
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def fused(test):
    """Marks a test of the kernels: gpu, and skipped where neither CUDA nor the interpreter is."""
    test = pytest.mark.skipif(not M.fused_available(DEVICE), reason="needs CUDA (or the Triton interpreter)")(test)
    return pytest.mark.gpu(test)


# rows not a multiple of any tile (37, 130), one block of columns (32), several steps of the
# GEMV's blocks (1056 = 33 blocks: a ragged last step), gpt-oss-20b's 2880 on the GPU
SHAPES = [(37, 96), (5, 32), (130, 1056), (64, 320)] + ([(2880, 2880)] if DEVICE == "cuda" else [])


def matrix(rows, cols, seed=0, device=DEVICE, exponents=(-12, 2)):
    """Scales over a wide range of exponents, so a wrong one cannot hide."""
    return random_mxfp4(rows, cols, device, torch.Generator(device=device).manual_seed(seed), exponents)


def assert_float32_close(y, ref):
    """Exact products, float32 sums in another order: close to the largest output's precision."""
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_reference_is_dequantize_then_linear():
    w = matrix(40, 64, device="cpu")
    x = torch.randn(3, 2, 64)
    y = M.mxfp4_linear(x, w, "reference")
    assert y.shape == (3, 2, 40)
    torch.testing.assert_close(y, F.linear(x, mxfp4.dequantize(w)))
    if not M.fused_available("cpu"):  # without the interpreter "auto" on the CPU is the reference
        torch.testing.assert_close(M.mxfp4_linear(x, w), y)


def test_bad_arguments():
    w = matrix(8, 64, device="cpu")
    with pytest.raises(ValueError):
        M.mxfp4_linear(torch.randn(1, 64), w, "fast")
    with pytest.raises(ValueError):
        M.mxfp4_linear(torch.randn(1, 32), w)


@pytest.mark.skipif(M.fused_available("cpu"), reason="the Triton interpreter runs fused on the CPU")
def test_fused_needs_cuda():
    with pytest.raises(RuntimeError):
        M.mxfp4_linear(torch.randn(1, 64), matrix(8, 64, device="cpu"), "fused")


def test_the_magnitude_table_is_e2m1():
    lut = M.TWICE_E2M1 & 0xFFFFFFFF
    assert [((lut >> (4 * c)) & 15) / 2 for c in range(8)] == list(mxfp4.FP4_VALUES[:8])


@fused
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 3])
def test_fused_equals_the_reference(rows, cols, dtype, T):
    w = matrix(rows, cols, seed=rows + T)
    x = torch.randn(T, cols, device=DEVICE).to(dtype)
    y = M.mxfp4_linear(x, w, "fused")
    assert y.shape == (T, rows) and y.dtype == dtype
    ref = F.linear(x, mxfp4.dequantize(w, dtype))
    ref64 = x.double() @ mxfp4.dequantize(w, torch.float64).T
    if dtype == torch.float32:
        assert_float32_close(y, ref)
    else:  # one rounding to bf16 each
        assert rel_err(y, ref) < 1e-2 and rel_err(y, ref64) < 1e-2


@fused
def test_pack_x_lays_out_fp16_pairs_of_each_block():
    """Block b's pair (8k + p, 8k + 4 + p) at int32 16b + 4p + k, lanes x * 2^14 / max |x|."""
    x = torch.randn(3, 96, device=DEVICE) * torch.tensor([1e-3, 1.0, 300.0], device=DEVICE)[:, None]
    x[2, 32:64] = 0  # an all-zero block
    pairs, amax = M.pack_x(x)
    lanes = pairs.cpu().view(torch.float16).float().view(3, 3, 4, 4, 2)  # [row, block, p, k, lane]
    want_amax = x.view(3, 3, 32).abs().amax(-1)
    assert torch.equal(amax.cpu(), want_amax.cpu())
    scaled = (x.view(3, 3, 32) * 16384 / want_amax.clamp_min(1e-30)[..., None]).cpu()
    for b in range(3):
        for p in range(4):
            for k in range(4):
                got = lanes[:, b, p, k]
                want = torch.stack([scaled[:, b, 8 * k + p], scaled[:, b, 8 * k + 4 + p]], -1)
                torch.testing.assert_close(got, want.half().float(), rtol=0, atol=0)
    assert torch.equal(lanes[2, 1], torch.zeros(4, 4, 2))


@fused
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_the_fp16_pair_loop_stays_within_fp16_of_the_product(rows, cols):
    """H2 (the bf16/fp16 default) forced on float32 x: every code's lane decoding, the pairs'
    order and the block scales, to fp16's precision of x and of the partial sums."""
    w = matrix(rows, cols, seed=rows)
    x = torch.randn(1, cols, device=DEVICE)
    out = torch.empty(1, rows, device=DEVICE)
    M.gemv(x, w, out, dict(M.gemv_config(rows, cols, torch.float32), H2=True))
    ref64 = x.double() @ mxfp4.dequantize(w, torch.float64).T
    assert rel_err(out, ref64) < 3e-3


def test_h2_is_the_default_for_half_precision_activations():
    if M.triton is None:
        pytest.skip("needs Triton")
    assert M.gemv_config(2880, 2880, torch.bfloat16)["H2"] and M.gemv_config(2880, 2880, torch.float16)["H2"]
    assert not M.gemv_config(2880, 2880, torch.float32)["H2"]


@fused
@pytest.mark.parametrize("T", [16, 17, 40])
def test_prefill_paths(T):
    """The GEMM's last token count and the dequantize + matmul path beyond it."""
    w = matrix(70, 160, seed=T)
    x = torch.randn(T, 160, device=DEVICE)
    assert_float32_close(M.mxfp4_linear(x, w, "fused"), F.linear(x, mxfp4.dequantize(w)))


@fused
def test_dequantize_fused_is_exact():
    w = matrix(45, 288, seed=3)
    for dtype in DTYPES:
        assert torch.equal(M.dequantize_fused(w, dtype), mxfp4.dequantize(w, dtype))


@fused
def test_the_model_uses_the_kernels_for_mxfp4_experts(monkeypatch):
    """OffloadedMixtral.linear sends an Mxfp4Matrix to mxfp4_linear with the model's kernels."""
    from types import SimpleNamespace

    from moeferry.engine.runtime.model import OffloadedMixtral
    real, calls = M.gemv, []

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(M, "gemv", counting)
    w, x = matrix(64, 128), torch.randn(1, 128, device=DEVICE)
    y = OffloadedMixtral.linear(SimpleNamespace(kernels="auto"), x, w)
    assert len(calls) == 1
    assert_float32_close(y, F.linear(x, mxfp4.dequantize(w)))
    OffloadedMixtral.linear(SimpleNamespace(kernels="reference"), x, w)
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------
# Routed experts of one token (moe_decode), against the per-expert eager path


def gpt_oss_slots(hidden, ffn, n_slots, device, seed=0):
    """Cache slots [n_slots, stride] of random gpt-oss experts (MXFP4 matrices, bf16 biases) as
    ExpertCache keeps them, and a function slot -> that slot's expert views."""
    from types import SimpleNamespace

    from moeferry.engine.measure import bench
    from moeferry.engine.storage import store
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=ffn, expert_act="clamped_swiglu")
    eq = {"bits": 4, "method": "mxfp4", "group_size": 32, "bias_dtype": "BF16"}
    fields, stride = store.expert_layout(cfg, eq)
    gen = torch.Generator().manual_seed(seed)
    slots = torch.stack([bench.random_expert(cfg, eq, fields, stride, "cpu", gen) for _ in range(n_slots)]).to(device)
    return slots, lambda s: store.view_expert(slots[s], fields, eq, cfg)


def eager_experts(h, ids, weights, slot_of, views, alpha, limit):
    """The model's decode arithmetic: experts in ascending id order, out.add_((y * w).to(dtype)),
    each through OffloadedMixtral's own clamped-SwiGLU expert on the reference linear."""
    from types import SimpleNamespace

    from moeferry.engine.runtime.model import OffloadedMixtral
    model = SimpleNamespace(linear=lambda x, w: M.mxfp4_linear(x, w, "reference"),
                            cfg=SimpleNamespace(swiglu_alpha=alpha, swiglu_limit=limit))
    model.clamped_swiglu_expert = lambda w, x: OffloadedMixtral.clamped_swiglu_expert(model, w, x)
    out = torch.zeros_like(h)
    ids_host = ids.tolist()
    for e in sorted(ids_host):
        k = ids_host.index(e)
        out.add_((OffloadedMixtral.expert(model, views(slot_of[e]), h) * weights[k:k + 1]).to(out.dtype))
    return out


@fused
@pytest.mark.parametrize("topk", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_decode_matches_the_per_expert_path(topk, dtype):
    hidden, ffn, n_experts, n_slots, alpha, limit = 96, 160, 8, 6, 1.702, 1.0
    slots, views = gpt_oss_slots(hidden, ffn, n_slots, DEVICE, seed=topk)
    gen = torch.Generator().manual_seed(topk)
    table = torch.randperm(n_experts, generator=gen) % n_slots  # expert -> slot
    ids = torch.randperm(n_experts, generator=gen)[:topk]
    while len(set(table[ids].tolist())) < topk:  # routed experts sit in distinct slots
        ids = torch.randperm(n_experts, generator=gen)[:topk]
    weights = torch.softmax(torch.randn(topk, generator=gen), 0)
    h = (torch.randn(1, hidden, generator=gen) * 8).to(DEVICE, dtype)
    gate = F.linear(h.float(), mxfp4.dequantize(views(0)["w1"])) + views(0)["b1"].float()
    assert (gate > limit).any() and (gate < limit).any()  # the clamp takes part
    assert M.moe_supported(views(0))
    out = torch.full_like(h, float("nan"))
    M.moe_decode(h, views(0), slots.shape[1], ids.to(DEVICE), weights.to(DEVICE), table.to(DEVICE, torch.int32),
                 out, alpha, limit)
    assert not torch.isnan(out).any()
    want = eager_experts(h, ids, weights.to(DEVICE), table.tolist(), views, alpha, limit)
    if dtype == torch.float32:
        assert_float32_close(out, want)
    else:  # the same roundings; float32 sums in another order can move one of them by an ulp
        assert rel_err(out, want) < 2e-2
    want64 = eager_experts(h.double(), ids, weights.double().to(DEVICE), table.tolist(),
                           lambda s: {k: v.double() if isinstance(v, torch.Tensor) else v
                                      for k, v in views(s).items()}, alpha, limit)
    assert rel_err(out, want64) < (1e-5 if dtype == torch.float32 else 3e-2)
    if dtype == torch.float32:  # the fp16-pair loop (bf16's default) on float32, h and act packed
        cfg = (dict(M.gemv_config(ffn, hidden, dtype), H2=True), dict(M.gemv_config(hidden, ffn, dtype), H2=True))
        M.moe_decode(h, views(0), slots.shape[1], ids.to(DEVICE), weights.to(DEVICE),
                     table.to(DEVICE, torch.int32), out, alpha, limit, cfg)
        assert rel_err(out, want64) < 5e-3
