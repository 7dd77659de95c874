"""moeferry.engine.kernels.hqq_gpu: the reference path everywhere, the fused Triton kernels where CUDA is.

The GPU tests (marked gpu) skip without CUDA; run them on the GPU machine with
`pytest -m gpu tests/engine/kernels/test_hqq_gpu.py`.
"""

import random

import pytest
import torch

from benchmarks.kernel_bench import random_qmatrix, rel_err
from moeferry.engine.kernels import hqq_gpu as K
from moeferry.engine.storage.quant import QMatrix, dequantize

FUSED_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the Triton interpreter
FORMATS = [(2, 16), (3, 64), (4, 64), (8, 64), (2, 32), (3, 16), (4, 8)]  # (bits, group size)
META = {"8bit": dict(meta8=True), "8bit-M1": dict(meta8=True, meta_group=1 << 40),
        "fp16": dict(meta8=False)}


# ---------------------------------------------------------------------------------------------
# Reference path (CPU)


@pytest.mark.parametrize("bits,g", FORMATS)
@pytest.mark.parametrize("meta", list(META))
def test_reference_is_dequantize_then_matmul(bits, g, meta):
    qm = random_qmatrix(128, 96, bits, g, seed=bits * 100 + g, **META[meta])
    W = dequantize(qm)
    for T in (1, 5):
        x = torch.randn(T, 96)
        torch.testing.assert_close(K.qlinear(x, qm, "reference"), x @ W.T)
        # on a machine without CUDA "auto" is the reference path
        if not torch.cuda.is_available():
            torch.testing.assert_close(K.qlinear(x, qm, "auto"), x @ W.T)


def test_reference_keeps_dtype_and_leading_dims():
    qm = random_qmatrix(64, 32, 4, 16, seed=1)
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    y = K.qlinear(x, qm, "reference")
    assert y.shape == (2, 3, 64) and y.dtype == torch.bfloat16
    ref = x.float() @ dequantize(qm).T
    assert rel_err(y, ref) < 1e-2


def test_out_buffer_is_filled_and_returned():
    qm = random_qmatrix(64, 32, 2, 16, seed=2)
    x = torch.randn(1, 32)
    out = torch.empty(1, 64)
    assert K.qlinear(x, qm, "reference", out=out) is out
    torch.testing.assert_close(out, x @ dequantize(qm).T)


def test_plain_weight_is_f_linear():
    w = torch.randn(48, 32)
    x = torch.randn(3, 32)
    torch.testing.assert_close(K.qlinear(x, w), x @ w.T)


def test_bad_arguments():
    qm = random_qmatrix(64, 32, 2, 16, seed=3)
    with pytest.raises(ValueError):
        K.qlinear(torch.randn(1, 32), qm, "fast")
    with pytest.raises(ValueError):
        K.qlinear(torch.randn(1, 31), qm)


@pytest.mark.skipif(K.fused_available("cpu"), reason="the Triton interpreter runs fused on the CPU")
def test_fused_needs_cuda():
    qm = random_qmatrix(64, 32, 2, 16, seed=4)
    with pytest.raises(RuntimeError):
        K.qlinear(torch.randn(1, 32), qm, "fused")


def test_supported_formats():
    assert all(K.fused_supported(random_qmatrix(64, 16, b, g, seed=5)) for b, g in FORMATS)
    # 3-bit groups of 4: the 1-bit plane's 8 codes per byte would straddle groups
    assert not K.fused_supported(random_qmatrix(64, 16, 3, 4, seed=6))
    assert not K.fused_supported(random_qmatrix(48, 16, 4, 24, seed=7))  # not a power of two


# ---------------------------------------------------------------------------------------------
# Fused kernels (GPU)


def _check(qm: QMatrix, T: int, dtype=torch.bfloat16, tol=1e-2):
    x = torch.randn(T, qm.cols, device="cuda").to(dtype)
    y = torch.full((T, qm.rows), float("nan"), device="cuda", dtype=dtype)
    K.qlinear(x, qm, "fused", out=y)
    assert not torch.isnan(y).any(), "an output element was not written"
    ref = K.qlinear(x, qm, "reference")
    ref64 = x.double() @ dequantize(qm, torch.float64).T
    e, e64 = rel_err(y, ref), rel_err(y, ref64)
    assert e <= tol and e64 <= tol, (qm.rows, qm.cols, qm.bits, qm.group_size, T, e, e64)
    return y


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("draw", range(24))
def test_fused_matches_reference_random(draw):
    rnd = random.Random()  # fresh shapes every run; printed on failure by _check's message
    bits, g = rnd.choice(FORMATS)
    rows = g * rnd.choice([1, 2, 3, 8, 24, 64]) * max(1, 8 // g)
    cols = rnd.choice([8, 40, 96, 256, 1000, 1024, 4096])
    meta = rnd.choice(list(META))
    qm = random_qmatrix(rows, cols, bits, g, device="cuda", **META[meta])
    for T in (1, rnd.choice([2, 3, 8]), rnd.choice([37, 128])):
        _check(qm, T)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,cols,bits,g", [(14336, 4096, 2, 16), (4096, 14336, 3, 64),
                                              (4096, 14336, 4, 64), (4096, 4096, 8, 64)])
def test_fused_mixtral_shapes(rows, cols, bits, g):
    for meta in ("8bit", "fp16"):
        qm = random_qmatrix(rows, cols, bits, g, device="cuda", **META[meta])
        _check(qm, 1)
        _check(qm, 1, torch.float16)
        _check(qm, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_split_k_is_deterministic_and_reusable():
    """The split-K fixup resets its counters: repeated and interleaved launches agree bitwise."""
    a = random_qmatrix(4096, 14336, 4, 64, device="cuda")
    b = random_qmatrix(1024, 4096, 2, 16, device="cuda")
    xa = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
    xb = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    ya = K.qlinear(xa, a, "fused")
    yb = K.qlinear(xb, b, "fused")
    for _ in range(5):
        assert torch.equal(K.qlinear(xa, a, "fused"), ya)
        assert torch.equal(K.qlinear(xb, b, "fused"), yb)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_on_a_side_stream():
    qm = random_qmatrix(4096, 14336, 2, 16, device="cuda")
    x = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
    ref = K.qlinear(x, qm, "fused")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = K.qlinear(x, qm, "fused")
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(y, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits,g", FORMATS)
def test_dequantize_fused_matches(bits, g):
    """Equal up to float32 rounding: the compiled kernel evaluates (c - z) * s as
    fma(c, s, -z * s) (LLVM's contraction), so it is not always bitwise equal."""
    for meta in META:
        qm = random_qmatrix(g * 24, 200, bits, g, device="cuda", **META[meta])
        out = torch.full((qm.rows, qm.cols), float("nan"), device="cuda")
        ref = dequantize(qm, torch.float32)
        # c*s - z*s cancels: allow a few float32 ulps of the largest term
        torch.testing.assert_close(K.dequantize_fused(qm, torch.float32, out=out), ref,
                                   rtol=1e-5, atol=1e-6 * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_falls_back_for_unsupported_groups():
    qm = random_qmatrix(64, 32, 3, 4, device="cuda")
    x = torch.randn(1, 32, device="cuda")
    torch.testing.assert_close(K.qlinear(x, qm, "auto"), K.qlinear(x, qm, "reference"))
    with pytest.raises(ValueError):
        K.qlinear(x, qm, "fused")


def test_auto_falls_back_to_the_reference_path_when_the_fused_path_fails(monkeypatch):
    """E.g. Triton cannot build its launcher (no C compiler): the answer stays right."""
    import moeferry.engine.kernels.hqq_gpu as K
    from moeferry.engine.storage.quant import EXPERT_SPECS, dequantize, quantize_matrix

    w = quantize_matrix(torch.randn(64, 32), EXPERT_SPECS[4], optimize=False)
    x = torch.randn(1, 32)

    def broken(*args):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(K, "FUSED_FAILURE", None)
    monkeypatch.setattr(K, "fused_available", lambda device=None: K.FUSED_FAILURE is None)
    monkeypatch.setattr(K, "fused_supported", lambda w: True)
    monkeypatch.setattr(K, "_fused", broken)
    with pytest.warns(UserWarning, match="fused kernels unavailable"):
        y = K.qlinear(x, w, "auto")
    torch.testing.assert_close(y, x @ dequantize(w).T)
    assert "C compiler" in K.FUSED_FAILURE
    with pytest.raises(RuntimeError):
        K.qlinear(x, w, "fused")  # asked for explicitly: the error is not hidden


# ---------------------------------------------------------------------------------------------
# Routed experts of one token (moe_decode), against the per-expert eager path


def packed_expert_slots(hidden, ffn, bits, g, meta8, n_slots, device, seed=0):
    """Cache slots [n_slots, stride] holding random packed experts, as ExpertCache keeps them,
    and a function slot -> that slot's expert views {w1, w3, w2}."""
    from types import SimpleNamespace

    from moeferry.engine.storage import store
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=ffn, expert_act="silu")  # Mixtral's experts
    quant = {"bits": bits, "group_size": g, "meta_group": 128, **({} if meta8 else {"meta_bits": 16})}
    fields, stride = store.expert_layout(cfg, quant)
    slots = torch.empty(n_slots, stride, dtype=torch.uint8)
    for s in range(n_slots):
        tensors = {}
        for m, name in enumerate(store.EXPERT_MATRICES):
            rows, cols = store.expert_shape(cfg, name)
            qm = random_qmatrix(rows, cols, bits, g, meta8=meta8, seed=seed * 1000 + s * 3 + m)
            tensors.update({f"{name}.{k}": v for k, v in qm.tensors().items()})
        slots[s] = store.pack_expert(tensors, fields, stride)
    slots = slots.to(device)
    return slots, lambda s: store.view_expert(slots[s], fields, quant, cfg)


def per_expert_moe(h, ids, weights, slot_of, views, kernels):
    """model.moe's decode arithmetic: experts in ascending id order, out.add_(bf16(y * w)),
    each expert through the model's own OffloadedMixtral.expert."""
    from types import SimpleNamespace

    from moeferry.engine.runtime.model import OffloadedMixtral
    model = SimpleNamespace(linear=lambda x, w: K.qlinear(x, w, kernels))
    out = torch.zeros_like(h)
    ids_host = ids.tolist()
    for e in sorted(ids_host):
        y = OffloadedMixtral.expert(model, views(slot_of[e]), h)
        out.add_((y * weights[ids_host.index(e)]).to(out.dtype))
    return out


def check_moe_decode(device, hidden, ffn, bits, g, meta8, topk, dtype, seed=0):
    n_experts, n_slots = 8, max(topk, 5)
    slots, views = packed_expert_slots(hidden, ffn, bits, g, meta8, n_slots, device, seed)
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(n_experts, generator=gen) % n_slots  # expert -> slot
    ids = torch.randperm(n_experts, generator=gen)[:topk]
    while len(set(table[ids].tolist())) < topk:  # routed experts sit in distinct slots
        ids = torch.randperm(n_experts, generator=gen)[:topk]
    weights = torch.softmax(torch.randn(topk, generator=gen), 0)
    h = torch.randn(1, hidden, generator=gen).to(device, dtype)
    out = torch.full_like(h, float("nan"))
    K.moe_decode(h, views(0), slots.shape[1], ids.to(device), weights.to(device),
                 table.to(device, torch.int32), out)
    assert not torch.isnan(out).any()
    ref64 = per_expert_moe(h.double(), ids, weights.tolist(), table.tolist(), views, "reference")
    fused = per_expert_moe(h, ids, weights.tolist(), table.tolist(), views, "fused")
    # bf16: act and each expert's output are rounded to bf16 (as the eager path does), 3 chained
    # products; float32: the same sums as the per-expert kernels, up to the split-K order
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(out, ref64) <= tol, rel_err(out, ref64)
    assert rel_err(out, fused) <= tol, rel_err(out, fused)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not K.fused_available(), reason="needs CUDA (or the Triton interpreter)")
@pytest.mark.parametrize("bits,g,meta8", [(2, 16, True), (3, 64, True), (4, 64, True), (2, 16, False), (4, 32, False)])
@pytest.mark.parametrize("topk", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_decode_matches_the_per_expert_path(bits, g, meta8, topk, dtype):
    if FUSED_DEVICE == "cpu" and dtype != torch.float32:
        pytest.skip("the Triton interpreter's bf16 truncates")
    check_moe_decode(FUSED_DEVICE, 256, 512, bits, g, meta8, topk, dtype, seed=bits + topk)


@pytest.mark.gpu
@pytest.mark.skipif(not K.fused_available(), reason="needs CUDA (or the Triton interpreter)")
@pytest.mark.parametrize("topk,absent", [(3, (1,)), (4, (0, 3)), (2, (0, 1))])
@pytest.mark.parametrize("programs", [None, 1])  # split-K as gemv_config chooses, and no split
def test_moe_decode_runs_experts_not_in_place_late(topk, absent, programs):
    """Experts whose table entry is -1 leave out untouched; run late once in place, out equals
    one launch over all of them, bit for bit (the same partials, summed in the same order)."""
    dtype = torch.bfloat16 if FUSED_DEVICE == "cuda" else torch.float32
    n_experts, n_slots = 8, 5
    slots, views = packed_expert_slots(128, 256, 4, 64, True, n_slots, FUSED_DEVICE, seed=topk)
    gen = torch.Generator().manual_seed(topk)
    ids = torch.randperm(n_experts, generator=gen)[:topk]
    table = torch.full((n_experts,), -1, dtype=torch.int32)
    table[ids] = torch.randperm(n_slots, generator=gen)[:topk].to(torch.int32)
    weights = torch.softmax(torch.randn(topk, generator=gen), 0)
    h = torch.randn(1, 128, generator=gen).to(FUSED_DEVICE, dtype)
    cfg = None if programs is None else ({"programs": programs}, {"programs": programs})
    args = (h, views(0), slots.shape[1], ids.to(FUSED_DEVICE), weights.to(FUSED_DEVICE))
    whole = torch.full_like(h, float("nan"))
    K.moe_decode(*args, table.to(FUSED_DEVICE), whole, cfg)
    hits_first = table.clone()
    hits_first[ids[list(absent)]] = -1
    out = torch.full_like(h, float("nan"))
    K.moe_decode(*args, hits_first.to(FUSED_DEVICE), out, cfg)
    assert torch.isnan(out).all()  # not written: an expert was missing
    K.moe_decode(*args, table.to(FUSED_DEVICE), out, cfg, late=torch.tensor(absent, device=FUSED_DEVICE))
    assert torch.equal(out, whole)
    K.moe_decode(*args, table.to(FUSED_DEVICE), out, cfg)  # the counters were left at zero
    assert torch.equal(out, whole)


@pytest.mark.gpu
@pytest.mark.skipif(not K.fused_available(), reason="needs CUDA (or the Triton interpreter)")
@pytest.mark.parametrize("tokens,topk,bits,g", [(3, 2, 4, 64), (5, 3, 2, 16), (2, 1, 3, 64)])
def test_moe_prompt_runs_the_pairs_asked_for(tokens, topk, bits, g):
    """moe_prompt: row p of y is the expert in slots[p] applied to token p // topk, for the
    positions asked for (as the per-expert path computes it), and only those; the pairs of a
    token, weighted and summed, give what moe_decode gives for it."""
    dtype = torch.bfloat16 if FUSED_DEVICE == "cuda" else torch.float32
    n_slots, hidden = 6, 128
    slots, views = packed_expert_slots(hidden, 256, bits, g, True, n_slots, FUSED_DEVICE, seed=tokens)
    gen = torch.Generator().manual_seed(tokens * 10 + topk)
    ids = torch.stack([torch.randperm(n_slots, generator=gen)[:topk] for _ in range(tokens)])
    slot_of = torch.randperm(n_slots, generator=gen).to(torch.int32)  # expert -> slot
    pair_slots = slot_of[ids].flatten().to(FUSED_DEVICE)
    h = torch.randn(tokens, hidden, generator=gen).to(FUSED_DEVICE, dtype)
    y = torch.full((tokens * topk, hidden), float("nan"), dtype=dtype, device=FUSED_DEVICE)
    first = [p for p in range(tokens * topk) if p % 2 == 0]
    for at in (first, [p for p in range(tokens * topk) if p % 2]):  # two launches, as two passes of a layer
        done = y.clone()
        K.moe_prompt(h, views(0), slots.shape[1], pair_slots, torch.tensor(at, dtype=torch.int32).to(FUSED_DEVICE),
                     topk, y)
        untouched = [p for p in range(tokens * topk) if p not in at]
        assert torch.equal(y[untouched].isnan(), done[untouched].isnan())
        if at is first:
            assert y[untouched].isnan().all()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for p in range(tokens * topk):
        t, e = p // topk, int(ids.flatten()[p])
        want = per_expert_moe(h[t:t + 1], torch.tensor([e]), [1.0], slot_of.tolist(), views, "fused")
        assert rel_err(y[p:p + 1], want) <= tol, p
    weights = torch.softmax(torch.randn(tokens, topk, generator=gen), -1)
    table = slot_of.to(FUSED_DEVICE)
    for t in range(tokens):
        decoded = torch.zeros(1, hidden, dtype=dtype, device=FUSED_DEVICE)
        K.moe_decode(h[t:t + 1], views(0), slots.shape[1], ids[t].to(FUSED_DEVICE), weights[t].to(FUSED_DEVICE),
                     table, decoded)
        summed = (y[t * topk:(t + 1) * topk].float() * weights[t, :, None].to(FUSED_DEVICE)).sum(0, keepdim=True)
        assert rel_err(summed, decoded.float()) <= tol, t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits,g", [(2, 16), (3, 64)])
def test_moe_decode_mixtral_shape_is_deterministic(bits, g):
    out = check_moe_decode("cuda", 4096, 14336, bits, g, True, 2, torch.bfloat16)
    assert torch.equal(check_moe_decode("cuda", 4096, 14336, bits, g, True, 2, torch.bfloat16), out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,cols,bits,g",
                         [(1024, 4096, 4, 64), (1024, 4096, 8, 64), (256, 512, 2, 16), (96, 200, 3, 32)])
def test_gemv_pair_equals_two_gemvs(rows, cols, bits, g):
    a = random_qmatrix(rows, cols, bits, g, device="cuda", seed=1)
    b = random_qmatrix(rows, cols, bits, g, device="cuda", seed=2)
    other_meta = random_qmatrix(rows, cols, bits, g, meta8=False, device="cuda")
    assert K.pair_supported(a, b) and not K.pair_supported(a, other_meta)
    x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
    want_a, want_b = K.qlinear(x, a, "fused"), K.qlinear(x, b, "fused")
    for _ in range(2):  # the split-K counters are reset for the next launch
        ya, yb = (torch.full((1, rows), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2))
        K.gemv_pair(x, a, b, ya, yb)
        assert rel_err(ya, want_a) <= 1e-3 and rel_err(yb, want_b) <= 1e-3


# ---------------------------------------------------------------------------------------------
# The packed fp16 decode loop (bf16/fp16 activations) against the float32 loop and the reference




@pytest.mark.gpu
@pytest.mark.skipif(not K.fused_available(), reason="needs CUDA (or the Triton interpreter)")
@pytest.mark.parametrize("rows,cols,bits,g", [(64, 3000, 2, 16), (64, 4096, 3, 64), (128, 2048, 4, 32),
                                              (64, 4096, 2, 16), (256, 64, 8, 64)])
@pytest.mark.parametrize("meta", list(META))
def test_packed_fp16_loop_matches_the_reference(rows, cols, bits, g, meta):
    """Ragged and whole tiles, several k tiles per program (programs=1: no split), one matrix
    and two in one loop (gemv_pair); fp16 activations (the interpreter's bf16 truncates)."""
    kw = dict(META[meta])
    mg = kw.pop("meta_group", 128)
    qa = random_qmatrix(rows, cols, bits, g, meta_group=mg, device=FUSED_DEVICE, seed=1, **kw)
    qb = random_qmatrix(rows, cols, bits, g, meta_group=mg, device=FUSED_DEVICE, seed=2, **kw)
    x = torch.randn(1, cols, device=FUSED_DEVICE).half()
    want_a = K.qlinear(x.float(), qa, "reference")
    want_b = K.qlinear(x.float(), qb, "reference")
    sms = K._sm_count(x.device)
    for packed in (True, False):
        cfg = dict(K.gemv_config(rows, cols, bits, g, sms), H2=packed, programs=1)
        assert K._gemv_launch(rows, cols, bits, g, sms, tuple(sorted(cfg.items())))[4]["H2"] == packed
        y = torch.full((1, rows), float("nan"), device=FUSED_DEVICE).half()
        K.gemv(x, qa, y, cfg)
        assert rel_err(y.float(), want_a) < (3e-3 if packed else 1e-3)
    ya, yb = (torch.full((1, rows), float("nan"), device=FUSED_DEVICE).half() for _ in range(2))
    assert K._gemv_launch(rows, cols, bits, g, sms, None, 2)[4]["H2"]
    K.gemv_pair(x, qa, qb, ya, yb)  # the default: packed where the format allows
    assert rel_err(ya.float(), want_a) < 3e-3 and rel_err(yb.float(), want_b) < 3e-3


def test_float32_activations_keep_the_float32_loop():
    assert K.gemv_config(14336, 4096, 2, 16)["H2"]
    assert not K.gemv_config(14336, 4096, 2, 16, exact=True)["H2"]
    assert not K.gemv_config(64, 100, 2, 16)["H2"]  # 100 columns: not whole 8-byte words
    # what a launch uses: gemv passes exact=True for float32 x; a forced H2 that cannot fit falls back
    assert K._gemv_launch(14336, 4096, 2, 16, 132, None, 1, False)[4]["H2"]
    assert not K._gemv_launch(14336, 4096, 2, 16, 132, None, 1, True)[4]["H2"]
    assert not K._gemv_launch(64, 104, 2, 16, 132, (("H2", True), ("KV", 4)))[4]["H2"]


@pytest.mark.gpu  # runs wherever Triton is (no GPU needed): the GPU machine, a developer's
@pytest.mark.skipif(K.triton is None or K._interpreting(),
                    reason="needs Triton, not its interpreter (compiles for sm_90 without a GPU)")
def test_packed_loop_needs_fewer_instructions_per_tile():
    from benchmarks.kernel_sass import compile_gemv, loop_report
    packed = loop_report(compile_gemv(14336, 4096, 2, packed=True))
    plain = loop_report(compile_gemv(14336, 4096, 2, packed=False))
    assert packed["opcodes"].get("HFMA2", 0) >= 64  # 128 weights per thread, two per HFMA2
    assert packed["loop_instructions"] < 0.75 * plain["loop_instructions"]
