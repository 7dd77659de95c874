"""The MoE Ferry store: a folder the engine loads without the original checkpoint.

    manifest.json        format + version, source, quantization, expert layout, every
                         file's size and sha256 (the manifest itself is the root of trust)
    config.json          the Hugging Face config (its model_type is the family:
                         SUPPORTED_FAMILIES)
    tokenizer files      tokenizer.json / tokenizer_config.json / chat template, as found
    dense.safetensors    everything but the routed experts, Hugging Face names with one
                         spelling for every family: the router is
                         model.layers.N.block_sparse_moe.gate.weight (and .bias: gpt_oss);
                         a qwen2_moe shared expert model.layers.N.mlp.shared_expert.{gate,up,
                         down}_proj.weight + mlp.shared_expert_gate.weight; a dense layer's MLP
                         model.layers.N.mlp.{gate,up,down}_proj.weight. A quantized matrix (the
                         attention projections and these MLPs, at the attention's width)
                         NAME.weight is stored as NAME.plane0, NAME.scale, ... (engine/quant.py)
    experts.safetensors  one uint8 tensor "experts" [MoE layers, experts, expert_bytes]: one
                         expert is one contiguous byte range, so one copy moves it; the rows
                         are the layers that have experts, in order (ModelConfig.moe_layer_ids)

The expert byte range holds w1, w3, w2 (gate, up, down; each [intermediate_size, hidden] but
w2 [hidden, intermediate_size], intermediate_size being the experts' own width) and, for a
family whose experts have biases (gpt_oss), b1, b3, b2 (field suffix "bias", in the
quantization's bias_dtype), as the fields listed in the manifest (name, dtype, shape,
offset), each 256-byte aligned so fields can be viewed in place. Expert matrices are HQQ
(engine/quant.py), source precision (bits 16) or MXFP4 as gpt-oss ships them (method
"mxfp4", engine/mxfp4.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine import mxfp4, quant
from engine.errors import UserError
from engine.model import ModelConfig
from engine.safetensors_io import DTYPE_NAMES, DTYPES, FormatError, read_header, read_tensor

FORMAT = "moeferry-store"
VERSION = 1
SUPPORTED_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss")  # config.json model_type
EXPERT_MATRICES = ("w1", "w3", "w2")
EXPERT_BIASES = ("b1", "b3", "b2")  # of w1, w3, w2, where the family has them
ATTN_MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MATRICES = ("gate_proj", "up_proj", "down_proj")  # dense layers' and the shared expert's
FIELD_ALIGN = 256


# ---------------------------------------------------------------------------------------------
# Shapes and layout


def attn_shape(cfg: ModelConfig, name: str) -> tuple[int, int]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (q, cfg.hidden_size), "k_proj": (kv, cfg.hidden_size),
            "v_proj": (kv, cfg.hidden_size), "o_proj": (cfg.hidden_size, q)}[name]


def expert_shape(cfg: ModelConfig, name: str) -> tuple[int, int]:
    """Rows and columns of expert matrix w1, w3 or w2; the length of bias b1, b3 or b2 as (n,)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    return {"w1": (f, h), "w3": (f, h), "w2": (h, f), "b1": (f,), "b3": (f,), "b2": (h,)}[name]


def dense_matrix_shape(cfg: ModelConfig, base: str) -> tuple[int, int] | None:
    """(rows, cols) of dense matrix `base` (a name without .weight) if it is quantized with the
    attention's quantization (attention projections, dense and shared-expert MLPs), else None."""
    proj = base.rsplit(".", 1)[-1]
    if proj in ATTN_MATRICES and ".self_attn." in base:
        return attn_shape(cfg, proj)
    if proj in MLP_MATRICES and ".mlp." in base:
        f = cfg.shared_expert_size if ".shared_expert." in base else cfg.dense_intermediate_size
        return (cfg.hidden_size, f) if proj == "down_proj" else (f, cfg.hidden_size)
    return None


def matrix_fields(rows: int, cols: int, quantization: dict) -> dict[str, tuple[torch.dtype, tuple]]:
    """Tensors that store one matrix: {suffix: (dtype, shape)}; suffix 'weight' if unquantized."""
    if quantization.get("method") == "mxfp4":
        return mxfp4.field_shapes(rows, cols)
    if quantization["bits"] == 16:
        return {"weight": (DTYPES[quantization["dtype"]], (rows, cols))}
    return quant.field_shapes(rows, cols, quant.QuantSpec.from_dict(quantization))


def expert_field_shapes(cfg: ModelConfig, name: str, quantization: dict) -> dict:
    """{suffix: (dtype, shape)} of one expert matrix or bias."""
    if name in EXPERT_BIASES:
        return {"bias": (DTYPES[quantization["bias_dtype"]], expert_shape(cfg, name))}
    return matrix_fields(*expert_shape(cfg, name), quantization)


def expert_parts(cfg: ModelConfig) -> tuple[str, ...]:
    """What one packed expert holds: w1, w3, w2 and, where the family has them, b1, b3, b2."""
    return EXPERT_MATRICES + (EXPERT_BIASES if cfg.expert_act == "clamped_swiglu" else ())


def expert_layout(cfg: ModelConfig, quantization: dict) -> tuple[list[dict], int]:
    """Fields of one packed expert with their offsets, and the expert's stride in bytes."""
    fields, offset = [], 0
    for m in expert_parts(cfg):
        for suffix, (dtype, shape) in expert_field_shapes(cfg, m, quantization).items():
            nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            fields.append({"name": f"{m}.{suffix}", "dtype": DTYPE_NAMES[dtype],
                           "shape": list(shape), "offset": offset, "nbytes": nbytes})
            offset = -(-(offset + nbytes) // FIELD_ALIGN) * FIELD_ALIGN
    return fields, offset


def pack_expert(tensors: dict[str, torch.Tensor], layout: list[dict], stride: int) -> torch.Tensor:
    """Field tensors -> one uint8 [stride] byte range."""
    buf = torch.zeros(stride, dtype=torch.uint8)
    for f in layout:
        t = tensors[f["name"]].detach().contiguous().cpu()
        buf[f["offset"]:f["offset"] + f["nbytes"]] = t.view(torch.uint8).reshape(-1)
    return buf


def view_expert(buf: torch.Tensor, layout: list[dict], quantization: dict, cfg: ModelConfig) -> dict:
    """One expert's byte range (uint8 [stride], any device) -> {w1, w3, w2: QMatrix | Mxfp4Matrix
    | Tensor, and b1, b3, b2: Tensor where the experts have biases}, views."""
    views: dict[str, dict[str, torch.Tensor]] = {}
    for f in layout:
        m, suffix = f["name"].split(".", 1)
        t = buf[f["offset"]:f["offset"] + f["nbytes"]].view(DTYPES[f["dtype"]]).view(f["shape"])
        views.setdefault(m, {})[suffix] = t
    out = {m: make_matrix(views[m], expert_shape(cfg, m), quantization) for m in EXPERT_MATRICES}
    return out | {b: views[b]["bias"] for b in EXPERT_BIASES if b in views}


def make_matrix(fields: dict[str, torch.Tensor], shape: tuple[int, int], quantization: dict):
    if quantization.get("method") == "mxfp4":
        return mxfp4.Mxfp4Matrix(shape[0], shape[1], fields["blocks"], fields["scales"])
    if quantization["bits"] == 16:
        return fields["weight"]
    info = {"rows": shape[0], "cols": shape[1], "bits": quantization["bits"],
            "group_size": quantization["group_size"]}
    return quant.QMatrix.from_tensors(info, fields)


# ---------------------------------------------------------------------------------------------
# Opening, verifying


@dataclass
class Store:
    path: Path
    manifest: dict
    hf_config: dict
    config: ModelConfig

    @property
    def expert_quant(self) -> dict:
        return self.manifest["quantization"]["experts"]

    @property
    def attn_quant(self) -> dict:
        return self.manifest["quantization"]["attention"]

    @property
    def expert_bytes(self) -> int:
        return self.manifest["experts"]["stride"]

    @property
    def expert_fields(self) -> list[dict]:
        return self.manifest["experts"]["fields"]


def resolve_store_path(arg: str | Path) -> Path:
    if str(arg) == "demo":
        from engine.demo import demo_store_path
        return demo_store_path()
    return Path(arg).expanduser()


def open_store(arg: str | Path) -> Store:
    path, manifest = read_manifest(arg)
    try:
        hf_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"{path}/config.json is missing or damaged; run `moeferry verify {path}`.") from None
    check_family(hf_config, f"The store {path}")
    return Store(path, manifest, hf_config, ModelConfig.from_hf(hf_config))


def check_family(hf_config: dict, what: str) -> None:
    """One sentence for a model family (config.json's model_type) this engine does not run."""
    kind = hf_config.get("model_type")
    if not kind and "MixtralForCausalLM" in hf_config.get("architectures", []):
        return  # ModelConfig.from_hf reads a config without model_type as Mixtral's
    if kind not in SUPPORTED_FAMILIES:
        raise UserError(f"{what} holds a {kind or 'unknown'!r} model; MoE Ferry runs these model "
                        f"types: {', '.join(SUPPORTED_FAMILIES)}.")


def read_manifest(arg: str | Path) -> tuple[Path, dict]:
    path = resolve_store_path(arg)
    mpath = path / "manifest.json"
    if not path.is_dir():
        raise UserError(f"{path} is not a folder; give the path of a MoE Ferry store "
                        f"(made by `moeferry convert`) or the word `demo`.")
    if not mpath.is_file():
        raise UserError(f"{path} has no manifest.json, so it is not a MoE Ferry store; "
                        f"convert a checkpoint into it first with `moeferry convert`.")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError:
        raise UserError(f"{mpath} is damaged (not valid JSON); convert or download the model again.") from None
    if manifest.get("format") != FORMAT:
        raise UserError(f"{path} is not a MoE Ferry store (its manifest names format "
                        f"{manifest.get('format')!r}); convert the checkpoint with `moeferry convert`.")
    if manifest.get("version") != VERSION:
        raise UserError(f"{path} is a store of format version {manifest.get('version')}, but this "
                        f"MoE Ferry reads version {VERSION}; convert the model again or update MoE Ferry.")
    return path, manifest


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def verify_store(arg: str | Path, progress=None) -> list[str]:
    """Re-hash every file in the manifest; return a sentence for each bad or missing file."""
    path, manifest = read_manifest(arg)
    bad = []
    files = manifest["files"]
    for i, (name, want) in enumerate(sorted(files.items())):
        p = path / name
        if progress:
            progress(i / len(files), f"checking {name}")
        if not p.is_file():
            bad.append(f"{name}: missing")
        elif p.stat().st_size != want["size"]:
            bad.append(f"{name}: size {p.stat().st_size} bytes, expected {want['size']}")
        elif sha256_file(p) != want["sha256"]:
            bad.append(f"{name}: contents changed (sha256 mismatch)")
    return bad


# ---------------------------------------------------------------------------------------------
# Reading weights


def read_dense(store: Store) -> dict:
    """Non-expert weights on the CPU: HF name -> Tensor (unquantized) or QMatrix (attention)."""
    path = store.path / "dense.safetensors"
    try:
        header, start = read_header(path)
    except (OSError, FormatError) as e:
        raise UserError(f"Cannot read {path} ({e}); run `moeferry verify {store.path}`.") from None
    raw = {name: read_tensor(path, entry, start) for name, entry in header.items()}
    out, grouped = {}, {}
    for name, t in raw.items():
        base, _, suffix = name.rpartition(".")
        if suffix in ("weight", "bias") or dense_matrix_shape(store.config, base) is None:
            out[name] = t
        else:
            grouped.setdefault(base, {})[suffix] = t
    for base, fields in grouped.items():
        out[base + ".weight"] = make_matrix(fields, dense_matrix_shape(store.config, base), store.attn_quant)
    return out


def experts_array(store: Store) -> torch.Tensor:
    """All experts as a read-only CPU uint8 tensor [layers, experts, stride] backed by mmap."""
    path = store.path / "experts.safetensors"
    try:
        header, start = read_header(path)
        entry = header["experts"]
    except (OSError, FormatError, KeyError) as e:
        raise UserError(f"Cannot read {path} ({e}); run `moeferry verify {store.path}`.") from None
    shape = tuple(entry["shape"])
    want = (store.config.num_moe_layers, store.config.num_experts, store.expert_bytes)
    if shape != want or os.path.getsize(path) < start + int(np.prod(shape)):
        raise UserError(f"{path} does not hold {want[0]}x{want[1]} experts of {want[2]} bytes; "
                        f"run `moeferry verify {store.path}` and convert again.")
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=shape)
    import warnings
    with warnings.catch_warnings():  # read-only mmap: we only ever copy out of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(mm)


def load_dequantized_hf_model(arg: str | Path, dtype: torch.dtype = torch.float32):
    """A transformers model of the store's family whose weights are exactly what the engine
    computes with (quantized matrices dequantized).

    The reference for correctness tests, perplexity and the locality study.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    store = open_store(arg)
    cfg = store.config
    sd = {name: as_float(w, dtype) for name, w in read_dense(store).items()}
    for name in [n for n in sd if ".block_sparse_moe.gate." in n]:  # the family's spelling
        sd[name.replace("block_sparse_moe.gate", "mlp.router" if cfg.family == "gpt_oss" else "mlp.gate")] = sd.pop(name)
    experts = experts_array(store)
    for row, layer in enumerate(cfg.moe_layer_ids):
        deq = [{m: as_float(x, dtype) for m, x in
                view_expert(experts[row, e].clone(), store.expert_fields, store.expert_quant, cfg).items()}
               for e in range(cfg.num_experts)]
        sd.update(hf_expert_tensors(cfg, f"model.layers.{layer}.mlp.experts.", deq))
    hf_dict = {k: v for k, v in store.hf_config.items() if k not in ("architectures", "quantization_config")}
    hf = AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    if getattr(hf, "tie_word_embeddings", False) and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    # rotary inv_freq is a non-persistent buffer left on meta: rebuild it on the CPU
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf)
    return model.to(dtype).eval()


def as_float(w, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, quant.QMatrix):
        return quant.dequantize(w, dtype)
    if isinstance(w, mxfp4.Mxfp4Matrix):
        return mxfp4.dequantize(w, dtype)
    return w.to(dtype)


def hf_expert_tensors(cfg: ModelConfig, prefix: str, experts: list[dict]) -> dict:
    """One layer's experts (w1, w3, w2 [, b1, b3, b2] each) as transformers' stacked tensors."""
    if cfg.family != "gpt_oss":
        return {prefix + "gate_up_proj": torch.stack([torch.cat([d["w1"], d["w3"]]) for d in experts]),
                prefix + "down_proj": torch.stack([d["w2"] for d in experts])}
    # gpt_oss: x @ W layout ([in, out]) with gate and up interleaved along the output
    gate_up = torch.stack([torch.stack([d["w1"], d["w3"]], dim=1).reshape(-1, cfg.hidden_size).T
                           for d in experts])
    gate_up_bias = torch.stack([torch.stack([d["b1"], d["b3"]], dim=1).reshape(-1) for d in experts])
    return {prefix + "gate_up_proj": gate_up.contiguous(), prefix + "gate_up_proj_bias": gate_up_bias,
            prefix + "down_proj": torch.stack([d["w2"].T for d in experts]).contiguous(),
            prefix + "down_proj_bias": torch.stack([d["b2"] for d in experts])}


# ---------------------------------------------------------------------------------------------
# Atomic install


def temp_sibling(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.partial"


def verify_and_install(tmp: Path, dest: Path, what: str = "converted") -> None:
    """Re-hash the finished temporary store and rename it into place (dest absent or empty)."""
    bad = verify_store(tmp)
    if bad:
        raise UserError(f"The {what} store failed verification ({bad[0]}); check the disk and run again.",
                        exit_code=1)
    if dest.is_dir():
        dest.rmdir()  # empty: callers refuse a non-empty destination up front
    if dest.exists():
        raise UserError(f"{dest} appeared while the store was being written; move it away and run again.")
    os.replace(tmp, dest)


def remove_partial(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
