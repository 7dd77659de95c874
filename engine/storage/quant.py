"""Low-bit weight format: HQQ quantization, bit packing and the reference dequantizer.

One quantized matrix W [rows, cols] with `bits` bits and group size g (HQQ, axis 0):
  G = rows // g. Each group of g weights shares one column k and the rows n, n+G, n+2G, ...
  W[n, k] = (code[n, k] - zero[n % G, k]) * scale[n % G, k]
This is HQQ's default grouping and exactly the layout of the paper's published checkpoint,
so its codes import byte for byte.

Codes are stored as bit planes of width w in (1, 2, 4, 8): 2-bit = one 2-bit plane,
3-bit = a 2-bit plane (high bits) + a 1-bit plane, 4-bit = one 4-bit plane. A plane of
width w packs p = 8 // w codes per byte along rows in blocks:
  part[r + s * rows // p, k] = (plane[r, k] >> (8 - w * (s + 1))) & (2**w - 1)
Because rows // p is a multiple of G, the p codes in one byte share their scale and zero.

Scales and zeros are either float16 [G, cols] or 8-bit: q uint8 [G, cols] with a float16
`meta` [2, M] (row 0 scale, row 1 zero): value[f] = (q[f] - meta[1, f % M]) * meta[0, f % M],
f the flat index into [G, cols]. 8-bit metadata is what brings 2-bit g16 from 4 to 3 bits
per weight, and bytes on the PCIe link are the bottleneck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.engine.errors import UserError

PLANES = {2: (2,), 3: (2, 1), 4: (4,), 8: (8,)}


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int
    meta_group: int  # scale values sharing one 8-bit meta pair (one pair if it doesn't divide)
    zero_meta_group: int | None = None  # the same for zeros; None = meta_group
    meta_bits: int = 8  # 8: scales and zeros are 8-bit + meta; 16: plain float16

    @classmethod
    def from_dict(cls, q: dict) -> "QuantSpec":
        return cls(q["bits"], q["group_size"], q["meta_group"], q.get("zero_meta_group"),
                   q.get("meta_bits", 8))


# Group sizes as the paper (and better for 3/4-bit experts than its 64/128 defaults would be).
EXPERT_SPECS = {2: QuantSpec(2, 16, 128), 3: QuantSpec(3, 64, 128), 4: QuantSpec(4, 64, 128)}
ATTN_SPECS = {4: QuantSpec(4, 64, 256), 8: QuantSpec(8, 64, 256)}


@dataclass
class QMatrix:
    rows: int
    cols: int
    bits: int
    group_size: int
    planes: list[torch.Tensor]  # uint8 [rows // (8 // w), cols] per plane width w
    scale: torch.Tensor  # uint8 [G, cols] when scale_meta is set, else float16 [G, cols]
    zero: torch.Tensor
    scale_meta: torch.Tensor | None = None  # float16 [2, M]
    zero_meta: torch.Tensor | None = None

    @property
    def groups(self) -> int:
        return self.rows // self.group_size

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"plane{i}": p for i, p in enumerate(self.planes)}
        out["scale"], out["zero"] = self.scale, self.zero
        if self.scale_meta is not None:
            out["scale_meta"] = self.scale_meta
        if self.zero_meta is not None:
            out["zero_meta"] = self.zero_meta
        return out

    def info(self) -> dict:
        """The JSON-able description that, with tensors(), rebuilds this matrix."""
        return {"rows": self.rows, "cols": self.cols, "bits": self.bits,
                "group_size": self.group_size}

    @classmethod
    def from_tensors(cls, info: dict, t: dict[str, torch.Tensor]) -> "QMatrix":
        planes = [t[f"plane{i}"] for i in range(len(PLANES[info["bits"]]))]
        return cls(info["rows"], info["cols"], info["bits"], info["group_size"], planes,
                   t["scale"], t["zero"], t.get("scale_meta"), t.get("zero_meta"))

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.tensors().values())


def field_shapes(rows: int, cols: int, spec: QuantSpec) -> dict[str, tuple[torch.dtype, tuple]]:
    """dtype and shape of every tensor of a matrix quantized with `spec` (8-bit metadata)."""
    check_shape(rows, cols, spec)
    G = rows // spec.group_size
    out = {f"plane{i}": (torch.uint8, (rows * w // 8, cols)) for i, w in enumerate(PLANES[spec.bits])}
    if spec.meta_bits == 16:
        out["scale"] = out["zero"] = (torch.float16, (G, cols))
        return out
    out["scale"] = out["zero"] = (torch.uint8, (G, cols))
    out["scale_meta"] = (torch.float16, (2, meta_groups(G * cols, spec.meta_group)))
    out["zero_meta"] = (torch.float16, (2, meta_groups(G * cols, spec.zero_meta_group or spec.meta_group)))
    return out


def check_shape(rows: int, cols: int, spec: QuantSpec) -> None:
    if spec.bits not in PLANES:
        raise ValueError(f"unsupported bit width {spec.bits}")
    if rows % spec.group_size or rows % 8:
        raise ValueError(f"a {rows}x{cols} matrix cannot be quantized with groups of "
                         f"{spec.group_size} rows (rows must be a multiple of the group size and of 8)")


def check_group_size(group_size: int, rows) -> None:
    """A chosen group size (`--expert-group-size`): a power of two from 8 that divides every
    matrix's row count (the fused kernels' and the packing's condition), else one sentence."""
    if group_size < 8 or group_size & (group_size - 1) or any(r % group_size for r in rows):
        raise UserError(f"--expert-group-size must be a power of two from 8 that divides every expert "
                        f"matrix's rows ({', '.join(map(str, sorted(set(rows))))}); {group_size} does not.")


def meta_groups(n: int, meta_group: int) -> int:
    """Number of 8-bit meta pairs for n values: n // meta_group when that divides, else 1."""
    return n // meta_group if n % meta_group == 0 and n >= meta_group else 1


# ---------------------------------------------------------------------------------------------
# Packing


def pack_codes(codes: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """codes uint8 [rows, cols] in [0, 2**bits) -> bit planes (see module docstring)."""
    planes, shift_left = [], bits
    for w in PLANES[bits]:
        shift_left -= w
        part = (codes >> shift_left) & ((1 << w) - 1)
        p = 8 // w
        block = part.view(p, codes.shape[0] // p, codes.shape[1]).to(torch.int32)
        packed = torch.zeros_like(block[0])
        for s in range(p):
            packed |= block[s] << (8 - w * (s + 1))
        planes.append(packed.to(torch.uint8))
    return planes


def random_qmatrix(rows: int, cols: int, spec: QuantSpec, gen: torch.Generator, device="cpu",
                   plausible: bool = False) -> QMatrix:
    """A synthetic matrix in the store's format, without an HQQ run: the one source of packed
    random weights (the benchmark's synthetic models, the kernel tests and benchmarks).

    Codes are uniform over the code range; scales and zeros are random. The metadata is random
    per meta group (scales 0.005-0.03, zeros over the code range: every pair differs, which the
    kernels' metadata decode must get right), or, with plausible=True, one pair that makes the
    scales 0.012-0.027 / (2**bits - 1), as HQQ gives weights of standard deviation ~0.01 (Mixtral's
    are 0.01-0.02), with zeros over the code range."""
    check_shape(rows, cols, spec)
    G, levels = rows // spec.group_size, 2 ** spec.bits - 1
    codes = torch.randint(0, levels + 1, (rows, cols), dtype=torch.uint8, device=device, generator=gen)
    planes = pack_codes(codes, spec.bits)
    rand = lambda *shape: torch.rand(*shape, device=device, generator=gen)  # noqa: E731
    if spec.meta_bits == 16:
        scale = (rand(G, cols) * 0.02 + 0.005).half()
        zero = (rand(G, cols) * levels).half()
        return QMatrix(rows, cols, spec.bits, spec.group_size, planes, scale, zero)

    def q8(meta_group: int, lo: float, hi: float, fixed: list[float]):  # 8-bit values + their meta pairs
        q = torch.randint(0, 256, (G, cols), dtype=torch.uint8, device=device, generator=gen)
        n = meta_groups(G * cols, meta_group)
        if plausible:
            meta = torch.tensor(fixed, device=device).view(2, 1).expand(2, n)
        else:
            meta = torch.stack([(rand(n) * (hi - lo) + lo) / 255, rand(n) * 40 - 20])
        return q, meta.half().contiguous()
    sq, sm = q8(spec.meta_group, 0.005, 0.03, [6e-5 / levels, -200.0])
    zq, zm = q8(spec.zero_meta_group or spec.meta_group, 0.0, levels, [levels / 255, 0.0])
    return QMatrix(rows, cols, spec.bits, spec.group_size, planes, sq, zq, sm, zm)


def unpack_codes(planes: list[torch.Tensor], bits: int) -> torch.Tensor:
    """Inverse of pack_codes: uint8 [rows, cols]."""
    codes, shift_left = None, bits
    for plane, w in zip(planes, PLANES[bits]):
        shift_left -= w
        p = 8 // w
        parts = [(plane >> (8 - w * (s + 1))) & ((1 << w) - 1) for s in range(p)]
        part = torch.cat(parts, dim=0)
        codes = part << shift_left if codes is None else codes | (part << shift_left)
    return codes


# ---------------------------------------------------------------------------------------------
# Quantizing


def quantize_meta8(values: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """values float [G, cols] -> (uint8 [G, cols], float16 meta [2, m]); value f shares meta f % m."""
    v = values.float().reshape(-1, m)  # row i holds flat indices i*m .. i*m+m-1: column = f % m
    lo, hi = v.min(dim=0).values, v.max(dim=0).values
    sc = ((hi - lo) / 255).clamp(min=1e-8).half()
    z = (-lo / sc.float()).half()
    q = torch.round(v / sc.float() + z.float()).clamp(0, 255).to(torch.uint8)
    return q.reshape(values.shape), torch.stack([sc, z])


def quantize_matrix(weight: torch.Tensor, spec: QuantSpec, optimize: bool = True) -> QMatrix:
    """HQQ-quantize weight [rows, cols] (any float dtype, any device) with 8-bit metadata."""
    from hqq.core.quantize import Quantizer  # imported late: hqq is slow to import

    rows, cols = weight.shape
    check_shape(rows, cols, spec)
    G = rows // spec.group_size
    W = weight.detach().float()
    codes, meta = Quantizer.quantize(W, nbits=spec.bits, group_size=spec.group_size, axis=0,
                                     optimize=optimize, bitpack=False, compute_dtype=torch.float32,
                                     device=str(W.device))
    codes = codes.reshape(rows, cols).round().clamp(0, 2**spec.bits - 1).to(torch.uint8)
    scale, zero = meta["scale"].reshape(G, cols), meta["zero"].reshape(G, cols)
    if spec.meta_bits == 16:
        return QMatrix(rows, cols, spec.bits, spec.group_size, pack_codes(codes, spec.bits),
                       scale.half(), zero.half())
    scale_q, scale_meta = quantize_meta8(scale, meta_groups(G * cols, spec.meta_group))
    zero_q, zero_meta = quantize_meta8(zero, meta_groups(G * cols, spec.zero_meta_group or spec.meta_group))
    return QMatrix(rows, cols, spec.bits, spec.group_size, pack_codes(codes, spec.bits),
                   scale_q, zero_q, scale_meta, zero_meta)


# ---------------------------------------------------------------------------------------------
# The reference dequantizer (CPU path and the ground truth for every fused kernel)


def round_rows_int8(w: torch.Tensor, device=None, block_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int8 [N, K], s float32 [N]) with w ~ q * s[:, None]: symmetric, one
    scale a row (the int8 LM heads: engine/kernels/int8_gpu.py on a GPU, torch_cpu's on the CPU).
    Rounded on `device` (default w's) block_rows rows at a time, so that no float32 copy of the
    whole matrix is made."""
    qs, ss = [], []
    for r in range(0, w.shape[0], block_rows):
        wf = w[r:r + block_rows].to(device).float()
        s = (wf.abs().amax(dim=1) / 127).clamp(min=1e-10)
        qs.append((wf / s[:, None]).round().clamp(-127, 127).to(torch.int8))
        ss.append(s)
    return torch.cat(qs), torch.cat(ss)


def decode_meta(q: torch.Tensor, meta: torch.Tensor | None) -> torch.Tensor:
    """Scale or zero as float32 [G, cols]."""
    if meta is None:
        return q.float()
    m = meta.shape[1]
    qf = q.float().reshape(-1, m)
    return ((qf - meta[1].float()) * meta[0].float()).reshape(q.shape)


def dequantize(qm: QMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    codes = unpack_codes(qm.planes, qm.bits).float()  # [rows, cols]
    scale = decode_meta(qm.scale, qm.scale_meta)  # [G, cols]
    zero = decode_meta(qm.zero, qm.zero_meta)
    reps = qm.group_size
    w = (codes.view(reps, qm.groups, qm.cols) - zero) * scale  # row n = i*G + j
    return w.reshape(qm.rows, qm.cols).to(dtype)


def bits_per_weight(qm: QMatrix) -> float:
    return qm.nbytes() * 8 / (qm.rows * qm.cols)
