"""Experts cut into S units along their intermediate dimension, exactly, in the store's layout.

An expert's output w2 (silu(w1 x) * w3 x) is a sum over its intermediate index n, so a partition
of n into S sets gives S smaller experts ("units") whose outputs add up to the expert's. A missed
expert then becomes S misses, which the CPU+GPU hybrid can serve part over the link and part on
the CPU at once (engine/runtime/placement.py prices each unit).

The cut moves whole bytes and needs no re-quantization (engine/storage/quant.py's layout: G groups,
row n in group n % G, p = 8 // w codes of rows r, r + R, ... in byte row r of a plane):
  unit p of w1 and w3 holds the rows n with n % G in [p G / S, (p + 1) G / S), in order: in each
      plane the byte rows r with r % G in that range (a byte's codes share their group), the
      scale and zero rows of those groups, and the 8-bit metadata as it is (value f keeps its meta
      pair f % M because S divides G cols / M);
  unit p of w2 holds the same intermediate indices as columns, its metadata gathered so that
      value (j, k') of the unit finds the pair of (j, column k') of the expert.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from moeferry.engine.errors import UserError
from moeferry.engine.runtime.expert_cache import pinned_empty
from moeferry.engine.storage import store as store_mod
from moeferry.engine.storage.quant import QMatrix


def unit_index(rows: int, groups: int, units: int, p: int) -> torch.Tensor:
    """The rows n of unit p (int64, increasing): those with n % groups in unit p's range."""
    per = groups // units
    n = torch.arange(rows)
    g = n % groups
    return n[(g >= p * per) & (g < (p + 1) * per)]


def can_split(w1: QMatrix, w2: QMatrix, units: int) -> str:
    """"" when these matrices cut into `units` units exactly, else why not (one sentence)."""
    G = w1.groups
    if units < 2 or G % units:
        return f"the experts' {G} row groups do not divide into {units} units"
    for meta in (w1.scale_meta, w1.zero_meta):
        if meta is not None and (G // units * w1.cols) % meta.shape[1]:
            return "the experts' 8-bit scale metadata does not follow a cut into units"
    for meta in (w2.scale_meta, w2.zero_meta):
        if meta is not None and meta.shape[1] % w2.cols and w2.cols % meta.shape[1]:
            return "the experts' down-projection metadata does not follow a cut into units"
    return ""


def rows_unit(w: QMatrix, units: int, p: int) -> QMatrix:
    """Unit p of w1 or w3 [I, H]: I / units rows (unit_index), the same values."""
    G = w.groups
    planes = [plane[unit_index(plane.shape[0], G, units, p)] for plane in w.planes]
    lo, hi = p * G // units, (p + 1) * G // units
    return QMatrix(w.rows // units, w.cols, w.bits, w.group_size, planes, w.scale[lo:hi], w.zero[lo:hi],
                   w.scale_meta, w.zero_meta)


def cols_unit(w: QMatrix, cols: torch.Tensor) -> QMatrix:
    """w2 [H, I] restricted to the columns `cols` (in that order), the same values."""
    return QMatrix(w.rows, len(cols), w.bits, w.group_size, [plane[:, cols] for plane in w.planes],
                   w.scale[:, cols], w.zero[:, cols], _meta_cols(w.scale_meta, w.cols, cols),
                   _meta_cols(w.zero_meta, w.cols, cols))


def _meta_cols(meta: torch.Tensor | None, cols_in: int, cols: torch.Tensor) -> torch.Tensor | None:
    """The meta pairs of a column subset. Value (j, k) of the matrix has pair (j cols_in + k) % M:
    with M = c cols_in that is pair (j % c) cols_in + k, with M dividing cols_in pair k % M."""
    if meta is None:
        return None
    M = meta.shape[1]
    if M % cols_in == 0:
        at = torch.cat([a * cols_in + cols for a in range(M // cols_in)])
    else:
        at = cols % M
    return meta[:, at].contiguous()


def split_expert(w: dict, units: int) -> list[dict]:
    """An expert's {w1, w3, w2: QMatrix} -> `units` experts whose outputs add up to its output."""
    G = w["w1"].groups
    out = []
    for p in range(units):
        cols = unit_index(w["w1"].rows, G, units, p)
        out.append({"w1": rows_unit(w["w1"], units, p), "w3": rows_unit(w["w3"], units, p),
                    "w2": cols_unit(w["w2"], cols)})
    return out


def unit_fields(part: dict) -> dict[str, torch.Tensor]:
    """A unit's tensors by their field names in a packed expert ("w1.plane0", ...)."""
    return {f"{m}.{name}": t for m in store_mod.EXPERT_MATRICES for name, t in part[m].tensors().items()}


def split_store(st, host: torch.Tensor, units: int, pin: bool = False, progress=None):
    """A store's experts as units: (the Store of a model with E * units experts of width I / units,
    top-k * units, and routing that expands each routed expert into its units; its experts uint8
    [layers, E * units, unit stride], pinned if asked)."""
    cfg, fields, host = split_host(st.config, host, st.expert_fields, st.expert_quant, units, pin, progress)
    manifest = copy.deepcopy(st.manifest)
    manifest["experts"].update(fields=fields, stride=host.shape[2])
    return replace(st, manifest=manifest, config=cfg), host


def split_host(cfg, host: torch.Tensor, fields: list[dict], quantization: dict, units: int, pin: bool = False,
               progress=None):
    """Experts uint8 [L, E, stride] in layout `fields` -> (the units' ModelConfig, their layout,
    their experts uint8 [L, E * units, unit stride]); expert e's units are e * units + p."""
    view = lambda buf: store_mod.view_expert(buf, fields, quantization, cfg)  # noqa: E731
    first = view(host[0, 0])
    if not all(isinstance(first.get(m), QMatrix) for m in store_mod.EXPERT_MATRICES) or "b1" in first:
        raise UserError("--expert-units cuts HQQ experts without biases (convert with --expert-bits 2, 3 or 4); "
                        "use --expert-units 1 for this model.")
    why = can_split(first["w1"], first["w2"], units)
    if why:
        raise UserError(f"--expert-units {units}: {why}; use --expert-units 1 or 2.")
    unit = unit_fields(split_expert(first, units)[0])
    ufields, stride = store_mod.layout_of([(name, t.dtype, tuple(t.shape)) for name, t in unit.items()])
    L, E = host.shape[:2]
    shape = (L, E * units, stride)
    out = pinned_empty(shape) if pin else torch.empty(shape, dtype=torch.uint8)
    for layer in range(L):
        for e in range(E):
            for p, part in enumerate(split_expert(view(host[layer, e]), units)):
                out[layer, e * units + p] = store_mod.pack_expert(unit_fields(part), ufields, stride)
        if progress:
            progress((layer + 1) / L, "cutting the experts into units")
    ucfg = replace(cfg, num_experts=E * units, top_k=cfg.top_k * units,
                   intermediate_size=cfg.intermediate_size // units, expert_units=units)
    return ucfg, ufields, out
