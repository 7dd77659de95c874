"""The shapes `moeferry bench --model` builds, and the random dense weights of each family.

MODEL_SHAPES holds each model as the config.json fields the engine reads (ModelConfig.from_hf),
so a family's options come with its shape; shape_config(model, layers) keeps its first layers;
native_expert_format(model) is the format its experts are in as users run them.
"""

from __future__ import annotations

import torch

from moeferry.engine.errors import UserError
from moeferry.engine.runtime.model import ModelConfig
from moeferry.engine.storage import store

MODEL_SHAPES = {
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                         num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e7, max_position_embeddings=262144),
    "gpt-oss-20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_local_experts=32, num_experts_per_tok=4, attention_bias=True, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"] * 18, rms_norm_eps=1e-5,
                        max_position_embeddings=131072,
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                             beta_slow=1.0, original_max_position_embeddings=4096, truncate=False)),
    "olmoe-1b-7b": dict(model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                        num_experts_per_tok=8, norm_topk_prob=False, rms_norm_eps=1e-5, rope_theta=10000.0,
                        max_position_embeddings=4096),
}


def native_expert_format(model: str) -> str:
    """The format a model's experts are in as users run them: gpt-oss ships MXFP4 (imported as it
    is by engine/storage/convert.py), the others are HQQ-quantized at conversion."""
    return "mxfp4" if MODEL_SHAPES.get(model, {}).get("model_type") == "gpt_oss" else "hqq"


def shape_config(model: str, layers: int | None = None) -> ModelConfig:
    """The ModelConfig of MODEL_SHAPES[model], with its first `layers` layers (all: None)."""
    if model not in MODEL_SHAPES:
        raise UserError(f"Unknown --model {model!r}; choose one of {', '.join(MODEL_SHAPES)}.")
    hf = dict(MODEL_SHAPES[model])
    layers = layers or hf["num_hidden_layers"]
    hf["num_hidden_layers"] = layers
    if "layer_types" in hf:
        hf["layer_types"] = hf["layer_types"][:layers]
    return ModelConfig.from_hf(hf)



def family_dense(cfg: ModelConfig, i: int, qmatrix, device, gen) -> dict:
    """Layer i's random dense weights beyond Mixtral's (store names, engine/storage/store.py): q/k norms,
    biases, sinks, the router's bias, a shared expert, a dense layer's MLP. qmatrix(rows, cols)
    makes a random quantized matrix (quant.random_qmatrix at the attention's width)."""
    p, H, dtype = f"model.layers.{i}.", cfg.hidden_size, torch.bfloat16

    def small(*shape, std=0.02):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen) * std

    out = {p + f"self_attn.{m}.bias": small(store.attn_shape(cfg, m)[0]) for m in cfg.attn_biases}
    if cfg.qk_norm != "none":
        n = (1, 1) if cfg.qk_norm == "head" else (cfg.num_heads, cfg.num_kv_heads)
        out[p + "self_attn.q_norm.weight"] = torch.ones(n[0] * cfg.head_dim, device=device, dtype=dtype)
        out[p + "self_attn.k_norm.weight"] = torch.ones(n[1] * cfg.head_dim, device=device, dtype=dtype)
    if cfg.sinks:
        out[p + "self_attn.sinks"] = small(cfg.num_heads, std=1.0)
    if cfg.router_bias:
        out[p + "block_sparse_moe.gate.bias"] = small(cfg.num_experts)
    mlp = None
    if i not in cfg.moe_layer_ids:
        mlp = p + "mlp."
    elif cfg.shared_expert_size:
        mlp = p + "mlp.shared_expert."
        out[p + "mlp.shared_expert_gate.weight"] = small(1, H)
    for m in store.MLP_MATRICES if mlp else ():
        out[mlp + m + ".weight"] = qmatrix(*store.dense_matrix_shape(cfg, mlp + m))
    return out
