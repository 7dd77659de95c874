"""The CPU+GPU hybrid on the CPU: misses computed from CPU copies give the model's tokens.

Here the "device" is the CPU too, so the split between the expert cache and the CPU copies is
exercised exactly as on a GPU machine (same dispatch, the CPU experts on the host thread once
the layer's device work is queued), and the greedy
tokens are compared with transformers' and with the cache-only run.
"""

import time

import pytest
import torch

from moeferry.engine.runtime.generate import SamplingSettings, load_engine
from moeferry.engine.runtime.placement import Costs
from moeferry.engine.storage.convert import convert_checkpoint
from moeferry.engine.storage.store import load_dequantized_hf_model
from tests.conftest import make_checkpoint, reference_greedy

PROMPT = [1, 10, 20, 30, 40, 50, 60, 7]
GREEDY = SamplingSettings(temperature=0, max_new_tokens=16)


def greedy(engine) -> list[int]:
    engine.eos_ids = set()
    engine.cached_ids = []
    return list(engine.generate_ids(PROMPT, GREEDY))


@pytest.fixture(scope="module")
def store16(tmp_path_factory):
    """A random 8-expert top-2 model in 16 bits, and transformers' greedy tokens for it."""
    d = tmp_path_factory.mktemp("hybrid")
    model = make_checkpoint(d / "ck", seed=11, num_local_experts=8, num_hidden_layers=3,
                            hidden_size=64, intermediate_size=128)
    convert_checkpoint(d / "ck", d / "st", 16, 16, "cpu")
    return d / "st", reference_greedy(model, PROMPT, 16)


# auto under stated costs: a link as fast as the CPU (two misses split), a slow link (every
# miss on the CPU), a slow GPU (the CPU computes the misses and the idle link copies them too)
SPLIT = Costs(link_gbps=1.0, cpu_gbps=1.0, gpu_expert_s=0.0, cpu_overhead_s=0.0)
SLOW_LINK = Costs(link_gbps=1e-3, cpu_gbps=1.0, gpu_expert_s=0.0)
IDLE_LINK = Costs(link_gbps=1.0, cpu_gbps=1.0, gpu_expert_s=1e-3, cpu_overhead_s=0.0)


@pytest.mark.parametrize("mode,costs", [("all", None), ("auto", SPLIT), ("auto", SLOW_LINK),
                                        ("auto", IDLE_LINK), ("auto", None)])
@pytest.mark.parametrize("k,depth", [(1, 0), (2, 1), (3, 2)])
def test_hybrid_tokens_equal_transformers_and_cache_only(store16, mode, costs, k, depth):
    path, want = store16
    only = load_engine(path, device="cpu", dtype="float32", cache_experts=k, prefetch=depth)
    assert greedy(only) == want
    hyb = load_engine(path, device="cpu", dtype="float32", cache_experts=k, prefetch=depth,
                      cpu_experts=mode, cpu_format="dense")
    if costs is not None:
        hyb.model.hybrid.costs = costs
    assert greedy(hyb) == want
    s = hyb.last_stats
    # every copy is a copied miss, a prefetch or a CPU miss copied for later: the bytes say so
    assert s.bytes_h2d == (s.misses_copied + s.prefetch_issued + s.misses_both) * hyb.store.expert_bytes
    assert s.cpu_expert_runs == s.misses_cpu
    assert 0 <= s.cpu_wait_s <= s.prefill_s + s.decode_s and (s.cpu_s > 0) == (s.misses_cpu > 0)
    if mode == "all" or costs is SLOW_LINK:  # every miss has a CPU copy: none waits for a copy
        assert s.misses_cpu > 0 and s.misses_copied == 0 and s.cpu_gb_per_s > 0
        # all: each is also copied for later (not on the critical path); a slow link: never
        assert s.misses_both == (s.misses_cpu if mode == "all" else 0)
        assert s.bytes_h2d <= (s.prefetch_issued + s.misses_both) * hyb.store.expert_bytes
    if costs is SPLIT:
        assert s.misses_cpu > 0 and s.misses_copied > 0
    if costs is IDLE_LINK:
        assert s.misses_both > 0 and s.misses_copied == 0


def test_cpu_experts_run_after_the_layers_device_work_is_queued(store16, monkeypatch):
    """The host computes a layer's CPU experts only once it has queued the layer's copies and
    device experts (the eager path runs each as it is acquired) and the next layer's prefetch:
    the device and the link work meanwhile."""
    from moeferry.engine.runtime import cpu_experts as ce

    path, want = store16
    engine = load_engine(path, device="cpu", dtype="float32", cache_experts=2, prefetch=1, cpu_experts="auto",
                         cpu_format="dense")
    hybrid, cache = engine.model.hybrid, engine.model.cache
    hybrid.costs = SPLIT
    events = []
    real_run, real_start, real_acquire, real_prefetch = ce.run_jobs, hybrid.start, cache.acquire, cache.prefetch

    def run_jobs(jobs, stats):
        events.append(("cpu", None))
        return real_run(jobs, stats)

    def start(layer, *args):
        events.append(("start", layer))
        return real_start(layer, *args)

    def acquire(layer, expert, keep=()):
        events.append(("acquire", layer))
        return real_acquire(layer, expert, keep)

    def prefetch(layer, experts):
        events.append(("prefetch", layer - 1))  # issued by the layer before
        return real_prefetch(layer, experts)

    monkeypatch.setattr(ce, "run_jobs", run_jobs)
    monkeypatch.setattr(hybrid, "start", start)
    monkeypatch.setattr(cache, "acquire", acquire)
    monkeypatch.setattr(cache, "prefetch", prefetch)
    assert greedy(engine) == want
    last = engine.store.config.num_layers - 1
    starts = [i for i, (what, _) in enumerate(events) if what == "start"]
    mixed = 0
    for i in starts:
        layer = events[i][1]
        cpu = next(j for j in range(i, len(events)) if events[j][0] == "cpu")
        between = events[i + 1:cpu]
        assert all(lay == layer for _, lay in between)  # nothing of another layer in between
        assert ("prefetch", layer) in between or layer == last  # the next layer's copies are queued
        after = events[cpu + 1:cpu + 2]
        assert not after or after[0][1] != layer  # nothing of this layer after its CPU job
        mixed += ("acquire", layer) in between
    assert starts and mixed > 0  # some layers had device and CPU experts


@pytest.mark.parametrize("copied", [True, False])
def test_the_cpu_computes_once_the_rest_of_the_layer_is_queued(copied):
    """dispatch with grouped device experts (one launch for the layer, add_all): the host
    queues the copies, the device's experts (which wait for their copies on the device), the
    release of the layer's slots and the prefetches, and only then computes the CPU's experts,
    whose sum it adds last (the grouped launch writes out)."""
    from types import SimpleNamespace

    from moeferry.engine.runtime.model import OffloadedMixtral

    events = []

    class Cache:
        stats = SimpleNamespace(bytes_h2d=0)

        def acquire(self, layer, e, keep=()):
            if copied and e == 2:
                self.stats.bytes_h2d += 1
                events.append("copy")
            return None, 0

        def sync_table(self, layer):
            events.append("table")

        def release(self, layer):
            events.append("release")

    class Hybrid:
        def choose(self, layer, needed, ids_host, cache):
            return {3: [(0, 2)]}, []

        def start(self, layer, rows, *io):
            events.append("h down")
            return SimpleNamespace(compute=lambda: events.append("cpu compute"), add=lambda: events.append("cpu add"))

    model = SimpleNamespace(cache=Cache(), hybrid=Hybrid(), timeline=None,
                            prefetcher=SimpleNamespace(issue=lambda cache, i, g: events.append("prefetch")))
    OffloadedMixtral.dispatch(model, 0, torch.tensor([[1, 2, 3]]), 1, None,
                              add_all=lambda at: events.append(f"device experts {at}"), io=(None, None, None))
    assert events == ["h down", *(["copy"] if copied else []), "table", "device experts [0, 1]", "release",
                      "prefetch", "cpu compute", "cpu add"]


def test_every_expert_on_the_cpu_without_a_cache(store16):
    """A machine without a GPU: no cache_experts -> the CPU kernels run every routed expert."""
    path, want = store16
    engine = load_engine(path, device="cpu", dtype="float32", cpu_experts="all", cpu_format="dense")
    assert engine.model.hybrid.every_expert
    assert greedy(engine) == want
    s = engine.last_stats
    assert s.cache_hits == 0 and s.cache_misses == 0 and s.bytes_h2d == 0
    assert s.cpu_expert_runs >= 15 * 3 * 2  # every decoded token's experts (and the prompt's)


def test_ram_budget_limits_the_cpu_copies_and_the_rest_is_copied(store16):
    path, want = store16
    engine = load_engine(path, device="cpu", dtype="float32", cache_experts=2, prefetch=0,
                         cpu_experts="all", cpu_format="dense")
    per_copy = next(iter(engine.model.hybrid.copies.values())).nbytes()
    engine = load_engine(path, device="cpu", dtype="float32", cache_experts=2, prefetch=0,
                         cpu_experts="all", cpu_format="dense", ram_budget=10 * per_copy + per_copy // 2)
    hybrid = engine.model.hybrid
    assert len(hybrid.copies) == 10 and hybrid.nbytes() <= 10.5 * per_copy
    assert {layer for layer, _ in hybrid.copies} == {0, 1, 2}  # spread over the layers
    assert greedy(engine) == want
    s = engine.last_stats
    assert s.misses_cpu > 0 and s.misses_copied > 0  # experts without a copy still go over


@pytest.mark.parametrize("fmt,tol", [("int8", 0.03), ("int4", 0.25)])
def test_quantized_cpu_copies_stay_close_to_the_gpu_copies(tmp_path, fmt, tol):
    """2-bit store: dense CPU copies give the dequantized model's tokens; int8/int4 copies
    (bf16 activations) give logits within their quantization error of the cache-only run."""
    make_checkpoint(tmp_path / "ck", seed=4, num_local_experts=4, hidden_size=64, intermediate_size=128)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 2, 4, "cpu")
    ref = load_dequantized_hf_model(tmp_path / "st")
    dense = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="all", cpu_format="dense")
    assert greedy(dense) == reference_greedy(ref, PROMPT, 16)
    ids = torch.tensor(PROMPT)
    logits = {}
    for name, kw in (("cache", {"cache_experts": 4}), (fmt, {"cpu_experts": "all", "cpu_format": fmt})):
        engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", **kw)
        engine.model.setup_kv(64)
        logits[name] = engine.model.forward(ids, 0, last_only=False)
    rel = ((logits[fmt] - logits["cache"]).norm() / logits["cache"].norm()).item()
    print(f"{fmt} CPU copies of a 2-bit store: logits differ by {rel:.4f} (relative)")
    assert 0 < rel < tol


def test_cpu_work_is_queued_before_the_gpu_experts_and_awaited_after(store16, monkeypatch):
    """The overlap's order in dispatch when nothing is copied: the CPU job starts (h down),
    the device's experts are queued, the host computes the CPU's and adds their result."""
    path, _ = store16
    engine = load_engine(path, device="cpu", dtype="float32", cache_experts=1, prefetch=0,
                         cpu_experts="all", cpu_format="dense")
    model, events = engine.model, []
    start, expert = model.hybrid.start, model.expert

    def spy_start(*a, **kw):
        events.append("cpu start")
        job = start(*a, **kw)
        compute, add = job.compute, job.add
        job.compute = lambda: (events.append("cpu compute"), compute())
        job.add = lambda: (events.append("cpu add"), add())
        return job

    monkeypatch.setattr(model.hybrid, "start", spy_start)
    monkeypatch.setattr(model, "expert", lambda w, h: (events.append("device expert"), expert(w, h))[1])
    model.setup_kv(16)
    model.trace = []
    model.forward(torch.tensor([5]), 0)
    for i, (ids, _) in enumerate(model.trace[0]):  # cache each layer's first routed expert
        model.cache.acquire(i, ids[0])
        model.cache.release(i)
    events.clear()
    model.forward(torch.tensor([5]), 0)  # the same routing: one hit, one miss per layer
    layers = [events[i:i + 4] for i in range(0, len(events), 4)]
    assert len(layers) == model.cfg.num_layers  # top-2 with one slot: one of each per layer
    assert all(step == ["cpu start", "device expert", "cpu compute", "cpu add"] for step in layers), events


def test_cpu_experts_options_are_checked(store16):
    from moeferry.engine.errors import UserError

    with pytest.raises(UserError, match="--cpu-experts must be"):
        load_engine(store16[0], device="cpu", cpu_experts="sometimes")
    with pytest.raises(UserError, match="--cpu-format must be"):
        load_engine(store16[0], device="cpu", cpu_experts="all", cpu_format="int3")


def test_a_16_bit_store_of_odd_sizes_gets_copies_its_kernel_can_run(tmp_path):
    """Hidden 40 and FFN 20: int4 (multiples of 32) and int8 (of 16: torch's int8 kernel crashes
    the process otherwise) cannot hold these experts, so the default CPU copies are dense and
    the prompt, 10 tokens through every CPU expert at once, gives transformers' tokens; asking
    for int8 gets one sentence naming what can."""
    from moeferry.engine.errors import UserError

    model = make_checkpoint(tmp_path / "ck", seed=5, num_local_experts=5, hidden_size=40, intermediate_size=20,
                            num_attention_heads=4, num_key_value_heads=2)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="all")
    assert {c.w13.fmt for c in engine.model.hybrid.copies.values()} == {"dense"}
    assert greedy(engine) == reference_greedy(model, PROMPT, 16)
    with pytest.raises(UserError, match="--cpu-format int8 needs .* multiples of 16 .*40 and 20.*--cpu-format dense"):
        load_engine(tmp_path / "st", device="cpu", cpu_experts="all", cpu_format="int8")


def test_prefill_gives_the_cpu_the_experts_with_fewest_tokens(store16):
    """For T tokens a CPU expert costs max(read, 2 * params * T / flops) and a copy the same
    for any T: in each prefill layer the CPU takes the experts serving the fewest tokens and the
    link the rest, at once; decode's single tokens go to the CPU. Tokens stay exact."""
    path, want = store16
    engine = load_engine(path, device="cpu", dtype="float32", cache_experts=1, prefetch=0,
                         cpu_experts="auto", cpu_format="dense")
    hybrid, stats = engine.model.hybrid, engine.model.cache.stats
    hybrid.costs = Costs(link_gbps=0.5, cpu_gbps=1.0, gpu_expert_s=0.0, cpu_overhead_s=0.0, cpu_gflops=0.5)
    layers, choose = [], hybrid.choose

    def spy(layer, needed, ids_host, cache):
        misses = [e for e in needed if e not in cache.resident(layer)]
        tokens = {e: sum(e in row for row in ids_host) for e in misses}
        rows, both = choose(layer, needed, ids_host, cache)
        layers.append(([tokens[e] for e in rows], [tokens[e] for e in misses if e not in rows]))
        return rows, both

    hybrid.choose = spy
    prompt = PROMPT * 4  # 32 tokens
    engine.model.setup_kv(64)
    engine.model.forward(torch.tensor(prompt), 0)
    split = [(cpu, copied) for cpu, copied in layers if cpu and copied]
    assert split and all(max(cpu) <= min(copied) for cpu, copied in split), layers
    assert sum(sum(copied) for _, copied in layers) > sum(sum(cpu) for cpu, _ in layers)
    before = stats.misses_cpu
    for n in range(6):
        engine.model.forward(torch.tensor([3 + n]), len(prompt) + n)
    assert stats.misses_cpu > before
    hybrid.choose = choose
    assert greedy(engine) == want and engine.last_stats.first_token_s > 0


def test_generate_cli_cpu_experts_json(tiny_store):
    import json

    from tests.conftest import run_cli

    args = ("generate", str(tiny_store), "--prompt", "hello there", "--device", "cpu", "--max-new-tokens", "6",
            "--json")
    off = run_cli(*args)
    on = run_cli(*args, "--cpu-experts", "all", "--cpu-format", "dense", "--cpu-threads", "1")
    assert off.returncode == 0 and on.returncode == 0, on.stderr
    a, b = json.loads(off.stdout), json.loads(on.stdout)
    assert a["token_ids"] == b["token_ids"]
    assert b["stats"]["cpu_expert_runs"] > 0 and b["stats"]["cache_misses"] == 0
    assert a["stats"]["cpu_expert_runs"] == 0
    bad = run_cli(*args, "--cpu-experts", "all", "--ram-budget", "1KB")
    assert bad.returncode == 2 and "raise --ram-budget" in bad.stderr and "Traceback" not in bad.stderr


def test_default_ram_budget_is_what_is_available(store16, monkeypatch):
    from moeferry.engine.setup import hardware
    from moeferry.engine.setup.plan import HOST_RESERVE_BYTES

    path, want = store16
    full = load_engine(path, device="cpu", dtype="float32", cache_experts=2, cpu_experts="all", cpu_format="dense")
    per_copy = next(iter(full.model.hybrid.copies.values())).nbytes()
    assert len(full.model.hybrid.copies) == 24 and full.note == ""
    available = HOST_RESERVE_BYTES + 5 * per_copy
    monkeypatch.setattr(hardware, "_ram_info", lambda: {"ram_available_bytes": available})
    tight = load_engine(path, device="cpu", dtype="float32", cache_experts=2, cpu_experts="all", cpu_format="dense")
    assert len(tight.model.hybrid.copies) == 5
    assert "CPU copies of 5 of the 24 experts" in tight.note
    assert greedy(tight) == want


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quantized_store_runs_its_own_bytes_on_the_cpu_by_default(tmp_path, bits):
    """A 2-4 bit store: the default CPU format is "hqq" (the stored expert in place, no copy),
    and it gives the dequantized model's greedy tokens, with a cache (hybrid) and without one."""
    from moeferry.engine.runtime.cpu_experts import HqqExpert

    make_checkpoint(tmp_path / "ck", seed=5, num_local_experts=4, hidden_size=64, intermediate_size=128)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", bits, 16, "cpu")
    want = reference_greedy(load_dequantized_hf_model(tmp_path / "st"), PROMPT, 16)
    for kw in ({"cache_experts": 2}, {}):
        engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="all", **kw)
        copies = engine.model.hybrid.copies
        assert len(copies) == engine.model.cfg.num_moe_layers * 4 and all(isinstance(c, HqqExpert) for c in copies.values())
        assert greedy(engine) == want, kw
        assert engine.last_stats.cpu_expert_runs > 0


@pytest.mark.parametrize("attn_bits,form", [(4, "in place"), (8, "int8")])
def test_the_cpu_engine_reads_its_dense_matrices_in_low_bit_forms(tmp_path, attn_bits, form):
    """Every expert on the CPU kernel (no cache): the attention's 2-4 bit matrices run on the
    same kernel from their stored bytes, 8-bit ones (which it does not take) and the head are
    rounded per row to int8 (as llama.cpp's files round theirs), where before all of them were
    float32: a quarter of the bytes or less, in RAM and per token. The logits stay within the
    roundings of the dequantized model's, and the greedy tokens equal it. A cache keeps them
    dequantized."""
    from moeferry.engine.kernels.hqq_cpu import CpuQMatrix
    from moeferry.engine.kernels.torch_cpu import CpuMatrix

    make_checkpoint(tmp_path / "ck", seed=5, num_local_experts=4, hidden_size=64, intermediate_size=128)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 2, attn_bits, "cpu")
    want = reference_greedy(load_dequantized_hf_model(tmp_path / "st"), PROMPT, 16)
    every = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="all")
    cached = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="off")  # all dequantized
    q_proj = every.model.moe_layers[0]["q_proj"]
    assert isinstance(q_proj, CpuQMatrix if form == "in place" else CpuMatrix)
    assert isinstance(every.model.lm_head, CpuMatrix) and every.model.lm_head.fmt == "int8"
    assert isinstance(cached.model.lm_head, torch.Tensor) and cached.model.lm_head.dtype == torch.float32
    assert every.model.dense_bytes < cached.model.dense_bytes
    with torch.inference_mode():
        got, ref = (e.model.forward(torch.tensor(PROMPT), 0) for e in (every, cached))
    assert ((got - ref).norm() / ref.norm()).item() < 0.03
    assert greedy(every) == want and greedy(cached) == want


def test_a_cpu_machine_runs_a_model_too_big_for_its_expert_cache_on_the_cpu_kernel(tmp_path, monkeypatch):
    """No --cpu-experts on a CPU device: a model whose experts fit the CPU cache whole keeps it
    (the demo's fast path, no CPU kernels); one that does not fit (Mixtral on a CPU-only PC; here
    the cache is shrunk to one of the tiny model's four experts per layer) runs every expert on the CPU
    kernel from the stored bytes, as --cpu-experts all does (whose tokens the test above holds
    to the dequantized model's), where before it dequantized most experts again for every token. A cache size is taken as asked."""
    from moeferry.engine.runtime import vram

    make_checkpoint(tmp_path / "ck", seed=6, num_local_experts=4, hidden_size=64, intermediate_size=128)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 2, 16, "cpu")
    want = reference_greedy(load_dequantized_hf_model(tmp_path / "st"), PROMPT, 16)
    small = load_engine(tmp_path / "st", device="cpu", dtype="float32")
    assert small.model.hybrid is None and small.model.cache.K == 4
    assert greedy(small) == want
    cfg = small.model.cfg
    per_slot = cfg.num_moe_layers * 3 * cfg.hidden_size * cfg.intermediate_size * 4  # float32, every layer
    monkeypatch.setattr(vram, "CPU_EXPERT_CACHE_BYTES", 4 * per_slot // 3)
    big = load_engine(tmp_path / "st", device="cpu", dtype="float32")
    assert big.model.hybrid is not None and big.model.hybrid.every_expert
    explicit = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="all")
    assert greedy(big) == greedy(explicit) and big.last_stats.cpu_expert_runs > 0
    asked = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=2)
    assert asked.model.hybrid is None and greedy(asked) == want
    # a 16-bit store has no in-place kernel (its CPU copies would need RAM): the default stays off
    convert_checkpoint(tmp_path / "ck", tmp_path / "st16", 16, 16, "cpu")
    monkeypatch.setattr(vram, "CPU_EXPERT_CACHE_BYTES", 1)
    plain = load_engine(tmp_path / "st16", device="cpu", dtype="float32")
    assert plain.model.hybrid is None and plain.model.cache.K >= 1


def test_the_cpu_expert_cache_is_sized_in_the_float32_it_holds(tmp_path, monkeypatch):
    """The CPU engine keeps its cached experts dequantized to float32, so its cache is sized in
    those bytes: a budget that holds every stored 4-bit expert (OLMoE's 3.4 GB store under the
    4 GiB default) holds fewer dequantized, 7.5x larger (OLMoE's would have grown to 26 GB)."""
    from moeferry.engine.runtime import vram

    make_checkpoint(tmp_path / "ck", seed=6, num_local_experts=4, hidden_size=64, intermediate_size=128)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 16, "cpu")
    probe = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="off")
    cfg, stored = probe.model.cfg, probe.store.expert_bytes
    dequantized = cfg.num_moe_layers * 3 * cfg.hidden_size * cfg.intermediate_size * 4  # one slot per layer
    monkeypatch.setattr(vram, "CPU_EXPERT_CACHE_BYTES", 2 * dequantized)
    assert vram.CPU_EXPERT_CACHE_BYTES >= cfg.num_moe_layers * 4 * stored  # every expert as stored fits
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="off")
    assert engine.model.cache.K == 2
    greedy(engine)
    held = sum(t.numel() * t.element_size() for layer in engine.model.cache.decoded for d in layer if d
               for t in d.values())
    assert 0 < held <= vram.CPU_EXPERT_CACHE_BYTES


def test_the_cpu_rate_of_the_cost_model_is_learned_from_decoded_layers(store16):
    """learned_costs moves the CPU rate LEARN of the way to what a layer's CPU work achieved,
    without touching the costs it was given; a layer placed by choose_in_time (learning set)
    updates the engine's costs when its CPU experts finish, and a slower learned CPU sends
    choose_by_finish's lone miss to the link instead."""
    from moeferry.engine.runtime import cpu_experts as ce
    from moeferry.engine.runtime.placement import ExpertSizes, choose_by_finish

    idle = Costs(link_gbps=10.0, cpu_gbps=40.0, gpu_expert_s=0.0, cpu_overhead_s=0.0)
    busy = ce.learned_costs(idle, 16_000_000, 1e-3)  # 16 GB/s achieved
    assert busy.cpu_gbps == pytest.approx(0.8 * 40 + 0.2 * 16) and idle.cpu_gbps == 40.0
    assert ce.learned_costs(idle, 0, 0.0) is idle
    for _ in range(40):
        busy = ce.learned_costs(busy, 16_000_000, 1e-3)
    assert busy.cpu_gbps == pytest.approx(16, rel=1e-3)
    sizes = ExpertSizes(gpu_bytes=20_000_000, cpu_bytes=20_000_000, params=1)  # 2 ms on the link
    assert choose_by_finish(idle, sizes, 0.0, 0.0, [(3, None)], {3}) == {3}  # 0.5 ms on the idle CPU
    assert choose_by_finish(busy, sizes, 0.0, 0.0, [(3, None)], {3}) == {3}  # 1.25 ms: still the CPU
    slow = busy
    for _ in range(40):  # 4 GB/s achieved: 5 ms on the CPU
        slow = ce.learned_costs(slow, 4_000_000, 1e-3)
    assert choose_by_finish(slow, sizes, 0.0, 0.0, [(3, None)], {3}) == set()
    # the hand-off is learned the same way: 1.8 ms of it leaves the busy CPU slower than the link
    late = busy
    for _ in range(40):
        late = ce.learned_costs(late, 16_000_000, 1e-3, hand_off_s=1.8e-3)
    assert late.cpu_overhead_s == pytest.approx(1.8e-3, rel=1e-3) and late.cpu_gbps == pytest.approx(16, rel=1e-3)
    assert ce.learned_costs(busy, 16_000_000, 1e-3).cpu_overhead_s == busy.cpu_overhead_s
    # a stall (a kernel compiling, a page fault) counts as at most OUTLIER times off
    stalled = ce.learned_costs(busy, 16_000_000, 10.0, hand_off_s=10.0)
    assert stalled.cpu_gbps == pytest.approx(busy.cpu_gbps * (1 - ce.LEARN + ce.LEARN / ce.OUTLIER))
    assert stalled.cpu_overhead_s <= busy.cpu_overhead_s + ce.LEARN * ce.OUTLIER * 1e-4
    assert choose_by_finish(late, sizes, 0.0, 0.0, [(3, None)], {3}) == set()

    path, _ = store16
    engine = load_engine(path, device="cpu", dtype="float32", cache_experts=2, cpu_experts="auto", cpu_format="dense")
    hybrid = engine.model.hybrid
    hybrid.costs = idle
    h, out = torch.randn(1, 64), torch.zeros(1, 64)
    hybrid.learning, hybrid.chosen_at = True, time.perf_counter()
    job = hybrid.start(0, {5: [(0, 0)]}, h, torch.ones(1, 2), out)
    job.compute()
    job.add()
    assert hybrid.costs is not idle and hybrid.costs.cpu_gbps != 40.0 and not hybrid.learning
    assert 0 < hybrid.costs.cpu_overhead_s < 0.01  # a fifth of its hand-off, learned from 0
    want = hybrid.copies[0, 5].forward(h)
    assert torch.allclose(out, want, atol=1e-6)
