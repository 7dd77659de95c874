"""CPU expert kernels: each format equals the float reference of its own copy.

int4 and int8 compute with bfloat16 activations (their fast path), so they are compared with
the float32 reference on bfloat16-rounded inputs, within bfloat16's rounding of the output.
"""

import pytest
import torch
import torch.nn.functional as F

from moeferry.engine.kernels import torch_cpu as tc
from moeferry.engine.runtime import cpu_experts as ce
from moeferry.engine.storage import quant


def bf16(t):
    return t.bfloat16().float()


def close_bf16(got, want):
    return torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def reference_expert(w1, w3, w2, x):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("T", [1, 3])
def test_int4_kernel_matches_its_dequantized_codes(g, T):
    gen = torch.Generator().manual_seed(g + T)
    w = torch.randn(96, 256, generator=gen) * 0.02
    q, s, z = tc.int4_codes(w, g)
    assert q.min() >= 0 and q.max() <= 15 and q.dtype == torch.int32
    cols = torch.arange(256) // g
    ref_w = (q.float() - 8) * s[:, cols] + z[:, cols]  # the documented layout
    m = tc.quantize_int4(w, g)
    assert m.packed.dtype == torch.uint8 and m.packed.shape == (96, 128)
    assert m.meta.shape == (256 // g, 96, 2)
    assert torch.equal(m.meta[..., 0].float().T, s) and torch.equal(m.meta[..., 1].float().T, z)
    x = torch.randn(T, 256, generator=gen)
    got = m.matmul(x)
    want = bf16(x) @ ref_w.T
    assert got.dtype == torch.float32 and close_bf16(got, want), (got - want).abs().max()
    # and the copy is close to the weights it came from: 4 bits, not noise
    assert (ref_w - w).norm() / w.norm() < 0.12


def test_int4_range_search_beats_plain_min_max():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    w[0, 5] = 9.0  # an outlier
    q, s, z = tc.int4_codes(w, 32)
    cols = torch.arange(128) // 32
    err = ((q.float() - 8) * s[:, cols] + z[:, cols] - w) ** 2
    lo, hi = w.view(64, 4, 32).amin(-1), w.view(64, 4, 32).amax(-1)
    sp = (hi - lo) / 15
    qp = ((w - lo[:, cols]) / sp[:, cols]).round().clamp(0, 15)
    err_plain = (qp * sp[:, cols] + lo[:, cols] - w) ** 2
    per_group = err.view(64, 4, 32).sum(-1), err_plain.view(64, 4, 32).sum(-1)
    # scales and zeros are rounded to bfloat16 afterwards, so a group may lose a little
    assert (per_group[0] <= per_group[1] * 1.05).all()
    assert err.sum() < 0.95 * err_plain.sum()


def test_int8_kernel_matches_its_dequantized_codes():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(80, 96, generator=gen)
    m = tc.quantize_int8(w)
    ref_w = m.packed.float() * m.meta.float()[:, None]
    assert (ref_w - w).norm() / w.norm() < 0.01
    x = torch.randn(2, 96, generator=gen)
    assert close_bf16(m.matmul(x), bf16(x) @ ref_w.T)


@pytest.mark.parametrize("expert_bits", [2, 3, 4])
@pytest.mark.parametrize("fmt", ce.COPY_FORMATS)
def test_cpu_expert_equals_reference_of_its_copy_and_reports_extra_error(expert_bits, fmt):
    """The GPU copy is the store's HQQ expert; the CPU copy is derived from its dequantized
    values. The CPU output equals the float reference of the CPU copy; its distance from the
    GPU copy's output is the extra error of the CPU format (printed, and bounded)."""
    gen = torch.Generator().manual_seed(expert_bits)
    H, I = 128, 256
    spec = quant.EXPERT_SPECS[expert_bits]
    src = [torch.randn(r, c, generator=gen) * 0.01 for r, c in ((I, H), (I, H), (H, I))]
    gpu = [quant.dequantize(quant.quantize_matrix(w, spec, optimize=False)) for w in src]
    cpu = ce.make_expert(*gpu, fmt)
    if fmt == "int4":
        codes = [tc.int4_codes(w, tc.int4_group(w.shape[1])) for w in (torch.cat(gpu[:2]), gpu[2])]
        deq = []
        for (q, s, z), w in zip(codes, (torch.cat(gpu[:2]), gpu[2])):
            cols = torch.arange(w.shape[1]) // tc.int4_group(w.shape[1])
            deq.append((q.float() - 8) * s[:, cols] + z[:, cols])
    elif fmt == "int8":
        deq = [m.packed.float() * m.meta.float()[:, None] for m in (cpu.w13, cpu.w2)]
    else:
        deq = [torch.cat(gpu[:2]), gpu[2]]
    x = torch.randn(4, H, generator=gen)
    got = cpu.forward(x)
    want = reference_expert(*deq[0].chunk(2), deq[1], x)
    if fmt == "dense":  # the GPU copy's own values in float32: the same products
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    else:
        assert close_bf16(got, want), (got - want).abs().max()
    on_gpu = reference_expert(*gpu, x)
    extra = ((got - on_gpu).norm() / on_gpu.norm()).item()
    own = ((on_gpu - reference_expert(*src, x)).norm() / on_gpu.norm()).item()
    print(f"{expert_bits}-bit GPU copy (its own error {own:.3f}), {fmt} CPU copy: extra error {extra:.4f}")
    # int4 in groups of 128 inputs adds about what a 4-bit GPU copy itself loses (~0.17 here)
    assert extra <= {"int4": 0.2, "int8": 0.02, "dense": 1e-6}[fmt]


def test_expert_bytes_per_format():
    w = [torch.randn(256, 128), torch.randn(256, 128), torch.randn(128, 256)]
    sizes = {fmt: ce.make_expert(*w, fmt).nbytes() for fmt in ce.COPY_FORMATS}
    params = 3 * 256 * 128
    assert sizes["dense"] == 4 * params  # float32 weights stay float32
    assert sizes["int8"] == params + 2 * (512 + 128)  # + a bfloat16 scale per row
    g13, g2 = tc.int4_group(128), tc.int4_group(256)
    assert sizes["int4"] == params // 2 + 4 * (512 * 128 // g13 + 128 * 256 // g2)


def test_int4_needs_inputs_in_multiples_of_32_and_int8_of_16():
    """int8's limit is torch's: _weight_int8pack_mm kills the process (a segmentation fault)
    for 4 or more rows of inputs not a multiple of 16, so such a copy is refused before it exists."""
    assert not ce.supported("int4", 48, 128) and ce.supported("int8", 48, 128)
    assert not ce.supported("int8", 40, 20) and ce.supported("dense", 40, 20)
    with pytest.raises(ValueError, match="multiple of 32"):
        tc.quantize_int4(torch.randn(8, 48))
    with pytest.raises(ValueError, match="multiple of 16"):
        tc.quantize_int8(torch.randn(8, 40))


def test_cpu_experts_run_on_the_calling_thread_with_their_threads_and_count_bytes():
    gen = torch.Generator().manual_seed(5)
    experts = [ce.make_expert(torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen),
                              torch.randn(32, 64, generator=gen), "int4") for _ in range(2)]
    xs = [torch.randn(1, 32, generator=gen) for _ in range(2)]
    before = torch.get_num_threads()
    try:
        hybrid = ce.CpuExperts({(0, 0): experts[0], (0, 1): experts[1]}, "all", threads=1)
        assert torch.get_num_threads() == 1
        out = hybrid.run(list(zip(experts, xs)))
    finally:
        torch.set_num_threads(before)
    for y, e, x in zip(out, experts, xs):
        assert torch.equal(y, e.forward(x))
    assert hybrid.stats.experts == 2
    assert hybrid.stats.bytes_read == sum(e.nbytes() for e in experts)
    assert hybrid.stats.seconds > 0 and hybrid.stats.gb_per_s > 0


def test_a_decoded_tokens_hqq_experts_run_in_one_kernel_call(monkeypatch):
    """Experts of one layout on the same input (a decoded token's CPU experts of a layer) go
    to hqq_cpu.swiglu_experts together, and give what each gives alone; experts on different
    inputs (a prompt's rows) run one call each."""
    from moeferry.engine.kernels import hqq_cpu

    spec, H, I = quant.EXPERT_SPECS[2], 64, 96
    gen = torch.Generator().manual_seed(11)
    experts = [ce.hqq_expert({m: quant.quantize_matrix(torch.randn(*shape, generator=gen) * 0.05, spec, optimize=False)
                              for m, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I)))}) for _ in range(3)]
    x = torch.randn(1, H, generator=gen)
    calls = []
    real = hqq_cpu.swiglu_experts
    monkeypatch.setattr(hqq_cpu, "swiglu_experts", lambda *a: (calls.append(len(a[1])), real(*a))[1])
    stats = ce.CpuRunStats()
    together = ce.run_jobs([(e, x) for e in experts], stats)
    ce.run_jobs([(e, x.clone()) for e in experts], stats)
    assert calls == [3, 1, 1, 1] and stats.experts == 6
    for y, e in zip(together, experts):
        assert torch.allclose(y, e.forward(x), rtol=1e-4, atol=1e-4 * y.abs().max().item())


def test_cpu_experts_take_their_thread_count_into_the_thread_that_runs_them(monkeypatch):
    """Loaded in one thread, run in another (the API server's queue): the running thread's
    pools get the CPU experts' count, for torch and for numba (each keeps it per thread)."""
    import threading

    gen = torch.Generator().manual_seed(6)
    expert = ce.make_expert(torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen),
                            torch.randn(32, 64, generator=gen), "int4")
    numba_set = []
    monkeypatch.setattr(ce.hqq_cpu, "set_threads", lambda n: numba_set.append((threading.get_ident(), n)))
    before = torch.get_num_threads()
    try:
        hybrid = ce.CpuExperts({(0, 0): expert}, "all", threads=1)
        hybrid.numba = True  # as for the in-place HQQ experts
        seen = []
        real = ce.run_jobs
        monkeypatch.setattr(ce, "run_jobs", lambda jobs, stats: (seen.append(torch.get_num_threads()),
                                                                 real(jobs, stats))[1])
        other = threading.Thread(target=hybrid.run, args=([(expert, torch.randn(1, 32, generator=gen))],))
        other.start()
        other.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
    assert [n for _, n in numba_set] == [1] and numba_set[0][0] == other.ident


def test_the_cpu_rate_is_timed_on_experts_read_in_turn_from_ram(monkeypatch):
    """generate.cpu_seconds times different experts in turn (one expert again and again would
    be served from the L3 cache), up to COLD_BYTES of them, and takes the median."""
    from moeferry.engine.runtime import generate

    class Copy:
        def __init__(self, i):
            self.i = i

        def nbytes(self):
            return 100

    ran = []

    class Hybrid:
        def run(self, jobs):
            ran.extend(c.i for c, _ in jobs)

    monkeypatch.setattr(generate, "COLD_BYTES", 1000)
    x = torch.zeros(1, 4)
    generate.cpu_seconds(Hybrid(), [Copy(i) for i in range(30)], x)
    assert ran == list(range(10))  # 10 different experts (1000 bytes)
    ran.clear()
    generate.cpu_seconds(Hybrid(), [Copy(i) for i in range(3)], x)
    assert ran == [0, 1, 2, 0, 1, 2]  # few experts: each timed twice
    calls = []
    Hybrid.run = lambda self, jobs: calls.append([c.i for c, _ in jobs])
    generate.cpu_seconds(Hybrid(), [Copy(i) for i in range(30)], x, together=4)
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7]]  # small experts as a layer runs them: a few to a call


def test_the_engines_cpu_threads_change_between_messages_and_go_back_to_its_own(tiny_checkpoint, tmp_path):
    """Engine.set_cpu_threads (the app's "Processor threads"): torch's and numba's counts on the
    calling thread and the CPU experts' own; 0 restores what load_engine chose. Replies stay
    the same."""
    import numba

    from moeferry.engine.errors import UserError
    from moeferry.engine.runtime.generate import SamplingSettings, load_engine
    from moeferry.engine.storage.convert import convert_checkpoint

    convert_checkpoint(tiny_checkpoint[0], tmp_path / "st", 4, 16, "cpu")
    before = torch.get_num_threads()
    try:
        engine = load_engine(tmp_path / "st", device="cpu", cpu_experts="all", cpu_threads=2)
        assert engine.model.hybrid is not None and engine.model.hybrid.every_expert
        greedy = SamplingSettings(temperature=0.0, max_new_tokens=6)
        want = [p.token_id for p in engine.stream("MoE", greedy)]
        engine.set_cpu_threads(1)
        assert (torch.get_num_threads(), numba.get_num_threads(), engine.model.hybrid.threads) == (1, 1, 1)
        assert [p.token_id for p in engine.stream("MoE", greedy)] == want
        assert torch.get_num_threads() == 1, "its run kept the count"
        engine.set_cpu_threads(0)
        assert torch.get_num_threads() == 2 and engine.model.hybrid.threads == 2
        assert numba.get_num_threads() == min(2, numba.config.NUMBA_NUM_THREADS)
        with pytest.raises(UserError, match="Processor threads"):
            engine.set_cpu_threads(-1)
        engine.close()
    finally:
        torch.set_num_threads(before)


def test_automatic_threads_follow_the_governor_and_a_count_given_turns_it_off():
    """CpuExperts without a thread count run numba's kernels under a ThreadGovernor: token_done
    feeds it each decoded token's time, and its count reaches numba's and torch's pools."""
    import numba

    spec, H, I = quant.EXPERT_SPECS[2], 64, 96
    gen = torch.Generator().manual_seed(12)
    expert = ce.hqq_expert({m: quant.quantize_matrix(torch.randn(*shape, generator=gen) * 0.05, spec, optimize=False)
                            for m, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I)))})
    before = torch.get_num_threads()
    try:
        hybrid = ce.CpuExperts({(0, 0): expert}, "all", every_expert=True)
        most = numba.config.NUMBA_NUM_THREADS
        if most == 1:
            assert hybrid.governor is None
            return
        assert hybrid.governor is not None and hybrid.threads == most
        for _ in range(12):  # every token 0.1 s at the most, 0.01 s at one fewer: the first try wins
            hybrid.token_done(0.1 if hybrid.threads == most else 0.01)
        assert hybrid.threads == most - 1
        hybrid.run([(expert, torch.randn(1, H, generator=gen))])
        assert numba.get_num_threads() == most - 1 and torch.get_num_threads() <= most - 1
        hybrid.set_threads(1)
        assert hybrid.governor is None and hybrid.threads == 1
        hybrid.token_done(5.0)
        assert hybrid.threads == 1
        hybrid.set_threads(None)
        assert hybrid.governor is not None and hybrid.threads == most
        on_a_gpu = ce.CpuExperts({(0, 0): expert}, "all")  # the hybrid: the pools' own counts
        assert on_a_gpu.governor is None and on_a_gpu.threads is None
    finally:
        torch.set_num_threads(before)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
