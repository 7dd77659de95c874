"""Import the paper's pre-quantized offloading checkpoint into a MoE Ferry store, as it is.

The format (shared/formats/paper-offloading-checkpoint.md) is HQQ, axis-0 groups strided by
G = rows / g, which is also our low-bit format (engine/storage/quant.py), so nothing is re-quantized:
- codes: the 2-, 4- and 8-bit `W_q` planes ARE our planes (copied byte for byte); 3-bit
  (HQQ's int32 "3bit_32": code[r + j*ceil(rows/10)] = (W_q[r] >> (27 - 3j)) & 7) is repacked;
- 8-bit metadata: `scale_q` [s, G*K/s] with `meta_scale.{scale,zero}` [1, G*K/s] is, flattened,
  exactly our uint8 [G, K] + float16 meta [2, M] with value[f] = (q[f] - meta[1, f % M]) *
  meta[0, f % M] and M = G*K/s (meta_group = s); `zero_q` with scalar `meta_zero` is M = 1;
- plain `meta.scale` / `meta.zero` (float16) become our meta_bits=16 layout.
A store holds one quantization per kind of matrix (experts, attention). When the checkpoint's
matrices of one kind differ only in their metadata, every matrix is brought to a common layout
without changing a single weight: meta pairs are repeated (exact) or, where some matrix of the
kind has plain float16 metadata, 8-bit metadata is decoded to float16 the way the paper's code
does (float16 arithmetic). Different bit widths or group sizes within one kind are refused.

Everything is decided from the tensors' shapes (safetensors headers) before a byte is written;
the store is written into a hidden sibling folder, verified, then renamed into place.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from moeferry.engine.errors import UserError
from moeferry.engine.runtime.model import ModelConfig
from moeferry.engine.storage import convert, quant, store
from moeferry.engine.storage.manifest import FORMAT
from moeferry.engine.storage.safetensors_io import DTYPES, StreamingWriter

TOKENIZER_REPO = "mistralai/Mixtral-8x7B-Instruct-v0.1"
TOKENIZER_HINT = (f"the tokenizer of {TOKENIZER_REPO} is in a gated repository: accept its licence at "
                  f"https://huggingface.co/{TOKENIZER_REPO} and log in (`hf auth login`), download its "
                  f"tokenizer files (tokenizer.json, tokenizer_config.json, special_tokens_map.json, "
                  f"tokenizer.model), then pass --tokenizer with their folder or the repository id")


# ---------------------------------------------------------------------------------------------
# The checkpoint's tensors


@dataclass
class Checkpoint:
    src: Path
    hf_config: dict
    weight_map: dict[str, str]
    headers: dict[str, dict]  # file name -> its safetensors header
    refs: dict[str, convert.TensorRef]  # full tensor name -> where its bytes are

    def ref(self, name: str) -> convert.TensorRef | None:
        return self.refs.get(name)

    def matrix(self, prefix: str) -> dict[str, convert.TensorRef]:
        """Tensors of one attention matrix: {'W_q': ref, 'meta.scale_q': ref, ...}."""
        return {k[len(prefix):]: r for k, r in self.refs.items() if k.startswith(prefix)}

    def expert(self, layer: int, e: int) -> dict[str, convert.TensorRef]:
        """Tensors of one expert, keys without prefix ('w1.W_q', ...), from the file the index names."""
        p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
        fname = self.weight_map.get(p + "w1.W_q") or self.weight_map.get(p + "w1.weight")
        if fname is None:
            fname = next((f for k, f in self.weight_map.items() if k.startswith(p)), None)
        if fname is None:
            raise UserError(f"The checkpoint's index names no file for layer {layer} expert {e} "
                            f"(no entry {p}w1.W_q); it is incomplete or not in the paper's format.")
        path, (header, start) = self.src / fname, self.headers[fname]
        out = {k[len(p):]: convert.TensorRef(path, v, start) for k, v in header.items() if k.startswith(p)}
        if not out:  # the paper's own layout: one expert per file, keys without prefix
            out = {k: convert.TensorRef(path, v, start) for k, v in header.items()
                   if k.split(".", 1)[0] in store.EXPERT_MATRICES}
        return out


def open_checkpoint(src: Path, tokenizer=None) -> Checkpoint:
    if not src.is_dir():
        raise UserError(f"{src} is not a folder; give the folder of the paper's offloading checkpoint.")
    store.check_no_code(src, f"The checkpoint {src}")
    weight_map, files = convert.read_index(src)
    hf = read_config(src, tokenizer)
    headers, refs = {}, {}
    for f in files:
        header, start = convert.shard_header(src / f)
        headers[f] = header, start
        for k, v in header.items():
            if k.startswith(("model.", "lm_head.")) and weight_map.get(k, f) == f:
                refs[k] = convert.TensorRef(src / f, v, start)
    return Checkpoint(src, hf, weight_map, headers, refs)


def read_config(src: Path, tokenizer) -> dict:
    """The checkpoint's config.json; else (the paper's demo takes it from the tokenizer repo) that one."""
    if not (src / "config.json").is_file() and tokenizer:
        tok = find_tokenizer(src, tokenizer)
        if (tok / "config.json").is_file():
            return convert.read_hf_config(tok)
    return convert.read_hf_config(src)


# ---------------------------------------------------------------------------------------------
# One matrix, from its headers alone


@dataclass(frozen=True)
class MatrixInfo:
    """What the checkpoint holds for one matrix W [rows, cols]."""
    rows: int
    cols: int
    bits: int  # 16: an unquantized `weight`
    group_size: int = 0
    scale: str = ""  # "q8": 8-bit with one meta pair per column of scale_q; "q8-other"; "f16"
    zero: str = ""
    scale_m: int = 0  # meta pairs ("q8")
    zero_m: int = 0
    dtype: str = "F16"  # of an unquantized weight

    @property
    def n_meta(self) -> int:  # scale (and zero) values: G * cols
        return self.rows * self.cols // self.group_size


def describe_matrix(entries: dict[str, dict], rows: int, cols: int, where: str) -> MatrixInfo:
    """entries: {'W_q': header entry, 'meta.scale_q': ..., ...} -> MatrixInfo (or a UserError)."""
    def bad(what: str) -> UserError:
        return UserError(f"The checkpoint's {where} {what}; it is damaged or not in the paper's format "
                         f"(shared/formats/paper-offloading-checkpoint.md).")

    if "bias" in entries:
        raise bad("has a bias, which Mixtral has not")
    if "W_q" not in entries:
        w = entries.get("weight")
        if w is None:
            raise bad("has neither W_q nor weight")
        if tuple(w["shape"]) != (rows, cols) or w["dtype"] not in ("F16", "BF16", "F32"):
            raise bad(f"weight is {w['dtype']} {w['shape']}, not a float [{rows}, {cols}] matrix")
        return MatrixInfo(rows, cols, 16, dtype=w["dtype"])
    wq = entries["W_q"]
    shape = tuple(wq["shape"])
    if wq["dtype"] == "U8" and len(shape) == 2 and shape[1] == cols and shape[0] and (8 * shape[0]) % rows == 0:
        bits = 8 * shape[0] // rows
    elif wq["dtype"] == "I32" and len(shape) == 2 and shape[1] == cols and shape[0] == -(-rows // 10):
        bits = 3
    else:
        raise bad(f"W_q is {wq['dtype']} {list(shape)}, which packs no supported bit width for a "
                  f"[{rows}, {cols}] matrix")
    if bits not in (2, 3, 4, 8):
        raise bad(f"W_q holds {bits}-bit codes; MoE Ferry reads 2-, 3-, 4- and 8-bit codes")

    scale, scale_m, n = describe_meta(entries, "scale", bad)
    zero, zero_m, n_zero = describe_meta(entries, "zero", bad)
    if n != n_zero or n == 0 or (rows * cols) % n:
        raise bad(f"has {n} scales and {n_zero} zeros, which do not fit a [{rows}, {cols}] matrix")
    g = rows * cols // n
    if rows % g or rows % 8:
        raise bad(f"groups of {g} rows do not divide its {rows} rows")
    return MatrixInfo(rows, cols, bits, g, scale, zero, scale_m, zero_m)


def describe_meta(entries: dict, which: str, bad) -> tuple[str, int, int]:
    """-> (layout, meta pairs, number of values) of the matrix's scales or zeros."""
    plain, q = entries.get(f"meta.{which}"), entries.get(f"meta.{which}_q")
    if q is None:
        if plain is None:
            raise bad(f"has neither meta.{which} nor meta.{which}_q")
        if plain["dtype"] not in ("F16", "BF16", "F32"):
            raise bad(f"meta.{which} is {plain['dtype']}, not float")
        return "f16", 0, math.prod(plain["shape"])
    ms, mz = entries.get(f"meta.meta_{which}.scale"), entries.get(f"meta.meta_{which}.zero")
    if ms is None or mz is None or q["dtype"] != "U8":
        raise bad(f"has meta.{which}_q without meta.meta_{which}.scale and .zero (or not uint8)")
    qshape = list(q["shape"]) if len(q["shape"]) >= 2 else [1] + list(q["shape"])
    n, cols = math.prod(qshape), qshape[-1]
    sizes = [math.prod(m["shape"]) for m in (ms, mz)]
    if all(k == 1 or (k == cols and m["shape"][-1] == cols) for k, m in zip(sizes, (ms, mz))):
        return "q8", (cols if cols in sizes else 1), n  # value f uses meta column f % cols
    try:  # some other meta grouping: decoded to float16 as HQQ does, by broadcasting
        if math.prod(torch.broadcast_shapes(tuple(q["shape"]), tuple(ms["shape"]), tuple(mz["shape"]))) != n:
            raise RuntimeError
    except RuntimeError:
        raise bad(f"has meta.meta_{which} of shape {ms['shape']} that does not fit meta.{which}_q "
                  f"{q['shape']}") from None
    return "q8-other", 0, n


# ---------------------------------------------------------------------------------------------
# One quantization per kind of matrix


def kind_quantization(infos: list[MatrixInfo], kind: str) -> dict:
    """The manifest's quantization for all matrices of one kind ('expert' or 'attention')."""
    plain = [i for i in infos if i.bits == 16]
    if plain and len(plain) != len(infos):
        raise UserError(f"The checkpoint mixes quantized and unquantized {kind} matrices, which one MoE "
                        f"Ferry store cannot hold; it cannot be imported.")
    if plain:
        dtypes = {i.dtype for i in infos}
        return {"bits": 16, "dtype": dtypes.pop() if len(dtypes) == 1 else "F32", "method": "paper-import"}
    for field, what in (("bits", "bit widths"), ("group_size", "group sizes")):
        values = sorted({getattr(i, field) for i in infos})
        if len(values) > 1:
            raise UserError(f"The checkpoint's {kind} matrices mix {what} ({', '.join(map(str, values))}), "
                            f"and a MoE Ferry store holds one per kind of matrix, so it cannot be imported.")
    q = {"bits": infos[0].bits, "group_size": infos[0].group_size}
    if all(i.scale == "q8" and i.zero == "q8" for i in infos):
        q.update(meta_group=common_meta_group([(i.n_meta, i.scale_m) for i in infos]),
                 zero_meta_group=common_meta_group([(i.n_meta, i.zero_m) for i in infos]), meta_bits=8)
    else:  # plain float16 metadata somewhere: all of this kind is stored as float16
        q.update(meta_group=None, zero_meta_group=None, meta_bits=16)
    q["method"] = "paper-import"
    return q


def common_meta_group(pairs: list[tuple[int, int]]) -> int:
    """A meta_group under which every matrix's (values n, meta pairs m) is exact: the store's pairs
    quant.meta_groups(n, meta_group) must be a multiple of m (pairs are then repeated); fewest bytes."""
    candidates = {n // m for n, m in pairs} | {math.gcd(*[n // m for n, m in pairs]), max(n for n, _ in pairs)}
    best = None
    for c in sorted(candidates):
        counts = [quant.meta_groups(n, c) for n, _ in pairs]
        if all(k % m == 0 for k, (_, m) in zip(counts, pairs)):
            cost = sum(counts)
            if best is None or cost < best[0]:
                best = (cost, c)
    return best[1]  # the gcd is always exact


# ---------------------------------------------------------------------------------------------
# One matrix, its bytes in our layout


def load_matrix(refs: dict[str, convert.TensorRef], info: MatrixInfo, q: dict) -> dict[str, torch.Tensor]:
    """The matrix's store tensors {suffix: tensor} (store.matrix_fields names) under quantization q."""
    if q["bits"] == 16:
        return {"weight": refs["weight"].load().to(DTYPES[q["dtype"]])}
    wq = refs["W_q"].load()
    if info.bits == 3:
        out = {f"plane{i}": p for i, p in enumerate(quant.pack_codes(unpack_3bit_i32(wq, info.rows), 3))}
    else:
        out = {"plane0": wq}  # the paper's W_q is our bit plane, byte for byte
    G = info.rows // info.group_size
    for which, layout in (("scale", info.scale), ("zero", info.zero)):
        if q["meta_bits"] == 8:
            group = q["meta_group"] if which == "scale" else q["zero_meta_group"]
            m_store = quant.meta_groups(G * info.cols, group)
            out[which] = refs[f"meta.{which}_q"].load().reshape(G, info.cols)
            out[f"{which}_meta"] = meta_pairs(refs, which, info.scale_m if which == "scale" else info.zero_m,
                                              m_store)
        elif layout == "f16":
            out[which] = refs[f"meta.{which}"].load().reshape(G, info.cols).to(torch.float16)
        else:  # 8-bit decoded to float16 with float16 arithmetic, as the paper's HQQ does
            v = refs[f"meta.{which}_q"].load().to(torch.float16)
            s, z = (refs[f"meta.meta_{which}.{k}"].load().to(torch.float16) for k in ("scale", "zero"))
            out[which] = ((v - z) * s).reshape(G, info.cols)
    return out


def meta_pairs(refs, which: str, m: int, m_store: int) -> torch.Tensor:
    """float16 [2, m_store] (row 0 scale, row 1 zero) from the paper's meta_{which}.scale/.zero."""
    s, z = (refs[f"meta.meta_{which}.{k}"].load().reshape(-1).to(torch.float16) for k in ("scale", "zero"))
    pairs = torch.stack([s.expand(m), z.expand(m)])  # a scalar serves every column
    return pairs.repeat(1, m_store // m)  # f % m_store % m == f % m: the same pair for every value


def unpack_3bit_i32(wq: torch.Tensor, rows: int) -> torch.Tensor:
    """HQQ's '3bit_32' int32 [ceil(rows/10), cols] -> uint8 codes [rows, cols]."""
    parts = [((wq >> (27 - 3 * j)) & 7).to(torch.uint8) for j in range(10)]
    return torch.cat(parts, dim=0)[:rows]


# ---------------------------------------------------------------------------------------------
# The plan: every matrix described, one quantization per kind


@dataclass
class Plan:
    cfg: ModelConfig
    eq: dict
    aq: dict
    dense: list[tuple[str, str]]  # (store name, checkpoint name) of unquantized non-expert tensors
    attn: dict[str, MatrixInfo]  # checkpoint prefix 'model.layers.L.self_attn.q_proj.' -> info
    experts: dict[tuple[int, int, str], MatrixInfo]


def plan_import(ck: Checkpoint) -> Plan:
    cfg = ModelConfig.from_hf(ck.hf_config)  # checked by convert.read_hf_config
    store.check_backed(cfg, sum((ck.src / f).stat().st_size for f in ck.headers), f"The checkpoint {ck.src}")
    convert.check_count(sum(len(h) for h, _ in ck.headers.values()), cfg.num_layers * cfg.num_experts * 3)
    dense = [("model.embed_tokens.weight",) * 2, ("model.norm.weight",) * 2]
    if "lm_head.weight" in ck.refs or not cfg.tie_word_embeddings:
        dense.append(("lm_head.weight",) * 2)
    attn, experts = {}, {}
    for l in range(cfg.num_layers):
        p = f"model.layers.{l}."
        dense += [(p + "input_layernorm.weight",) * 2, (p + "post_attention_layernorm.weight",) * 2]
        gate = p + "block_sparse_moe.gate.weight"
        dense.append((gate, gate if gate in ck.refs else p + "mlp.gate.weight"))
        for m in store.ATTN_MATRICES:
            prefix = f"{p}self_attn.{m}."
            entries = {k: r.entry for k, r in ck.matrix(prefix).items()}
            attn[prefix] = describe_matrix(entries, *store.attn_shape(cfg, m), prefix.rstrip("."))
        for e in range(cfg.num_experts):
            refs = ck.expert(l, e)
            for m in store.EXPERT_MATRICES:
                entries = {k[len(m) + 1:]: r.entry for k, r in refs.items() if k.startswith(m + ".")}
                where = f"layer {l} expert {e} {m}"
                experts[l, e, m] = describe_matrix(entries, *store.expert_shape(cfg, m), where)
    convert.check_present(ck.refs, [s for _, s in dense])
    want = {"model.embed_tokens.weight": [cfg.vocab_size, cfg.hidden_size], "model.norm.weight": [cfg.hidden_size],
            "lm_head.weight": [cfg.vocab_size, cfg.hidden_size]}
    for name, src in dense:
        shape = ck.refs[src].entry["shape"]
        expect = want.get(name) or ([cfg.num_experts, cfg.hidden_size] if "gate" in name else [cfg.hidden_size])
        if list(shape) != expect:
            raise UserError(f"The checkpoint's {src} has shape {shape} where its config.json implies {expect}; "
                            f"the config does not belong to these weights.")
    eq = kind_quantization(list(experts.values()), "expert")
    aq = kind_quantization(list(attn.values()), "attention")
    try:
        for q, infos in ((eq, experts.values()), (aq, attn.values())):
            for i in infos:
                store.matrix_fields(i.rows, i.cols, q)
    except ValueError as e:
        raise UserError(f"This checkpoint's shapes do not fit a MoE Ferry store: {e}.") from None
    return Plan(cfg, eq, aq, dense, attn, experts)


def check_requested_bits(expert_bits, attn_bits, plan: Plan) -> None:
    have = {"--expert-bits": plan.eq["bits"], "--attn-bits": plan.aq["bits"]}
    for flag, asked in (("--expert-bits", expert_bits), ("--attn-bits", attn_bits)):
        if asked is not None and asked != have[flag]:
            raise UserError(f"This checkpoint is already quantized ({have['--expert-bits']}-bit experts, "
                            f"{have['--attn-bits']}-bit attention) and is imported as it is, so {flag} "
                            f"{asked} cannot apply; leave out --expert-bits and --attn-bits, or convert the "
                            f"original weights for other bit widths.")


# ---------------------------------------------------------------------------------------------
# The tokenizer


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))


def find_tokenizer(src: Path, tokenizer) -> Path:
    """The folder to copy the tokenizer files from: --tokenizer (folder or cached repo) or src."""
    if tokenizer is None:
        if has_tokenizer(src):
            return src
        raise UserError(f"{src} has no tokenizer files, and {TOKENIZER_HINT}.")
    folder = Path(str(tokenizer)).expanduser()
    if not folder.is_dir():
        try:
            folder = convert.resolve_tokenizer_dir(tokenizer)
        except UserError:
            folder = cached_tokenizer(str(tokenizer))
    if folder is None or not has_tokenizer(folder):
        raise UserError(f"--tokenizer {tokenizer} names no folder holding tokenizer.json or tokenizer.model, "
                        f"nor a repository with them in your Hugging Face cache; {TOKENIZER_HINT}.")
    return folder


def cached_tokenizer(repo_id: str) -> Path | None:
    """A snapshot of repo_id in the HF cache that holds its tokenizer (weights not needed)."""
    from moeferry.engine.setup.hf_cache import cache_repo_dir
    root = cache_repo_dir(repo_id)
    snaps = root / "snapshots"
    if not snaps.is_dir():
        return None
    ref = root / "refs" / "main"
    first = [snaps / ref.read_text().strip()] if ref.is_file() else []
    others = sorted((p for p in snaps.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    return next((p for p in first + others if p.is_dir() and has_tokenizer(p)), None)


# ---------------------------------------------------------------------------------------------
# Importing


def import_paper_checkpoint(src, dest, expert_bits: int | None = None, attn_bits: int | None = None,
                            tokenizer=None, progress=None, cancel: threading.Event | None = None) -> Path:
    """The paper's offloading checkpoint in `src` -> a verified MoE Ferry store at `dest`.

    No weight is re-quantized. progress(fraction, message); setting `cancel` stops it, and
    nothing is left behind.
    """
    src, dest = Path(src).expanduser(), Path(dest).expanduser()
    ck = open_checkpoint(src, tokenizer)
    plan = plan_import(ck)
    check_requested_bits(expert_bits, attn_bits, plan)
    tok_dir = find_tokenizer(src, tokenizer)
    cfg = plan.cfg
    if tokenizer is not None:
        convert.check_tokenizer(tok_dir, cfg)
    convert.check_destination(dest)
    tmp = store.temp_sibling(dest)
    store.remove_partial(tmp)  # leftovers of an earlier interrupted run, before measuring space
    convert.check_free_space(dest, store_bytes(ck, plan))
    convert.make_temp(tmp)
    report = progress or (lambda f, m: None)
    total = len(plan.dense) + len(plan.attn) + cfg.num_layers * cfg.num_experts
    done = [0]

    def tick(msg: str) -> None:
        if cancel is not None and cancel.is_set():
            raise convert.Cancelled()
        done[0] += 1
        report(done[0] / total, msg)

    try:
        convert.copy_tokenizer(src, tok_dir, tmp)
        (tmp / "config.json").write_text(json.dumps(ck.hf_config, indent=2))
        hashes = {"dense.safetensors": write_dense(tmp, ck, plan, tick),
                  "experts.safetensors": write_experts(tmp, ck, plan, tick)}
        convert.write_manifest(tmp, cfg, ck.hf_config, src, plan.eq, plan.aq, hashes)
        manifest = json.loads((tmp / "manifest.json").read_text())
        manifest["source"]["format"] = "paper-offloading-checkpoint"
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        report(1.0, "verifying the new store")
        store.verify_and_install(tmp, dest, "imported")
    except convert.Cancelled:
        store.remove_partial(tmp)
        raise UserError("Import cancelled; nothing was written.", exit_code=1) from None
    except OSError as e:
        store.remove_partial(tmp)
        raise convert.file_error(e, dest) from None
    except BaseException:
        store.remove_partial(tmp)
        raise
    return dest


def dense_entries(ck: Checkpoint, plan: Plan) -> list[tuple]:
    """dense.safetensors' declared tensors (name, dtype, shape)."""
    entries = [(dst, DTYPES[ck.refs[src].entry["dtype"]], tuple(ck.refs[src].entry["shape"]))
               for dst, src in plan.dense]
    for prefix, info in plan.attn.items():
        fields = store.matrix_fields(info.rows, info.cols, plan.aq)
        entries += [(prefix + k, dt, shape) for k, (dt, shape) in fields.items()]
    return entries


def store_bytes(ck: Checkpoint, plan: Plan) -> int:
    """The tensor bytes of the store the plan makes (dense and experts)."""
    cfg = plan.cfg
    dense = sum(convert.nbytes(dt, shape) for _, dt, shape in dense_entries(ck, plan))
    return dense + cfg.num_layers * cfg.num_experts * store.expert_layout(cfg, plan.eq)[1]


def write_dense(tmp: Path, ck: Checkpoint, plan: Plan, tick) -> str:
    entries = dense_entries(ck, plan)
    w = StreamingWriter(tmp / "dense.safetensors", entries, {"format": FORMAT})
    for dst, src in plan.dense:
        w.write(dst, ck.refs[src].load())
        tick(f"copying {dst}")
    for prefix, info in plan.attn.items():
        tensors = load_matrix(ck.matrix(prefix), info, plan.aq)
        for k in store.matrix_fields(info.rows, info.cols, plan.aq):  # in the declared order
            w.write(prefix + k, tensors[k].contiguous())
        tick(f"copying {prefix}W_q")
    return w.close()


def write_experts(tmp: Path, ck: Checkpoint, plan: Plan, tick) -> str:
    cfg = plan.cfg
    fields, stride = store.expert_layout(cfg, plan.eq)
    w = StreamingWriter(tmp / "experts.safetensors",
                        [("experts", torch.uint8, (cfg.num_layers, cfg.num_experts, stride))],
                        {"format": FORMAT})
    for layer in range(cfg.num_layers):
        for e in range(cfg.num_experts):
            refs = ck.expert(layer, e)
            tensors = {}
            for m in store.EXPERT_MATRICES:
                mine = {k[len(m) + 1:]: r for k, r in refs.items() if k.startswith(m + ".")}
                for k, t in load_matrix(mine, plan.experts[layer, e, m], plan.eq).items():
                    tensors[f"{m}.{k}"] = t
            for f in fields:  # the layout promises these exact shapes; never pack a mismatch
                t = tensors[f["name"]]
                if list(t.shape) != f["shape"] or DTYPES[f["dtype"]] != t.dtype:
                    raise AssertionError(f"{f['name']}: {t.dtype} {list(t.shape)} != {f['dtype']} {f['shape']}")
            w.write_raw("experts", memoryview(store.pack_expert(tensors, fields, stride).numpy()))
            tick(f"copying layer {layer} expert {e}")
    return w.close()
