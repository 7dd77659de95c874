"""Hugging Face MoE checkpoint folder -> MoE Ferry store, one tensor at a time.

The families of engine/storage/store.py's SUPPORTED_FAMILIES (config.json's model_type); experts
stored per expert or stacked as 3-D tensors, gpt-oss's MXFP4 experts imported as they are
(--expert-bits 16) or dequantized and re-quantized with HQQ (2/3/4).

Peak memory is bounded by one expert (three matrices in the source dtype) plus HQQ's float32
workspace for one matrix (about 6 copies of it), never the checkpoint: for Mixtral-8x7B
about 0.35 GB + 1.4 GB, whatever the checkpoint's 93 GB. Reads go through plain file reads
(engine/storage/safetensors_io.py), so no mmap keeps pages of the checkpoint resident.

The store is written into a hidden sibling folder, re-verified, then renamed into place: an
interrupted conversion never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moeferry.engine.errors import UserError
from moeferry.engine.runtime.generate import resolve_device
from moeferry.engine.runtime.model import ModelConfig
from moeferry.engine.setup.hf_cache import path_problem
from moeferry.engine.storage import mxfp4, quant, store
from moeferry.engine.storage.manifest import FORMAT, VERSION, read_json
from moeferry.engine.storage.safetensors_io import FormatError, StreamingWriter, read_header, read_tensor

TOKENIZER_FILES = store.TOKENIZER_FILES
EXTRA_FILES = ("generation_config.json",)
SPACE_MARGIN_BYTES = 64 << 20  # beyond the store's own size: config, tokenizer, manifest
FLOAT_DTYPES = ("BF16", "F16", "F32")  # what a checkpoint's weights may be (MXFP4 blocks and scales: U8)


class Cancelled(Exception):
    pass


@dataclass
class TensorRef:
    file: Path
    entry: dict
    data_start: int

    def load(self) -> torch.Tensor:
        return read_tensor(self.file, self.entry, self.data_start)


# ---------------------------------------------------------------------------------------------
# Reading the source folder


def read_hf_config(src: Path) -> dict:
    """config.json of a checkpoint folder that ships no code, of a supported family, sizes checked."""
    if not src.is_dir():
        raise UserError(f"{src} is not a folder; give the folder of a Hugging Face MoE checkpoint.")
    if not (src / "config.json").is_file():
        raise UserError(f"{src} has no config.json, so it is not a Hugging Face checkpoint; "
                        f"give the folder that holds config.json and the .safetensors files.")
    cfg = read_json(src / "config.json")
    if not isinstance(cfg, dict):
        raise UserError(f"{src}/config.json is not valid JSON; download the checkpoint again.")
    store.check_no_code(src, f"The checkpoint {src}")
    store.model_config(cfg, f"The checkpoint {src}")
    return cfg


def read_index(src: Path) -> tuple[dict[str, str], list[str]]:
    """model.safetensors.index.json's weight_map and the shard files it names (all present)."""
    index = src / "model.safetensors.index.json"
    try:
        weight_map = read_json(index)["weight_map"]  # None (missing, too large, not JSON): damaged
        files = sorted(set(weight_map.values()))  # not a dict of file names: damaged too
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{index} is missing or damaged; download the checkpoint again.") from None
    for f in files:  # relative names that stay in src (the paper's format has subfolders)
        problem = path_problem(f)
        if problem:
            raise UserError(f"{index} names the shard {f[:80]!r}, which {problem}; a checkpoint's shards are "
                            f"files of its own folder: download the checkpoint again.")
    missing = [f for f in files if not (src / f).is_file()]
    if missing:
        raise UserError(f"{src} is missing {len(missing)} of {len(files)} shards named by "
                        f"model.safetensors.index.json ({', '.join(missing[:3])}); "
                        f"finish the download (`moeferry fetch` resumes) and try again.")
    return weight_map, files


def shard_header(path: Path) -> tuple[dict, int]:
    """A shard's safetensors header and where its data starts, or one clear sentence."""
    try:
        return read_header(path)
    except (OSError, FormatError) as e:
        raise UserError(f"Cannot read {path} ({e}); download it again.") from None


def index_tensors(src: Path) -> dict[str, TensorRef]:
    """Every tensor name in the checkpoint -> where its bytes are."""
    if (src / "model.safetensors.index.json").is_file():
        _, files = read_index(src)
    else:
        files = sorted(p.name for p in src.glob("*.safetensors") if p.is_file())  # no FIFO to block on
        if not files:
            raise UserError(f"{src} has no .safetensors files; MoE Ferry reads safetensors "
                            f"checkpoints (model.safetensors or model-000NN-of-000MM.safetensors).")
    refs = {}
    for name in files:
        path = src / name
        header, start = shard_header(path)
        for key, entry in header.items():
            refs[key] = TensorRef(path, entry, start)
    return refs


def detect_format(src) -> str:
    """'paper' for the paper's pre-quantized offloading checkpoint, else 'hf'."""
    index = read_json(Path(src).expanduser() / "model.safetensors.index.json")
    keys = index.get("weight_map") if isinstance(index, dict) else None
    return "paper" if isinstance(keys, dict) and any(str(k).endswith(".W_q") for k in keys) else "hf"


def expert_loader(refs: dict[str, TensorRef], cfg: ModelConfig):
    """A function (layer, expert) -> {w1, w3, w2} for per-expert or fused (3-D) checkpoints."""
    def per_expert(layer, e):
        p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
        return {m: refs[p + m + ".weight"].load() for m in store.EXPERT_MATRICES}

    n, layers = cfg.num_experts, cfg.moe_layer_ids
    if "model.layers.0.block_sparse_moe.experts.0.w1.weight" in refs:
        check_experts(refs, len(layers) * n * 3, lambda: {
            f"model.layers.{l}.block_sparse_moe.experts.{e}.{m}.weight": list(store.expert_shape(cfg, m))
            for l in layers for e in range(n) for m in store.EXPERT_MATRICES})
        return per_expert, refs["model.layers.0.block_sparse_moe.experts.0.w1.weight"].entry["dtype"]
    if "model.layers.0.mlp.experts.gate_up_proj" in refs:
        return stacked_loader(refs, cfg)
    raise UserError("The checkpoint has no Mixtral expert weights (expected keys like "
                    "model.layers.0.block_sparse_moe.experts.0.w1.weight); is it a Mixtral checkpoint?")


def stacked_loader(refs: dict[str, TensorRef], cfg: ModelConfig):
    """transformers' stacked experts (every family but gpt_oss), checked: a loader and its dtype."""
    h, f, n, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.moe_layer_ids
    need = lambda: {f"model.layers.{l}.mlp.experts.{m}": shape for l in layers  # noqa: E731
                    for m, shape in (("gate_up_proj", [n, 2 * f, h]), ("down_proj", [n, h, f]))}
    check_experts(refs, len(layers) * 2, need)
    return (lambda layer, e: read_stacked_expert(refs, cfg, layer, e)), \
        refs[f"model.layers.{layers[0]}.mlp.experts.gate_up_proj"].entry["dtype"]


def check_experts(refs: dict[str, TensorRef], n: int, need, dtypes=FLOAT_DTYPES) -> None:
    """The n expert tensors the config implies: counted against the checkpoint's before they are
    named (need() -> {name: shape}), then each present, of its shape and of one of `dtypes`."""
    check_count(len(refs), n)
    want = need()
    check_present(refs, list(want))
    check_shapes(refs, want)
    check_dtypes(refs, list(want), dtypes)


def read_stacked_expert(refs: dict[str, TensorRef], cfg: ModelConfig, layer: int, e: int) -> dict:
    """Expert e of transformers' stacked layout: gate_up_proj [E, 2F, H] (gate rows, then up)
    and down_proj [E, H, F]."""
    p = f"model.layers.{layer}.mlp.experts."
    gate_up = slice_first(refs[p + "gate_up_proj"], e)  # [2F, H]
    return {"w1": gate_up[:cfg.intermediate_size], "w3": gate_up[cfg.intermediate_size:],
            "w2": slice_first(refs[p + "down_proj"], e)}


def family_expert_loader(refs: dict[str, TensorRef], cfg: ModelConfig, keep_mxfp4: bool):
    """(layer, expert) -> {w1, w3, w2 [, b1, b3, b2]}, the experts' source dtype and their
    biases' dtype (None without biases), for the checkpoint's family."""
    if cfg.family == "mixtral":
        return (*expert_loader(refs, cfg), None)
    if cfg.family == "gpt_oss":
        return gpt_oss_expert_loader(refs, cfg, keep_mxfp4)
    return qwen_expert_loader(refs, cfg)


def qwen_expert_loader(refs: dict[str, TensorRef], cfg: ModelConfig):
    """qwen3_moe, qwen2_moe, olmoe: mlp.experts.E.{gate,up,down}_proj.weight, or stacked."""
    names = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    layers = cfg.moe_layer_ids
    if f"model.layers.{layers[0]}.mlp.experts.0.gate_proj.weight" in refs:
        check_experts(refs, len(layers) * cfg.num_experts * 3, lambda: {
            f"model.layers.{l}.mlp.experts.{e}.{n}.weight": list(store.expert_shape(cfg, m))
            for l in layers for e in range(cfg.num_experts) for m, n in names})

        def per_expert(layer, e):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            return {m: refs[p + n + ".weight"].load() for m, n in names}
        return per_expert, refs[f"model.layers.{layers[0]}.mlp.experts.0.gate_proj.weight"].entry["dtype"], None
    return (*stacked_loader(refs, cfg), None)


def gpt_oss_expert_loader(refs: dict[str, TensorRef], cfg: ModelConfig, keep_mxfp4: bool):
    """gpt_oss: gate_up_proj [E, H, 2F] (x @ W, gate and up interleaved) and down_proj [E, F, H]
    with biases, or the MXFP4 gate_up_proj_blocks / _scales [E, 2F, ...] and down_proj_... [E, H, ...]."""
    p0 = "model.layers.{}.mlp.experts."
    E, F, H, layers = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size, cfg.moe_layer_ids
    mx, B = (p0.format(layers[0]) + "gate_up_proj_blocks") in refs, mxfp4.BLOCK
    if mx and (H % B or F % B):
        raise UserError(f"The checkpoint's config.json gives hidden_size {H} and intermediate_size {F}, but MXFP4 "
                        f"experts need multiples of {B}; the config does not belong to these weights.")
    weights = {"gate_up_proj_blocks": [E, 2 * F, H // B, B // 2], "gate_up_proj_scales": [E, 2 * F, H // B],
               "down_proj_blocks": [E, H, F // B, B // 2], "down_proj_scales": [E, H, F // B]} if mx \
        else {"gate_up_proj": [E, H, 2 * F], "down_proj": [E, F, H]}
    biases = {"gate_up_proj_bias": [E, 2 * F], "down_proj_bias": [E, H]}
    for parts, dtypes in ((weights, ("U8",) if mx else FLOAT_DTYPES), (biases, FLOAT_DTYPES)):
        check_experts(refs, len(layers) * len(parts),
                      lambda parts=parts: {p0.format(l) + n: shape for l in layers for n, shape in parts.items()}, dtypes)

    def load(layer, e):
        p = p0.format(layer)
        gate_up_bias, out = slice_first(refs[p + "gate_up_proj_bias"], e), {}
        out["b1"], out["b3"], out["b2"] = gate_up_bias[0::2], gate_up_bias[1::2], slice_first(refs[p + "down_proj_bias"], e)
        if not mx:
            gate_up = slice_first(refs[p + "gate_up_proj"], e)  # [H, 2F]
            return out | {"w1": gate_up[:, 0::2].T.contiguous(), "w3": gate_up[:, 1::2].T.contiguous(),
                          "w2": slice_first(refs[p + "down_proj"], e).T.contiguous()}
        blocks, scales = slice_first(refs[p + "gate_up_proj_blocks"], e), slice_first(refs[p + "gate_up_proj_scales"], e)
        mats = {"w1": mxfp4.Mxfp4Matrix(F, H, blocks[0::2].contiguous(), scales[0::2].contiguous()),
                "w3": mxfp4.Mxfp4Matrix(F, H, blocks[1::2].contiguous(), scales[1::2].contiguous()),
                "w2": mxfp4.Mxfp4Matrix(H, F, slice_first(refs[p + "down_proj_blocks"], e),
                                        slice_first(refs[p + "down_proj_scales"], e))}
        if not keep_mxfp4:  # to be re-quantized: the values transformers computes with
            mats = {m: mxfp4.dequantize(w, torch.bfloat16) for m, w in mats.items()}
        return out | mats

    first = p0.format(layers[0])
    dtype = "mxfp4" if mx else refs[first + "gate_up_proj"].entry["dtype"]
    return load, dtype, refs[first + "gate_up_proj_bias"].entry["dtype"]


def slice_first(ref: TensorRef, i: int) -> torch.Tensor:
    """ref's tensor [N, ...] -> its i-th slice, reading only those bytes."""
    shape = ref.entry["shape"]
    start, end = ref.entry["data_offsets"]
    per = (end - start) // shape[0]
    entry = {"dtype": ref.entry["dtype"], "shape": shape[1:],
             "data_offsets": [start + i * per, start + (i + 1) * per]}
    return read_tensor(ref.file, entry, ref.data_start)


def dense_names(cfg: ModelConfig, refs: dict) -> list[tuple[str, str]]:
    """(store name, checkpoint name) of every non-expert tensor."""
    names = [("model.embed_tokens.weight",) * 2, ("model.norm.weight",) * 2]
    if "lm_head.weight" in refs or not cfg.tie_word_embeddings:
        names.append(("lm_head.weight",) * 2)
    for l in range(cfg.num_layers):
        p = f"model.layers.{l}."
        names += [(p + "input_layernorm.weight",) * 2, (p + "post_attention_layernorm.weight",) * 2]
        names += [(p + f"self_attn.{m}.weight",) * 2 for m in store.ATTN_MATRICES]
        names += family_layer_names(cfg, refs, p, l)
    check_count(len(refs), len(names), "non-expert")
    check_present(refs, [src for _, src in names])
    check_shapes(refs, {src: dense_shape(cfg, dst) for dst, src in names})
    check_dtypes(refs, [src for _, src in names], FLOAT_DTYPES)
    return names


def dense_shape(cfg: ModelConfig, name: str) -> list[int]:
    """The shape config.json implies for the non-expert tensor `name` (its store name)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    fixed = {"model.embed_tokens.weight": [v, h], "lm_head.weight": [v, h], "model.norm.weight": [h]}
    base, kind = name.rsplit(".", 1)
    part = base.rsplit(".", 1)[-1]
    matrix = store.dense_matrix_shape(cfg, base)
    if name in fixed:
        return fixed[name]
    if matrix is not None and kind == "weight":
        return list(matrix)
    if part in store.ATTN_MATRICES:  # a bias
        return [store.attn_shape(cfg, part)[0]]
    if part in ("q_norm", "k_norm"):
        heads = cfg.num_heads if part == "q_norm" else cfg.num_kv_heads
        return [cfg.head_dim * (1 if cfg.qk_norm == "head" else heads)]
    if name.endswith("self_attn.sinks"):
        return [cfg.num_heads]
    if base.endswith("block_sparse_moe.gate"):
        return [cfg.num_experts, h] if kind == "weight" else [cfg.num_experts]
    if part == "shared_expert_gate":
        return [1, h]
    assert part.endswith("layernorm"), name  # dense_names names nothing else
    return [h]


def family_layer_names(cfg: ModelConfig, refs: dict, p: str, layer: int) -> list[tuple[str, str]]:
    """(store name, checkpoint name) of layer's dense tensors beyond norms and projections: the
    router (one store spelling for all families), biases, q/k norms, sinks, dense MLPs."""
    out = [(p + f"self_attn.{m}.bias",) * 2 for m in cfg.attn_biases]
    if cfg.qk_norm != "none":
        out += [(p + "self_attn.q_norm.weight",) * 2, (p + "self_attn.k_norm.weight",) * 2]
    if cfg.sinks:
        out.append((p + "self_attn.sinks",) * 2)
    if layer not in cfg.moe_layer_ids:
        return out + [(p + f"mlp.{m}.weight",) * 2 for m in store.MLP_MATRICES]
    gate = p + "block_sparse_moe.gate.weight"
    if cfg.family == "gpt_oss":
        out += [(gate, p + "mlp.router.weight"), (p + "block_sparse_moe.gate.bias", p + "mlp.router.bias")]
    else:
        out.append((gate, gate if gate in refs else p + "mlp.gate.weight"))
    if cfg.shared_expert_size:
        out += [(p + f"mlp.shared_expert.{m}.weight",) * 2 for m in store.MLP_MATRICES]
        out.append((p + "mlp.shared_expert_gate.weight",) * 2)
    return out


def check_count(have: int, n: int, what: str = "expert") -> None:
    """Refuse a config that implies more tensors than the checkpoint's headers hold (`have`)."""
    if n > have:
        raise UserError(f"The checkpoint's config.json implies {n} {what} tensors, but its files hold "
                        f"{have} tensors in all; the config does not belong to these weights.")


def check_shapes(refs: dict, want: dict[str, list[int]]) -> None:
    """Tensors whose shape the config fixes must have it (slices and views rely on it)."""
    for name, shape in want.items():
        if refs[name].entry["shape"] != shape:
            raise UserError(f"The checkpoint's {name} has shape {refs[name].entry['shape']} where its "
                            f"config.json implies {shape}; the config does not belong to these weights.")


def check_dtypes(refs: dict, names: list[str], dtypes) -> None:
    """Weights must be floats (MXFP4 blocks and scales bytes): anything else is not a model's tensor."""
    for name in names:
        if refs[name].entry["dtype"] not in dtypes:
            raise UserError(f"The checkpoint's {name} is {refs[name].entry['dtype']}, not {' or '.join(dtypes)}; "
                            f"it is damaged or not the model its config.json names.")


def checkpoint_bytes(refs: dict[str, TensorRef]) -> int:
    return sum(p.stat().st_size for p in {r.file for r in refs.values()})


def check_present(refs: dict, names: list[str]) -> None:
    missing = [n for n in names if n not in refs]
    if missing:
        raise UserError(f"The checkpoint lacks {len(missing)} tensors its model needs (first: {missing[0]}); "
                        f"it is incomplete or not the model its config.json names.")


def quantization_of(bits: int, specs: dict, source_dtype: str, allowed, rows: list[int],
                    group_size: int | None = None, what: str = "matrices", notice=None) -> dict:
    """The quantization of one kind of matrix (experts or attention) as the manifest records it.

    Small models whose row counts the default group size does not divide get the largest
    power-of-two group that divides them all (Mixtral-8x7B keeps the defaults). Where not even
    groups of 8 do (HQQ's groups and bit planes need rows in multiples of 8, which every
    released model has and a tiny test model may not), that kind keeps the source precision and
    notice(sentence) hears of it. group_size, where given, is taken as it is or refused
    (quant.check_group_size).
    """
    if bits not in allowed:
        raise UserError(f"{bits}-bit is not offered here; choose one of {', '.join(map(str, allowed))}.")
    if bits == 16:
        return {"bits": 16, "dtype": source_dtype}
    s = specs[bits]
    if group_size is not None:
        quant.check_group_size(group_size, rows)
        return {"bits": bits, "group_size": group_size, "meta_group": s.meta_group, "method": "hqq"}
    g = s.group_size
    while g > 8 and any(r % g for r in rows):
        g //= 2
    odd = [r for r in rows if r % g]
    if odd:
        if notice is not None:
            notice(f"the {what} stay at 16 bits: a matrix of {odd[0]} rows cannot be quantized in groups "
                   f"of {g} rows (rows must be a multiple of 8).")
        return {"bits": 16, "dtype": source_dtype}
    return {"bits": bits, "group_size": g, "meta_group": s.meta_group, "method": "hqq"}


def has_tokenizer(folder: Path) -> bool:
    """Whether the folder holds a tokenizer's vocabulary (tokenizer.json or tokenizer.model)."""
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))


def copy_tokenizer(src: Path, tok_dir: Path | None, dest: Path) -> None:
    where = tok_dir or src
    if not has_tokenizer(where):
        raise UserError(f"{where} has no tokenizer (tokenizer.json or tokenizer.model); copy the "
                        f"tokenizer files next to the weights or pass --tokenizer DIR.")
    for f in TOKENIZER_FILES:
        if (where / f).is_file():
            shutil.copy2(where / f, dest / f)
    for f in EXTRA_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, dest / f)


# ---------------------------------------------------------------------------------------------
# Converting


def convert_checkpoint(src, dest, expert_bits: int, attn_bits: int, device: str = "auto",
                       tokenizer: str | Path | None = None, progress=None,
                       cancel: threading.Event | None = None, expert_group_size: int | None = None,
                       notice=None) -> Path:
    """Convert and install atomically; returns dest. progress(fraction, message).
    expert_group_size: HQQ rows per scale and zero of the experts (None = quant.EXPERT_SPECS's).
    notice(sentence): what the conversion does other than asked (see quantization_of)."""
    if expert_group_size is not None and expert_bits == 16:  # kept as they are, MXFP4 imports too
        raise UserError("--expert-group-size is for quantized experts; 16-bit experts have no groups.")
    src, dest = Path(src).expanduser(), Path(dest).expanduser()
    hf = read_hf_config(src)
    cfg = ModelConfig.from_hf(hf)
    refs = index_tensors(src)
    store.check_backed(cfg, checkpoint_bytes(refs), f"The checkpoint {src}")
    load_expert, src_dtype, bias_dtype = family_expert_loader(refs, cfg, keep_mxfp4=expert_bits == 16)
    names = dense_names(cfg, refs)
    dense_shapes = [sh for dst, _ in names if dst.endswith(".weight")
                    and (sh := store.dense_matrix_shape(cfg, dst[:-len(".weight")])) is not None]
    if src_dtype == "mxfp4" and expert_bits == 16:  # imported as it is
        eq = {"bits": 4, "method": "mxfp4", "group_size": mxfp4.BLOCK}
    else:
        eq = quantization_of(expert_bits, quant.EXPERT_SPECS, "BF16" if src_dtype == "mxfp4" else src_dtype,
                             (2, 3, 4, 16), [store.expert_shape(cfg, m)[0] for m in store.EXPERT_MATRICES],
                             expert_group_size, "experts", notice)
    if bias_dtype is not None:
        eq["bias_dtype"] = bias_dtype
    aq = quantization_of(attn_bits, quant.ATTN_SPECS, refs["model.layers.0.self_attn.q_proj.weight"].entry["dtype"],
                         (4, 8, 16), sorted({rows for rows, _ in dense_shapes}), None, "attention", notice)
    dev = resolve_device(device)
    tok_dir = resolve_tokenizer_dir(tokenizer) if tokenizer else None
    # the tokenizer loads now, not at the first generate after minutes of converting
    if tok_dir is not None or has_tokenizer(src):
        check_tokenizer(tok_dir or src, cfg)
    check_destination(dest)
    tmp = store.temp_sibling(dest)
    store.remove_partial(tmp)  # leftovers of an earlier interrupted run, before measuring space
    dense_bytes = sum(nbytes(dt, shape) for _, dt, shape in dense_entries(cfg, refs, names, aq)[0])
    check_free_space(dest, dense_bytes + cfg.num_moe_layers * cfg.num_experts * store.expert_layout(cfg, eq)[1])
    make_temp(tmp)
    report = progress or (lambda f, m: None)
    try:
        copy_tokenizer(src, tok_dir, tmp)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        total = len(names) + cfg.num_moe_layers * cfg.num_experts
        done = [0]

        def tick(msg):
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            done[0] += 1
            report(done[0] / total, msg)

        hashes = {"dense.safetensors": write_dense(tmp, cfg, refs, names, aq, dev, tick)}
        hashes["experts.safetensors"] = write_experts(tmp, cfg, load_expert, eq, dev, tick)
        write_manifest(tmp, cfg, hf, src, eq, aq, hashes)
        report(1.0, "verifying the new store")
        store.verify_and_install(tmp, dest, "converted")
    except Cancelled:
        store.remove_partial(tmp)
        raise UserError("Conversion cancelled; nothing was written.", exit_code=1) from None
    except OSError as e:
        store.remove_partial(tmp)
        raise file_error(e, dest) from None
    except BaseException:
        store.remove_partial(tmp)
        raise
    return dest


def nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * dtype.itemsize


def check_free_space(dest: Path, store_bytes: int) -> None:
    """Refuse up front when the store (its size is known from the config) does not fit."""
    where = dest.parent if dest.parent != Path("") else Path(".")
    need = store_bytes + SPACE_MARGIN_BYTES
    free = shutil.disk_usage(where).free
    if need > free:
        raise UserError(f"Not enough free disk space in {where}: the store needs {need / 1e9:.2f} GB but "
                        f"only {free / 1e9:.2f} GB is free; free some space or choose another DEST.", 1)


def make_temp(tmp: Path) -> None:
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"Cannot create the store in {tmp.parent} ({e.strerror or e}); choose a DEST in a "
                        f"folder you can write to.") from None


def file_error(e: OSError, dest: Path) -> UserError:
    """A disk or file failure during a conversion, as one sentence (the partial store is gone)."""
    return UserError(f"Writing the store {dest} failed ({e.strerror or e}"
                     f"{': ' + str(e.filename) if e.filename else ''}); nothing was kept: free some disk "
                     f"space or check the folders, then run again.", 1)


def check_tokenizer(tok_dir: Path, cfg: ModelConfig) -> None:
    """The tokenizer (the checkpoint's or one given with --tokenizer) must load, ship no code and
    cover the model's vocabulary, but for the padding many models add to it (Qwen3's 151,936
    rows hold 151,669 tokens), which a trained model does not sample: up to 1 % of the rows."""
    store.check_no_code(tok_dir, f"The tokenizer folder {tok_dir}")
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad folder
        raise UserError(f"Cannot load the tokenizer in {tok_dir} ({type(e).__name__}); download the model's "
                        f"tokenizer files again, or give their folder with --tokenizer.") from None
    if cfg.vocab_size - len(tok) > cfg.vocab_size // 100:
        raise UserError(f"The tokenizer in {tok_dir} knows {len(tok)} tokens but the model has "
                        f"{cfg.vocab_size}, so some of its output could not be shown; give the model's own "
                        f"tokenizer with --tokenizer.")


def check_destination(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{dest} already exists and is not empty; choose a new folder or remove it first.")
    parent = dest.parent if dest.parent != Path("") else Path(".")
    if not parent.is_dir():
        raise UserError(f"The folder {parent} does not exist; create it first or choose another DEST.")


def resolve_tokenizer_dir(arg) -> Path:
    p = Path(arg).expanduser()
    if p.is_dir():
        return p
    try:
        from moeferry.engine.setup.hf_cache import find_in_hf_cache
        found = find_in_hf_cache(str(arg))
    except ImportError:
        found = None
    if found is None:
        raise UserError(f"--tokenizer {arg} is neither a folder nor a repository in your Hugging Face "
                        f"cache; download it first with `moeferry fetch {arg} DIR`.")
    return found


def dense_entries(cfg: ModelConfig, refs, names, aq: dict) -> tuple[list, list]:
    """dense.safetensors' declared tensors (name, dtype, shape) and how each is made."""
    entries, plan = [], []
    for dst, src_name in names:
        entry = refs[src_name].entry
        base = dst[: -len(".weight")]
        shape = store.dense_matrix_shape(cfg, base) if dst.endswith(".weight") else None
        if shape is not None and aq["bits"] != 16:
            fields = store.matrix_fields(*shape, aq)
            entries += [(f"{base}.{k}", dt, shape) for k, (dt, shape) in fields.items()]
            plan.append((dst, src_name, base, True))
        else:
            from moeferry.engine.storage.safetensors_io import DTYPES
            dtype = DTYPES[aq["dtype"]] if shape is not None else DTYPES[entry["dtype"]]
            entries.append((dst, dtype, tuple(entry["shape"])))
            plan.append((dst, src_name, dst, False))
    return entries, plan


def write_dense(tmp: Path, cfg: ModelConfig, refs, names, aq: dict, dev, tick) -> str:
    entries, plan = dense_entries(cfg, refs, names, aq)
    w = StreamingWriter(tmp / "dense.safetensors", entries, {"format": FORMAT})
    for dst, src_name, base, quantized in plan:
        t = refs[src_name].load()
        if quantized:
            qm = quantize(t, aq, dev)
            for k, v in qm.tensors().items():
                w.write(f"{base}.{k}", v.cpu())
        else:
            w.write(dst, t)
        tick(f"converting {dst}")
    return w.close()


def write_experts(tmp: Path, cfg: ModelConfig, load_expert, eq: dict, dev, tick) -> str:
    fields, stride = store.expert_layout(cfg, eq)
    shape = (cfg.num_moe_layers, cfg.num_experts, stride)
    w = StreamingWriter(tmp / "experts.safetensors", [("experts", torch.uint8, shape)],
                        {"format": FORMAT})
    for layer in cfg.moe_layer_ids:
        for e in range(cfg.num_experts):
            mats = load_expert(layer, e)
            tensors = {}
            for m, t in mats.items():
                if m in store.EXPERT_BIASES:
                    tensors[f"{m}.bias"] = t
                elif isinstance(t, mxfp4.Mxfp4Matrix):
                    tensors.update({f"{m}.{k}": v for k, v in t.tensors().items()})
                elif eq["bits"] == 16:
                    tensors[f"{m}.weight"] = t
                else:
                    for k, v in quantize(t, eq, dev).tensors().items():
                        tensors[f"{m}.{k}"] = v.cpu()
            w.write_raw("experts", memoryview(store.pack_expert(tensors, fields, stride).numpy()))
            tick(f"converting layer {layer} expert {e}")
    return w.close()


def quantize(t: torch.Tensor, q: dict, dev) -> quant.QMatrix:
    return quant.quantize_matrix(t.to(dev), quant.QuantSpec.from_dict(q))


def write_manifest(tmp: Path, cfg, hf, src: Path, eq, aq, hashes: dict) -> None:
    fields, stride = store.expert_layout(cfg, eq)
    files = {}
    for p in sorted(tmp.iterdir()):
        files[p.name] = {"size": p.stat().st_size,
                         "sha256": hashes.get(p.name) or store.sha256_file(p)}
    manifest = {
        "format": FORMAT, "version": VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source_info(src),
        "quantization": {"experts": eq, "attention": aq},
        "experts": {"file": "experts.safetensors", "tensor": "experts", "stride": stride,
                    "fields": fields},
        "files": files,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))


def source_info(src: Path) -> dict:
    """Repo and revision when src is a Hugging Face cache snapshot or a fetched folder."""
    info = {"path": str(src.resolve())}
    m = re.search(r"models--([^/]+)--([^/]+)/snapshots/([0-9a-f]+)", str(src.resolve()))
    if m:
        info.update(repo=f"{m.group(1)}/{m.group(2)}", revision=m.group(3))
    for meta in (src / ".moeferry-fetch.json", src / "fetch.json"):
        if meta.is_file():
            try:
                info.update({k: v for k, v in json.loads(meta.read_text()).items() if k in ("repo", "revision")})
            except ValueError:
                pass
    return info
