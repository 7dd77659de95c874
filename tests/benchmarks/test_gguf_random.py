"""benchmarks/gguf_random.py: the GGUFs llama.cpp is measured on hold what its loader asks for.

The expected tensors below are transcribed from llama.cpp's loaders (src/models/llama.cpp,
qwen3moe.cpp, olmoe.cpp, openai-moe.cpp, qwen2moe.cpp: create_tensor's names and ggml dims,
innermost first); each file is read back with gguf-py's own GGUFReader.
"""

from dataclasses import replace

import numpy as np
import pytest

from moeferry.engine.measure.bench_shapes import shape_config
from moeferry.engine.runtime.model import ModelConfig

try:
    from benchmarks import gguf_random
except ModuleNotFoundError as e:
    if e.name != "gguf":
        raise
    pytest.skip("llama.cpp's gguf-py (the `gguf` package, in the dev extra) is not installed",
                allow_module_level=True)

gguf = gguf_random.gguf
Q = gguf.GGMLQuantizationType

TINY = dict(vocab_size=300, num_layers=2, num_experts=4, top_k=2)
CONFIGS = {
    "mixtral": replace(shape_config("mixtral-8x7b", 2), **TINY, hidden_size=256, intermediate_size=512,
                       num_heads=4, num_kv_heads=2, head_dim=64),
    "qwen3_moe": replace(shape_config("qwen3-30b-a3b", 2), **TINY, hidden_size=256, intermediate_size=256,
                         dense_intermediate_size=768, num_heads=4, num_kv_heads=2, head_dim=128),
    "olmoe": replace(shape_config("olmoe-1b-7b", 2), **TINY, hidden_size=256, intermediate_size=512,
                     num_heads=4, num_kv_heads=4, head_dim=64),
    # 288 columns: not a multiple of Q4_K's 256, so the matrices fall back to Q5_0 as llama.cpp's do
    "gpt_oss": replace(shape_config("gpt-oss-20b", 2), **TINY, hidden_size=288, intermediate_size=288,
                       num_heads=4, num_kv_heads=2, head_dim=64),
    "qwen2_moe": ModelConfig.from_hf(dict(
        model_type="qwen2_moe", vocab_size=300, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        shared_expert_intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=4, num_experts_per_tok=2)),
}
ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "gpt_oss": "gpt-oss", "qwen2_moe": "qwen2moe"}


def expected_tensors(cfg: ModelConfig) -> dict[str, list[int]]:
    """name -> ggml dims that llama.cpp's loader of the family creates (required ones, and the
    optional q/k/v biases where the family has them)."""
    H, F, E, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.vocab_size
    q, kv, fam = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.family
    out = {"token_embd.weight": [H, V], "output_norm.weight": [H], "output.weight": [H, V]}
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        t = {"attn_norm.weight": [H], "attn_q.weight": [H, q], "attn_k.weight": [H, kv], "attn_v.weight": [H, kv],
             "attn_output.weight": [q, H], "ffn_gate_inp.weight": [H, E], "ffn_gate_exps.weight": [H, F, E],
             "ffn_up_exps.weight": [H, F, E], "ffn_down_exps.weight": [F, H, E]}
        t["post_attention_norm.weight" if fam == "gpt_oss" else "ffn_norm.weight"] = [H]
        if fam == "qwen3_moe":
            t |= {"attn_q_norm.weight": [cfg.head_dim], "attn_k_norm.weight": [cfg.head_dim]}
        if fam == "olmoe":
            t |= {"attn_q_norm.weight": [H], "attn_k_norm.weight": [H]}
        if fam in ("gpt_oss", "qwen2_moe"):
            t |= {"attn_q.bias": [q], "attn_k.bias": [kv], "attn_v.bias": [kv]}
        if fam == "gpt_oss":
            t |= {"attn_sinks.weight": [cfg.num_heads], "attn_output.bias": [H], "ffn_gate_inp.bias": [E],
                  "ffn_gate_exps.bias": [F, E], "ffn_up_exps.bias": [F, E], "ffn_down_exps.bias": [H, E]}
        if fam == "qwen2_moe":
            S = cfg.shared_expert_size
            t |= {"ffn_gate_inp_shexp.weight": [H], "ffn_gate_shexp.weight": [H, S], "ffn_up_shexp.weight": [H, S],
                  "ffn_down_shexp.weight": [S, H]}
        out |= {p + k: v for k, v in t.items()}
    return out


def field(reader, key):
    return reader.fields[key].contents()


def written(tmp_path, family, qtype):
    path = tmp_path / f"{family}.gguf"
    gguf_random.write_gguf(path, CONFIGS[family], qtype)
    return gguf.GGUFReader(str(path))


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("qtype", ["Q4_K_M", "MXFP4"])
def test_each_family_is_written_as_llama_cpps_architecture(tmp_path, family, qtype):
    cfg = CONFIGS[family]
    r = written(tmp_path, family, qtype)
    arch = field(r, "general.architecture")
    assert arch == ARCH[family]
    got = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    assert got == expected_tensors(cfg)
    types = {t.name: t.tensor_type for t in r.tensors}
    fallback = Q.Q5_0 if cfg.hidden_size % 256 else Q.Q4_K  # gpt_oss's 288 columns
    for name, ty in types.items():
        if name.endswith("_exps.weight"):
            assert ty == (Q.MXFP4 if qtype == "MXFP4" else fallback), name
        elif name.endswith(("attn_q.weight", "token_embd.weight", "_shexp.weight")) and "inp" not in name:
            assert ty == (Q.Q8_0 if qtype == "MXFP4" else fallback), name
        elif name.endswith("attn_output.weight"):  # 256 columns (heads x head_dim) everywhere here
            assert ty == (Q.Q8_0 if qtype == "MXFP4" else Q.Q4_K), name
        elif name.endswith((".bias", "norm.weight", "sinks.weight", "ffn_gate_inp.weight", "inp_shexp.weight")):
            assert ty == Q.F32, name
    want = {"block_count": cfg.num_layers, "embedding_length": cfg.hidden_size, "expert_count": cfg.num_experts,
            "expert_used_count": cfg.top_k, "attention.head_count": cfg.num_heads,
            "attention.head_count_kv": cfg.num_kv_heads, "attention.key_length": cfg.head_dim,
            "attention.value_length": cfg.head_dim, "context_length": cfg.max_position_embeddings}
    want["feed_forward_length" if family == "olmoe" else "expert_feed_forward_length"] = cfg.intermediate_size
    if family == "gpt_oss":
        want |= {"attention.sliding_window": 128, "rope.scaling.original_context_length": 4096}
    if family == "qwen2_moe":
        want["expert_shared_feed_forward_length"] = cfg.shared_expert_size
    assert {k: field(r, f"{arch}.{k}") for k in want} == want
    assert field(r, "tokenizer.ggml.model") == "llama"
    assert len(r.fields["tokenizer.ggml.tokens"].data) == cfg.vocab_size
    assert field(r, "tokenizer.ggml.token_type")[:3] == [2, 3, 3]


@pytest.mark.parametrize("family,qtype,blocks", [("qwen3_moe", "Q4_K_M", {Q.Q4_K}), ("mixtral", "Q2_K", {Q.Q2_K}),
                                                 ("gpt_oss", "MXFP4", {Q.MXFP4, Q.Q8_0}),
                                                 ("gpt_oss", "Q4_K_M", {Q.Q4_K, Q.Q5_0}),  # llama.cpp's fallback
                                                 ("gpt_oss", "Q2_K", {Q.Q2_K, Q.Q4_0})])
def test_the_random_blocks_decode_to_small_finite_weights_that_differ(tmp_path, family, qtype, blocks):
    r = written(tmp_path, family, qtype)
    seen = set()
    for t in r.tensors:
        if t.tensor_type in (Q.F32, Q.F16):
            continue
        seen.add(t.tensor_type)
        rows = t.data.reshape(-1, t.data.shape[-1])[:3]
        w = gguf.quants.dequantize(rows, t.tensor_type)
        assert np.isfinite(w).all() and 0 < np.abs(w).max() < 0.2, t.name
        assert len(np.unique(w)) > 4, t.name  # random codes, not a constant
    assert seen == blocks


def test_the_cli_writes_the_full_width_shape_and_finds_the_ncmoe_that_fits(tmp_path, capsys):
    out = tmp_path / "olmoe.gguf"
    assert gguf_random.main(["--model", "olmoe-1b-7b", "--type", "Q2_K", "--layers", "2", "--fit", "1GiB",
                             str(out)]) == 0
    printed = capsys.readouterr().out.split()
    r = gguf.GGUFReader(str(out))
    shapes = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    assert shapes["blk.1.ffn_down_exps.weight"] == [1024, 2048, 64] and shapes["token_embd.weight"] == [2048, 50304]
    assert "blk.2.attn_norm.weight" not in shapes
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    experts = [sum(n for name, n in sizes.items() if name.startswith(f"blk.{i}.ffn_") and "_exps" in name)
               for i in range(2)]
    total = sum(sizes.values())
    assert printed == ["0", str(total), str(total)]  # all of it fits in 1 GiB
    for fit, n in ((total, 0), (total - 1, 1), (total - experts[0], 1), (total - experts[0] - 1, 2), (1, 2)):
        assert gguf_random.ncmoe_for(sizes, fit) == (n, total - sum(experts[:n]), total), fit
    assert gguf_random.main(["--fit", f"{(total - experts[0]) / 2**20}MiB", str(out)]) == 0  # the file as it is
    assert capsys.readouterr().out.split() == ["1", str(total - experts[0]), str(total)]


def test_a_shape_with_dense_layers_is_refused_in_one_sentence(tmp_path):
    cfg = replace(CONFIGS["qwen3_moe"], moe_layers=(1,))
    with pytest.raises(SystemExit, match="experts in every layer"):
        gguf_random.write_gguf(tmp_path / "x.gguf", cfg, "Q4_K_M")
