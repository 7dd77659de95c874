"""Forced routing, routing traces and their mapping (engine/measure/routing.py), on the CPU.

The model is the benchmark's own synthetic Mixtral (moeferry.engine.measure.bench.build) at a tiny size, so
these run the same code as `moeferry bench` does on the GPU, with copies, LRU and prefetch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moeferry.engine.errors import UserError
from moeferry.engine.kernels import hqq_gpu
from moeferry.engine.measure import bench, routing
from moeferry.engine.measure.routing import lru_hits
from moeferry.engine.runtime import vram
from moeferry.engine.runtime.decode_graphs import GraphedDecode, use_cuda_graphs
from moeferry.engine.runtime.model import rms_norm, rope_cos_sin
from moeferry.engine.storage import quant

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "benchmarks" / "traces" / "demo-heldout.safetensors"
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 4,
        "head_dim": 16, "max_position_embeddings": 1024}


@pytest.fixture(scope="module")
def synthetic():
    torch.set_num_threads(1)
    return bench.build(3, 2, 8, device="cpu", config=TINY, log=lambda m: None)


def decode(s: bench.Synthetic, k: int, prefetch: int, source, prompt: list[int], steps: int, extra: int = 0):
    """(logits per forward, the routing tables each forward used, the model) for a prompt then
    `steps` greedy tokens; the first `extra` layers cache k + 1 experts."""
    model = s.model("lru", k, prefetch, "reference", extra_slot_layers=extra)
    model.routing = source
    model.setup_kv(len(prompt) + steps)
    model.trace = []
    logits, tables = [], []
    tokens, start = prompt, 0
    for _ in range(steps + 1):
        out = model.forward(torch.tensor(tokens), start, last_only=False)
        logits.append(out)
        if isinstance(source, routing.TableRouting):
            tables.append((source.ids.clone(), source.weights.clone()))
        start += len(tokens)
        tokens = [int(out[-1].argmax())]
    return logits, tables, model


def reference_logits(s: bench.Synthetic, model, tokens: list[int], start: int, ids, weights):
    """The eager maths with the given choice: attention from the model's own function (its KV
    cache), the experts dequantized straight from host bytes and summed by hand."""
    cfg = s.cfg
    views = bench.expert_views(cfg, s.fields, s.eq)
    t = torch.tensor(tokens)
    cos, sin = rope_cos_sin(model.inv_freq, torch.arange(start, start + len(tokens)), s.dtype)
    x = F.embedding(t, model.embed)
    for i, layer in enumerate(model.layers):
        x = x + model.attention(i, layer, rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps), cos, sin, start)
        h = rms_norm(x, layer["moe_norm"], cfg.rms_norm_eps)
        out = torch.zeros_like(h)
        for row in range(len(tokens)):
            for j in range(cfg.top_k):
                w = {m: quant.dequantize(v, torch.float32) for m, v in views(s.host[i, ids[i, row, j]]).items()}
                y = (F.silu(h[row] @ w["w1"].T) * (h[row] @ w["w3"].T)) @ w["w2"].T
                out[row] += weights[i, row, j] * y
        x = x + out
    return F.linear(rms_norm(x, model.norm, cfg.rms_norm_eps), model.lm_head).float()


@pytest.mark.parametrize("extra", [0, 2])
def test_forced_routing_gives_the_logits_of_the_eager_maths_with_that_choice(synthetic, extra):
    s = synthetic
    source = routing.UniformRouting(s.cfg.num_layers, s.cfg.num_experts, s.cfg.top_k, "cpu", depth=1, seed=3)
    prompt = [5, 17, 99, 3]
    logits, tables, model = decode(s, 3, 1, source, prompt, 6, extra)  # 3 of 8 cached: copies and evictions
    assert model.cache.stats.misses > 0 and model.cache.stats.prefetch_issued > 0
    assert [model.cache.slots_in(layer) for layer in range(3)] == [4] * extra + [3] * (3 - extra)
    ref = s.model("lru", s.cfg.num_experts, 0, "reference")  # for its attention and KV cache only
    ref.setup_kv(16)
    tokens, start = prompt, 0
    for out, (ids, weights) in zip(logits, tables):
        want = reference_logits(s, ref, tokens, start, ids, weights)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        start += len(tokens)
        tokens = [int(out[-1].argmax())]
    # and the choice is really forced: the dispatch saw the drawn experts, not the router's
    for step, (ids, _) in zip(model.trace, tables[1:]):
        assert [tuple(sel) for sel, _ in step] == [tuple(r) for r in ids[:, 0].tolist()]


@pytest.mark.parametrize("decoded", [5, 64, 150])
def test_tables_reserved_before_a_run_are_those_drawn_during_it(decoded):
    """The bench draws a forced routing's tables before its clock (reserve): the same tables, in
    the same order, as drawing them while decoding, and no draw once the decode has begun."""
    def run(reserve: bool):
        src = routing.UniformRouting(6, 16, 3, "cpu", depth=2, seed=7)
        src.CHUNK = 32
        src.begin(1)  # a chunk part used before the prompt, as in a chat's second turn
        if reserve:
            src.reserve(9, decoded)
        draws = []
        src.upload = lambda n, draw=src.upload: draws.append(n) or draw(n)
        src.begin(9)
        seen = [(src.ids.clone(), src.weights.clone(), src.guesses.clone())]
        for _ in range(decoded):
            src.begin(1)
            seen.append((src.ids.clone(), src.weights.clone(), src.guesses.clone()))
        return seen, draws, src.recall()

    (free, drawn_free, recall_free), (ahead, drawn_ahead, recall_ahead) = run(False), run(True)
    left = 31  # of the chunk the first token opened
    assert drawn_ahead == [] and drawn_free == [9] + [32] * max(0, -(-(decoded - left) // 32))
    assert recall_ahead == recall_free
    for a, b in zip(free, ahead, strict=True):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.parametrize("kernels", ["reference", pytest.param("fused", marks=pytest.mark.skipif(
    not hqq_gpu.fused_available("cpu"), reason="needs TRITON_INTERPRET=1 and Triton"))])
def test_the_graphs_force_the_routing_and_guesses_as_the_eager_forward_does(synthetic, kernels):
    """The graphed decode (capture=False: its segments run as they come) writes the forced choice
    and guesses in each layer's attention segment, from buffers filled once per token (on the
    fused kernels, the router's launch writes the choice); dispatch sees what the eager
    forward's copies per layer give it: the same experts, the same copies and prefetches, the
    same logits."""
    s = synthetic
    prompt, tokens = [5, 17, 99, 3], [40, 7, 81, 2, 66, 13, 29, 90]
    runs = []
    for graphed in (False, True):
        model = s.model("lru", 3, 1, kernels if graphed else "reference")
        model.routing = routing.UniformRouting(s.cfg.num_layers, s.cfg.num_experts, s.cfg.top_k, "cpu", depth=1,
                                               seed=3)
        model.setup_kv(32)
        if graphed:
            model.graphs = GraphedDecode(model, capture=False)
            model.graphs.prepare(32)
            assert model.graphs.fast == (kernels == "fused")
            model.kernels = "reference"  # the prompt (the fused prompt kernels need packed experts)
        model.forward(torch.tensor(prompt), 0)
        model.trace = []
        logits = [model.forward(torch.tensor([t]), len(prompt) + n) for n, t in enumerate(tokens)]
        runs.append((torch.cat(logits), model.trace, model.cache.stats))
    (eager, eager_trace, eager_stats), (graphs, graphs_trace, graphs_stats) = runs
    assert graphs_trace == eager_trace and len(graphs_trace) == len(tokens)
    assert graphs_stats == eager_stats and eager_stats.prefetch_issued > 0 and eager_stats.misses > 0
    tolerance = 1e-5 if kernels == "reference" else 2e-3  # the fused GEMVs' packed fp16 sums
    torch.testing.assert_close(graphs, eager, rtol=tolerance, atol=tolerance)


def test_a_recorded_trace_replays_identically(synthetic, tmp_path):
    s = synthetic
    prompt = [7, 1, 64, 30, 2]
    recorder = routing.TraceRecorder(depth=2, guesses=3)
    logits, _, model = decode(s, 4, 1, recorder, prompt, 12)  # the model's own routing, recorded
    stats = model.cache.stats
    trace = recorder.trace(s.cfg.num_experts, "test")
    assert trace.ids.shape == (3, len(prompt) + 12, 2) and trace.guesses.shape == (2, 3, len(prompt) + 12, 3)
    trace.save(tmp_path / "t.safetensors")
    loaded = routing.RoutingTrace.load(tmp_path / "t.safetensors")
    assert (loaded.ids == trace.ids).all() and (loaded.guesses == trace.guesses).all()
    np.testing.assert_allclose(loaded.weights, trace.weights, atol=1e-3)
    replay, _, again = decode(s, 4, 1, routing.TraceRouting(loaded, "cpu"), prompt, 12)
    # same experts per token and layer at the dispatch, same cache traffic, nearly the same logits
    assert [[sel for sel, _ in step] for step in again.trace] == [[sel for sel, _ in step] for step in model.trace]
    assert [[sel for sel, _ in step] for step in again.trace] == [
        [tuple(r) for r in trace.ids[:, t].tolist()] for t in range(len(prompt), len(prompt) + 12)]
    assert again.cache.stats == stats
    for a, b in zip(logits, replay):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)  # the weights went through float16


def test_uniform_routing_hits_k_over_e_and_reaches_the_stated_recall(synthetic):
    s = synthetic
    cfg = s.cfg
    k = 3
    budget = (s.dense_bytes + vram.kv_cache_bytes(cfg.num_layers, 8 + 300, cfg.num_kv_heads, cfg.head_dim)
              + k * cfg.num_layers * s.host.shape[2])
    cond = bench.Conditions("uniform", guess_recall=0.7, seed=1)
    r = bench.measure(s, str(budget), 8, 300, ("lru", "full"), ("reference",), 1, log=lambda m: None, cond=cond)
    lru, full = r["results"]
    assert lru["cache_experts"] == k
    assert lru["hit_rate"] == pytest.approx(k / cfg.num_experts, abs=0.03)
    assert full["guess_recall"][1] == pytest.approx(0.7, abs=0.05)
    assert lru["guess_recall"] == {}  # lru does not prefetch
    assert full["hit_rate"] > lru["hit_rate"] + 0.1  # right guesses arrive before they are needed
    assert r["routing"]["mode"] == "uniform" and r["routing"]["stated_guess_recall"] == 0.7
    assert r["routing"]["uniform_hit_ratio"] == {"reference": k / cfg.num_experts}
    assert r["cpu_threads"] == torch.get_num_threads() and r["link"]["paced_gb_per_s"] is None
    table = bench.markdown_table(r)
    assert "Routing: uniform" in table and "probability 0.7^d" in table and "CPU threads: 1" in table


def test_model_routing_reports_the_recall_of_the_models_own_guesses(synthetic):
    s = synthetic
    source = routing.ModelRouting()
    recorder = routing.TraceRecorder(depth=1, guesses=2)
    decode(s, 4, 1, source, [3, 4, 5], 10)
    decode(s, 4, 1, recorder, [3, 4, 5], 10)
    trace = recorder.trace(s.cfg.num_experts, "")
    decoded = trace.tokens(3, 3 + 10)  # ModelRouting counts decoded tokens only
    assert source.recall()[1] == pytest.approx(routing.trace_recall(decoded, 1))


def skewed_trace(layers=4, experts=8, tokens=2048, seed=0) -> routing.RoutingTrace:
    """A trace with per-layer skewed loads and locality (a token often repeats the last one's
    experts), guesses right about 80 % of the time."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((layers, tokens, 2), dtype=np.int64)
    for l in range(layers):
        p = rng.dirichlet(np.full(experts, 0.5))
        for t in range(tokens):
            ids[l, t] = ids[l, t - 1] if t and rng.random() < 0.4 else rng.choice(experts, 2, replace=False, p=p)
    guesses = np.full((2, layers, tokens, 3), -1)
    for d in (1, 2):
        for l in range(layers - d):
            guesses[d - 1, l] = routing.stated_recall_guess(ids[l + d], experts, 0.8, 3, rng)
    w = rng.random((layers, tokens, 2)).astype(np.float32)
    return routing.RoutingTrace(ids, -np.sort(-w / w.sum(-1, keepdims=True)), guesses, experts, "skewed")


def load(ids: np.ndarray, experts: int) -> np.ndarray:
    return np.bincount(ids.reshape(-1), minlength=experts) / ids.size


def test_mapping_to_more_layers_keeps_each_layers_statistics():
    src = skewed_trace()
    dst = routing.map_trace(src, 32, 8, 2, seed=5)
    assert dst.ids.shape == (32, 2048, 2) and dst.guesses.shape == (2, 32, 2048, 3)
    for l in range(32):
        s = l % 4
        # a relabelling: the same loads, the same LRU hits at every cache size
        assert sorted(load(dst.ids[l], 8)) == pytest.approx(sorted(load(src.ids[s], 8)))
        assert [lru_hits(dst.ids[l], c) for c in (1, 3, 5)] == [lru_hits(src.ids[s], c) for c in (1, 3, 5)]
        np.testing.assert_array_equal(dst.weights[l], src.weights[s])
    for d in (1, 2):
        assert routing.trace_recall(dst, d) == pytest.approx(routing.trace_recall(src, d), abs=0.02)
        # layers whose guess stays inside one repetition keep their recorded recall exactly
        for l in [l for l in range(32 - d) if l % 4 + d < 4]:
            found = (dst.ids[l + d][:, :, None] == dst.guesses[d - 1, l][:, None, :2]).any(-1).mean()
            want = (src.ids[l % 4 + d][:, :, None] == src.guesses[d - 1, l % 4][:, None, :2]).any(-1).mean()
            assert found == pytest.approx(want)


def test_mapping_to_more_experts_splits_each_experts_load_over_its_copies():
    src = skewed_trace()
    dst = routing.map_trace(src, 4, 16, 2, seed=2, block=64)
    assert dst.ids.max() < 16 and dst.ids.min() >= 0
    share_high = []
    for l in range(4):
        merged = load(dst.ids[l] % 8, 8)  # copies e and e+8 of one relabelled source expert
        assert sorted(merged) == pytest.approx(sorted(load(src.ids[l], 8)))
        assert (dst.ids[l, :, 0] // 8 == dst.ids[l, :, 1] // 8).all()  # one copy per (token, layer)
        share_high.append((dst.ids[l] >= 8).mean())
        # within a block the choice of copy is fixed, so a block's LRU hits are the source's
        assert lru_hits(dst.ids[l, :64], 2) == lru_hits(src.ids[l, :64], 2)
    assert np.mean(share_high) == pytest.approx(0.5, abs=0.1)
    for d in (1, 2):
        assert routing.trace_recall(dst, d) == pytest.approx(routing.trace_recall(src, d), abs=0.02)


def test_mapping_refuses_what_it_cannot_keep():
    src = skewed_trace(tokens=64)
    with pytest.raises(UserError, match="multiple of 8"):
        routing.map_trace(src, 32, 12, 2)
    with pytest.raises(UserError, match="top-4"):
        routing.map_trace(src, 32, 16, 4)


def test_a_bad_trace_file_is_one_sentence(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a trace")
    with pytest.raises(UserError, match="not a routing trace"):
        routing.RoutingTrace.load(bad)
    with pytest.raises(UserError, match="does not exist"):
        routing.RoutingTrace.load(tmp_path / "missing.safetensors")
    with pytest.raises(UserError, match="Unknown --routing"):
        routing.parse_routing("zipf", bench.ModelConfig(**bench.MIXTRAL), "cpu", 0.85, 1)


def test_the_shipped_demo_trace_is_what_moeferry_trace_records():
    from moeferry.engine.measure.routing import load_text_ids
    from moeferry.engine.runtime.generate import load_engine

    shipped = routing.RoutingTrace.load(SHIPPED)
    assert SHIPPED.stat().st_size < 200_000
    assert "training/data/heldout.txt" in shipped.note
    assert (shipped.num_layers, shipped.num_experts, shipped.top_k, shipped.depth) == (8, 8, 2, 3)
    assert shipped.num_tokens >= 512 + 8  # the bench's longest replay (prompt 512, 8 new tokens)
    np.testing.assert_allclose(shipped.weights.sum(-1), 1.0, atol=2e-3)
    engine = load_engine("demo", device="cpu", cuda_graphs=False)
    ids = load_text_ids(engine.tokenizer, str(ROOT / "training" / "data" / "heldout.txt"), 48)
    again = routing.record_trace(engine, ids, "")
    np.testing.assert_array_equal(again.ids, shipped.ids[:, :48])
    np.testing.assert_array_equal(again.guesses, shipped.guesses[:, :, :48])
    stats = routing.trace_stats(shipped)
    assert stats["guess_recall"][1] > 0.5  # a trained router: far above the random 2/8


def test_a_held_cache_keeps_the_prompts_experts_and_an_lru_follows_the_decode():
    """decode_hits: conversations of a prompt read into a fresh LRU cache, then decoded tokens
    counted, the cache held (a streaming decode's) or going on as an LRU."""
    prompt, shift, same = [[0, 1]] * 4, [[2, 3]] * 3, [[1, 0]] * 3
    layer = np.array(prompt + shift + prompt + same)  # two conversations of 4 + 3 tokens
    assert routing.decode_hits(layer, 2, 4, 3, held=False) == (4 + 6, 12)  # misses on the first shifted token only
    assert routing.decode_hits(layer, 2, 4, 3, held=True) == (0 + 6, 12)
    assert routing.decode_hits(layer, 1, 4, 3, held=True) == (3, 12)  # expert 0 held: the first of the last token
    both = np.stack([layer, layer[::-1]])
    assert routing.decode_hit_ratio(both, 2, 4, 3, held=True) == pytest.approx(
        sum(routing.decode_hits(x, 2, 4, 3, True)[0] for x in both) / 24)
    assert routing.decode_hit_ratio(both, 2, 10, 5, held=False) == 0.0  # no conversation fits


def test_the_recorder_sees_what_transformers_routes(tiny_store, tiny_checkpoint):
    from moeferry.engine.runtime.generate import load_engine

    hf = tiny_checkpoint[1]
    engine = load_engine(str(tiny_store), device="cpu", cuda_graphs=False)
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(0))
    trace = routing.record_trace(engine, ids, "", window=20)
    for start in (0, 20):  # each window a fresh context
        with torch.no_grad():
            out = hf(input_ids=ids[start:start + 20][None], output_router_logits=True)
        for l, logits in enumerate(out.router_logits):
            probs = torch.softmax(logits.float(), -1)
            w, want = probs.topk(2, dim=-1)
            np.testing.assert_array_equal(trace.ids[l, start:start + 20], want.numpy())
            np.testing.assert_allclose(trace.weights[l, start:start + 20], (w / w.sum(-1, keepdim=True)).numpy(),
                                       atol=1e-5)


def test_cli_trace_writes_a_trace_and_its_statistics(tiny_store, tmp_path):
    from tests.conftest import run_cli

    text = tmp_path / "t.txt"
    text.write_text("abc def ghi jkl mno pqr stu vwx yz\n\n" * 20)
    out = tmp_path / "trace.safetensors"
    r = run_cli("trace", str(tiny_store), "--text", str(text), "--out", str(out), "--max-tokens", "100",
                "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    import json
    stats = json.loads(r.stdout)
    trace = routing.RoutingTrace.load(out)
    assert stats["tokens"] == trace.num_tokens == 100 and stats["layers"] == 2
    assert set(stats["lru_hit_ratio"]) == {"1", "2", "3", "4"} and stats["lru_hit_ratio"]["4"] > 0.9
    r = run_cli("trace", str(tiny_store), "--text", str(tmp_path / "none.txt"), "--out", str(out))
    assert r.returncode == 2 and "is not a file" in r.stderr and "Traceback" not in r.stderr


def test_cli_bench_checks_its_routing_before_anything_else():
    from tests.conftest import run_cli

    r = run_cli("bench", "--routing", "zipf")
    assert r.returncode == 2 and "Unknown --routing 'zipf'" in r.stderr
    r = run_cli("bench", "--routing", "trace:/nonexistent.safetensors")
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run_cli("bench", "--routing", f"trace:{SHIPPED}", "--prompt-len", "2000")
    assert r.returncode == 2 and "The trace holds 1536 tokens and this run needs 2064" in r.stderr
    r = run_cli("bench", "--guess-recall", "1.5")
    assert r.returncode == 2 and "--guess-recall" in r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_name", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_preparing_graphs_runs_the_grouped_kernels_on_distinct_experts(monkeypatch, model_name):
    """The grouped expert kernels order a token's experts by id and read past their scratch when
    two are equal (gpt-oss-20b's MXFP4 kernel: an illegal memory access while its graphs were
    prepared). Every run of them, the graphs' warm-up included, must get distinct ids: resident
    under forced routing (the one graph), a smaller cache, and the hybrid's GPU part."""
    from moeferry.engine.kernels.decode import FusedOps
    from moeferry.engine.measure.bench_shapes import shape_config
    from moeferry.engine.runtime.generate import cpu_copies_of, cpu_experts_for
    seen = []
    run = FusedOps.moe_decode

    def recording(self, h, experts, slot_bytes, ids, weights, table, out):
        if not torch.cuda.is_current_stream_capturing():  # a capture records, it does not run
            seen.append(ids.tolist())
        return run(self, h, experts, slot_bytes, ids, weights, table, out)

    monkeypatch.setattr(FusedOps, "moe_decode", recording)
    cfg = shape_config(model_name)
    s = bench.build(2, 4, 4, config=TINY | {"num_experts": 8, "top_k": min(4, cfg.top_k)}, model=model_name,
                    log=lambda m: None)
    for k, hybrid in ((s.cfg.num_experts, False), (5, False), (5, True)):
        model = s.model("lru", k, 1, "fused")
        model.routing = routing.UniformRouting(s.cfg.num_layers, s.cfg.num_experts, s.cfg.top_k, s.device, seed=3)
        if hybrid:
            copies = cpu_copies_of(s.cfg, s.host, bench.expert_views(s.cfg, s.fields, s.eq), s.device, None, None, k)
            model.hybrid = cpu_experts_for(copies, s.cfg, s.host, model.cache, "all", 2)
        model.setup_kv(32)
        use_cuda_graphs(model)
        seen.clear()
        model.graphs.prepare(32)
        model.forward(torch.tensor([5], device=s.device), 0)
        assert seen, "the grouped kernels ran"
        for ids in seen:
            assert len(set(ids)) == len(ids) and all(0 <= e < s.cfg.num_experts for e in ids), (k, hybrid, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("budget", ["12GiB-like", "resident"])
def test_graphs_honour_forced_routing(budget):
    """Graphed decode (per-layer graphs with K < E; the one-graph path with K = E) under forced
    uniform routing gives the eager path's logits with the same forced choice."""
    s = bench.build(4, 2, 4, log=lambda m: None)
    k = 5 if budget == "12GiB-like" else s.cfg.num_experts
    prompt = list(range(10, 26))
    results = []
    for graphs, seed in ((False, 4), (True, 4), (False, 5)):  # the last: another forced choice
        src = routing.UniformRouting(s.cfg.num_layers, s.cfg.num_experts, s.cfg.top_k, s.device, depth=1, seed=seed)
        model = s.model("lru", k, 1, "fused")
        model.routing = src
        model.setup_kv(64)
        use_cuda_graphs(model, graphs)
        if graphs:
            model.graphs.prepare(64)
            assert model.graphs.one_graph == (k == s.cfg.num_experts)
        model.trace = []
        out = [model.forward(torch.tensor(prompt, device=s.device), 0).float().cpu()]
        for n, tok in enumerate(range(40, 48)):  # the same tokens in both runs (no greedy drift)
            out.append(model.forward(torch.tensor([tok], device=s.device), len(prompt) + n).float().cpu())
        results.append((out, [[sel for sel, _ in step] for step in model.trace]))
    (eager, eager_ids), (graphed, graphed_ids), (other, other_ids) = results
    assert graphed_ids == eager_ids != other_ids  # the forced experts, token by token and layer by layer
    rel = lambda a, b: float((b - a).norm() / a.norm())  # noqa: E731
    for a, b, c in zip(eager, graphed, other):  # bfloat16, different kernels: equal to rounding,
        assert rel(a, b) < 5e-2 and 4 * rel(a, b) < rel(a, c)  # and far closer than another choice


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_paced_copies_run_at_the_paced_rate():
    """ExpertCache(pace_cycles=...) copies at the paced rate, and the bytes still arrive."""
    import time

    from moeferry.engine.runtime.expert_cache import ExpertCache, pace_cycles, sleep_cycles_per_s

    dev = torch.device("cuda")
    nbytes = 64 << 20
    host = torch.randint(0, 255, (1, 8, nbytes), dtype=torch.uint8)
    link = bench.pinned_bandwidth(dev)
    target = link / 3
    cache = ExpertCache(host, 2, dev, lambda buf: buf,
                        pace_cycles=pace_cycles(nbytes, target, link, sleep_cycles_per_s(dev)))
    torch.cuda.synchronize()
    t = time.perf_counter()
    for e in range(8):  # every one a miss
        cache.acquire(0, e)
        cache.release(0)
    torch.cuda.synchronize()
    rate = 8 * nbytes / (time.perf_counter() - t)
    assert rate == pytest.approx(target, rel=0.15)
    assert cache.stats.misses == 8
    assert torch.equal(cache.layer_slots[0][cache.lru[0][7]].cpu(), host[0, 7])


def test_a_trace_replays_to_its_last_token_and_no_further(synthetic):
    src = skewed_trace(layers=3, tokens=70)
    source = routing.TraceRouting(src, "cpu")
    source.begin(4)  # a prompt
    assert (source.ids.numpy() == src.ids[:, :4]).all()
    for t in range(4, 70):  # decoded tokens, drawn a chunk at a time
        source.begin(1)
        assert (source.ids[:, 0].numpy() == src.ids[:, t]).all()
        assert (source.guesses.numpy() == np.maximum(src.guesses[:, :, t, :2].transpose(1, 0, 2), 0)).all()
    with pytest.raises(UserError, match="holds 70 tokens"):
        source.begin(1)
    decoded = src.tokens(4, 70)
    assert source.recall() == pytest.approx({d: routing.trace_recall(decoded, d) for d in (1, 2)})
