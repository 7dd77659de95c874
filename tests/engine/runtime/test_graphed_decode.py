"""The CUDA-graph decode (engine/runtime/decode_graphs.py) on the CPU, for every family.

GraphedDecode with capture=False runs the model's layer through the same segments, keys and
host part as on a GPU, only without capturing them. On the eager operations that runs
everywhere; on the fused ones (engine/decode_kernels.FusedOps: the decode kernels, the fused
GEMVs, the grouped expert kernel) under the Triton interpreter (TRITON_INTERPRET=1 with
Triton installed; skipped otherwise). Greedy tokens must equal transformers' (16-bit
weights) or the eager forward's (quantized experts on the grouped kernel).
"""

import numpy as np
import pytest
import torch
import transformers as T

from moeferry.engine.kernels import hqq_gpu
from moeferry.engine.runtime.decode_graphs import GraphedDecode
from moeferry.engine.runtime.expert_cache import ExpertCache
from moeferry.engine.runtime.generate import SamplingSettings, load_engine
from moeferry.engine.runtime.model import OffloadedMixtral
from moeferry.engine.storage import store as store_mod
from moeferry.engine.storage.convert import convert_checkpoint
from moeferry.engine.storage.quant import QMatrix
from tests.conftest import make_checkpoint, reference_greedy
from tests.engine.test_families import BY_ID, Variant, build, save

FUSED = hqq_gpu.fused_available("cpu")  # only under TRITON_INTERPRET=1
OPS = ["eager", pytest.param("fused", marks=pytest.mark.skipif(not FUSED, reason="needs TRITON_INTERPRET=1 and Triton"))]
NEW_TOKENS = 10
PROMPT = list(range(3, 15))
# qwen2_moe without attention biases and with a power-of-two head size: a shared expert next to
# experts of sizes the grouped expert kernel takes
PLAIN_QWEN2 = Variant("qwen2_moe-plain-attention", T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
                      dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24, hidden_size=64,
                           shared_expert_intermediate_size=40, intermediate_size=40, qkv_bias=False), seed=2)
FAMILIES = ["mixtral", "qwen3_moe-top3-dense-layer", "qwen3_moe-top1-sparse-step-stacked", "olmoe-top3",
            "olmoe-top1-clip-stacked", "qwen2_moe-shared-top3", "qwen2_moe-no-shared-top1-window",
            PLAIN_QWEN2.id, "gpt_oss-top3-window5", "gpt_oss-top1-window3", "olmoe-top2-longrope"]


def checkpoint(vid: str, folder):
    if vid == "mixtral":
        return make_checkpoint(folder, seed=5, num_local_experts=5, num_experts_per_tok=2, num_hidden_layers=3,
                               sliding_window=6)
    v = PLAIN_QWEN2 if vid == PLAIN_QWEN2.id else BY_ID[vid]
    return save(v, build(v), folder)


def graphed(model: OffloadedMixtral, ops: str) -> GraphedDecode:
    model.kernels = "reference" if ops == "eager" else "auto"
    model.graphs = GraphedDecode(model, capture=False)
    assert model.graphs.fast == (ops == "fused")
    return model.graphs


@pytest.mark.slow
@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("vid", FAMILIES)
def test_graphed_decode_gives_transformers_tokens(tmp_path, vid, ops):
    hf = checkpoint(vid, tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=1, cuda_graphs=False)
    engine.eos_ids = set()
    want = reference_greedy(hf, PROMPT, NEW_TOKENS)
    E = engine.config.num_experts
    for k, depth in ((1, 0), (2, 1), (E, 2)):
        engine.set_cache_experts(k)
        engine.set_prefetch(depth)
        g = graphed(engine.model, ops)
        g.prepare(64)
        prepared = set(g.graphs)
        engine.cached_ids = []
        got = list(engine.generate_ids(PROMPT, SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS)))
        assert got == want, f"K={k} D={depth}"
        assert set(g.graphs) == prepared, "decode ran a segment prepare() did not capture"
        if ops == "fused":  # every family's attention fused: its graphs do not depend on the span
            assert {key[2] for key in g.graphs if key[0] == "attention"} == {0}
        stats = engine.last_stats
        assert stats.cache_hits + stats.cache_misses >= (NEW_TOKENS - 1) * engine.config.num_moe_layers * engine.config.top_k
        if depth == 0 or k == E:
            assert stats.prefetch_issued == 0


@pytest.mark.slow
@pytest.mark.skipif(not FUSED, reason="needs TRITON_INTERPRET=1 and Triton")
def test_greedy_decode_runs_ahead_of_the_host(tmp_path):
    """Every expert resident: each token's graph also picks the next token and reads its
    embedding (GraphedDecode.decode_greedy), so the host reads a token while the next is made.
    The tokens are the eager forward's, with the embedding on the device and read from host
    memory by the embedding kernel; stopped at an end token (one graph past it has run), the
    conversation goes on as the eager forward's does; sampling and repetition controls take the
    host's loop."""
    checkpoint("mixtral", tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 8, "cpu")
    engine = packed_engine(tmp_path / "st", 1)
    engine = packed_engine(tmp_path / "st", engine.config.num_experts)
    m = engine.model
    greedy = SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS)

    def eager(prompt):
        graphs, m.graphs, m.kernels = m.graphs, None, "reference"
        engine.cached_ids = []
        tokens = list(engine.generate_ids(prompt, greedy))
        m.graphs, m.kernels, engine.cached_ids = graphs, "auto", []
        return tokens
    want = eager(PROMPT)
    g = graphed(m, "fused")
    for host_embedding in (False, True):
        m.embed_on_host = host_embedding  # on the CPU the "host" embedding is read by embed_row all the same
        g.key = None  # check_keys again
        assert m.runs_ahead()
        g.prepare(64)
        engine.cached_ids = []
        assert list(engine.generate_ids(PROMPT, greedy)) == want, f"host embedding {host_embedding}"
        assert {key[0] for key in g.graphs} == {"token", "ahead"}
    stop = next(j for j in range(2, NEW_TOKENS) if want[j] not in want[:j])  # the first time it appears
    engine.eos_ids = {want[stop]}
    assert list(engine.generate_ids(PROMPT, greedy)) == want[:stop + 1]
    assert engine.cached_ids == PROMPT + want[:stop]
    engine.eos_ids = set()
    follow = PROMPT + want[:stop + 1] + [5]
    got = list(engine.generate_ids(follow, greedy))
    assert engine.last_stats.reused_prompt_tokens == len(PROMPT) + stop  # the cached prefix, and the extra graph's row
    assert got == eager(follow)
    ran = []
    g.decode_greedy = lambda *a: ran.append(a)  # must not be called
    for settings in (SamplingSettings(temperature=0.7, max_new_tokens=4, seed=1),
                     SamplingSettings(temperature=0, max_new_tokens=4, repeat_penalty=1.2)):
        engine.cached_ids = []
        assert len(list(engine.generate_ids(PROMPT, settings))) == 4
    assert ran == []


def test_streaming_tokens_are_counted_from_their_routing_and_fetched_guesses():
    """count_streamed: a routed expert the cache lacks is a miss read over the link, unless the
    previous layer's guess fetched it (a hit, a prefetch used); every guess the cache lacked was
    fetched over the link (a prefetch issued)."""
    from types import SimpleNamespace

    from moeferry.engine.runtime.expert_cache import CacheStats
    table = np.array([[0, 1, -1, -1], [-1, -1, 0, -1]], dtype=np.int32)  # layer 0 holds 0 and 1, layer 1 holds 2
    ids = torch.tensor([[0, 3], [2, 1]])  # a hit and a miss in each layer
    guesses = torch.tensor([[1, 0], [3, 2]])  # layer 0's guess for layer 1: both lacking, 1 used; the last row unused
    for fetch, want in ((False, dict(hits=2, misses=2, prefetch_issued=0, prefetch_used=0, bytes_h2d=20)),
                        (True, dict(hits=3, misses=1, prefetch_issued=2, prefetch_used=1, bytes_h2d=30))):
        g = GraphedDecode.__new__(GraphedDecode)
        g.m = SimpleNamespace(cache=SimpleNamespace(table_np=table, stats=CacheStats(), slot_bytes=10))
        g.streamed = [torch.stack([ids, guesses]) if fetch else ids] * 2  # two tokens
        g.count_streamed()
        got = g.m.cache.stats
        assert {key: getattr(got, key) for key in want} == {key: 2 * v for key, v in want.items()}, f"{fetch=}"
        assert g.streamed == []


def packed_engine(folder, k: int, extra_slot_layers: int = 0):
    """An engine whose expert cache keeps the packed experts (no dequantization per load) and
    whose attention keeps its packed matrices: what a GPU runs, so the fused GEMVs and the
    grouped expert kernel have their formats. The first extra_slot_layers layers cache k + 1."""
    engine = load_engine(folder, device="cpu", dtype="float32", cache_experts=k, cuda_graphs=False)
    st, cfg = engine.store, engine.config
    dense = {n: w if isinstance(w, QMatrix) else w.float() for n, w in store_mod.read_dense(st).items()}

    def views(buf):
        return store_mod.view_expert(buf, st.expert_fields, st.expert_quant, cfg)

    cache = ExpertCache(store_mod.experts_array(st), k, torch.device("cpu"), views,
                        extra_slot_layers=extra_slot_layers)
    engine.model = OffloadedMixtral(cfg, dense, cache, torch.device("cpu"), torch.float32, "auto")
    engine.model.setup_kv(256)
    engine.eos_ids = set()
    return engine


@pytest.mark.slow
@pytest.mark.skipif(not FUSED, reason="needs TRITON_INTERPRET=1 and Triton")
@pytest.mark.parametrize("vid", ["mixtral", PLAIN_QWEN2.id])  # expert sizes the fused formats take
def test_grouped_experts_decode_as_the_eager_layer(tmp_path, vid):
    """Quantized experts on hqq_gpu.moe_decode (one launch for all routed experts, slots read on
    the device), a cache of every expert as one token graph, and the hybrid's subsets."""
    checkpoint(vid, tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 8, "cpu")
    check_grouped_decode(tmp_path / "st", shared="qwen2" in vid)


@pytest.mark.slow
@pytest.mark.skipif(not FUSED, reason="needs TRITON_INTERPRET=1 and Triton")
@pytest.mark.parametrize("vid", ["mixtral", PLAIN_QWEN2.id])
def test_a_prompt_runs_its_experts_grouped_as_one_at_a_time(tmp_path, vid):
    """OffloadedMixtral.prompt_experts: a prompt runs each layer's experts in passes of one
    launch pair each (the cached experts, then the others as the slots take them), with the
    logits of running them one at a time (to float32 rounding: GEMVs for GEMMs); each expert
    is copied in at most once a layer, as one at a time would."""
    checkpoint(vid, tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 8, "cpu")
    tokens = torch.tensor(PROMPT)
    E = packed_engine(tmp_path / "st", 2).config.num_experts
    for k in (E, 2):
        engine = packed_engine(tmp_path / "st", k)
        m = engine.model
        copies = []  # each layer's

        def counted(mi, s, picks, copies=copies, prompt_experts=m.prompt_experts, stats=m.cache.stats):
            misses = stats.misses
            prompt_experts(mi, s, picks)
            copies.append(stats.misses - misses)
        m.prompt_experts = counted
        assert m.prompt_grouped(len(PROMPT))
        grouped = m.forward(tokens, 0, last_only=False)
        assert len(copies) == engine.config.num_moe_layers and sum(copies) == m.cache.stats.misses
        assert (sum(copies) > 0) == (k < E)
        fresh = packed_engine(tmp_path / "st", k)
        fresh.model.grouped_prompt_kernel = False
        one_at_a_time = fresh.model.forward(tokens, 0, last_only=False)
        assert sum(copies) <= fresh.model.cache.stats.misses
        torch.testing.assert_close(grouped, one_at_a_time, rtol=1e-4, atol=1e-4)
        assert torch.equal(grouped.argmax(-1), one_at_a_time.argmax(-1))


@pytest.mark.slow
@pytest.mark.skipif(not FUSED, reason="needs TRITON_INTERPRET=1 and Triton")
def test_mxfp4_experts_decode_on_the_grouped_kernel_as_the_eager_layer(tmp_path):
    """gpt-oss's MXFP4 experts (imported as they are) on mxfp4_gpu.moe_decode: biases and the
    clamped SwiGLU in the grouped launch, the eager sink attention around it."""
    from tests.engine.test_families import mxfp4_checkpoint
    mxfp4_checkpoint(tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    check_grouped_decode(tmp_path / "st", shared=False, mxfp4=True)


def check_grouped_decode(store_dir, shared: bool, mxfp4: bool = False):
    """Greedy tokens of the graphed decode on the grouped expert kernel equal the eager forward's,
    with 2 experts cached per layer (a graph per layer; HQQ experts: hits first, the misses in a
    late launch), 3 in the first two layers, with 2 and the misses read from host memory (the
    one-graph token, the cache as the prompt left it; with prefetch, the next layer's guesses
    fetched ahead), and with all of them (the one-graph token)."""
    greedy = SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS)
    E = None
    for k, extra, stream, depth in ((2, 0, False, 1), (2, 2, False, 1), (2, 0, True, 0), (2, 0, True, 1),
                                    (None, 0, False, 1)):
        engine = packed_engine(store_dir, k or 2, extra)
        E = engine.config.num_experts
        if k is None:  # every expert resident: the one-graph token
            engine = packed_engine(store_dir, E)
        engine.set_prefetch(depth)
        engine.model.kernels = "reference"
        want = list(engine.generate_ids(PROMPT, greedy))
        engine.model.stream_misses = stream
        g = graphed(engine.model, "fused")
        g.prepare(64)
        engine.cached_ids = []
        assert list(engine.generate_ids(PROMPT, greedy)) == want, f"K={k or E}, {extra} layers with one more, {stream=}"
        assert g.grouped and g.one_graph == (k is None or stream) and g.streams == stream
        assert g.s.fetch == (stream and depth > 0)
        assert g.ops.hits_first == (k is not None and not stream and not mxfp4)
        keys = {key[0] for key in g.graphs}
        assert keys == ({"token", "ahead"} if g.one_graph else {"attention", "moe", "head"} | ({"shared"} if shared else set())
                        | ({"late"} if g.ops.hits_first else set()))
        if stream:  # the decoded tokens' misses were read over the "link", not copied in: counted as such
            stats, cfg = engine.last_stats, engine.config
            assert stats.cache_misses > 0
            assert stats.cache_hits + stats.cache_misses >= (NEW_TOKENS - 1) * cfg.num_moe_layers * cfg.top_k
            assert stats.bytes_h2d == (stats.cache_misses + stats.prefetch_issued) * engine.model.cache.slot_bytes
            fenced = []  # the next prompt's copies wait for the streaming graphs queued before them
            engine.model.cache.fence = lambda fenced=fenced: fenced.append(True)
            engine.cached_ids = []
            list(engine.generate_ids(PROMPT[:3], SamplingSettings(temperature=0, max_new_tokens=2)))
            assert fenced == [True]


@pytest.mark.skipif(not FUSED, reason="needs TRITON_INTERPRET=1 and Triton")
def test_the_grouped_kernel_runs_only_the_gpu_part_of_a_hybrid_layer(tmp_path):
    """grouped_experts with a subset of the top-k positions (the others on the CPU): out is the
    weighted sum of exactly those experts, as the eager per-expert path adds them."""
    checkpoint("mixtral", tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 8, "cpu")
    engine = packed_engine(tmp_path / "st", 5)
    m = engine.model
    g = graphed(m, "fused")
    g.check_keys()
    s = g.s
    m.cache.sync_tables()
    s.h.normal_(generator=torch.Generator().manual_seed(0))
    s.ids[0, 0] = torch.tensor([3, 1])
    s.weights[0] = torch.tensor([0.7, 0.3])
    for at in ([0], [1], [0, 1], []):
        m.grouped_experts(0, s, g.ops, g.run, at)
        want = torch.zeros_like(s.out)
        for p in at:
            e = int(s.ids[0, 0, p])
            want += m.expert(m.cache.slot_weights(0, m.cache.lru[0][e]), s.h) * s.weights[0, p]
        torch.testing.assert_close(s.out, want, rtol=1e-5, atol=1e-6)


def test_rope_tables_cover_the_kv_cache_not_the_whole_context(tmp_path):
    """The graphs' cos/sin tables hold the KV cache's positions (a model's 262144-position
    context made 0.5 GiB of them, past the VRAM budget), follow a larger KV cache, and the
    tokens after it grows still equal transformers'."""
    from moeferry.engine.runtime.model import rope_cos_sin

    hf = checkpoint("mixtral", tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=2, cuda_graphs=False)
    engine.eos_ids = set()
    m = engine.model
    m.kv = None
    m.setup_kv(8)
    g = graphed(m, "eager")
    assert g.s.cos.shape[0] == 256 < engine.config.max_position_embeddings
    prompt = [3 + i % 90 for i in range(200)]  # with the new tokens, past the 256 positions the tables hold
    got = list(engine.generate_ids(prompt, SamplingSettings(temperature=0, max_new_tokens=80)))
    assert m.kv.capacity == 512 and g.s.cos.shape[0] == 512
    cos, sin = rope_cos_sin(m.inv_freq, torch.arange(512), m.dtype, m.rope_scale)
    assert torch.equal(g.s.cos, cos) and torch.equal(g.s.sin, sin)
    assert got == reference_greedy(hf, prompt, 80)


@pytest.mark.parametrize("ops", [None, *OPS])
def test_an_embedding_in_host_memory_gives_the_lookups_logits(tmp_path, ops):
    """The path of an untied embedding on a GPU (kept in host memory: embed_into copies the
    tokens' rows into x before layer 0, and neither attention_block nor any graph looks them up),
    taken on the CPU: the eager forward (ops None) and the graphed decode give the logits of the
    lookup in layer 0, for a prompt and the tokens after it (through the staging row)."""
    checkpoint("mixtral", tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=2, cuda_graphs=False)
    m = engine.model
    assert not m.embed_on_host and m.staging is None  # on the CPU the embedding is on the device

    def logits() -> torch.Tensor:
        if ops is not None:
            graphed(m, ops).prepare(64)
        out = [m.forward(torch.tensor(PROMPT), 0)]
        for n, tok in enumerate([5, 9, 13, 2]):
            out.append(m.forward(torch.tensor([tok]), len(PROMPT) + n))
        return torch.cat(out)

    want = logits()
    m.embed_on_host = True
    m.staging = torch.empty(1, m.cfg.hidden_size, dtype=m.embed.dtype)  # on a GPU page-locked
    assert torch.equal(logits(), want)
