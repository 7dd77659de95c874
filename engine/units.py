"""Byte units, the one byte formatter and the one duration formatter. Imports nothing.

Memory (VRAM, RAM, budgets) is counted in binary units; downloads and disk space, as the hub
and disk makers count them, in decimal ones. fmt_bytes writes either; fmt_memory writes a
memory size the way GPUs and RAM are sold: GiB written "GB", whole when it is near one.
"""

from __future__ import annotations

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12

_BINARY = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
_DECIMAL = (("TB", TB), ("GB", GB), ("MB", MB), ("KB", KB))


def fmt_bytes(n: float | None, decimal: bool = False) -> str:
    """'1.5 GiB' (or with decimal=True '1.6 GB'), one decimal; '512 B' below a kilobyte;
    'unknown' for None."""
    if n is None:
        return "unknown"
    for unit, size in _DECIMAL if decimal else _BINARY:
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_memory(n: float) -> str:
    """A memory size as it is sold: 12 GiB -> '12 GB', 7.5 GiB -> '7.5 GB', 31.9 GiB -> '32 GB'."""
    gb = n / GiB
    return f"{gb:.0f} GB" if gb >= 10 or abs(gb - round(gb)) < 0.05 else f"{gb:.1f} GB"


def fmt_duration(seconds: float | None) -> str:
    """'45 s', '1 min 15 s', '1 h 02 min'; 'unknown' for None, NaN or a negative time."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "unknown"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {(seconds % 3600) // 60:02d} min"
