"""Streaming safetensors reading and writing, one tensor at a time.

The `safetensors` package reads through mmap (touched pages count towards the process's
resident memory while the file is open) and writes only whole dicts. Converting a 93 GB
checkpoint needs neither: we read each tensor into its own buffer and write tensors in
order under a header that is known up front. The format is the public safetensors spec:
u64 little-endian header length, a JSON header, then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
MAX_HEADER_BYTES = 100_000_000


@cache
def _torch_dtypes() -> tuple[dict, dict]:
    """(name -> torch dtype, torch dtype -> name); torch is imported only for reading or writing
    tensors, so that checking a header (the wizard's look at the Hugging Face cache) stays light."""
    import torch

    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool}
    return dtypes, {v: k for k, v in dtypes.items()}


def __getattr__(name: str):
    """DTYPES and DTYPE_NAMES, made on first use (see _torch_dtypes)."""
    if name in ("DTYPES", "DTYPE_NAMES"):
        return _torch_dtypes()[name == "DTYPE_NAMES"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class FormatError(Exception):
    pass


def read_header(path: Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where tensor data starts).

    Every entry is checked against the file before anything is allocated: a known dtype, a
    shape of non-negative integers, data_offsets [start, end] with end - start equal to the
    shape's bytes, inside the file, and no two tensors sharing bytes.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise FormatError(f"{path.name} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise FormatError(f"{path.name} is not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{path.name} is not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path.name} is not a safetensors file (its header is not an object)")
    header.pop("__metadata__", None)
    check_entries(path.name, header, size - 8 - n)
    return header, 8 + n


def check_entries(name: str, header: dict, data_bytes: int) -> None:
    """Raise FormatError unless every entry fits the data section (data_bytes long)."""
    spans = []
    for key, e in header.items():
        if not isinstance(e, dict) or e.get("dtype") not in ITEMSIZE:
            raise FormatError(f"{name}: tensor {key!r} has no known dtype")
        shape, offsets = e.get("shape"), e.get("data_offsets")
        if not _ints(shape) or any(d < 0 for d in shape):
            raise FormatError(f"{name}: tensor {key!r} has a bad shape {shape!r}")
        if not _ints(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1] <= data_bytes:
            raise FormatError(f"{name}: tensor {key!r} lies outside the file (data_offsets "
                              f"{offsets!r}, {data_bytes} data bytes); the file is truncated or damaged")
        nbytes = math.prod(shape) * ITEMSIZE[e["dtype"]]
        if offsets[1] - offsets[0] != nbytes:
            raise FormatError(f"{name}: tensor {key!r} claims {offsets[1] - offsets[0]} bytes for "
                              f"shape {shape} ({nbytes} bytes)")
        if nbytes:
            spans.append(offsets)
    spans.sort()
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            raise FormatError(f"{name}: two tensors share bytes; the file is damaged")


def _ints(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def read_tensor(path: Path, entry: dict, data_start: int) -> torch.Tensor:
    """Read one tensor (header entry, checked by read_header) into a fresh CPU tensor."""
    import torch

    start, end = entry["data_offsets"]
    with open(path, "rb") as f:
        if data_start + end > os.fstat(f.fileno()).st_size:  # the file shrank since its header was read
            raise FormatError(f"{path.name} is truncated")
        buf = bytearray(end - start)
        f.seek(data_start + start)
        if f.readinto(buf) != len(buf):
            raise FormatError(f"{path.name} is truncated")
    dtype = _torch_dtypes()[0][entry["dtype"]]
    if not buf:
        return torch.empty(entry["shape"], dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(entry["shape"])


class StreamingWriter:
    """Write a safetensors file whose tensors (names, dtypes, shapes) are declared up front.

    Tensors must then be written in the declared order. The sha256 of the whole file is
    computed on the way (`sha256` after close()).
    """

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple]],
                 metadata: dict[str, str] | None = None, align: int = 256):
        import torch

        header, offset = {}, 0
        self.order = []
        for name, dtype, shape in entries:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            offset = -(-offset // align) * align  # keep every tensor aligned for views
            header[name] = {"dtype": _torch_dtypes()[1][dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self.order.append((name, dtype, tuple(shape), offset, nbytes))
            offset += nbytes
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % align)  # data section starts aligned too
        self.data_start = 8 + len(raw)
        self.total = self.data_start + offset
        self.path = path
        self.f = open(path, "wb")
        self.hash = hashlib.sha256()
        self.pos = 0
        self._write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def _write(self, b) -> None:
        self.f.write(b)
        self.hash.update(b)
        self.pos += len(b)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, dtype, shape, offset, nbytes = self.order[self.next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"expected {want_name} {dtype} {shape}, got {name} {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        pad = self.data_start + offset - self.pos
        if pad:
            self._write(b"\0" * pad)
        self._write(tensor_bytes(tensor))
        self.next += 1

    def write_raw(self, name: str, data: bytes | memoryview) -> None:
        """Write part of the next tensor's bytes (for tensors written in slices)."""
        want_name, _, _, offset, nbytes = self.order[self.next]
        if name != want_name:
            raise ValueError(f"expected {want_name}, got {name}")
        start = self.data_start + offset
        if self.pos < start:
            self._write(b"\0" * (start - self.pos))
        self._write(data)
        if self.pos == start + nbytes:
            self.next += 1
        elif self.pos > start + nbytes:
            raise ValueError(f"too many bytes for {name}")

    def close(self) -> str:
        if self.next != len(self.order):
            raise ValueError(f"{self.path.name}: only {self.next} of {len(self.order)} tensors written")
        self.f.close()
        return self.hash.hexdigest()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    import torch

    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")
