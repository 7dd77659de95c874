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
                         NAME.weight is stored as NAME.plane0, NAME.scale, ... (engine/storage/quant.py)
    experts.safetensors  one uint8 tensor "experts" [MoE layers, experts, expert_bytes]: one
                         expert is one contiguous byte range, so one copy moves it; the rows
                         are the layers that have experts, in order (ModelConfig.moe_layer_ids)

The expert byte range holds w1, w3, w2 (gate, up, down; each [intermediate_size, hidden] but
w2 [hidden, intermediate_size], intermediate_size being the experts' own width) and, for a
family whose experts have biases (gpt_oss), b1, b3, b2 (field suffix "bias", in the
quantization's bias_dtype), as the fields listed in the manifest (name, dtype, shape,
offset), each 256-byte aligned so fields can be viewed in place. Expert matrices are HQQ
(engine/storage/quant.py), source precision (bits 16) or MXFP4 as gpt-oss ships them (method
"mxfp4", engine/storage/mxfp4.py).

Nothing in a store is trusted before it is checked (docs/STORE.md lists the checks): the
manifest names plain files of the folder only (no `..`, absolute, drive, device or stream
names, no links out) and lists REQUIRED_FILES and a tokenizer; every file the loader reads
(LOADER_FILES) is listed; the config's model_type is one of SUPPORTED_FAMILIES and its
sizes are bounded and backed by the files' real bytes; no `auto_map` and no Python file,
so no code shipped inside a store or checkpoint ever runs.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeferry.engine.errors import UserError
from moeferry.engine.runtime.model import ModelConfig
from moeferry.engine.storage import mxfp4, quant
from moeferry.engine.storage.manifest import (
    REQUIRED_FILES,
    inside,
    read_json,
    read_manifest,
)
from moeferry.engine.storage.safetensors_io import DTYPE_NAMES, DTYPES, FormatError, read_header, read_tensor
from moeferry.engine.units import GiB

SUPPORTED_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss")  # config.json model_type
SWIGLU_ACTIVATIONS = ("silu", "swish")  # config.json's hidden_act the experts and MLPs may have (transformers: both SiLU)
EXPERT_MATRICES = ("w1", "w3", "w2")
EXPERT_BIASES = ("b1", "b3", "b2")  # of w1, w3, w2, where the family has them
ATTN_MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MATRICES = ("gate_proj", "up_proj", "down_proj")  # dense layers' and the shared expert's
FIELD_ALIGN = 256

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
LOADER_FILES = REQUIRED_FILES + TOKENIZER_FILES + ("generation_config.json",)
# What a config may claim, far above every released MoE model, so that no count read from a
# file can make a loop or an allocation unbounded before the files' real sizes are compared.
CONFIG_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18,
                 "num_layers": 1024, "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 4096,
                 "num_experts": 4096, "top_k": 4096, "max_position_embeddings": 1 << 24}


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
    return layout_of([(f"{m}.{suffix}", dtype, shape) for m in expert_parts(cfg)
                      for suffix, (dtype, shape) in expert_field_shapes(cfg, m, quantization).items()])


def layout_of(items: list[tuple[str, torch.dtype, tuple]]) -> tuple[list[dict], int]:
    """(name, dtype, shape) in order -> fields with their aligned offsets, and the stride."""
    fields, offset = [], 0
    for name, dtype, shape in items:
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        fields.append({"name": name, "dtype": DTYPE_NAMES[dtype], "shape": list(shape), "offset": offset,
                       "nbytes": nbytes})
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


def open_store(arg: str | Path) -> Store:
    """Open a store after every check that needs no hashing (verify_store re-hashes)."""
    path, manifest = read_manifest(arg)
    listed_file_problems(path, manifest, hashing=False, exit_code=1)
    hf_config = read_json(path / "config.json")
    check_no_code(path, f"The store {path}", read={"config.json": hf_config})
    if not isinstance(hf_config, dict):
        raise UserError(f"{path}/config.json is missing or damaged; run `moeferry verify {path}`.", 1)
    cfg = model_config(hf_config, f"The store {path}")
    check_layout(path, manifest, cfg)
    check_backed(cfg, sum((path / f).stat().st_size for f in ("dense.safetensors", "experts.safetensors")),
                 f"The store {path}")
    return Store(path, manifest, hf_config, cfg)


def listed_file_problems(path: Path, manifest: dict, hashing: bool, exit_code: int = 1,
                         progress=None) -> list[str]:
    """A sentence per listed file that is missing, a link out, the wrong size or (hashing) changed,
    and per unlisted file the loader would read. Without hashing, the first problem is raised."""
    files = manifest["files"]
    bad = []
    for i, (name, want) in enumerate(sorted(files.items())):
        p = path / name
        if progress:
            progress(i / len(files), f"checking {name}")
        if p.is_symlink() and not inside(path, p):
            bad.append(f"{name}: a link to a file outside the store")
        elif not p.is_file():
            bad.append(f"{name}: missing")
        elif p.stat().st_size != want["size"]:
            bad.append(f"{name}: size {p.stat().st_size} bytes, expected {want['size']}")
        elif hashing and sha256_file(p) != want["sha256"]:
            bad.append(f"{name}: contents changed (sha256 mismatch)")
    bad += [f"{f}: read by the loader but not listed in the manifest"
            for f in LOADER_FILES if f not in files and (path / f).exists()]
    if bad and not hashing:
        raise UserError(f"The store {path} is damaged ({bad[0]}); run `moeferry verify {path}`, then "
                        f"convert or download the model again.", exit_code)
    return bad


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def verify_store(arg: str | Path, progress=None) -> list[str]:
    """Re-hash every file in the manifest; return a sentence for each bad, missing or unlisted file.

    A store that would run code, whose config the engine refuses, or whose manifest's layout
    does not fit that config raises UserError (exit 1), as loading it would.
    """
    path, manifest = read_manifest(arg)
    hf = read_json(path / "config.json")
    check_no_code(path, f"The store {path}", exit_code=1, read={"config.json": hf})
    bad = listed_file_problems(path, manifest, hashing=True, progress=progress)
    if not any(b.startswith("config.json:") for b in bad):
        if not isinstance(hf, dict):
            bad.append("config.json: not a JSON object")
        else:
            check_layout(path, manifest, model_config(hf, f"The store {path}", exit_code=1))
    return bad


# ---------------------------------------------------------------------------------------------
# Trust: families, code, sizes (for stores and checkpoints alike)


def check_no_code(folder: Path, what: str, exit_code: int = 2, read: dict | None = None) -> None:
    """Refuse a folder that ships Python files or names custom code (`auto_map`) in its configs.
    `read`: {file name: its JSON value} of the configs the caller has parsed already."""
    read = read or {}
    py = next(iter(sorted(folder.rglob("*.py"))), None)
    if py is not None:
        raise UserError(f"{what} contains the Python file {py.relative_to(folder)}; MoE Ferry never "
                        f"runs code shipped with a model, so it refuses the folder: use a checkpoint "
                        f"without custom code.", exit_code)
    for name in ("config.json",) + TOKENIZER_FILES + ("generation_config.json",):
        if name.endswith(".json") and name != "tokenizer.json" and \
                _has_key(read[name] if name in read else read_json(folder / name), "auto_map"):
            raise UserError(f"{what} has an auto_map in {name}, which asks to run custom code; MoE "
                            f"Ferry never runs code shipped with a model, so it refuses the folder.",
                            exit_code)


def _has_key(obj, key: str) -> bool:
    if isinstance(obj, dict):
        return key in obj or any(_has_key(v, key) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_key(v, key) for v in obj)
    return False


def model_config(hf: dict, what: str, exit_code: int = 2) -> ModelConfig:
    """The engine's config from a Hugging Face config.json, after its family and every count
    in it are checked (positive integers within CONFIG_LIMITS)."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED_FAMILIES:
        raise UserError(f"{what} holds a {str(kind or 'unknown')[:40]!r} model, which MoE Ferry cannot run "
                        f"(it runs model_type {', '.join(SUPPORTED_FAMILIES)}); use a checkpoint of one of "
                        f"those.", exit_code)
    act = hf.get("hidden_act", "silu")
    if kind != "gpt_oss" and act not in SWIGLU_ACTIVATIONS:  # gpt_oss's experts ignore hidden_act
        raise UserError(f"{what} has experts whose activation is {str(act)[:40]!r} (config.json's hidden_act); "
                        f"MoE Ferry runs SwiGLU experts with SiLU only ({', '.join(SWIGLU_ACTIVATIONS)}), so it "
                        f"cannot run this model.", exit_code)
    try:
        cfg = ModelConfig.from_hf(hf)
    except KeyError as e:
        raise UserError(f"{what} has a config.json without a usable {e.args[0] if e.args else 'value'!s:.60}; "
                        f"it is damaged or not a {kind} config.", exit_code) from None
    except ZeroDivisionError:
        raise UserError(f"{what} has a config.json with a count of zero where one divides another (such as "
                        f"num_attention_heads); it is damaged.", exit_code) from None
    except (TypeError, ValueError, AttributeError):
        raise UserError(f"{what} has a config.json with a value of the wrong kind where a number is needed; "
                        f"it is damaged or not a {kind} config.", exit_code) from None
    for name, limit in CONFIG_LIMITS.items():
        v = getattr(cfg, name)
        if type(v) is not int or not 1 <= v <= limit:
            raise UserError(f"{what} has a config.json whose {name} is {str(v)[:40]}, not a whole number "
                            f"from 1 to {limit}; it is damaged.", exit_code)
    ok = (cfg.top_k <= cfg.num_experts and cfg.num_heads % cfg.num_kv_heads == 0
          and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                  for x in (cfg.rms_norm_eps, cfg.rope_theta))
          and (cfg.sliding_window is None or (type(cfg.sliding_window) is int and cfg.sliding_window > 0)))
    if not ok:
        raise UserError(f"{what} has a config.json whose experts per token, heads, rms_norm_eps, rope_theta "
                        f"or sliding_window do not fit together; it is damaged.", exit_code)
    if not cfg.moe_layer_ids:
        raise UserError(f"{what} has no layer with routed experts (its config.json's decoder_sparse_step and "
                        f"mlp_only_layers make every layer dense); MoE Ferry runs mixture-of-experts models, so "
                        f"run this one with a runtime for dense models.", exit_code)
    return cfg


def min_model_bytes(cfg: ModelConfig) -> int:
    """A lower bound on the bytes any file set holding this model needs: every weight at one bit."""
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    experts = cfg.num_experts * 3 * cfg.hidden_size * cfg.intermediate_size
    return (cfg.num_layers * attn + cfg.num_moe_layers * experts + cfg.vocab_size * cfg.hidden_size) // 8


def check_backed(cfg: ModelConfig, nbytes: int, what: str) -> None:
    """Refuse a config that claims more weights than the files' real bytes could hold."""
    need = min_model_bytes(cfg)
    if need > nbytes:
        raise UserError(f"{what} has a config.json describing {cfg.num_layers} layers of {cfg.num_experts} "
                        f"experts (at least {need / GiB:.1f} GiB even at 1 bit per weight), but its weight "
                        f"files hold {nbytes / GiB:.3f} GiB; the config does not belong to these weights.")


def check_layout(path: Path, manifest: dict, cfg: ModelConfig) -> None:
    """The manifest's quantization and expert layout must be what this config implies."""
    try:
        q = manifest["quantization"]
        fields, stride = expert_layout(cfg, q["experts"])
        for m in ATTN_MATRICES:
            matrix_fields(*attn_shape(cfg, m), q["attention"])
        ok = manifest["experts"].get("stride") == stride and manifest["experts"].get("fields") == fields
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
        ok = False
    if not ok:
        raise UserError(f"{path}/manifest.json describes a quantization or expert layout that does not fit "
                        f"its config.json; the store is damaged: convert the model again.", 1)


# ---------------------------------------------------------------------------------------------
# Reading weights


def read_dense(store: Store) -> dict:
    """Non-expert weights on the CPU: HF name -> Tensor (unquantized) or QMatrix (attention)."""
    path = store.path / "dense.safetensors"
    try:
        header, start = read_header(path)
    except (OSError, FormatError) as e:
        raise UserError(f"Cannot read {path} ({e}); run `moeferry verify {store.path}`.") from None
    check_dense_shapes(store, header)
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


def check_dense_shapes(store: Store, header: dict) -> None:
    """Every tensor whose shape the config fixes must have it (views and matmuls rely on it)."""
    cfg = store.config
    h, v = cfg.hidden_size, cfg.vocab_size
    known = {"model.embed_tokens.weight": [v, h], "lm_head.weight": [v, h], "model.norm.weight": [h]}
    for name, entry in header.items():
        want = known.get(name)
        parts = name.split(".")
        if want is None and len(parts) == 6 and parts[3] == "self_attn" and parts[4] in ATTN_MATRICES \
                and parts[5] == "bias":
            want = [attn_shape(cfg, parts[4])[0]]
        elif want is None and len(parts) == 6 and parts[3] == "self_attn" and parts[4] in ATTN_MATRICES:
            fields = matrix_fields(*attn_shape(cfg, parts[4]), store.attn_quant)
            dtype, shape = fields.get(parts[5], (None, None))
            want = list(shape) if shape is not None and DTYPE_NAMES[dtype] == entry["dtype"] else "none"
        elif want is None and name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            want = [h]
        elif want is None and name.endswith("block_sparse_moe.gate.weight"):
            want = [cfg.num_experts // cfg.expert_units, h]  # the router routes whole experts
        if want is not None and entry["shape"] != want:
            raise UserError(f"{store.path}/dense.safetensors holds {name} as {entry['dtype']} {entry['shape']}, "
                            f"which does not fit the store's config and quantization; run "
                            f"`moeferry verify {store.path}` and convert again.", 1)


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
    if shape != want or entry["dtype"] != "U8" or entry["data_offsets"][0] != 0:
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
    for name, t in model.state_dict().items():  # qwen2_moe builds a shared expert (and gate) of size 0
        if name not in sd and cfg.shared_expert_size == 0 and ".shared_expert" in name:  # no effect; not stored
            sd[name] = torch.zeros(t.shape, dtype=dtype)
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
    fsync_folder(tmp)
    if dest.is_dir():
        dest.rmdir()  # empty: callers refuse a non-empty destination up front
    if dest.exists():
        raise UserError(f"{dest} appeared while the store was being written; move it away and run again.")
    os.replace(tmp, dest)
    fsync_dir(dest.parent)


def fsync_folder(folder: Path) -> None:
    """Flush every file of the folder and the folder itself to the disk (before it is renamed)."""
    for p in sorted(folder.iterdir()):
        if p.is_file() and not p.is_symlink():
            with open(p, "r+b") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries durable (POSIX; Windows has no directory handles to flush)."""
    if os.name == "nt":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_partial(tmp: Path) -> None:
    """Delete a temporary sibling (this run's, or the leftovers of one that was killed)."""
    shutil.rmtree(tmp, ignore_errors=True)
