"""moeferry.engine.measure.bench's synthetic model, the part that runs without a GPU (and where
its embedding lives on one, marked gpu)."""

import pytest
import torch

from moeferry.engine.errors import UserError
from moeferry.engine.measure import bench
from moeferry.engine.runtime.generate import EMBEDDING, device_bytes
from moeferry.engine.storage import quant, store


def test_a_random_expert_unpacks_to_mixtral_like_weights():
    cfg = bench.ModelConfig(**{**bench.MIXTRAL, "num_layers": 1, "hidden_size": 64, "intermediate_size": 128})
    for bits, spec in quant.EXPERT_SPECS.items():
        eq = {"bits": bits, "group_size": spec.group_size, "meta_group": spec.meta_group}
        fields, stride = store.expert_layout(cfg, eq)
        buf = bench.random_expert(cfg, eq, fields, stride, "cpu", torch.Generator().manual_seed(bits))
        assert buf.shape == (stride,) and buf.dtype == torch.uint8
        views = bench.expert_views(cfg, fields, eq)(buf)
        for name in store.EXPERT_MATRICES:
            assert (views[name].rows, views[name].cols) == store.expert_shape(cfg, name)
            w = quant.dequantize(views[name], torch.float32)
            # HQQ on weights of std ~0.01 (Mixtral's are 0.01-0.02): zero-centred, similar spread
            assert 0.005 < float(w.std()) < 0.015 and abs(float(w.mean())) < 0.003, (bits, name)


def test_gpt_oss_benches_mxfp4_experts_by_default():
    """A tiny gpt-oss: its experts are MXFP4 (4.25 bits per weight, gpt-oss's spread), the
    cache's slots are MXFP4 experts' size, the model decodes from them, and the report says so."""
    from moeferry.engine.measure.bench_shapes import native_expert_format
    from moeferry.engine.storage import mxfp4

    assert native_expert_format("gpt-oss-20b") == "mxfp4" and native_expert_format("mixtral-8x7b") == "hqq"
    tiny = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4,
            "num_kv_heads": 4, "head_dim": 16, "max_position_embeddings": 256}
    s = bench.build(2, 2, 8, device="cpu", config=tiny, log=lambda m: None, model="gpt-oss-20b")
    assert s.expert_format == "mxfp4" and s.expert_bits_per_weight() == 4.25
    eq = {"bits": 4, "method": "mxfp4", "group_size": 32, "bias_dtype": "BF16"}
    fields, stride = store.expert_layout(s.cfg, eq)
    assert s.host.shape == (2, 32, stride) and s.fields == fields
    views = bench.expert_views(s.cfg, s.fields, s.eq)(s.host[1, 5])
    w1 = views["w1"]
    assert isinstance(w1, mxfp4.Mxfp4Matrix) and (w1.rows, w1.cols) == (96, 64)
    assert 0.005 < float(mxfp4.dequantize(w1).std()) < 0.06
    model = s.model("lru", 8, 1, "reference")
    assert model.cache.slot_bytes == stride and model.cache.slots.shape == (2 * 8, stride)
    r = bench.measure(s, None, 8, 6, ("lru",), ("reference",), 1, log=lambda m: None)
    assert r["expert_format"] == "mxfp4" and r["expert_bits_per_weight"] == 4.25 and r["expert_bytes"] == stride
    assert r["host_dense_bytes"] == 0  # on the CPU every dense weight is on the device
    (result,) = r["results"]
    assert result["decode_tokens_per_s"] > 0 and result["hit_rate"] == 1.0  # no budget: every expert cached
    assert "MXFP4 experts, 4.25 bits/weight" in bench.markdown_table(r)
    r = bench.measure(s, None, 8, 6, ("hybrid",), ("reference",), 1, log=lambda m: None)  # MXFP4 in place
    assert r["cpu_experts"]["format"] == "mxfp4" and r["cpu_experts"]["extra_ram_bytes"] == 0


def test_the_expert_format_is_explicit_on_the_command_line():
    with pytest.raises(UserError, match="--expert-format hqq"):
        bench.cli_bench(["--model", "gpt-oss-20b", "--expert-bits", "4"])
    hqq = bench.build(1, 3, 8, device="cpu", log=lambda m: None, model="gpt-oss-20b", expert_format="hqq",
                      config={"vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_heads": 4,
                              "num_kv_heads": 4, "head_dim": 16, "max_position_embeddings": 256})
    assert hqq.expert_format == "hqq" and hqq.eq["bits"] == 3 and 3.25 < hqq.expert_bits_per_weight() < 3.3  # + 16 bits per 64


def test_an_unknown_mode_is_named_with_the_modes_there_are():
    with pytest.raises(UserError, match="Unknown mode 'streaming' in --modes; choose from naive, lru, full, hybrid, "
                                        "stream, fetch"):
        bench.cli_bench(["--modes", "lru,streaming"])


def test_a_group_size_of_32_takes_fewer_bits_and_still_decodes():
    """--expert-group-size 32 at 2 bits: 2.5 bits per weight (16 bits of scale and zero per 32
    rows) against the default's 3.0, a smaller cache slot, the report names the groups, and the
    model decodes from them."""
    tiny = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
            "num_kv_heads": 4, "head_dim": 16, "max_position_embeddings": 256}
    g16 = bench.build(1, 2, 8, device="cpu", config=tiny, log=lambda m: None)
    g32 = bench.build(1, 2, 8, device="cpu", config=tiny, log=lambda m: None, group_size=32)
    assert g16.eq["group_size"] == 16 and g32.eq["group_size"] == 32
    assert 2.95 < g16.expert_bits_per_weight() < 3.1 and 2.45 < g32.expert_bits_per_weight() < 2.6
    assert g32.host.shape[2] < g16.host.shape[2]
    r = bench.measure(g32, None, 8, 6, ("lru", "hybrid"), ("reference",), 1, log=lambda m: None)
    assert r["expert_group_size"] == 32 and "2-bit HQQ experts in groups of 32" in bench.markdown_table(r)
    assert all(res["decode_tokens_per_s"] > 0 for res in r["results"])
    for bad in (24, 256):  # not a power of two; does not divide the hidden size 64
        with pytest.raises(UserError, match="--expert-group-size"):
            bench.build(1, 2, 8, device="cpu", config=tiny, log=lambda m: None, group_size=bad)


def test_a_replayed_trace_is_reported_with_its_own_statistics(tmp_path):
    """measure() on the CPU with the shipped demo trace (8 layers onto 3: mapped by
    moeferry.engine.measure.routing.map_trace's rule, layer l of the target from layer l mod 8), the report
    states routing, link and threads, and reads back from JSON."""
    import json
    from pathlib import Path

    trace = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "demo-heldout.safetensors"
    tiny = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
            "num_kv_heads": 4, "head_dim": 16, "max_position_embeddings": 256}
    s = bench.build(3, 2, 8, device="cpu", config=tiny, log=lambda m: None)
    cond = bench.Conditions(routing=f"trace:{trace}")
    r = bench.measure(s, None, 8, 12, ("full",), ("reference",), 1, log=lambda m: None, cond=cond)
    assert r["routing"]["mode"] == "trace" and r["routing"]["stated_guess_recall"] is None
    stats = r["routing"]["trace"]
    assert stats["tokens"] == 8 + 12 and stats["layers"] == 3
    (result,) = r["results"]
    assert result["hit_rate"] == 1.0 and result["cache_experts"] == 8  # no budget: all resident
    again = json.loads(json.dumps(r))
    line = bench.conditions_line(again)
    assert f"LRU hit ratio at 8 cached: {stats['lru_hit_ratio'][8]:.3f}" in line
    assert "trace " in line and "demo-heldout" in line and "CPU threads" in line


def test_the_hybrid_mode_reports_its_cpu_experts(monkeypatch):
    """measure()'s hybrid mode on the CPU under a budget that caches 2 of 8 experts: misses
    run on the CPU from the stored 2-bit bytes in place ("hqq", no extra RAM), and the report
    says so with the bits per weight the CPU reads. The cost model gets stated costs (a link far
    slower than the CPU), not the load-time measurement, whose split on a busy CI box can send
    every miss to the copy."""
    from moeferry.engine.runtime import generate
    from moeferry.engine.runtime.placement import Costs

    monkeypatch.setattr(generate, "measure_costs",
                        lambda *a: Costs(link_gbps=1e-3, cpu_gbps=1.0, gpu_expert_s=0.0, cpu_overhead_s=0.0))
    tiny = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
            "num_kv_heads": 4, "head_dim": 16, "max_position_embeddings": 256}
    s = bench.build(2, 2, 8, device="cpu", config=tiny, log=lambda m: None)
    budget = bench.cache_size_for  # the budget that leaves room for exactly 2 slots
    per_slot = s.cfg.num_moe_layers * s.host.shape[2]
    for extra in range(0, 64 << 20, 1 << 14):
        if budget(s.dense_bytes + 2 * per_slot + extra, s.cfg, s.dense_bytes, s.host.shape[2], 20, s.device,
                  "reference") == (2, 0):
            break
    r = bench.measure(s, str(s.dense_bytes + 2 * per_slot + extra), 8, 12, ("lru", "hybrid"), ("reference",), 1,
                      log=lambda m: None, cond=bench.Conditions(routing="uniform"))
    lru, hybrid = r["results"]
    assert lru["cache_experts"] == hybrid["cache_experts"] == 2
    assert hybrid["misses_cpu"] > 0 and lru["misses_cpu"] == 0
    # its CPU figures are the decode's alone: as many CPU runs as decoded misses on the CPU
    assert hybrid["cpu_decode_experts"] == hybrid["misses_cpu"] and hybrid["cpu_gb_per_s"] > 0
    cpu = r["cpu_experts"]
    assert cpu["format"] == "hqq" and cpu["experts"] == 2 * 8
    assert cpu["extra_ram_bytes"] == 0  # it reads the stored experts, metadata included, in place
    assert 2.5 < cpu["bits_per_weight"] < 3.5  # 2-bit codes + 8-bit scales and zeros per 16
    # the layers' split accounts for every decoded MoE layer but each token's last (the head follows)
    for result in (lru, hybrid):
        split = result["layer_split"]
        assert sum(row["per_token"] for row in split) == pytest.approx(s.cfg.num_moe_layers - 1, abs=0.02)
    assert any(row["on_cpu"] > 0 and row["kernel_ms"] > 0 for row in hybrid["layer_split"])
    assert all(row["on_cpu"] == 0 and row["kernel_ms"] == 0 for row in lru["layer_split"])
    # the host's steps add up to its share, the CPU's step to the kernel's
    for row in lru["layer_split"] + hybrid["layer_split"]:
        steps = row["host_phases_ms"]
        assert sum(ms for name, ms in steps.items() if name != "cpu") == pytest.approx(row["host_ms"], abs=0.02)
        assert steps.get("cpu", 0.0) == pytest.approx(row["kernel_ms"], abs=0.02)
        assert ("up" in steps) == (row["on_cpu"] > 0)


def test_what_the_budget_leaves_after_k_a_layer_goes_to_one_slot_more_in_the_first_layers():
    tiny = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
            "num_kv_heads": 4, "head_dim": 16, "max_position_embeddings": 256}
    s = bench.build(3, 2, 8, device="cpu", config=tiny, log=lambda m: None)
    stride, context = s.host.shape[2], 8 + 6
    sizing = device_bytes(s.cfg, s.dense_bytes, stride, context, torch.bfloat16, s.device, "reference")
    budget = sizing.needed(2) + 2 * stride  # two experts a layer, and two experts more
    assert bench.cache_size_for(budget, s.cfg, s.dense_bytes, stride, context, s.device, "reference") == (2, 2)
    r = bench.measure(s, str(budget), 8, 6, ("lru",), ("reference",), 1, log=lambda m: None)
    assert (r["cache_experts"], r["extra_slot_layers"]) == (2, 2)
    assert "2 experts cached per layer (3 in the first 2)" in bench.markdown_table(r)
    assert r["routing"]["uniform_hit_ratio"]["reference"] == (2 * 3 + 2) / (8 * 3)
    assert r["results"][0]["peak_vram_bytes"] == (3 + 3 + 2) * stride  # the cache's bytes on the CPU
    assert r["results"][0]["device_used_bytes"] == 0  # no driver's count off a GPU
    header, rule, row = bench.markdown_table(r).splitlines()[-3:]
    assert header.count("|") == rule.count("|") == row.count("|") and "GPU memory used GiB" in header


def test_the_gpu_memory_in_use_is_the_drivers_total_less_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**30, 80 * 2**30))
    assert bench.gpu_memory(torch.device("cuda", 0)) == (77 * 2**30, 80 * 2**30)
    assert bench.gpu_memory(torch.device("cpu")) == (0, 0)


def test_the_layer_split_adds_each_kind_of_layer_up():
    """bench.layer_split on stated times: each layer's time runs from its routing sync to the
    next layer's; the host's Python, the CPU kernel and the device's share add up to it."""
    from moeferry.engine.runtime.model import LayerTimes

    ms = 1e-3
    times = [LayerTimes(0, 0, 0, 0.0, 0.1 * ms),  # a hit: host 0.1, device 0.9
             LayerTimes(1, 1, 1, 1.0 * ms, 2.0 * ms, 0.5 * ms),  # a split miss: host 0.5, kernel 0.5, device 0.5
             LayerTimes(2, 1, 0, 2.5 * ms, 2.6 * ms),  # the token's last: left out
             LayerTimes(0, 0, 0, 5.0 * ms, 5.1 * ms),  # the next token, alike
             LayerTimes(1, 1, 1, 6.0 * ms, 7.0 * ms, 0.7 * ms),
             LayerTimes(2, 0, 0, 7.5 * ms, 7.6 * ms)]
    hit, split = bench.layer_split(times, steps=2)
    assert (hit["copied"], hit["on_cpu"], hit["per_token"]) == (0, 0, 1.0)
    assert (hit["ms"], hit["host_ms"], hit["kernel_ms"], hit["device_wait_ms"]) == pytest.approx((1.0, 0.1, 0.0, 0.9))
    assert (split["copied"], split["on_cpu"], split["per_token"]) == (1, 1, 1.0)
    assert (split["ms"], split["host_ms"], split["kernel_ms"], split["device_wait_ms"]) == pytest.approx((1.5, 0.4, 0.6, 0.5))


def test_the_bench_cuts_its_experts_into_units_and_routes_whole_experts():
    """--expert-units 2: the synthetic model's experts become 16 units of half the width per
    layer, the cache holds units, uniform routing draws whole experts (the two units of one
    expert always together: a token's units are 2 x top-2 = 4, in pairs e * 2, e * 2 + 1), and
    the logits are the whole-expert model's."""
    tiny = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
            "num_kv_heads": 4, "head_dim": 16, "max_position_embeddings": 256}
    whole = bench.build(2, 2, 8, device="cpu", config=tiny, log=lambda m: None)
    cut = bench.build(2, 2, 8, device="cpu", config=tiny, log=lambda m: None, expert_units=2)
    assert (cut.cfg.num_experts, cut.cfg.top_k, cut.cfg.intermediate_size) == (16, 4, 64)
    assert cut.host.shape[:2] == (2, 16) and cut.host.shape[2] < whole.host.shape[2]
    source = bench.Conditions(routing="uniform").routing_source(cut.cfg, "cpu", 1)
    assert (source.E, source.k) == (8, 2)
    m_whole, m_cut = whole.model("lru", 8, 0, "reference"), cut.model("lru", 16, 0, "reference")
    for m in (m_whole, m_cut):
        m.setup_kv(32)
    ids = torch.tensor([3, 1, 4, 1, 5])
    torch.testing.assert_close(m_cut.forward(ids, 0), m_whole.forward(ids, 0), rtol=1e-4, atol=1e-4)
    r = bench.measure(cut, "none", 8, 6, ("lru",), ("reference",), 0, log=lambda m: None,
                      cond=bench.Conditions(routing="uniform"))
    assert r["expert_units"] == 2 and "each cut into 2 units" in bench.markdown_table(r)
    assert r["results"][0]["hit_rate"] == 1.0


def test_the_bound_divides_by_the_paced_link_when_copies_are_paced():
    """Under --h2d-gbps the bound is the bytes over the rate the paced copies reached, not over
    the unpaced link (which made the desktop stand-in's bound half what it is)."""
    unpaced = {"measured_gb_per_s": 55.0, "paced_gb_per_s": None}
    paced = {**unpaced, "paced_gb_per_s": 25.0, "achieved_paced_copy_gb_per_s": 24.5}
    assert bench.link_bytes_per_s(unpaced) == 55e9 and bench.link_bytes_per_s(paced) == 24.5e9
    d = {"bytes_h2d": 63 * 490_000_000, "hits": 3, "misses": 1, "prefetch_used": 0, "prefetch_issued": 0}
    r = bench.mode_result("lru", "fused", 6, 0, 0.5, 2.0, d, 0, {}, 64, bench.link_bytes_per_s(paced), 0.006, None)
    assert r.bound_ms_per_token == pytest.approx(20.0)  # 0.49 GB at 24.5 GB/s, more than the compute


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_synthetic_embedding_stays_in_host_memory_and_its_bytes_go_to_the_cache():
    """As the engine keeps an untied embedding: gpt-oss-20b's (201088 x 2880, 1.16 GB) in host
    memory and out of the resident bytes, so a budget that cached 3 experts per layer with it on
    the GPU caches what its bytes hold more; the model decodes from it (every expert cached: the
    one-graph token)."""
    s = bench.build(2, model="gpt-oss-20b", log=lambda m: None)
    embed = s.dense[EMBEDDING]
    assert embed.device.type == "cpu" and s.dense["lm_head.weight"].is_cuda
    assert s.host_dense_bytes == embed.nbytes == 201088 * 2880 * 2
    stride, prompt, new = s.host.shape[2], 8, 4
    on_gpu = device_bytes(s.cfg, s.dense_bytes + embed.nbytes, stride, prompt + new, torch.bfloat16, s.device, "fused")
    budget = on_gpu.needed(3)
    k, _ = bench.cache_size_for(budget, s.cfg, s.dense_bytes, stride, prompt + new, s.device)
    assert k == min(s.cfg.num_experts, 3 + embed.nbytes // on_gpu.per_slot) == s.cfg.num_experts
    r = bench.measure(s, str(budget), prompt, new, ("lru",), ("fused",), log=lambda m: None)
    assert r["cache_experts"] == k and r["host_dense_bytes"] == embed.nbytes and r["resident_bytes"] == s.dense_bytes
    assert r["results"][0]["decode_tokens_per_s"] > 0
