"""The offloaded engine is the same model as transformers' MixtralForCausalLM."""

import pytest
import torch

from moeferry.engine.runtime.generate import SamplingSettings, load_engine
from moeferry.engine.storage.convert import convert_checkpoint
from moeferry.engine.storage.store import load_dequantized_hf_model
from tests.conftest import make_checkpoint, reference_greedy

CONFIGS = [
    # experts, top-k, q heads / kv heads, layers, sharded
    dict(num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
         num_hidden_layers=2, shard="60KB"),
    dict(num_local_experts=8, num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=2,
         num_hidden_layers=3, shard=None),
    dict(num_local_experts=6, num_experts_per_tok=1, num_attention_heads=4, num_key_value_heads=4,
         num_hidden_layers=2, shard="100KB"),
    dict(num_local_experts=5, num_experts_per_tok=3, num_attention_heads=4, num_key_value_heads=1,
         num_hidden_layers=4, shard=None),
]

PROMPT = [1, 10, 20, 30, 40, 50, 60, 7]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_greedy_tokens_equal_transformers_for_every_cache_size_and_prefetch(tmp_path, i):
    cfg = dict(CONFIGS[i])
    shard = cfg.pop("shard")
    model = make_checkpoint(tmp_path / "ck", seed=i, shard=shard, **cfg)
    if shard:
        assert len(list((tmp_path / "ck").glob("model-*.safetensors"))) > 1
    want = reference_greedy(model, PROMPT, 24)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=1)
    greedy = SamplingSettings(temperature=0, max_new_tokens=24)
    engine.eos_ids = set()  # transformers' reference runs without stopping at </s>
    for k in range(1, cfg["num_local_experts"] + 1):
        engine.set_cache_experts(k)
        for depth in (0, 1, 2):
            engine.set_prefetch(depth)
            engine.cached_ids = []  # no KV reuse between runs: each run is a fresh generation
            got = list(engine.generate_ids(PROMPT, greedy))
            assert got == want, f"K={k} D={depth}"
            s = engine.last_stats
            layers, top_k = cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
            decode_uses = 23 * layers * top_k
            assert s.cache_hits + s.cache_misses >= decode_uses
            if k == cfg["num_local_experts"]:
                assert s.cache_misses == 0 and s.bytes_h2d == 0


@pytest.mark.parametrize("expert_bits,attn_bits", [(2, 4), (3, 8), (4, 4)])
def test_quantized_store_logits_match_transformers_on_dequantized_weights(tmp_path, expert_bits, attn_bits):
    make_checkpoint(tmp_path / "ck", seed=3, shard="80KB", num_local_experts=4,
                    hidden_size=64, intermediate_size=128, num_key_value_heads=4)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", expert_bits, attn_bits, "cpu")
    ref = load_dequantized_hf_model(tmp_path / "st")
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=2, prefetch=1)
    engine.eos_ids = set()
    ids = torch.tensor(PROMPT)
    engine.model.setup_kv(64)
    got = engine.model.forward(ids, 0, last_only=False)
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
    rel = (got - want).norm() / want.norm()
    assert rel <= 1e-3, rel
    greedy = SamplingSettings(temperature=0, max_new_tokens=12)
    assert list(engine.generate_ids(PROMPT, greedy)) == reference_greedy(ref, PROMPT, 12)


def test_quantized_store_is_smaller_and_differs_from_source(tmp_path, tiny_checkpoint):
    """A quantized store really is quantized: fewer bytes, weights close to but not equal to the source."""
    convert_checkpoint(tiny_checkpoint[0], tmp_path / "q2", 2, 4, "cpu")
    convert_checkpoint(tiny_checkpoint[0], tmp_path / "q16", 16, 16, "cpu")
    size = lambda p: (p / "experts.safetensors").stat().st_size  # noqa: E731
    assert size(tmp_path / "q2") * 6 < size(tmp_path / "q16")  # fp32 source: 32 bits vs ~3-4
    ref = tiny_checkpoint[1].model.layers[0].mlp.experts.gate_up_proj.detach()
    deq = load_dequantized_hf_model(tmp_path / "q2").model.layers[0].mlp.experts.gate_up_proj
    rel = ((deq - ref).norm() / ref.norm()).item()
    assert 0.05 < rel < 0.5


def test_kv_prefix_reuse_gives_the_same_tokens(tiny_store, tiny_checkpoint):
    engine = load_engine(tiny_store, device="cpu", cache_experts=2)
    engine.eos_ids = set()
    greedy = SamplingSettings(temperature=0, max_new_tokens=6)
    first = list(engine.generate_ids(PROMPT, greedy))
    longer = PROMPT + first + [11, 12]
    got = list(engine.generate_ids(longer, greedy))
    assert engine.last_stats.reused_prompt_tokens == len(PROMPT) + len(first) - 1
    assert got == reference_greedy(tiny_checkpoint[1], longer, 6)


def test_the_greedy_loop_that_runs_ahead_keeps_the_conversation(tiny_store, tiny_checkpoint, monkeypatch):
    """Engine._generate's greedy path through model.decode_greedy (taken where the model runs
    ahead: on a GPU with every expert resident; here its one-forward-a-token form): the tokens
    of the host loop, an end token stops it with the generator closed, the cached tokens are
    those fed, and a longer prompt reuses them; sampling or a penalty keeps the host loop."""
    engine = load_engine(tiny_store, device="cpu", cache_experts=2)
    engine.eos_ids = set()
    greedy = SamplingSettings(temperature=0, max_new_tokens=8)
    want = list(engine.generate_ids(PROMPT, greedy))
    m = engine.model
    calls, closed = [], []

    def decode_greedy(token, start, n, original=m.decode_greedy):
        calls.append((token, start, n))
        try:
            yield from original(token, start, n)
        finally:
            closed.append(start)
    monkeypatch.setattr(m, "runs_ahead", lambda: True)
    monkeypatch.setattr(m, "decode_greedy", decode_greedy)
    engine.cached_ids = []
    assert list(engine.generate_ids(PROMPT, greedy)) == want
    assert calls == [(want[0], len(PROMPT), 7)] and closed == [len(PROMPT)]
    stop = next(j for j in range(1, 8) if want[j] not in want[:j])
    engine.eos_ids = {want[stop]}
    engine.cached_ids = []
    assert list(engine.generate_ids(PROMPT, greedy)) == want[:stop + 1]
    assert engine.cached_ids == PROMPT + want[:stop] and len(closed) == 2
    engine.eos_ids = set()
    longer = PROMPT + want[:stop + 1] + [11]
    assert list(engine.generate_ids(longer, greedy)) == reference_greedy(tiny_checkpoint[1], longer, 8)
    assert engine.last_stats.reused_prompt_tokens == len(PROMPT) + stop
    calls.clear()
    for settings in (SamplingSettings(temperature=0.8, max_new_tokens=4, seed=3),
                     SamplingSettings(temperature=0, max_new_tokens=4, repeat_penalty=1.3)):
        engine.cached_ids = []
        assert len(list(engine.generate_ids(PROMPT, settings))) == 4
    assert calls == []


def test_sampling_is_reproducible_with_a_seed(tiny_store):
    engine = load_engine(tiny_store, device="cpu")
    s = SamplingSettings(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=7)
    a = list(engine.generate_ids(PROMPT, s))
    engine.cached_ids = []
    b = list(engine.generate_ids(PROMPT, s))
    s.seed = 8
    c = list(engine.generate_ids(PROMPT, s))
    assert a == b and a != c


def test_stream_yields_text_and_cancel_stops_it(tiny_store):
    import threading
    engine = load_engine(tiny_store, device="cpu")
    engine.eos_ids = set()
    cancel = threading.Event()
    pieces = []
    for piece in engine.stream("hello", SamplingSettings(temperature=0, max_new_tokens=50), cancel):
        pieces.append(piece)
        if len(pieces) == 3:
            cancel.set()
    assert len(pieces) == 3
    assert engine.last_stats.new_tokens == 3
    text = "".join(p.text for p in pieces)
    assert text == engine.tokenizer.decode([p.token_id for p in pieces], skip_special_tokens=True)


def test_chat_template_is_applied(tiny_store):
    engine = load_engine(tiny_store, device="cpu")
    ids = engine.encode([{"role": "user", "content": "hi"}], chat=True)
    text = engine.tokenizer.decode(ids)
    assert text.replace(" ", "").startswith("<user>hi</s><assistant>".replace(" ", "")[:2]) or "h" in text
    assert engine.encode("hi", chat=True) == ids
    assert engine.encode("hi", chat=False) != ids


def test_expert_trace_records_routing_and_residency(tiny_store):
    engine = load_engine(tiny_store, device="cpu", cache_experts=2, prefetch=0)
    engine.eos_ids = set()
    list(engine.generate_ids(PROMPT, SamplingSettings(temperature=0, max_new_tokens=5)))
    t = engine.last_trace
    assert len(t.selected) == 4  # the first token comes from prefill
    hits = sum(e in res for sel_t, res_t in zip(t.selected, t.resident_before)
               for sel, res in zip(sel_t, res_t) for e in sel)
    assert all(len(res) <= 2 for res_t in t.resident_before for res in res_t)
    assert hits <= engine.last_stats.cache_hits


def test_detokenize_gives_the_whole_text_from_short_windows():
    """The demo's byte-level BPE: multi-byte characters split over tokens, leading spaces."""
    from transformers import AutoTokenizer

    from moeferry.engine.runtime.generate import detokenize
    from moeferry.engine.setup.demo import demo_store_path
    tok = AutoTokenizer.from_pretrained(str(demo_store_path()))
    text = ("Use `open()` to read a file: naïve café, 日本語 and 🙂 too.\n    for line in f:\n"
            "        print(line)  # ünïcödé ") * 8
    ids = tok.encode(text, add_special_tokens=False)
    lengths = []
    real_decode = tok.decode

    def decode(window, **kw):
        lengths.append(len(window))
        return real_decode(window, **kw)

    tok.decode = decode
    pieces = list(detokenize(tok, ids))
    assert "".join(p for _, p in pieces) == real_decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for _, p in pieces)
    assert len(ids) > 200 and max(lengths) <= 8  # never the whole reply


def test_a_prompts_tokens_per_expert_come_from_the_host_routing_as_nonzero_finds_them():
    """token_routes gives each expert the tokens routed to it (ascending) and their top-k
    positions, the same pairs a nonzero over the routing finds, from one upload."""
    from moeferry.engine.runtime.model import token_routes

    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(7, generator=g)[:3] for _ in range(11)])  # [T=11, k=3] of 7 experts
    routes = token_routes(ids.tolist(), torch.device("cpu"))
    assert sorted(routes) == sorted(set(ids.flatten().tolist()))
    for e, (rows, pos) in routes.items():
        want_rows, want_pos = (ids == e).nonzero(as_tuple=True)
        assert rows.tolist() == want_rows.tolist() and pos.tolist() == want_pos.tolist()
