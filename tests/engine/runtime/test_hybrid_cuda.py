"""The CPU+GPU hybrid on CUDA (run on the GPU machine; skipped without a GPU).

CPU and GPU experts in one layer, the CPU's work overlapping the GPU's, no lost updates, and
the CUDA-graph decode equal to the eager one with the hybrid on.
"""


import pytest
import torch

from moeferry.engine.runtime.generate import SamplingSettings, load_engine
from moeferry.engine.runtime.placement import Costs
from moeferry.engine.storage.convert import convert_checkpoint
from tests.conftest import make_checkpoint, reference_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = [1, 10, 20, 30, 40, 50, 60, 7]
GREEDY = SamplingSettings(temperature=0, max_new_tokens=24)
SPLIT = Costs(link_gbps=1.0, cpu_gbps=1.0, gpu_expert_s=0.0, cpu_overhead_s=0.0)  # misses split
SLOW_LINK = Costs(link_gbps=1e-6, cpu_gbps=1.0, gpu_expert_s=0.0)  # every miss on the CPU


def greedy(engine) -> list[int]:
    engine.eos_ids = set()
    engine.cached_ids = []
    return list(engine.generate_ids(PROMPT, GREEDY))


@pytest.mark.parametrize("mode,costs", [("all", None), ("auto", SPLIT)])
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_hybrid_tokens_equal_transformers(tmp_path, mode, costs, graphs):
    model = make_checkpoint(tmp_path / "ck", seed=7, num_local_experts=8, num_hidden_layers=3)
    want = reference_greedy(model, PROMPT, 24)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cuda")
    for k, depth in ((1, 0), (2, 1), (3, 2)):
        engine = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=k,
                             prefetch=depth, cpu_experts=mode, cpu_format="dense", cuda_graphs=graphs)
        if costs is not None:
            engine.model.hybrid.costs = costs
        assert greedy(engine) == want, f"K={k} D={depth}"
        s = engine.last_stats
        assert s.misses_cpu > 0 and s.misses_cpu + s.misses_copied == s.cache_misses


def test_cuda_graph_decode_equals_eager_with_the_hybrid(tmp_path):
    """2-bit experts on the grouped kernels, int4 CPU copies: the graphed decode (the GPU part
    of a layer through the per-count subset graphs) equals the eager decode."""
    make_checkpoint(tmp_path / "ck", seed=5, num_key_value_heads=4, hidden_size=128, intermediate_size=256,
                    num_local_experts=6, num_hidden_layers=3)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 2, 4, "cuda")
    runs = {}
    for graphs in (False, True):
        engine = load_engine(tmp_path / "st", device="cuda", dtype="bfloat16", cache_experts=3, prefetch=0,
                             kernels="fused", cuda_graphs=graphs, cpu_experts="auto", cpu_format="int4")
        engine.model.hybrid.costs = SLOW_LINK  # nothing is copied: experts 0-2 stay cached, 3-5 on the CPU
        cache = engine.model.cache
        for i in range(cache.L):
            for e in range(3):
                cache.acquire(i, e)
                cache.release(i)
        engine.model.setup_kv(64)
        logits = [engine.model.forward(torch.tensor(PROMPT, device="cuda"), 0)]
        engine.model.trace = []
        for n, tok in enumerate([5, 9, 13, 2, 77, 31]):
            logits.append(engine.model.forward(torch.tensor([tok], device="cuda"), len(PROMPT) + n))
        runs[graphs] = torch.cat(logits).float().cpu()
        if graphs:
            assert engine.model.graphs is not None and engine.model.graphs.grouped
        mixed = sum(1 for step in engine.model.trace for ids, resident in step
                    if any(e in resident for e in ids) and any(e not in resident for e in ids))
        assert mixed > 0 and engine.model.cache.stats.misses_cpu > 0  # GPU and CPU experts in a layer
    rel = ((runs[True] - runs[False]).norm() / runs[False].norm()).item()
    assert rel < 1e-2, rel


def test_cuda_cpu_and_gpu_experts_in_one_layer_lose_no_update(tmp_path):
    """Every layer with one cached and one missed expert: the layer's output is the sum of
    both, the CPU's added after the grouped launch wrote `out` (not overwritten by it)."""
    make_checkpoint(tmp_path / "ck", seed=2, num_local_experts=4, num_hidden_layers=2, hidden_size=128,
                    intermediate_size=256)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cuda")
    ref = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=4, cuda_graphs=False)
    hyb = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=1, prefetch=0,
                      cpu_experts="all", cpu_format="dense", cuda_graphs=True)
    for engine in (ref, hyb):
        engine.model.setup_kv(64)
    want = [ref.model.forward(torch.tensor([t], device="cuda"), n) for n, t in enumerate(PROMPT)]
    hyb.model.trace = []
    got = [hyb.model.forward(torch.tensor([t], device="cuda"), n) for n, t in enumerate(PROMPT)]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    mixed = sum(1 for step in hyb.model.trace for ids, resident in step
                if any(e in resident for e in ids) and any(e not in resident for e in ids))
    assert mixed > 0  # some layers really had a GPU and a CPU expert at once


def test_cuda_cpu_experts_overlap_the_gpu(tmp_path, monkeypatch):
    """The host computes a layer's CPU expert while the device still runs that layer's GPU
    expert (queued before, never waited for): each GPU expert is made to take 3 ms, so a CPU
    job that starts while the stream is still busy overlapped it. Tokens stay transformers'."""
    model = make_checkpoint(tmp_path / "ck", seed=3, num_local_experts=4, num_hidden_layers=2, hidden_size=1024,
                            intermediate_size=4096)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cuda")
    engine = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=2, prefetch=0,
                         cpu_experts="all", cpu_format="dense", cuda_graphs=False)
    from moeferry.engine.runtime import cpu_experts as ce
    from moeferry.engine.runtime.expert_cache import sleep_cycles_per_s

    cycles = int(3e-3 * sleep_cycles_per_s(engine.device))
    busy, real_run, real_acquire = [], ce.run_jobs, engine.model.cache.acquire

    def run_jobs(work, stats):
        busy.append(not torch.cuda.current_stream().query())
        return real_run(work, stats)

    def slow_acquire(*a, **kw):
        out = real_acquire(*a, **kw)
        torch.cuda._sleep(cycles)  # the GPU expert that follows waits behind this
        return out

    monkeypatch.setattr(ce, "run_jobs", run_jobs)
    monkeypatch.setattr(engine.model.cache, "acquire", slow_acquire)
    assert greedy(engine) == reference_greedy(model, PROMPT, 24)
    # a layer whose experts all miss has no GPU expert to overlap
    assert busy and sum(busy) >= len(busy) // 2, busy


def test_cuda_a_new_cache_keeps_the_pinned_experts_and_the_link_clock(tmp_path):
    """Engine.set_cache_experts builds a new cache: it reuses the pinned host copy (the hybrid's
    in-place CPU experts read it: a second pin would double the RAM) and the hybrid keeps the
    new cache's link queue on the host clock."""
    make_checkpoint(tmp_path / "ck", seed=7, num_local_experts=6, num_hidden_layers=2, hidden_size=128,
                    intermediate_size=256)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 2, 4, "cuda")
    engine = load_engine(tmp_path / "st", device="cuda", dtype="bfloat16", cache_experts=2, prefetch=0,
                         cpu_experts="auto")
    pinned = engine.model.cache.host
    assert pinned.is_pinned()
    greedy(engine)
    engine.set_cache_experts(3)
    assert engine.model.cache.host.data_ptr() == pinned.data_ptr()
    greedy(engine)
    assert engine.model.cache.link_s_per_byte is not None and engine.model.cache.link_free_at > 0
