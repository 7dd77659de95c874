"""Random configs of every supported family against transformers, as the engine will be checked
on checkpoints the other tests have not seen.

Each seed draws a family (mixtral, qwen3_moe, olmoe, qwen2_moe, gpt_oss) and its sizes and options
(heads and key/value heads, head sizes, 1-4 layers, 2-20 experts, top-1 to top-4, tied
embeddings, attention biases, dense layers, shared experts, sliding windows, YaRN, q/k clipping),
stores the checkpoint with experts per expert or stacked, converts it at 16 bits or quantized,
and checks the greedy tokens of two turns (the second extends the first, so its prefix comes
from the KV cache) against transformers' on the same weights (the store's dequantized ones when
quantized), under a random cache size and prefetch depth.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers as T

from moeferry.engine.runtime.generate import SamplingSettings, load_engine
from moeferry.engine.storage.convert import convert_checkpoint
from moeferry.engine.storage.store import load_dequantized_hf_model
from tests.engine.test_families import Variant, save

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss")
SEEDS = range(30)


def random_config(rng: random.Random, family: str) -> tuple[type, type, dict]:
    heads = rng.choice([2, 4, 6])
    c = dict(vocab_size=rng.choice([64, 96, 130]), num_hidden_layers=rng.randint(1, 4), num_attention_heads=heads,
             num_key_value_heads=rng.choice([d for d in (1, 2, 3, 6) if heads % d == 0]),
             hidden_size=rng.choice([h for h in (32, 48, 64, 96) if h % heads == 0 and h // heads % 2 == 0]),
             max_position_embeddings=256, initializer_range=0.15, tie_word_embeddings=rng.random() < 0.3)
    experts = rng.randint(2, 20)
    top_k = rng.randint(1, min(experts, 4))
    dense_layers = [i for i in range(c["num_hidden_layers"]) if rng.random() < 0.3]
    if family == "mixtral":
        c.update(num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=rng.choice([8, 16, 24, 40]),
                 sliding_window=rng.choice([None, rng.randint(2, 8)]),
                 rope_parameters=dict(rope_type="default", rope_theta=rng.choice([1e4, 1e6])))
        return T.MixtralConfig, T.MixtralForCausalLM, c
    if family == "qwen3_moe":
        c.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=rng.choice([8, 16, 24]),
                 intermediate_size=rng.choice([16, 40]), head_dim=rng.choice([8, 12, 16, 20]),
                 norm_topk_prob=rng.random() < 0.5, attention_bias=rng.random() < 0.3,
                 decoder_sparse_step=rng.choice([1, 1, 2]), mlp_only_layers=dense_layers)
        return T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, c
    if family == "olmoe":
        c.update(num_experts=experts, num_experts_per_tok=top_k, intermediate_size=rng.choice([8, 16, 24, 40]),
                 norm_topk_prob=rng.random() < 0.5, clip_qkv=rng.choice([None, None, 0.5, 1.5, 4.0]))
        return T.OlmoeConfig, T.OlmoeForCausalLM, c
    if family == "qwen2_moe":
        c.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=rng.choice([8, 16, 24]),
                 shared_expert_intermediate_size=rng.choice([0, 16, 56]), intermediate_size=40,
                 norm_topk_prob=rng.random() < 0.5, decoder_sparse_step=rng.choice([1, 1, 2]),
                 mlp_only_layers=dense_layers)
        if rng.random() < 0.4:
            c.update(use_sliding_window=True, sliding_window=rng.randint(2, 8),
                     max_window_layers=rng.randint(0, c["num_hidden_layers"]))
        return T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, c
    c.update(num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=rng.choice([8, 16, 24, 40]),
             head_dim=rng.choice([8, 12, 16]), sliding_window=rng.randint(2, 8))
    if rng.random() < 0.5:
        c["rope_parameters"] = dict(rope_type="yarn", rope_theta=150000.0, factor=rng.choice([2.0, 4.0]),
                                    beta_fast=32.0, beta_slow=1.0, truncate=False,
                                    original_max_position_embeddings=rng.choice([16, 64]))
    return T.GptOssConfig, T.GptOssForCausalLM, c


def has_moe_layer(family: str, c: dict) -> bool:
    if family not in ("qwen3_moe", "qwen2_moe"):
        return True
    return any(i not in c["mlp_only_layers"] and (i + 1) % c["decoder_sparse_step"] == 0
               for i in range(c["num_hidden_layers"]))


def greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens by whole forwards (generate() would take token 0 for padding)."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(out[-1])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_config_decodes_transformers_tokens_over_two_turns(tmp_path, seed):
    rng = random.Random(seed)
    family = FAMILIES[seed % len(FAMILIES)]
    config, model_class, c = random_config(rng, family)
    while not has_moe_layer(family, c):  # every layer dense: not a mixture of experts (a UserError of its own)
        config, model_class, c = random_config(rng, family)
    torch.manual_seed(seed)
    model = model_class(config(**c)).eval()
    with torch.no_grad():  # norms, biases and sinks start at 1 / 0: random, so that skipping one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif "bias" in name or "sinks" in name:
                p.normal_(0, 0.5)
    stacked = rng.random() < 0.5 and not c["tie_word_embeddings"]
    save(Variant("random", config, model_class, {}, stacked=stacked), model, tmp_path / "ck")
    quantized = rng.random() < 0.35
    bits = (rng.choice([2, 3, 4]), rng.choice([4, 8])) if quantized else (16, 16)
    convert_checkpoint(tmp_path / "ck", tmp_path / "st", *bits, "cpu")
    if quantized:
        model = load_dequantized_hf_model(tmp_path / "st")
    experts = c.get("num_experts", c.get("num_local_experts"))
    engine = load_engine(tmp_path / "st", device="cpu", dtype="float32", cache_experts=rng.randint(1, experts),
                         prefetch=rng.randint(0, 2))
    engine.eos_ids = set()
    ids = [rng.randrange(3, c["vocab_size"]) for _ in range(rng.randint(3, 24))]
    first = list(engine.generate_ids(ids, SamplingSettings(temperature=0, max_new_tokens=10)))
    assert first == greedy(model, ids, 10), (family, c, bits)
    ids += first + [rng.randrange(3, c["vocab_size"]) for _ in range(rng.randint(1, 12))]
    second = list(engine.generate_ids(ids, SamplingSettings(temperature=0, max_new_tokens=8)))
    assert engine.last_stats.reused_prompt_tokens > 0
    assert second == greedy(model, ids, 8), (family, c, bits)
