"""The MoE Ferry store: a folder the engine loads without the original checkpoint.

    manifest.json        format + version, source, quantization, expert layout, every
                         file's size and sha256 (the manifest itself is the root of trust)
    config.json          the Hugging Face Mixtral config
    tokenizer files      tokenizer.json / tokenizer_config.json / chat template, as found
    dense.safetensors    everything but the experts, Hugging Face names; a quantized matrix
                         NAME.weight is stored as NAME.plane0, NAME.scale, ... (engine/quant.py)
    experts.safetensors  one uint8 tensor "experts" [layers, experts, expert_bytes]: one expert
                         is one contiguous byte range, so one copy moves it

The expert byte range holds w1, w3, w2 (gate, up, down) as the fields listed in the manifest
(name, dtype, shape, offset), each 256-byte aligned so fields can be viewed in place.
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

from engine import quant
from engine.errors import UserError
from engine.model import ModelConfig
from engine.safetensors_io import DTYPE_NAMES, DTYPES, FormatError, read_header, read_tensor

FORMAT = "moeferry-store"
VERSION = 1
EXPERT_MATRICES = ("w1", "w3", "w2")
ATTN_MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj")
FIELD_ALIGN = 256


# ---------------------------------------------------------------------------------------------
# Shapes and layout


def attn_shape(cfg: ModelConfig, name: str) -> tuple[int, int]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (q, cfg.hidden_size), "k_proj": (kv, cfg.hidden_size),
            "v_proj": (kv, cfg.hidden_size), "o_proj": (cfg.hidden_size, q)}[name]


def expert_shape(cfg: ModelConfig, name: str) -> tuple[int, int]:
    h, f = cfg.hidden_size, cfg.intermediate_size
    return (h, f) if name == "w2" else (f, h)


def matrix_fields(rows: int, cols: int, quantization: dict) -> dict[str, tuple[torch.dtype, tuple]]:
    """Tensors that store one matrix: {suffix: (dtype, shape)}; suffix 'weight' if unquantized."""
    if quantization["bits"] == 16:
        return {"weight": (DTYPES[quantization["dtype"]], (rows, cols))}
    return quant.field_shapes(rows, cols, quant.QuantSpec.from_dict(quantization))


def expert_layout(cfg: ModelConfig, quantization: dict) -> tuple[list[dict], int]:
    """Fields of one packed expert with their offsets, and the expert's stride in bytes."""
    fields, offset = [], 0
    for m in EXPERT_MATRICES:
        rows, cols = expert_shape(cfg, m)
        for suffix, (dtype, shape) in matrix_fields(rows, cols, quantization).items():
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
    """One expert's byte range (uint8 [stride], any device) -> {w1, w3, w2: QMatrix | Tensor}, views."""
    views: dict[str, dict[str, torch.Tensor]] = {m: {} for m in EXPERT_MATRICES}
    for f in layout:
        m, suffix = f["name"].split(".", 1)
        t = buf[f["offset"]:f["offset"] + f["nbytes"]].view(DTYPES[f["dtype"]]).view(f["shape"])
        views[m][suffix] = t
    return {m: make_matrix(views[m], expert_shape(cfg, m), quantization) for m in EXPERT_MATRICES}


def make_matrix(fields: dict[str, torch.Tensor], shape: tuple[int, int], quantization: dict):
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
    return Store(path, manifest, hf_config, ModelConfig.from_hf(hf_config))


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
        if suffix == "weight" or not any(a in base for a in ATTN_MATRICES):
            out[name] = t
        else:
            grouped.setdefault(base, {})[suffix] = t
    for base, fields in grouped.items():
        proj = base.rsplit(".", 1)[1]
        out[base + ".weight"] = make_matrix(fields, attn_shape(store.config, proj), store.attn_quant)
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
    want = (store.config.num_layers, store.config.num_experts, store.expert_bytes)
    if shape != want or os.path.getsize(path) < start + int(np.prod(shape)):
        raise UserError(f"{path} does not hold {want[0]}x{want[1]} experts of {want[2]} bytes; "
                        f"run `moeferry verify {store.path}` and convert again.")
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=shape)
    import warnings
    with warnings.catch_warnings():  # read-only mmap: we only ever copy out of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(mm)


def load_dequantized_hf_model(arg: str | Path, dtype: torch.dtype = torch.float32):
    """A transformers MixtralForCausalLM whose weights are exactly what the engine computes with.

    The reference for correctness tests, perplexity and the locality study.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    store = open_store(arg)
    cfg = store.config
    dense = read_dense(store)
    experts = experts_array(store)
    sd = {}
    for name, w in dense.items():
        sd[name] = quant.dequantize(w, dtype) if isinstance(w, quant.QMatrix) else w.to(dtype)
    for layer in range(cfg.num_layers):
        mats = [view_expert(experts[layer, e].clone(), store.expert_fields, store.expert_quant, cfg)
                for e in range(cfg.num_experts)]
        deq = [{m: (quant.dequantize(x[m], dtype) if isinstance(x[m], quant.QMatrix) else x[m].to(dtype))
                for m in EXPERT_MATRICES} for x in mats]
        p = f"model.layers.{layer}.mlp.experts."
        sd[p + "gate_up_proj"] = torch.stack([torch.cat([d["w1"], d["w3"]]) for d in deq])
        sd[p + "down_proj"] = torch.stack([d["w2"] for d in deq])
        gate = sd.pop(f"model.layers.{layer}.block_sparse_moe.gate.weight")
        sd[f"model.layers.{layer}.mlp.gate.weight"] = gate
    hf = MixtralConfig(**{k: v for k, v in store.hf_config.items() if k not in ("architectures",)})
    with torch.device("meta"):
        model = MixtralForCausalLM(hf)
    if getattr(hf, "tie_word_embeddings", False) and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    # rotary inv_freq is a non-persistent buffer left on meta: rebuild it on the CPU
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf)
    return model.to(dtype).eval()


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
