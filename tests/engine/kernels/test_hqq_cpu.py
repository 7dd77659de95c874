"""The CPU kernel for stored HQQ experts (engine/kernels/hqq_cpu.py) against the dequantized reference.

It reads the store's own layout (bit planes, 8-bit scales and zeros with float16 metadata),
so each test quantizes with moeferry.engine.storage.quant and compares with quant.dequantize, in float32.
Shapes are odd on purpose: few groups, metadata that wraps inside a row, rows that end in a
partial block of inputs, 1 and 3 tokens.

The kernel rounds its inputs xs = s[j, :] * x (per group j of rows) to int8 per block of 32
(llama.cpp's Q8_0 activations), so it is not exact: each xs[k] moves by at most half its
block's step, and row n's error is sum_k (code[n, k] - center) * e_k. The tests hold it to that
bound (any wrong code, scale or index breaks it by far) and to its typical size (under 1 %).
"""

import dataclasses

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


def int8_input_bound(qm: quant.QMatrix, x: torch.Tensor) -> torch.Tensor:
    """[T, rows]: the largest |kernel - reference| that rounding the inputs allows. Block b of
    group j's xs has the step D * m with m = ceil(max |xs| over b / (127 D)), D = max |xs| over
    the row / (127 * MMAX): at most the block's max / 127 + D; the codes enter centered."""
    T, K = x.shape
    G, B = qm.groups, hqq_cpu.BLOCK
    codes = quant.unpack_codes(qm.planes, qm.bits).float().view(qm.group_size, G, K)  # row n = i * G + j
    xs = quant.decode_meta(qm.scale, qm.scale_meta)[None] * x[:, None, :]  # [T, G, K]
    nb = -(-K // B)
    block_max = F.pad(xs.abs(), (0, nb * B - K)).view(T, G, nb, B).amax(-1)
    step = block_max / 127 + block_max.amax(-1, keepdim=True) / (127 * hqq_cpu.MMAX)
    step = step.repeat_interleave(B, -1)[..., :K]
    center = (2 ** qm.bits - 1) / 2
    return 0.5 * torch.einsum("igk,tgk->tig", (codes - center).abs(), step).reshape(T, qm.rows)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.bits}bit-g{s.group_size}-m{s.meta_group}")
# 1160 inputs: 36 whole blocks (more than FLUSH pairs of them) and a tail of 8
@pytest.mark.parametrize("rows,cols,T", [(64, 96, 1), (192, 40, 3), (128, 200, 2), (64, 1160, 1)])
def test_matmul_matches_dequantized_reference_to_int8_input_rounding(spec, rows, cols, T):
    qm = qmatrix(rows, cols, spec, rows + cols + spec.bits)
    w = hqq_cpu.from_qmatrix(qm)
    x = torch.randn(T, cols, generator=torch.Generator().manual_seed(T))
    spiky = x.clone()
    spiky[:, 3] *= 30  # an outlier input, as hidden states have: its block's step grows 30x
    for inputs in (x, spiky):
        want = inputs @ quant.dequantize(qm).T
        got = torch.from_numpy(hqq_cpu.matmul(inputs.numpy(), w))
        assert got.shape == (T, rows)
        excess = (got - want).abs() - int8_input_bound(qm, inputs)
        assert (excess <= 1e-5 * want.abs().max()).all(), excess.max()  # float32 rounding besides
    assert (got - want).norm() / want.norm() < 0.03
    want = x @ quant.dequantize(qm).T
    assert (torch.from_numpy(hqq_cpu.matmul(x.numpy(), w)) - want).norm() / want.norm() < 0.01


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.bits}bit-g{s.group_size}-m{s.meta_group}")
def test_a_prompts_rows_equal_each_token_run_alone(spec):
    """A prompt (T > 1) decodes each group's scales and zeros once for all its tokens, a lone
    token as it goes: the same products, to float32 rounding (the zero term's sum over the
    inputs runs in another order), far below the int8 rounding of the inputs (about 1e-2)."""
    qm = qmatrix(192, 1160, spec, 7)
    w = hqq_cpu.from_qmatrix(qm)
    x = torch.randn(5, 1160, generator=torch.Generator().manual_seed(5)).numpy()
    together = hqq_cpu.matmul(x, w)
    alone = np.concatenate([hqq_cpu.matmul(x[t:t + 1], w) for t in range(5)])
    assert np.abs(together - alone).max() <= 1e-4 * np.abs(alone).max()


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
    # three products, each about 0.5 % off (see the module docstring)
    assert (got - want).norm() / want.norm() < 0.02
    # it reads the stored bytes themselves (planes, 8-bit scales/zeros, float16 metadata)
    assert expert.nbytes() == sum(q.nbytes() for q in w.values()) and expert.copied_bytes() == 0
    assert np.shares_memory(expert.w1.planes[0], w["w1"].planes[0].numpy())
    assert np.shares_memory(expert.w1.scale_meta, w["w1"].scale_meta.numpy())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.bits}bit-g{s.group_size}-m{s.meta_group}")
@pytest.mark.parametrize("T", [1, 3])
def test_several_experts_in_one_call_equal_each_run_alone(spec, T):
    """swiglu_experts spreads every expert's groups over one set of parallel loops, reading
    each expert's arrays where they lie: the same products as each expert's matrices one at a
    time, to float32 rounding (the compiler may order a group's sums otherwise)."""
    H, I = 192, 128
    experts = [tuple(hqq_cpu.from_qmatrix(qmatrix(*shape, spec, 3 * e + m))
                     for m, shape in enumerate(((I, H), (I, H), (H, I)))) for e in range(3)]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).numpy()

    def one_at_a_time(w1, w3, w2):  # one matrix at a time (qmatmul): another driver than swiglu_experts'
        gate, up = hqq_cpu.matmul(x, w1), hqq_cpu.matmul(x, w3)
        return hqq_cpu.matmul((gate / (1 + np.exp(-gate)) * up).astype(np.float32), w2)

    alone = np.stack([one_at_a_time(*e) for e in experts])
    together = hqq_cpu.swiglu_experts(x, experts, np.stack([hqq_cpu.expert_addresses(*e) for e in experts]))
    assert together.shape == (3, T, H)
    assert np.abs(together - alone).max() <= 1e-4 * np.abs(alone).max()
    # each expert's own result, not a neighbour's
    assert all(np.abs(together[e] - alone[f]).max() > 1e-2 * np.abs(alone).max() for e in range(3) for f in range(3) if e != f)
    # arrays it would read beyond are refused before any address is taken
    w1 = experts[0][0]
    short = dataclasses.replace(w1, planes=(w1.planes[0][:-1],) + w1.planes[1:])
    with pytest.raises(ValueError, match="shapes"):
        hqq_cpu.expert_addresses(short, *experts[0][1:])
    with pytest.raises(ValueError, match="w1 and w3"):
        hqq_cpu.expert_addresses(experts[0][0], experts[0][2], experts[0][2])


def test_unsupported_matrices_are_refused():
    assert not hqq_cpu.supported(torch.zeros(4, 4))
    qm = quant.quantize_matrix(torch.randn(64, 32), quant.QuantSpec(8, 64, 256), optimize=False)
    assert not hqq_cpu.supported(qm)  # 8-bit attention matrices are not experts' widths here
    fp16_meta = quant.quantize_matrix(torch.randn(64, 32), quant.QuantSpec(2, 16, 128, meta_bits=16), optimize=False)
    assert not hqq_cpu.supported(fp16_meta)


SPIN_CHECK = """
import os
from moeferry.engine.kernels import hqq_cpu
before = os.environ.get("GOMP_SPINCOUNT")
hqq_cpu.kernels()
hqq_cpu.set_threads(1)
alone = os.environ.get("GOMP_SPINCOUNT")
hqq_cpu.spin_between_layers()
print(before, alone, os.environ.get("GOMP_SPINCOUNT"))
"""


@pytest.mark.parametrize("users", [None, "1234"])
def test_the_kernel_threads_spin_between_layers_only_when_asked_and_unless_the_user_says_otherwise(users):
    """numba's libgomp reads GOMP_SPINCOUNT when the first parallel call loads it: the kernel
    alone (the CPU engine) leaves it as it is, spin_between_layers (the GPU engine's hybrid)
    sets the long spin, and a value the user set stays."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if users:
        env["GOMP_SPINCOUNT"] = users
    out = subprocess.run([sys.executable, "-c", SPIN_CHECK], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(users), str(users), users or hqq_cpu.SPIN_COUNT]


THREADS_CHECK = """
import numba, torch
from moeferry.engine.kernels import hqq_cpu
torch.set_num_threads(1)
hqq_cpu.set_threads(2)  # the first call starts numba's pool
print(torch.get_num_threads(), numba.get_num_threads())
"""


@pytest.mark.skipif(hqq_cpu.available() != "", reason="needs numba")
def test_setting_the_kernels_threads_keeps_torchs_count():
    """numba's OpenMP layer sets OpenMP's count to its whole pool when it starts (torch reads that
    count): set_threads gives numba its count and leaves torch's as it was (the bench's hybrid
    on 8 threads reported 16)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", THREADS_CHECK], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", str(min(2, os.cpu_count()))]
