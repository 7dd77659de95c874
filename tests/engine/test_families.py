"""qwen3_moe, olmoe, qwen2_moe and gpt_oss on the same engine, against transformers' own models.

Tiny random models from transformers' config classes (odd sizes, top-1 and top-3, dense layers,
a shared expert on and off, sliding windows shorter than the prompt), converted and run through
the CLI contract, for several cache sizes and prefetch depths.
"""

import json
from dataclasses import dataclass, field

import pytest
import torch
import transformers as T

from moeferry.engine.errors import UserError
from moeferry.engine.runtime.generate import SamplingSettings, load_engine
from moeferry.engine.storage.convert import convert_checkpoint
from moeferry.engine.storage.mxfp4 import Mxfp4Matrix, dequantize as mxfp4_dequantize
from moeferry.engine.storage.store import (
    SUPPORTED_FAMILIES,
    experts_array,
    load_dequantized_hf_model,
    open_store,
    sha256_file,
    view_expert,
)
from tests.conftest import make_tokenizer, reference_greedy, run_cli, save_checkpoint

COMMON = dict(vocab_size=96, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.15)
PROMPT_TEXT = "MoE-ferry!"  # 10 tokens of the tests' character-level tokenizer (no space: that is <unk>, id 0,
# which transformers' generate() would mask as padding)
NEW_TOKENS = 14


@dataclass
class Variant:
    id: str
    config: type
    model: type
    kwargs: dict
    stacked: bool = False  # experts saved as transformers' 3-D tensors, not per expert
    shard: str | None = None
    options: dict = field(default_factory=dict)  # ModelConfig fields the variant must produce
    seed: int = 0  # one whose greedy reply is not a single repeated token


VARIANTS = [
    Variant("qwen3_moe-top3-dense-layer", T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
            dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=40,
                 head_dim=20, mlp_only_layers=[1], norm_topk_prob=True), shard="40KB",
            options=dict(qk_norm="head", moe_layers=(0, 2), norm_topk_prob=True)),
    Variant("qwen3_moe-top1-sparse-step-stacked", T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
            dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16, intermediate_size=32,
                 decoder_sparse_step=2, num_hidden_layers=4, norm_topk_prob=False), stacked=True,
            options=dict(moe_layers=(1, 3), norm_topk_prob=False)),
    Variant("olmoe-top3", T.OlmoeConfig, T.OlmoeForCausalLM,
            dict(num_experts=6, num_experts_per_tok=3, intermediate_size=24), shard="40KB",
            options=dict(qk_norm="full", norm_topk_prob=False)),
    Variant("olmoe-top1-clip-stacked", T.OlmoeConfig, T.OlmoeForCausalLM,
            dict(num_experts=4, num_experts_per_tok=1, intermediate_size=40, clip_qkv=1.5), stacked=True,
            options=dict(clip_qkv=1.5)),
    Variant("olmoe-top2-longrope", T.OlmoeConfig, T.OlmoeForCausalLM,  # the long factors from position 16 on
            dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32, num_hidden_layers=2,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
                                      short_factor=[1.0, 1.0, 1.5, 2.0, 3.0, 4.0],
                                      long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0]))),
    Variant("qwen2_moe-shared-top3", T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
            dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=24,
                 shared_expert_intermediate_size=56, intermediate_size=40), shard="40KB", seed=2,
            options=dict(shared_expert_size=56, attn_biases=("q_proj", "k_proj", "v_proj"))),
    Variant("qwen2_moe-no-shared-top1-window", T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
            dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=24, shared_expert_intermediate_size=0,
                 intermediate_size=40, use_sliding_window=True, sliding_window=4, max_window_layers=2),
            stacked=True, seed=2, options=dict(shared_expert_size=0, layer_windows=(4, None, None))),
    Variant("gpt_oss-top3-window5", T.GptOssConfig, T.GptOssForCausalLM,
            dict(num_local_experts=5, num_experts_per_tok=3, intermediate_size=24, head_dim=16, sliding_window=5,
                 rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                      beta_slow=1.0, original_max_position_embeddings=64, truncate=False)),
            options=dict(sinks=True, router="topk_softmax", layer_windows=(5, None, 5))),
    Variant("gpt_oss-top1-window3", T.GptOssConfig, T.GptOssForCausalLM,
            dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=40, head_dim=12, sliding_window=3,
                 num_hidden_layers=2), seed=2,
            options=dict(expert_act="clamped_swiglu", layer_windows=(3, None))),
]
# routers of more than 16 experts take the two-kernel route on the GPU (engine/kernels/decode.py)
MANY_EXPERTS = [
    Variant("qwen3_moe-24-experts-top4", T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
            dict(num_experts=24, num_experts_per_tok=4, moe_intermediate_size=16, intermediate_size=32,
                 head_dim=20, norm_topk_prob=True)),
    Variant("gpt_oss-20-experts-top3", T.GptOssConfig, T.GptOssForCausalLM,
            dict(num_local_experts=20, num_experts_per_tok=3, intermediate_size=24, head_dim=16, sliding_window=5,
                 num_hidden_layers=2)),
]
BY_ID = {v.id: v for v in VARIANTS + MANY_EXPERTS}


def build(v: Variant, seed: int | None = None):
    """The variant's transformers model (float32, eval). Norms, biases and sinks get random
    values too (they are initialised to 1 / 0): an engine that skipped one would still agree."""
    torch.manual_seed(v.seed if seed is None else seed)
    model = v.model(v.config(**{**COMMON, **v.kwargs})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif "bias" in name or "sinks" in name:
                p.normal_(0, 0.5)
    return model


def save(v: Variant, model, folder):
    if not v.stacked:
        return save_checkpoint(model, folder, v.shard)
    from safetensors.torch import save_file
    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    sd = {k: t.contiguous() for k, t in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)  # really 3-D experts
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    make_tokenizer(model.config.vocab_size, folder)
    return model


def reference(model, ids: list[int], eos: int) -> list[int]:
    """transformers' greedy tokens, up to and including the first end-of-sequence token."""
    want = reference_greedy(model, ids, NEW_TOKENS)
    return want[:want.index(eos) + 1] if eos in want else want


@pytest.mark.slow
@pytest.mark.parametrize("vid", [v.id for v in VARIANTS])
def test_greedy_tokens_equal_transformers_through_the_cli(tmp_path, vid):
    v = BY_ID[vid]
    model = save(v, build(v), tmp_path / "ck")
    r = run_cli("convert", str(tmp_path / "ck"), str(tmp_path / "st"), "--expert-bits", "16", "--attn-bits", "16",
                "--device", "cpu")
    assert r.returncode == 0, r.stderr
    st = open_store(tmp_path / "st")
    for name, want in v.options.items():
        assert getattr(st.config, name) == want, name
    tok = T.AutoTokenizer.from_pretrained(str(tmp_path / "st"))
    ids = tok(PROMPT_TEXT)["input_ids"]
    assert len(ids) == len(PROMPT_TEXT)
    want = reference(model, ids, tok.eos_token_id)
    assert len(set(want)) > 3  # the model says something, not one token over and over
    E = st.config.num_experts
    for k, depth in ((1, 0), (2, 1), (E, 2)):
        r = run_cli("generate", str(tmp_path / "st"), "--prompt", PROMPT_TEXT, "--temperature", "0", "--json",
                    "--device", "cpu", "--dtype", "float32", "--max-new-tokens", str(NEW_TOKENS),
                    "--cache-experts", str(k), "--prefetch", str(depth))
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["token_ids"] == want, f"K={k} D={depth}"
        s = out["stats"]
        assert s["cache_hits"] + s["cache_misses"] >= (len(want) - 1) * st.config.num_moe_layers * st.config.top_k
        if k == E:
            assert s["cache_misses"] == 0 and s["bytes_h2d"] == 0
        elif depth == 0:
            assert s["prefetch_issued"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("vid", ["qwen3_moe-top3-dense-layer", "olmoe-top1-clip-stacked",
                                 "qwen2_moe-shared-top3", "gpt_oss-top3-window5"])
def test_every_cache_size_and_prefetch_depth_gives_transformers_tokens(tmp_path, vid):
    v = BY_ID[vid]
    model = save(v, build(v, seed=1), tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=1)
    engine.eos_ids = set()
    ids = list(range(3, 3 + 12))
    want = reference_greedy(model, ids, NEW_TOKENS)
    greedy = SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS)
    for k in range(1, engine.config.num_experts + 1):
        engine.set_cache_experts(k)
        for depth in (0, 1, 2, 3):
            engine.set_prefetch(depth)
            engine.cached_ids = []
            assert list(engine.generate_ids(ids, greedy)) == want, f"K={k} D={depth}"


def test_longrope_takes_its_long_factors_where_transformers_does(tmp_path):
    """LongRoPE's factors depend on how far a forward reaches (transformers' dynamic_rope_update):
    short up to original_max_position_embeddings (16 here), long for any forward past it, its
    whole prompt included. Prompts of 12 tokens (the decode crosses) and 20 (the prefill does; it
    shares 12 with the first, whose cached keys were made short and must not be reused); found
    by random configs: the engine used the short factors throughout."""
    v = BY_ID["olmoe-top2-longrope"]
    model = save(v, build(v, seed=1), tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=2, prefetch=1)
    engine.eos_ids = set()
    greedy = SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS)
    for n in (12, 20):
        ids = list(range(3, 3 + n))
        assert list(engine.generate_ids(ids, greedy)) == reference_greedy(model, ids, NEW_TOKENS), n


@pytest.mark.parametrize("vid,expert_bits,attn_bits", [("qwen3_moe-top3-dense-layer", 4, 8),
                                                        ("olmoe-top3", 2, 4),
                                                        ("qwen2_moe-shared-top3", 3, 8),
                                                        ("qwen2_moe-no-shared-top1-window", 4, 8),
                                                        ("gpt_oss-top1-window3", 4, 4)])
def test_quantized_logits_equal_the_dequantized_reference(tmp_path, vid, expert_bits, attn_bits):
    v = BY_ID[vid]
    save(v, build(v, seed=2), tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", expert_bits, attn_bits, "cpu")
    st = open_store(tmp_path / "st")
    assert st.expert_quant["bits"] == expert_bits and st.attn_quant["bits"] == attn_bits
    ref = load_dequantized_hf_model(tmp_path / "st")
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=2, prefetch=1)
    engine.eos_ids = set()
    ids = list(range(5, 5 + 11))
    engine.model.setup_kv(64)
    got = engine.model.forward(torch.tensor(ids), 0, last_only=False)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    rel = (got - want).norm() / want.norm()
    assert rel <= 1e-4, rel
    greedy = SamplingSettings(temperature=0, max_new_tokens=10)
    assert list(engine.generate_ids(ids, greedy)) == reference_greedy(ref, ids, 10)


@pytest.mark.parametrize("family,sizes,kept", [
    ("olmoe", dict(hidden_size=20, num_attention_heads=2, num_key_value_heads=1, intermediate_size=24),
     ("experts", "attention")),  # 20 rows: neither tiles
    ("qwen3_moe", dict(hidden_size=48, head_dim=10, num_attention_heads=2, num_key_value_heads=1,
                       moe_intermediate_size=24, intermediate_size=40), ("attention",))])  # q: 20 rows
def test_matrices_of_odd_rows_stay_at_16_bits_and_say_so(tmp_path, family, sizes, kept):
    """HQQ's groups need row counts that are multiples of 8 (every released model has them): a
    random model with other sizes still converts through the CLI, the kind that cannot be
    quantized kept at 16 bits with one line saying so, and its tokens are the store's own
    dequantized model's."""
    v = next(v for v in VARIANTS if v.id.startswith(family))
    save(v, v.model(v.config(**{**COMMON, **v.kwargs, **sizes})).eval(), tmp_path / "ck")
    r = run_cli("convert", str(tmp_path / "ck"), str(tmp_path / "st"), "--expert-bits", "4", "--attn-bits", "4",
                "--device", "cpu")
    assert r.returncode == 0, r.stderr
    for what in ("experts", "attention"):
        assert (f"the {what} stay at 16 bits" in r.stderr) == (what in kept), r.stderr
    st = open_store(tmp_path / "st")
    assert st.expert_quant["bits"] == (16 if "experts" in kept else 4) and st.attn_quant["bits"] == 16
    ref = load_dequantized_hf_model(tmp_path / "st")
    r = run_cli("generate", str(tmp_path / "st"), "--prompt", PROMPT_TEXT, "--temperature", "0", "--json",
                "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "8", "--cache-experts", "2")
    assert r.returncode == 0, r.stderr
    tok = T.AutoTokenizer.from_pretrained(str(tmp_path / "st"))
    ids = tok(PROMPT_TEXT)["input_ids"]
    assert json.loads(r.stdout)["token_ids"] == reference(ref, ids, tok.eos_token_id)[:8]


def test_quantized_store_really_is_quantized(tmp_path):
    """The reference above is the store's own dequantized weights: they are close to the source's
    but not equal (else the quantized test would test nothing), shared expert included."""
    v = BY_ID["qwen2_moe-shared-top3"]
    model = save(v, build(v, seed=2), tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 2, 4, "cpu")
    deq = load_dequantized_hf_model(tmp_path / "st")
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.shared_expert.up_proj.weight",
                 "model.layers.2.self_attn.q_proj.weight"):
        src, got = model.get_parameter(name).detach(), deq.get_parameter(name).detach()
        rel = ((got - src).norm() / src.norm()).item()
        assert 0.01 < rel < 0.5, (name, rel)
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert torch.equal(deq.get_parameter(bias), model.get_parameter(bias))  # biases stay exact


@pytest.mark.parametrize("vid,rope", [
    ("gpt_oss-top3-window5", None),  # the variant's YaRN, as gpt-oss's config.json on the Hub spells it
    ("qwen3_moe-top3-dense-layer", dict(type="linear", factor=4.0)),  # and "type" for rope_type
])
def test_a_config_of_rope_scaling_and_rope_theta_gets_transformers_tokens(tmp_path, vid, rope):
    """Configs written before transformers 5 (gpt-oss's and Qwen's on the Hub) give RoPE as
    rope_scaling plus rope_theta, which transformers still reads (found by random configs: the
    engine read only rope_parameters and ran such a gpt-oss without its YaRN)."""
    v = BY_ID[vid]
    kwargs = dict(v.kwargs)
    if rope is not None:
        kwargs["rope_parameters"] = dict(rope_type=rope["type"], rope_theta=50000.0, factor=rope["factor"])
    torch.manual_seed(0)
    model = v.model(v.config(**{**COMMON, **kwargs})).eval()
    save_checkpoint(model, tmp_path / "ck")
    hf = json.loads((tmp_path / "ck" / "config.json").read_text())
    params = hf.pop("rope_parameters")
    hf["rope_theta"] = params.pop("rope_theta")
    hf["rope_scaling"] = params if rope is None else dict(rope)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(hf))
    ref = v.model.from_pretrained(tmp_path / "ck", dtype=torch.float32).eval()
    assert ref.config.rope_parameters["rope_type"] != "default"
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    assert open_store(tmp_path / "st").config.rope_scaling["rope_type"] == ref.config.rope_parameters["rope_type"]
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=2, prefetch=1)
    engine.eos_ids = set()
    ids = list(range(3, 3 + 30))
    greedy = SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS)
    assert list(engine.generate_ids(ids, greedy)) == reference_greedy(ref, ids, NEW_TOKENS)


@pytest.mark.parametrize("vid,windows", [("gpt_oss-top3-window5", (5, None, 5)),
                                         ("qwen2_moe-no-shared-top1-window", (4, None, None))])
def test_a_config_without_layer_types_gets_transformers_windows(tmp_path, vid, windows):
    """Without layer_types in config.json transformers' config classes fill them in: gpt_oss
    slides on every other layer, qwen2_moe on every other one below max_window_layers (found by
    random configs: the engine ran such a gpt_oss without windows, such a qwen2_moe with a window
    on every layer)."""
    v = BY_ID[vid]
    save(v, build(v), tmp_path / "ck")
    hf = json.loads((tmp_path / "ck" / "config.json").read_text())
    del hf["layer_types"]
    (tmp_path / "ck" / "config.json").write_text(json.dumps(hf))
    ref = v.model.from_pretrained(tmp_path / "ck", dtype=torch.float32).eval()
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    assert open_store(tmp_path / "st").config.layer_windows == windows
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=2, prefetch=1)
    engine.eos_ids = set()
    ids = list(range(3, 3 + 12))  # longer than the windows
    greedy = SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS)
    assert list(engine.generate_ids(ids, greedy)) == reference_greedy(ref, ids, NEW_TOKENS)


# ---------------------------------------------------------------------------------------------
# gpt-oss's MXFP4 experts


MXFP4_VARIANT = Variant("gpt_oss-mxfp4", T.GptOssConfig, T.GptOssForCausalLM,  # MXFP4: 32-column blocks
                        dict(hidden_size=64, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                             head_dim=16, sliding_window=4))


def mxfp4_checkpoint(folder, seed: int = 0):
    """A gpt-oss checkpoint whose experts are MXFP4 as the released ones are (random codes,
    block scales of 2^-7 .. 2^-3), and the transformers model that loads it (dequantizing)."""
    from safetensors.torch import load_file, save_file
    model = build(MXFP4_VARIANT, seed)
    save_checkpoint(model, folder)
    sd = load_file(folder / "model.safetensors")
    cfg = model.config
    E, H, F = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(seed)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        del sd[p + "gate_up_proj"], sd[p + "down_proj"]
        for name, rows, cols in (("gate_up_proj", 2 * F, H), ("down_proj", H, F)):
            sd[p + name + "_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
            sd[p + name + "_scales"] = torch.randint(120, 125, (E, rows, cols // 32), dtype=torch.uint8, generator=g)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((folder / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(hf))
    ref = T.GptOssForCausalLM.from_pretrained(folder, quantization_config=T.Mxfp4Config(dequantize=True),
                                              dtype=torch.float32)
    return sd, ref.eval()


def test_mxfp4_experts_are_imported_as_they_are_and_equal_transformers_dequantization(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    sd, ref = mxfp4_checkpoint(tmp_path / "ck")
    r = run_cli("convert", str(tmp_path / "ck"), str(tmp_path / "st"), "--expert-bits", "16", "--attn-bits", "16",
                "--device", "cpu")
    assert r.returncode == 0, r.stderr
    st = open_store(tmp_path / "st")
    assert st.expert_quant["method"] == "mxfp4"
    cfg, experts = st.config, experts_array(st)
    F = cfg.intermediate_size
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = convert_moe_packed_tensors(sd[p + "gate_up_proj_blocks"], sd[p + "gate_up_proj_scales"],
                                             dtype=torch.float32)  # [E, H, 2F], transformers' own
        down = convert_moe_packed_tensors(sd[p + "down_proj_blocks"], sd[p + "down_proj_scales"], dtype=torch.float32)
        assert torch.equal(gate_up, ref.model.layers[layer].mlp.experts.gate_up_proj.detach())
        for e in range(cfg.num_experts):
            w = view_expert(experts[layer, e].clone(), st.expert_fields, st.expert_quant, cfg)
            assert isinstance(w["w1"], Mxfp4Matrix)
            assert torch.equal(w["w1"].blocks, sd[p + "gate_up_proj_blocks"][e, 0::2])  # the bytes, as they were
            assert torch.equal(mxfp4_dequantize(w["w1"]), gate_up[e][:, 0::2].T)
            assert torch.equal(mxfp4_dequantize(w["w3"]), gate_up[e][:, 1::2].T)
            assert torch.equal(mxfp4_dequantize(w["w2"]), down[e].T)
            assert w["w1"].rows == F
    tok = T.AutoTokenizer.from_pretrained(str(tmp_path / "st"))
    ids = tok(PROMPT_TEXT)["input_ids"]
    want = reference(ref, ids, tok.eos_token_id)
    assert len(set(want)) > 3
    for k, depth in ((2, 1), (cfg.num_experts, 0)):
        r = run_cli("generate", str(tmp_path / "st"), "--prompt", PROMPT_TEXT, "--temperature", "0", "--json",
                    "--device", "cpu", "--dtype", "float32", "--max-new-tokens", str(NEW_TOKENS),
                    "--cache-experts", str(k), "--prefetch", str(depth))
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["token_ids"] == want, f"K={k} D={depth}"


def test_mxfp4_experts_requantized_to_hqq(tmp_path):
    """--expert-bits 4 on an MXFP4 checkpoint: dequantized (as transformers does), then HQQ."""
    _, ref = mxfp4_checkpoint(tmp_path / "ck", seed=1)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 16, "cpu")
    assert open_store(tmp_path / "st").expert_quant["method"] == "hqq"
    deq = load_dequantized_hf_model(tmp_path / "st")
    src = ref.model.layers[0].mlp.experts.gate_up_proj.detach()
    got = deq.model.layers[0].mlp.experts.gate_up_proj.detach()
    assert 0.01 < ((got - src).norm() / src.norm()).item() < 0.3
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=3, prefetch=1)
    ids = list(range(4, 16))
    engine.model.setup_kv(64)
    logits = engine.model.forward(torch.tensor(ids), 0, last_only=False)
    with torch.no_grad():
        want = deq(torch.tensor([ids])).logits[0]
    assert ((logits - want).norm() / want.norm()).item() <= 1e-4


def test_mxfp4_experts_run_on_their_cpu_kernel_in_place(tmp_path):
    """gpt-oss's MXFP4 experts run on their CPU kernel from the stored bytes
    (engine/kernels/mxfp4_cpu.py): every expert without a cache (a machine without a GPU) and
    the misses of a cache of 2 (the hybrid), the logits within 3 % of transformers' dequantized
    model's (the kernel rounds the inputs to int8)."""
    from moeferry.engine.runtime.cpu_experts import Mxfp4Expert

    _, ref = mxfp4_checkpoint(tmp_path / "ck", seed=2)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    ids = list(range(4, 16))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1].float()
    for kw in ({}, {"cache_experts": 2}):
        engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="all", **kw)
        assert all(isinstance(c, Mxfp4Expert) for c in engine.model.hybrid.copies.values())
        engine.model.setup_kv(64)
        got = engine.model.forward(torch.tensor(ids), 0)[-1]
        assert ((got - want).norm() / want.norm()).item() < 0.03, kw
        assert engine.model.hybrid.stats.experts > 0


# ---------------------------------------------------------------------------------------------
# Families the engine does not run


def test_an_unsupported_family_gets_one_sentence_naming_the_supported_ones(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 2}))
    r = run_cli("convert", str(ck), str(tmp_path / "st"), "--expert-bits", "4", "--attn-bits", "4")
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert "deepseek_v3" in line and all(f in line for f in SUPPORTED_FAMILIES), line
    assert "Traceback" not in r.stderr and not (tmp_path / "st").exists()


@pytest.mark.parametrize("family,dense", [("qwen2_moe", dict(decoder_sparse_step=2)),
                                          ("qwen3_moe", dict(mlp_only_layers=[0]))])
def test_a_checkpoint_without_moe_layers_gets_one_sentence(tmp_path, family, dense):
    """decoder_sparse_step and mlp_only_layers can leave a one-layer model without any routed
    experts (found by random configs: convert then failed with an IndexError)."""
    v = next(v for v in VARIANTS if v.id.startswith(family))
    model = v.model(v.config(**{**COMMON, **v.kwargs, "num_hidden_layers": 1, "mlp_only_layers": [], **dense})).eval()
    save_checkpoint(model, tmp_path / "ck")
    r = run_cli("convert", str(tmp_path / "ck"), str(tmp_path / "st"), "--expert-bits", "16", "--attn-bits", "16",
                "--device", "cpu")
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert "no layer with routed experts" in line and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_experts_of_another_activation_get_one_sentence(tmp_path, family):
    """transformers runs the experts and MLPs with config.json's hidden_act; the engine's are SiLU
    (found by random configs: hidden_act "gelu" converted and ran, with other tokens than
    transformers'). gpt_oss's experts ignore hidden_act, so it is not refused there."""
    v = next(v for v in VARIANTS if v.id.startswith(family))
    model = v.model(v.config(**{**COMMON, **v.kwargs, "hidden_act": "gelu"})).eval()
    save_checkpoint(model, tmp_path / "ck")
    r = run_cli("convert", str(tmp_path / "ck"), str(tmp_path / "st"), "--expert-bits", "16", "--attn-bits", "16",
                "--device", "cpu")
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert "'gelu'" in line and "hidden_act" in line and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "st").exists()
    v = BY_ID["gpt_oss-top1-window3"]
    model = v.model(v.config(**{**COMMON, **v.kwargs, "hidden_act": "gelu"}))
    save_checkpoint(model, tmp_path / "gpt")
    convert_checkpoint(tmp_path / "gpt", tmp_path / "gpt_st", 16, 16, "cpu")


def test_a_store_of_an_unsupported_family_is_refused(tiny_store, tmp_path):
    import shutil
    st = tmp_path / "st"
    shutil.copytree(tiny_store, st)
    hf = json.loads((st / "config.json").read_text())
    (st / "config.json").write_text(json.dumps(hf | {"model_type": "jamba"}))
    manifest = json.loads((st / "manifest.json").read_text())  # listed as it now is: only the family is wrong
    manifest["files"]["config.json"] = {"size": (st / "config.json").stat().st_size,
                                        "sha256": sha256_file(st / "config.json")}
    (st / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="jamba.*qwen3_moe"):
        open_store(st)


# ---------------------------------------------------------------------------------------------
# GPU: every family through the CUDA-graph decode of its own layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("expert_bits", [16, 4])
@pytest.mark.parametrize("vid", [v.id for v in VARIANTS + MANY_EXPERTS])
def test_cuda_graphs_run_every_family(tmp_path, vid, expert_bits):
    """16-bit: transformers' tokens; 4-bit experts (the grouped kernel where the format takes
    them): the eager layer's tokens on the same weights. Every cache size's graphs too."""
    v = BY_ID[vid]
    model = save(v, build(v), tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", expert_bits, 16, "cuda")
    ids = list(range(3, 15))
    greedy = SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS)
    runs = {}
    for graphs in (False, True):
        engine = load_engine(tmp_path / "st", device="cuda", dtype="float32", cache_experts=1, prefetch=1,
                             cuda_graphs=graphs)
        assert (engine.model.graphs is not None) == graphs and "eager" not in engine.note
        engine.eos_ids = set()
        runs[graphs] = []
        for k in (1, 2, engine.config.num_experts):
            engine.set_cache_experts(k)
            engine.cached_ids = []
            runs[graphs].append(list(engine.generate_ids(ids, greedy)))
    assert runs[True] == runs[False]
    if expert_bits == 16:
        assert runs[True] == [reference_greedy(model, ids, NEW_TOKENS)] * 3


# ---------------------------------------------------------------------------------------------
# The catalog's entries for these families


@pytest.mark.parametrize("entry_id,params", [("qwen3-30b-a3b-instruct-2507-4bit", 30_532_122_624),
                                             ("gpt-oss-20b-mxfp4", None),
                                             ("olmoe-1b-7b-0125-instruct-4bit", None)])
def test_catalog_sizes_are_the_store_layout_of_the_repositorys_config(entry_id, params):
    """Each entry's sizes follow from its config (the repository's config.json, copied into the
    entry) through the engine's own store layout; bf16 downloads are 2 bytes per parameter (Qwen3's
    count as published: 30,532,122,624)."""
    from moeferry.engine.runtime.model import ModelConfig
    from moeferry.engine.storage import quant, store
    from moeferry.engine.storage.convert import quantization_of
    from tests.conftest import ROOT
    entry = {e["id"]: e for e in json.loads((ROOT / "resources" / "catalog.json").read_text())["models"]}[entry_id]
    cfg, s = ModelConfig.from_hf(entry["config"]), entry["sizes"]
    assert cfg.family in SUPPORTED_FAMILIES
    if cfg.family == "gpt_oss":
        eq = {"bits": 4, "method": "mxfp4", "group_size": 32, "bias_dtype": "BF16"}
        assert entry["expert_bits"] == 16 and "original/*" not in entry["allow_patterns"]
    else:
        eq = quantization_of(entry["expert_bits"], quant.EXPERT_SPECS, "BF16", (2, 3, 4),
                             [store.expert_shape(cfg, m)[0] for m in store.EXPERT_MATRICES])
    assert s["expert_bytes"] == store.expert_layout(cfg, eq)[1]
    assert (s["num_layers"], s["num_experts"], s["top_k"]) == (cfg.num_moe_layers, cfg.num_experts, cfg.top_k)
    assert entry["store_bytes"] == s["num_layers"] * s["num_experts"] * s["expert_bytes"] + s["dense_bytes"]
    assert entry["disk_bytes"] == entry["download_bytes"] + entry["store_bytes"]
    if cfg.family != "gpt_oss":
        total = s["dense_params"] + s["num_layers"] * s["num_experts"] * s["expert_params"]
        assert entry["download_bytes"] == 2 * total and total == (params or total)


# ---------------------------------------------------------------------------------------------
# `moeferry bench --model`: the synthetic model of each shape


def test_bench_model_shapes_are_the_published_ones():
    from moeferry.engine.measure import bench, bench_shapes
    from moeferry.engine.runtime.model import ModelConfig
    assert bench_shapes.shape_config("mixtral-8x7b") == ModelConfig(**bench.MIXTRAL)
    assert set(bench_shapes.MODEL_SHAPES) == {"mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b", "olmoe-1b-7b"}
    q, g, o = (bench_shapes.shape_config(m) for m in ("qwen3-30b-a3b", "gpt-oss-20b", "olmoe-1b-7b"))
    assert (q.num_layers, q.hidden_size, q.num_experts, q.top_k, q.intermediate_size, q.num_heads, q.num_kv_heads,
            q.head_dim, q.qk_norm) == (48, 2048, 128, 8, 768, 32, 4, 128, "head")
    assert (g.num_layers, g.hidden_size, g.num_experts, g.top_k, g.sinks, g.rope_scaling["rope_type"]) == \
        (24, 2880, 32, 4, True, "yarn")
    assert g.layer_windows == (128, None) * 12
    assert (o.num_layers, o.num_experts, o.top_k, o.qk_norm, o.norm_topk_prob) == (16, 64, 8, "full", False)
    assert bench_shapes.shape_config("gpt-oss-20b", layers=3).layer_windows == (128, None, 128)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "olmoe-1b-7b", "mixtral-8x7b"])
def test_bench_builds_a_synthetic_model_the_engine_runs(name):
    """The synthetic weights of each shape (shrunk: the CPU) hold what the family's layer reads."""
    from dataclasses import replace

    from moeferry.engine.measure import bench
    from moeferry.engine.measure.bench_shapes import shape_config
    from moeferry.engine.runtime.expert_cache import ExpertCache
    from moeferry.engine.runtime.model import OffloadedMixtral
    from moeferry.engine.storage import quant
    cfg = replace(shape_config(name, layers=2), vocab_size=128, hidden_size=128, intermediate_size=64,
                  num_heads=4, num_kv_heads=2, head_dim=32, num_experts=6, top_k=min(3, shape_config(name).top_k))
    dense, _, host, fields, eq = bench.synthetic_model(cfg, 4, 8, "cpu")
    assert host.shape[:2] == (cfg.num_moe_layers, cfg.num_experts)
    dense = {k: quant.dequantize(w) if isinstance(w, quant.QMatrix) else w.float() for k, w in dense.items()}
    cache = ExpertCache(host, 2, torch.device("cpu"), bench.expert_views(cfg, fields, eq),
                        decode=lambda ws: {m: quant.dequantize(w) if isinstance(w, quant.QMatrix) else w.float()
                                           for m, w in ws.items()})
    model = OffloadedMixtral(cfg, dense, cache, torch.device("cpu"), torch.float32, "reference")
    model.setup_kv(16)
    logits = model.forward(torch.arange(5), 0)
    assert logits.shape == (1, 128) and torch.isfinite(logits).all()
    assert cache.stats.misses > 0


@pytest.mark.parametrize("vid", ["gpt_oss-top1-window3", "qwen3_moe-top3-dense-layer"])
def test_cpu_experts_run_the_family_in_place(tmp_path, vid):
    """The hybrid's CPU experts on an HQQ store of another family (gpt_oss: biases and the
    clamped SwiGLU): the dequantized model's greedy tokens with a cache of 2 and with none,
    each decoded token's norms, attention (sinks, sliding window; qwen3_moe's q/k norms) and
    routing on the compiled CPU operations."""
    from moeferry.engine.kernels.decode_cpu import CpuDecodeOps

    v = BY_ID[vid]
    save(v, build(v, seed=2), tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, 16, "cpu")
    ref = load_dequantized_hf_model(tmp_path / "st")
    ids = list(range(5, 5 + 11))
    want = reference_greedy(ref, ids, 10)
    greedy = SamplingSettings(temperature=0, max_new_tokens=10)
    for kw in ({"cache_experts": 2}, {}):
        engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="all", **kw)
        engine.eos_ids = set()
        assert isinstance(engine.model.decode_ops, CpuDecodeOps)
        assert list(engine.generate_ids(ids, greedy)) == want, kw
        assert engine.last_stats.cpu_expert_runs > 0


@pytest.mark.parametrize("vid,attn_bits", [("gpt_oss-top3-window5", 4), ("olmoe-top3", 8),
                                           ("qwen2_moe-shared-top3", 4), ("qwen3_moe-top3-dense-layer", 8)])
def test_the_cpu_engine_runs_each_family_with_its_dense_matrices_in_low_bit_forms(tmp_path, vid, attn_bits):
    """Every expert on the CPU kernel (no cache): each attention product of a prompt, in its
    low-bit form (2-4 bit in place, 8-bit as int8), stays within 2 % of the dequantized
    matrix's on the same input, and the prompt's logits (the head in int8 too) within 5 % of the
    dequantized model's. Greedy tokens are not compared: on these random models a top-1 or
    clamped-SwiGLU router flips on rounding this small (test_hybrid holds Mixtral's tokens)."""
    from moeferry.engine.kernels.hqq_cpu import CpuQMatrix
    from moeferry.engine.kernels.torch_cpu import CpuMatrix
    from moeferry.engine.runtime.model import ATTN_PROJECTIONS, OffloadedMixtral

    v = BY_ID[vid]
    save(v, build(v, seed=2), tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 4, attn_bits, "cpu")
    ref = load_dequantized_hf_model(tmp_path / "st")
    ids = list(range(5, 5 + 11))
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="all")
    plain = load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="off")
    dequantized = {id(low[n]): full[n] for low, full in zip(engine.model.layers, plain.model.layers)
                   for n in ATTN_PROJECTIONS}
    assert all(isinstance(layer[n], CpuQMatrix if attn_bits < 8 else CpuMatrix)
               for layer in engine.model.layers for n in ATTN_PROJECTIONS)
    errors, linear = [], OffloadedMixtral.linear

    def checked(self, x, w):
        y = linear(self, x, w)
        if id(w) in dequantized:
            want = torch.nn.functional.linear(x, dequantized[id(w)])
            errors.append(((y - want).norm() / want.norm()).item())
        return y

    OffloadedMixtral.linear = checked
    try:
        engine.model.setup_kv(64)
        engine.model.forward(torch.tensor(ids), 0, last_only=False)
    finally:
        OffloadedMixtral.linear = linear
    assert len(errors) == 4 * engine.model.cfg.num_layers and max(errors) < 0.02
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1].float()
    got = engine.model.forward(torch.tensor(ids), 0)[-1]
    assert ((got - want).norm() / want.norm()).item() < 0.05  # measured 0.015-0.022


def test_cpu_experts_refuse_a_16_bit_gpt_oss_store(tmp_path):
    v = BY_ID["gpt_oss-top1-window3"]
    save(v, build(v, seed=2), tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 16, 16, "cpu")
    with pytest.raises(UserError, match="--expert-bits 2, 3 or 4"):
        load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="all")


def test_cpu_experts_say_why_a_2_bit_gpt_oss_store_of_odd_sizes_cannot_run_on_the_cpu(tmp_path):
    """Converted at 2 bits, a gpt_oss model whose expert matrices do not divide into the
    quantization groups keeps them at 16 bits; the CPU kernel cannot run them and gpt_oss has no
    copy format: the sentence says that, not only how to convert."""
    v = Variant("gpt_oss-odd", T.GptOssConfig, T.GptOssForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, hidden_size=40, intermediate_size=20, head_dim=10,
                     sliding_window=3, num_hidden_layers=2))
    save(v, build(v), tmp_path / "ck")
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", 2, 8, "cpu")
    with pytest.raises(UserError, match="stayed at 16 bits.*use --cpu-experts off"):
        load_engine(tmp_path / "st", device="cpu", dtype="float32", cpu_experts="all")
