"""The correctness tests again on CUDA (run on the GPU machine; skipped without a GPU)."""

import math

import pytest
import torch

from moeferry.engine.kernels import int8_gpu
from moeferry.engine.runtime import vram
from moeferry.engine.runtime.generate import SamplingSettings, engine_device_bytes, load_engine
from moeferry.engine.storage.convert import convert_checkpoint
from moeferry.engine.storage.store import load_dequantized_hf_model
from tests.conftest import make_checkpoint, reference_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = [1, 10, 20, 30, 40, 50, 60, 7]


@pytest.mark.parametrize("experts,top_k,kv_heads,layers", [(4, 2, 2, 2), (8, 2, 2, 3), (6, 1, 4, 2), (5, 3, 1, 4)])
def test_cuda_greedy_tokens_equal_transformers(tmp_path, experts, top_k, kv_heads, layers):
    model = make_checkpoint(tmp_path / "ck", seed=experts, shard="80KB", num_local_experts=experts,
                            num_experts_per_tok=top_k, num_key_value_heads=kv_heads, num_hidden_layers=layers)
    want = reference_greedy(model, PROMPT, 24)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cuda")
    engine = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=1)
    engine.eos_ids = set()  # transformers' reference runs without stopping at </s>
    for k in range(1, experts + 1):
        engine.set_cache_experts(k)
        for depth in (0, 1, 2):
            engine.set_prefetch(depth)
            engine.cached_ids = []
            got = list(engine.generate_ids(PROMPT, SamplingSettings(temperature=0, max_new_tokens=24)))
            assert got == want, f"K={k} D={depth}"


@pytest.mark.parametrize("kernels", ["reference", "fused"])
@pytest.mark.parametrize("expert_bits,attn_bits", [(2, 4), (3, 8), (4, 4)])
def test_cuda_quantized_logits_match_dequantized_reference(tmp_path, expert_bits, attn_bits, kernels):
    make_checkpoint(tmp_path / "ck", seed=3, num_key_value_heads=4, hidden_size=128, intermediate_size=256)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", expert_bits, attn_bits, "cuda")
    ref = load_dequantized_hf_model(tmp_path / "st")
    engine = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=2, prefetch=1,
                         kernels=kernels)
    ids = torch.tensor(PROMPT)
    engine.model.setup_kv(64)
    got = engine.model.forward(ids.cuda(), 0, last_only=False).cpu()
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= (1e-3 if kernels == "reference" else 1e-2), rel
    engine.model.setup_kv(64)
    tok = engine.model.forward(ids[:1].cuda(), 0)  # decode path (T=1) too
    assert tok.shape[-1] == want.shape[-1]


@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_host_embedding_greedy_tokens_equal_transformers(tmp_path, graphs):
    """An untied embedding stays in host memory on the GPU (a token's row gathered there and
    copied in before layer 0, through a pinned row): greedy tokens equal transformers' on the
    store's dequantized weights, eager and through CUDA graphs, with 2 of 6 experts cached (a
    graph per layer) and with all 6 (the one-graph token, which holds no lookup: a lookup of
    device tokens in the host embedding would fail)."""
    make_checkpoint(tmp_path / "ck", seed=5, num_key_value_heads=4, hidden_size=128, intermediate_size=256,
                    num_local_experts=6, num_hidden_layers=3)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 8, "cuda")  # 4-bit experts: the grouped kernel's
    want = reference_greedy(load_dequantized_hf_model(tmp_path / "st"), PROMPT, 24)
    for k in (2, 6):
        engine = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=k, prefetch=1,
                             cuda_graphs=graphs)
        m = engine.model
        assert m.embed_on_host and m.embed.device.type == "cpu" and m.staging.is_pinned()
        assert m.lm_head.is_cuda
        if graphs:
            assert m.graphs.grouped and m.graphs.one_graph == (k == 6)
            assert m.runs_ahead() == (k == 6)  # the embedding then read by the GPU, page-locked
            assert m.embed.is_pinned() == (k == 6)
        engine.eos_ids = set()
        got = list(engine.generate_ids(PROMPT, SamplingSettings(temperature=0, max_new_tokens=24)))
        assert got == want, f"K={k}"
        engine.close()


@pytest.mark.parametrize("tied", [False, True])
def test_cuda_greedy_decode_runs_ahead_and_stops_cleanly(tmp_path, tied, monkeypatch):
    """Every expert resident: the greedy loop that queues each token's graph before it reads the
    token before (GraphedDecode.decode_greedy; the embedding on the device, or in host memory
    read by the GPU) gives the tokens of the loop that sends each token from the host; stopped
    at an end token with one more graph run, the conversation goes on with the same tokens."""
    from moeferry.engine.runtime import decode_graphs
    make_checkpoint(tmp_path / "ck", seed=7, num_key_value_heads=4, hidden_size=128, intermediate_size=256,
                    num_local_experts=6, num_hidden_layers=3, tie_word_embeddings=tied)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 8, "cuda")
    greedy = SamplingSettings(temperature=0, max_new_tokens=30)
    runs = {}
    for ahead in (False, True):
        monkeypatch.setattr(decode_graphs, "RUN_AHEAD", ahead)
        engine = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=6)
        assert engine.model.runs_ahead() == ahead
        engine.eos_ids = set()
        want = list(engine.generate_ids(PROMPT, greedy))
        stop = next(j for j in range(1, 30) if want[j] not in want[:j])  # tied: [7, 1, 1, ...]
        engine.eos_ids = {want[stop]}
        first = list(engine.generate_ids(PROMPT, greedy))
        engine.eos_ids = set()
        follow = PROMPT + first + [5]
        runs[ahead] = want, first, list(engine.generate_ids(follow, greedy)), engine.last_stats.reused_prompt_tokens
        assert first == want[:stop + 1]
        engine.close()
    assert runs[True] == runs[False]


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_cuda_streamed_misses_give_the_tokens_of_copied_ones(tmp_path, family):
    """2 of 6 experts cached (HQQ 4-bit), or 2 of gpt-oss's MXFP4 ones: the one-graph token that
    reads each missing expert where it lies in page-locked host memory (model.stream_misses)
    gives the greedy tokens of the decode that copies misses in, and runs ahead of the host."""
    if family == "mixtral":
        make_checkpoint(tmp_path / "ck", seed=8, num_key_value_heads=4, hidden_size=128, intermediate_size=256,
                        num_local_experts=6, num_hidden_layers=3)
        convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 8, "cuda")
    else:
        from tests.engine.test_families import mxfp4_checkpoint
        mxfp4_checkpoint(tmp_path / "ck")
        convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cuda")
    greedy = SamplingSettings(temperature=0, max_new_tokens=24)
    runs = {}
    for stream, depth in ((False, 1), (True, 0), (True, 1)):  # depth 1 streaming: the guesses fetched ahead
        engine = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=2, prefetch=depth)
        engine.model.stream_misses = stream
        engine.eos_ids = set()
        runs[stream, depth] = list(engine.generate_ids(PROMPT, greedy))
        g = engine.model.graphs
        assert g.streams == stream and engine.model.runs_ahead() == stream and g.s.fetch == (stream and depth > 0)
        if stream:
            assert engine.last_stats.cache_misses > 0
        engine.close()
    assert runs[True, 0] == runs[False, 1] and runs[True, 1] == runs[False, 1]


@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_an_int8_head_gives_the_greedy_tokens_of_its_dequantized_reference(tmp_path, graphs, monkeypatch):
    """With quantized attention a large LM head is rounded to int8 on the GPU (here any head:
    the threshold lowered). Greedy tokens equal transformers' on the store's dequantized weights
    with the head's int8 rows dequantized, eager and through CUDA graphs (which capture its kernel),
    with 2 of 6 experts cached and all 6; the engine's sizing counts a byte a weight."""
    monkeypatch.setattr(vram, "INT8_HEAD_MIN_BYTES", 0)
    make_checkpoint(tmp_path / "ck", seed=6, num_key_value_heads=4, hidden_size=128, intermediate_size=256,
                    num_local_experts=6, num_hidden_layers=3)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 8, "cuda")
    ref = load_dequantized_hf_model(tmp_path / "st")
    for k in (2, 6):
        engine = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=k, prefetch=1,
                             cuda_graphs=graphs)
        head = engine.model.lm_head
        assert isinstance(head, int8_gpu.Int8Rows) and head.q.is_cuda and head.q.dtype == torch.int8
        exact = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=k, kernels="reference")
        assert isinstance(exact.model.lm_head, torch.Tensor)  # the reference kernels keep it float
        assert exact.model.dense_bytes - engine.model.dense_bytes == head.rows * head.cols * 3 - 4 * head.rows
        exact.close()
        with torch.no_grad():
            ref.lm_head.weight.copy_(head.dequantize().cpu())
        want = reference_greedy(ref, PROMPT, 24)
        engine.eos_ids = set()
        got = list(engine.generate_ids(PROMPT, SamplingSettings(temperature=0, max_new_tokens=24)))
        assert got == want, f"K={k}"
        engine.close()


def test_cuda_graph_decode_equals_eager_decode(tmp_path):
    make_checkpoint(tmp_path / "ck", seed=5, num_key_value_heads=4, hidden_size=128, intermediate_size=256,
                    num_local_experts=6, num_hidden_layers=3)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 2, 4, "cuda")
    runs = {}
    for graphs in (False, True):
        engine = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=3, prefetch=1,
                             cuda_graphs=graphs)
        engine.eos_ids = set()
        assert (engine.model.graphs is not None) == graphs
        long_prompt = PROMPT * 40  # 320 tokens: decode crosses the 256-position attention span
        runs[graphs] = [list(engine.generate_ids(p, SamplingSettings(temperature=0, max_new_tokens=40)))
                        for p in (PROMPT, long_prompt)]
        stats = engine.last_stats
        assert stats.cache_hits + stats.cache_misses > 0
    assert runs[True] == runs[False]


def test_cuda_a_one_graph_token_traces_what_eager_decode_traces(tmp_path):
    """Every expert cached (one CUDA graph a token, its routing read only when the trace is
    taken) and the eager decode give the same tokens and the same trace; the token goes in from
    the host, through the embedding in host memory or the token copied up."""
    for tied in (False, True):
        make_checkpoint(tmp_path / f"ck{tied}", seed=6, num_key_value_heads=4, hidden_size=128,
                        intermediate_size=256, num_local_experts=6, num_hidden_layers=3, tie_word_embeddings=tied)
        convert_checkpoint(tmp_path / f"ck{tied}", tmp_path / f"st{tied}", 2, 4, "cuda")
        runs = {}
        for graphs in (False, True):
            engine = load_engine(tmp_path / f"st{tied}", device="cuda", dtype="float32", cache_experts=6,
                                 cuda_graphs=graphs)
            engine.eos_ids = set()
            assert engine.model.embed_on_host == (not tied)
            tokens = list(engine.generate_ids(PROMPT, SamplingSettings(temperature=0, max_new_tokens=20)))
            assert (graphs and engine.model.graphs.one_graph) or not graphs
            trace = engine.last_trace
            assert len(trace.selected) == 19 and all(len(layer) == 2 for step in trace.selected for layer in step)
            runs[graphs] = tokens, trace.selected, trace.resident_before
        assert runs[True] == runs[False], tied


def test_cuda_new_graphs_leave_no_memory_behind(tmp_path):
    """Each engine load (and each run of the benchmark) makes a new GraphedDecode; the fused
    kernels' scratch, kept per stream, must be reused, not left behind: memory after decoding
    with the third set of graphs is what it was with the second (it grew every time when
    each set captured on a stream of its own)."""
    import gc

    from moeferry.engine.runtime.decode_graphs import use_cuda_graphs

    make_checkpoint(tmp_path / "ck", seed=6, num_key_value_heads=4, hidden_size=256, intermediate_size=512,
                    num_local_experts=6, num_hidden_layers=3)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 2, 4, "cuda")
    engine = load_engine(tmp_path / "st", device="cuda", dtype="bfloat16", cache_experts=3, prefetch=0)
    sampling = SamplingSettings(temperature=0, max_new_tokens=8)
    after = []
    for _ in range(3):
        engine.model.graphs = None
        gc.collect()  # the old graphs (model <-> graphs is a cycle)
        use_cuda_graphs(engine.model)
        engine.cached_ids = []
        list(engine.generate_ids(PROMPT, sampling))
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    assert after[2] == after[1], after


def test_cuda_a_budget_between_k_and_k_plus_one_gives_the_first_layers_one_slot_more(tmp_path):
    """What a VRAM budget leaves after 2 experts a layer, two experts' bytes, goes to the first
    two layers (vram.DeviceBytes.extra_slot_layers); the copies land in each layer's own slots
    and the greedy tokens are those of 2 a layer, with fewer misses."""
    make_checkpoint(tmp_path / "ck", seed=7, num_key_value_heads=4, hidden_size=256, intermediate_size=512,
                    num_local_experts=8, num_hidden_layers=4)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 4, "cuda")
    sampling = SamplingSettings(temperature=0, max_new_tokens=48)

    def decode(engine, extra: int) -> tuple[list[int], int]:
        assert [engine.model.cache.slots_in(layer) for layer in range(4)] == [3] * extra + [2] * (4 - extra)
        engine.eos_ids = set()
        tokens = list(engine.generate_ids(PROMPT * 3, sampling))
        misses = engine.last_stats.cache_misses
        engine.close()
        return tokens, misses

    engine = load_engine(tmp_path / "st", device="cuda", dtype="bfloat16", cache_experts=2, prefetch=1)
    budget = engine_device_bytes(engine).needed(2) + 2 * engine.store.expert_bytes
    runs = [decode(engine, 0)]
    runs.append(decode(load_engine(tmp_path / "st", device="cuda", dtype="bfloat16", vram_budget=budget, prefetch=1), 2))
    (want, misses), (got, fewer) = runs
    assert got == want and fewer < misses


@pytest.mark.parametrize("landing_waits", [False, True])
def test_cuda_hits_first_decode_equals_routing_first(tmp_path, landing_waits, monkeypatch):
    """The grouped launch before the routing is read (experts in place first, the misses late)
    gives the tokens and logits of the launch after it, for caches of 2 and 4 of 8 experts and
    prefetch depths 0-2: slots being copied over while the first launch runs are never read."""
    from moeferry.engine.runtime import decode_graphs, expert_cache

    make_checkpoint(tmp_path / "ck", seed=7, num_key_value_heads=4, hidden_size=256, intermediate_size=512,
                    num_local_experts=8, num_hidden_layers=4)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 4, "cuda")
    monkeypatch.setattr(expert_cache, "LANDING_WAIT_BYTES", math.inf if landing_waits else 0)
    sampling = SamplingSettings(temperature=0, max_new_tokens=48)
    for k in (2, 4):
        for depth in (0, 1, 2):
            runs = {}
            for hits_first in (False, True):
                monkeypatch.setattr(decode_graphs, "HITS_FIRST", hits_first)
                engine = load_engine(tmp_path / "st", device="cuda", dtype="bfloat16", cache_experts=k,
                                     prefetch=depth)
                engine.eos_ids = set()
                g, ran = engine.model.graphs, []
                g.run = lambda key, fn, ran=ran, replay=g.run: (ran.append(key[0]), replay(key, fn))
                runs[hits_first] = list(engine.generate_ids(PROMPT * 3, sampling))
                assert g.ops.hits_first == hits_first
                assert ("late" in ran) == hits_first  # misses: late launches (and only hits first has them)
                engine.close()
            assert runs[True] == runs[False], f"K={k} D={depth}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [8, 3])
def test_cuda_a_prompt_runs_its_experts_grouped_as_one_at_a_time(tmp_path, dtype, k):
    """A prompt runs each layer's experts in passes of one launch pair (OffloadedMixtral.
    prompt_experts): with every expert cached one pass, with 3 of 8 the cached ones and then the
    others 3 at a time. The logits are those of running them one at a time, to rounding (GEMVs
    for GEMMs); in float32 the greedy tokens are the same."""
    make_checkpoint(tmp_path / "ck", seed=9, num_key_value_heads=4, hidden_size=256, intermediate_size=512,
                    num_local_experts=8, num_hidden_layers=4)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 4, "cuda")
    sampling = SamplingSettings(temperature=0, max_new_tokens=16)
    runs = []
    for grouped in (True, False):
        engine = load_engine(tmp_path / "st", device="cuda", dtype=dtype, cache_experts=k, prefetch=1)
        engine.eos_ids = set()
        m = engine.model
        if not grouped:
            m.grouped_prompt_kernel = False
        assert m.prompt_grouped(len(PROMPT) * 3) == grouped
        m.setup_kv(64)
        logits = m.forward(torch.tensor(PROMPT * 3).cuda(), 0, last_only=False).float()
        engine.cached_ids = []
        runs.append((logits, list(engine.generate_ids(PROMPT * 3, sampling)), m.cache.stats.misses))
        engine.close()
    (got, tokens, copies), (want, want_tokens, want_copies) = runs
    assert ((got - want).norm() / want.norm()).item() <= (1e-4 if dtype == "float32" else 2e-2)
    assert copies <= want_copies
    if dtype == "float32":
        assert tokens == want_tokens
