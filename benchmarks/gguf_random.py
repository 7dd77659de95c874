"""A GGUF of one `moeferry bench --model` shape with random weights, for llama.cpp beside us.

    python benchmarks/gguf_random.py --model qwen3-30b-a3b --type Q4_K_M OUT.gguf
    python benchmarks/gguf_random.py --fit 11GiB OUT.gguf     # the -ncmoe that leaves <= 11 GiB on the GPU
                                                              # (also with --model: of the file it writes)

The shape is engine/measure/bench_shapes.py's (the same ModelConfig the engine's synthetic model has),
written as llama.cpp's architecture of that family (mixtral as "llama", qwen3_moe "qwen3moe",
olmoe "olmoe", gpt_oss "gpt-oss", qwen2_moe "qwen2moe"), with the tensor names, shapes and
hyperparameter keys its loader (src/models/<arch>.cpp) asks for. No quantizer runs: each block
is random codes under small fixed scales (finite, valid), and one array serves every layer.

--type picks the blocks: Q4_K_M writes every matrix as Q4_K (llama.cpp's own Q4_K_M also puts
output and half of attn_v / ffn_down in Q6_K: a few percent more bytes), Q2_K as Q2_K, MXFP4
the experts as MXFP4 (gpt-oss as released) and the other matrices as Q8_0. A matrix whose rows
the block does not divide (gpt-oss's 2880) gets llama.cpp's own fallback: Q4_K -> Q5_0,
Q2_K -> Q4_0. Norms, routers, biases and sinks are float32. The vocabulary is a SentencePiece
one of the model's size (llama-bench feeds random token ids; nothing is tokenized).

llama.cpp's gguf-py is found through $GGUF_PY, else .carry/llamacpp/src/gguf-py (the sources
llama-bench is built from), else the installed `gguf` package (PyPI's is the same code).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeferry.engine.measure.bench_shapes import MODEL_SHAPES, shape_config  # noqa: E402
from moeferry.engine.runtime.model import ModelConfig  # noqa: E402


def import_gguf():
    for where in (os.environ.get("GGUF_PY"), ROOT / ".carry" / "llamacpp" / "src" / "gguf-py"):
        if where and (Path(where) / "gguf" / "__init__.py").is_file():
            sys.path.insert(0, str(where))
            break
    import gguf
    return gguf


gguf = import_gguf()
Q = gguf.GGMLQuantizationType
T = gguf.MODEL_TENSOR

ARCHS = {"mixtral": gguf.MODEL_ARCH.LLAMA, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "olmoe": gguf.MODEL_ARCH.OLMOE,
         "gpt_oss": gguf.MODEL_ARCH.GPT_OSS, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE}
# --type: (experts' block, the other matrices' block, the file type llama.cpp records)
TYPES = {"Q4_K_M": (Q.Q4_K, Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
         "Q2_K": (Q.Q2_K, Q.Q2_K, gguf.LlamaFileType.MOSTLY_Q2_K),
         "MXFP4": (Q.MXFP4, Q.Q8_0, gguf.LlamaFileType.MOSTLY_MXFP4_MOE)}
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q2_K: Q.Q4_0}  # llama.cpp's, for rows the 256-wide block does not divide
# Byte offsets of each block's float16 scales (d, and dmin where there is one) in ggml's block_* structs.
F16_SCALES = {Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q2_K: (80, 82)}
MXFP4_EXPONENT = 120  # E8M0 block scale 2^(120-127): codes of at most 6 give weights below 0.05
EXPERT_TENSORS = re.compile(r"blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")  # what -ncmoe keeps on the CPU


class Blocks:
    """Random quantized matrices of one block type, one numpy array (..., rows, row bytes) each."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def matrix(self, qtype, *shape: int) -> np.ndarray:
        *lead, cols = shape
        per, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        assert cols % per == 0, (qtype, shape)
        n = int(np.prod(lead)) * (cols // per)
        a = np.frombuffer(self.rng.bytes(n * nbytes), np.uint8).reshape(n, nbytes).copy()
        if qtype == Q.MXFP4:
            a[:, 0] = MXFP4_EXPONENT
        for off in F16_SCALES.get(qtype, ()):
            a[:, off:off + 2] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
        return a.reshape(*lead, (cols // per) * nbytes)

    def floats(self, *shape: int, mean: float = 0.0) -> np.ndarray:
        return (mean + 0.02 * self.rng.standard_normal(shape)).astype(np.float32)


def block_type(main, cols: int):
    return main if cols % gguf.GGML_QUANT_SIZES[main][0] == 0 else FALLBACK.get(main, Q.Q8_0)


def write_gguf(path, cfg: ModelConfig, type_name: str, seed: int = 0) -> dict[str, int]:
    """Write cfg's model as llama.cpp's architecture of its family, with random `type_name` blocks;
    returns each tensor's bytes."""
    if cfg.family not in ARCHS:
        raise SystemExit(f"No llama.cpp architecture for {cfg.family}; choose one of {', '.join(ARCHS)}.")
    if cfg.num_moe_layers != cfg.num_layers:
        raise SystemExit(f"llama.cpp's {cfg.family} has experts in every layer, but this shape has dense layers.")
    arch = ARCHS[cfg.family]
    expert_q, dense_q, ftype = TYPES[type_name]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    write_hparams(w, cfg, ftype)
    write_vocab(w, cfg.vocab_size)
    known, sizes = set(gguf.MODEL_TENSORS[arch]), {}
    for kind, bid, suffix, array, qtype in tensors(cfg, expert_q, dense_q, Blocks(seed)):
        assert kind in known, (arch, kind)  # a name this architecture's loader knows
        name = gguf.TENSOR_NAMES[kind].format(bid=bid) + "." + suffix
        w.add_tensor(name, array, raw_dtype=qtype)
        sizes[name] = array.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return sizes


def write_hparams(w, cfg: ModelConfig, ftype) -> None:
    w.add_name(f"random {cfg.family}")
    w.add_file_type(ftype)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    # olmoe reads its experts' width from feed_forward_length, the others from expert_feed_forward_length
    w.add_feed_forward_length(cfg.dense_intermediate_size or cfg.intermediate_size)
    if cfg.family != "olmoe":
        w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.top_k)
    if cfg.shared_expert_size:
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_size)
    if cfg.family == "gpt_oss":  # sliding window on even layers (llama.cpp's default pattern of 2), YaRN
        w.add_sliding_window(next(x for x in cfg.layer_windows if x))
        rope = cfg.rope_scaling or {}
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def write_vocab(w, n: int) -> None:
    """A SentencePiece vocabulary of n tokens: unk, bos, eos, the 256 byte tokens, then words."""
    TT = gguf.TokenType
    tokens = [b"<unk>", b"<s>", b"</s>"] + [b"<0x%02X>" % i for i in range(256)]
    types = [TT.UNKNOWN, TT.CONTROL, TT.CONTROL] + [TT.BYTE] * 256
    tokens += [("\u2581w%d" % i).encode() for i in range(n - len(tokens))]
    types += [TT.NORMAL] * (n - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(n)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def tensors(cfg: ModelConfig, expert_q, dense_q, b: Blocks):
    """(tensor kind, layer, suffix, numpy array, GGML type or None for float32) in file order.
    Numpy shapes are ggml's dims reversed: llama.cpp's {n_embd, n_ff, n_expert} is (E, F, H)."""
    H, F, E, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def mat(qtype, *shape):
        t = block_type(qtype, shape[-1])
        return b.matrix(t, *shape), t

    norm = b.floats(H, mean=1.0)
    embed, outw = mat(dense_q, V, H), mat(dense_q, V, H)
    layer = {T.ATTN_NORM: (norm, None), T.ATTN_Q: mat(dense_q, q, H), T.ATTN_K: mat(dense_q, kv, H),
             T.ATTN_V: mat(dense_q, kv, H), T.ATTN_OUT: mat(dense_q, H, q),
             T.ATTN_POST_NORM if cfg.family == "gpt_oss" else T.FFN_NORM: (norm, None),
             T.FFN_GATE_INP: (b.floats(E, H), None)}
    if cfg.qk_norm == "head":
        layer[T.ATTN_Q_NORM] = layer[T.ATTN_K_NORM] = (b.floats(cfg.head_dim, mean=1.0), None)
    elif cfg.qk_norm == "full":  # llama.cpp's olmoe: both over n_embd (OLMoE has as many kv heads as heads)
        layer[T.ATTN_Q_NORM] = layer[T.ATTN_K_NORM] = (norm, None)
    if cfg.sinks:
        layer[T.ATTN_SINKS] = (b.floats(cfg.num_heads), None)
    gate_up = mat(expert_q, E, F, H)
    layer |= {T.FFN_GATE_EXP: gate_up, T.FFN_UP_EXP: gate_up, T.FFN_DOWN_EXP: mat(expert_q, E, H, F)}
    if cfg.shared_expert_size:
        S = cfg.shared_expert_size
        layer |= {T.FFN_GATE_INP_SHEXP: (b.floats(H), None), T.FFN_GATE_SHEXP: mat(dense_q, S, H),
                  T.FFN_UP_SHEXP: mat(dense_q, S, H), T.FFN_DOWN_SHEXP: mat(dense_q, H, S)}
    bias = {kind: b.floats(n) for kind, m, n in ((T.ATTN_Q, "q_proj", q), (T.ATTN_K, "k_proj", kv),
                                                  (T.ATTN_V, "v_proj", kv), (T.ATTN_OUT, "o_proj", H))
            if m in cfg.attn_biases}
    if cfg.router_bias:
        bias[T.FFN_GATE_INP] = b.floats(E)
    if cfg.expert_act == "clamped_swiglu":  # gpt-oss's experts have biases
        bias |= {T.FFN_GATE_EXP: b.floats(E, F), T.FFN_UP_EXP: b.floats(E, F), T.FFN_DOWN_EXP: b.floats(E, H)}

    yield T.TOKEN_EMBD, None, "weight", *embed
    for i in range(cfg.num_layers):
        for kind, (array, qtype) in layer.items():
            yield kind, i, "weight", array, qtype
            if kind in bias:
                yield kind, i, "bias", bias[kind], None
    yield T.OUTPUT_NORM, None, "weight", norm, None
    yield T.OUTPUT, None, "weight", *outw


def ncmoe_for(sizes: dict[str, int], gpu_bytes: int) -> tuple[int, int, int]:
    """(N, bytes left on the GPU, all bytes) for a GGUF's tensor sizes: the smallest llama-bench
    -ncmoe N (the first N layers' experts on the CPU) that leaves at most gpu_bytes of weights on
    the GPU; every layer if none does."""
    per_layer: dict[int, int] = {}
    for name, n in sizes.items():
        m = EXPERT_TENSORS.match(name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + n
    total = left = sum(sizes.values())
    n = 0
    while left > gpu_bytes and n < len(per_layer):
        left -= per_layer[n]
        n += 1
    return n, left, total


def file_sizes(path) -> dict[str, int]:
    """Each tensor's bytes in an existing GGUF (GGUFReader parses the whole vocabulary: seconds)."""
    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(GiB|MiB|GB|MB|B)", text.strip())
    if not m:
        raise SystemExit(f"--fit {text!r} is not a size like 11GiB or 11500MiB.")
    return int(float(m.group(1)) * {"GiB": 2**30, "MiB": 2**20, "GB": 10**9, "MB": 10**6, "B": 1}[m.group(2)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(MODEL_SHAPES), help="the shape to write")
    p.add_argument("--type", choices=tuple(TYPES), default="Q4_K_M", help="the blocks (default Q4_K_M)")
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)  # the first N layers: tests
    p.add_argument("--fit", help="then print N, the bytes it leaves on the GPU and all bytes, where N is the "
                                 "-ncmoe that leaves at most this much (e.g. 11GiB); without --model, of OUT as it is")
    p.add_argument("out", help="the GGUF file")
    a = p.parse_args(argv)
    if not (a.model or a.fit):
        p.error("give --model to write a GGUF, or --fit to size an existing one")
    if a.model:
        sizes = write_gguf(a.out, shape_config(a.model, a.layers), a.type)
        print(f"{a.out}: {a.model} {a.type}, {os.path.getsize(a.out) / 2**30:.2f} GiB", file=sys.stderr)
    else:
        sizes = file_sizes(a.out)
    if a.fit:
        print(*ncmoe_for(sizes, parse_size(a.fit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
