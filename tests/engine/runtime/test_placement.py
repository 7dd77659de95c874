"""The hybrid's cost model on stated costs (Mixtral-8x7B sizes, the GPU machine's speeds)."""

import pytest

from moeferry.engine.runtime import placement as pl

# One Mixtral expert: 2-bit GPU copy 66.7 MB, int4 g128 CPU copy 88 MB, 176M weights
MIXTRAL = pl.ExpertSizes(gpu_bytes=66_700_000, cpu_bytes=88_000_000, params=176_160_768)
H200_BOX = pl.Costs(link_gbps=55.0, cpu_gbps=70.0, gpu_expert_s=40e-6, cpu_overhead_s=20e-6)
DESKTOP = pl.Costs(link_gbps=25.0, cpu_gbps=45.0, gpu_expert_s=40e-6, cpu_overhead_s=20e-6)


def test_one_miss_goes_to_the_faster_channel():
    # one miss, one hit, 8 CPU threads (45 GB/s): copy 66.7/55 = 1.21 ms + 2 GPU experts (1.29)
    # vs CPU 88/45 = 1.96 ms: copy; at 16 threads (70 GB/s) the CPU's 1.28 ms just wins
    eight = pl.Costs(link_gbps=55.0, cpu_gbps=45.0, gpu_expert_s=40e-6, cpu_overhead_s=20e-6)
    plan = pl.choose_misses(eight, MIXTRAL, [3], hits=1, can_cpu={3}, tokens={3: 1})
    assert plan.copy == (3,) and plan.cpu == ()
    assert plan.seconds == pytest.approx(66.7e6 / 55e9 + 2 * 40e-6)
    plan = pl.choose_misses(H200_BOX, MIXTRAL, [3], hits=1, can_cpu={3}, tokens={3: 1})
    assert plan.cpu == (3,) and plan.seconds == pytest.approx(20e-6 + 88e6 / 70e9)
    # on a PCIe 4 desktop the link is slower than RAM: the CPU computes it
    plan = pl.choose_misses(DESKTOP, MIXTRAL, [3], hits=1, can_cpu={3}, tokens={3: 1})
    assert plan.cpu == (3,) and plan.copy == ()
    assert plan.seconds == pytest.approx(20e-6 + 88e6 / 45e9)


def test_two_misses_use_both_channels_at_once():
    plan = pl.choose_misses(H200_BOX, MIXTRAL, [1, 6], hits=0, can_cpu={1, 6}, tokens={1: 1, 6: 1})
    assert len(plan.cpu) == 1 and len(plan.copy) == 1
    serial = 2 * 66.7e6 / 55e9 + 2 * 40e-6
    assert plan.seconds < 0.6 * serial  # about half of copying both


def test_misses_without_a_cpu_copy_are_copied():
    plan = pl.choose_misses(DESKTOP, MIXTRAL, [1, 6], hits=0, can_cpu={6}, tokens={1: 1, 6: 1})
    assert plan.copy == (1,) and plan.cpu == (6,)


def test_long_prompts_copy_short_ones_compute():
    costs = pl.Costs(link_gbps=25.0, cpu_gbps=45.0, gpu_expert_s=40e-6, cpu_gflops=1000.0)
    short = pl.choose_misses(costs, MIXTRAL, [2], hits=0, can_cpu={2}, tokens={2: 4})
    long = pl.choose_misses(costs, MIXTRAL, [2], hits=0, can_cpu={2}, tokens={2: 128})
    assert short.cpu == (2,)  # 4 tokens: still reading-bound, 1.96 ms < 2.67 ms copy
    assert long.copy == (2,)  # 128 tokens: 2 * 176M * 128 flops at 1 TFLOP/s = 45 ms
    assert pl.cpu_s(costs, MIXTRAL, 128) == pytest.approx(2 * MIXTRAL.params * 128 / 1000e9)


def test_the_idle_link_also_copies_a_cpu_expert_for_later():
    """A slow GPU (the copies then compute wait on it) leaves the link idle while the CPU
    works: the CPU computes the misses and the link brings one of them for next time."""
    slow_gpu = pl.Costs(link_gbps=55.0, cpu_gbps=70.0, gpu_expert_s=2e-3, cpu_overhead_s=20e-6)
    plan = pl.choose_misses(slow_gpu, MIXTRAL, [4], hits=1, can_cpu={4}, tokens={4: 1})
    assert plan.cpu == (4,) and plan.both == (4,)
    plan = pl.choose_misses(DESKTOP, MIXTRAL, [4], hits=1, can_cpu={4}, tokens={4: 1})
    assert plan.cpu == (4,) and plan.both == ()  # the copy would outlast the layer


def test_ties_go_to_copying():
    even = pl.Costs(link_gbps=1.0, cpu_gbps=1.0, gpu_expert_s=0.0, cpu_overhead_s=0.0)
    same = pl.ExpertSizes(1000, 1000, 1)
    assert pl.choose_misses(even, same, [0], 0, {0}, {0: 1}).copy == (0,)


def test_ram_budget_picks_what_fits_spread_over_layers():
    assert len(pl.cpu_copies(32, 8, 88_000_000, None, slots=5)) == 256
    picks = pl.cpu_copies(32, 8, 88_000_000, 16 * (1 << 30), slots=5)  # a 32 GB desktop's half
    assert len(picks) == 16 * (1 << 30) // 88_000_000 == 195
    assert len(set(picks)) == len(picks)
    per_layer = [sum(1 for layer, _ in picks if layer == i) for i in range(32)]
    assert max(per_layer) - min(per_layer) <= 1


def test_ram_budget_copies_the_likely_misses_first():
    counts = [[50, 40, 30, 20, 10, 5, 1, 0]]  # layer 0's use per expert, from a trace
    picks = pl.cpu_copies(1, 8, 100, 300, slots=2, counts=counts)
    # experts 0 and 1 are usually cached; 2, 3, 4 are the most frequent misses
    assert picks == [(0, 2), (0, 3), (0, 4)]


def test_the_split_is_the_best_of_every_subset_and_scales_to_a_whole_layer_of_misses():
    """choose_misses tries only the prefixes of the misses ordered by tokens served: the best
    split of every subset, found by brute force on stated costs, and a prompt that misses all
    128 experts of a Qwen3 layer is decided in a few milliseconds (every subset: never)."""
    import itertools
    import random
    import time

    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 7)
        misses = rng.sample(range(16), n)
        able = {e for e in misses if rng.random() < 0.8}
        tokens = {e: rng.choice([1, 1, 2, 5, 40, 128]) for e in misses}
        costs = pl.Costs(link_gbps=rng.uniform(5, 60), cpu_gbps=rng.uniform(5, 60), gpu_expert_s=rng.uniform(0, 1e-4),
                         cpu_gflops=rng.uniform(50, 1000), cpu_overhead_s=rng.uniform(0, 3e-4))
        hits = rng.randint(0, 2)
        plan = pl.choose_misses(costs, MIXTRAL, misses, hits, able, tokens)
        best = min(pl.layer_s(costs, MIXTRAL, hits, [e for e in misses if e not in sub], list(sub), tokens)
                   for k in range(len(able) + 1) for sub in itertools.combinations(sorted(able), k))
        assert plan.seconds == pytest.approx(best, rel=1e-6)
        assert set(plan.cpu) <= able and set(plan.cpu) | set(plan.copy) == set(misses)
    qwen = pl.ExpertSizes(gpu_bytes=3_300_000, cpu_bytes=3_300_000, params=3 * 2048 * 768)
    t0 = time.perf_counter()
    plan = pl.choose_misses(H200_BOX, qwen, list(range(128)), 0, set(range(128)), {e: 1 + e % 9 for e in range(128)})
    assert time.perf_counter() - t0 < 0.5 and len(plan.cpu) + len(plan.copy) == 128
    # the CPU's share is the experts that serve the fewest tokens
    assert all(1 + e % 9 <= min(1 + c % 9 for c in plan.copy) for e in plan.cpu)


def test_predicted_hybrid_layer_beats_copy_only():
    gpu_only, hybrid = pl.predicted_miss_s(DESKTOP, MIXTRAL, misses_per_layer=2, hits_per_layer=0)
    assert gpu_only == pytest.approx(2 * 66.7e6 / 25e9 + 2 * 40e-6)
    assert hybrid < 0.75 * gpu_only


def test_plan_predicts_the_hybrid_from_the_probe():
    """A quantized store's experts run in place on the CPU at the HQQ kernel's share of RAM speed
    (plan.HQQ_CPU_OF_RAM), of which a decode gets plan.CPU_IN_DECODE_OF_ALONE, each layer with a
    CPU expert paying placement.CUDA_HAND_OFF_S on the host: so beside a 25 GB/s link the CPU helps
    only with fast RAM, and then little (as measured on the desktop stand-in, docs/BENCHMARKS.md);
    a 16-bit store's run from int4 copies, which the note prices in RAM."""
    from moeferry.engine.setup import plan

    m = plan.ModelSizes.from_config(plan.MIXTRAL_8X7B_CONFIG, 2, 4)
    desktop = {"gpu_name": "RTX 3060", "h2d_bytes_per_s": 25e9, "gpu_mem_bandwidth_bytes_per_s": 360e9,
               "ram_total_bytes": 64 << 30}
    slow_ram, fast_ram = dict(desktop, cpu_matvec_params_per_s=1e9), dict(desktop, cpu_matvec_params_per_s=12e9)
    faster_ram = dict(desktop, cpu_matvec_params_per_s=25e9)
    p_slow, p_fast, p_faster = (plan.make_plan(hw, m, 12 << 30) for hw in (slow_ram, fast_ram, faster_ram))
    assert p_slow.predicted_tokens_per_s == pytest.approx(p_fast.predicted_tokens_per_s)  # GPU-only
    # 4 and 48 GB/s of RAM: the CPU never wins a miss; 100 GB/s: some (layers with two misses,
    # a quarter of them with 4 of 8 cached); 200 GB/s (a workstation): more
    assert p_slow.predicted_hybrid_tokens_per_s == pytest.approx(p_slow.predicted_tokens_per_s)
    assert p_fast.predicted_hybrid_tokens_per_s == pytest.approx(p_fast.predicted_tokens_per_s)
    assert p_faster.predicted_tokens_per_s < p_faster.predicted_hybrid_tokens_per_s < 1.2 * p_faster.predicted_tokens_per_s
    p_workstation = plan.make_plan(dict(desktop, cpu_matvec_params_per_s=50e9), m, 12 << 30)
    assert p_workstation.predicted_hybrid_tokens_per_s > 1.25 * p_workstation.predicted_tokens_per_s
    assert "--cpu-experts auto, from the experts already in RAM" in p_faster.notes[-1]
    m16 = plan.ModelSizes.from_config(plan.MIXTRAL_8X7B_CONFIG, 16, 16)
    p16 = plan.make_plan(dict(faster_ram, ram_total_bytes=256 << 30), m16, 24 << 30)
    assert p16.predicted_hybrid_tokens_per_s is not None and "int4 copies taking" in p16.notes[-1]
    everything = plan.make_plan(dict(fast_ram, gpu_name="H200"), m, 80 << 30)
    assert everything.cache_experts_per_layer == 8 and everything.predicted_hybrid_tokens_per_s is None


def test_each_decode_expert_goes_where_it_finishes_first():
    """choose_by_finish on stated costs: copy 1.0 ms, CPU 1.5 ms per expert, 0.1 ms hand-off."""
    from moeferry.engine.runtime.placement import Costs, ExpertSizes, choose_by_finish
    c = Costs(link_gbps=1.0, cpu_gbps=1.0, gpu_expert_s=0.0, cpu_overhead_s=1e-4)
    s = ExpertSizes(gpu_bytes=1_000_000, cpu_bytes=1_500_000, params=1)
    # one miss, link idle: the copy (1.0 ms) beats the CPU (1.6 ms)
    assert choose_by_finish(c, s, 0.0, 0.0, [(3, None)], {3}) == set()
    # one miss behind 2 ms of queued copies: the CPU's 1.6 ms wins
    assert choose_by_finish(c, s, 0.0, 2e-3, [(3, None)], {3}) == {3}
    # two misses, link idle: the second copy lands at 2.0 ms, so it goes to the CPU (1.6 ms)
    assert choose_by_finish(c, s, 0.0, 0.0, [(3, None), (5, None)], {3, 5}) == {5}
    # a resident expert whose prefetch lands at 3 ms is computed on the CPU; a landed one is not
    assert choose_by_finish(c, s, 0.0, 3e-3, [(1, 3e-3), (2, 0.0)], {1, 2}) == {1}
    # without a CPU copy nothing moves to the CPU
    assert choose_by_finish(c, s, 0.0, 3e-3, [(1, 3e-3)], set()) == set()
