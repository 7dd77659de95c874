"""Developer benchmark (not shipped): CPU expert kernels on Mixtral shapes vs RAM read speed.

    python -m benchmarks.cpu_experts --threads 2          # this 2-core box (from the repo root)
    python -m benchmarks.cpu_experts --threads 16 8 1     # the GPU machine

For each thread count: the RAM read bandwidth (a large float32 sum), then one batch-1
product with a 14336x4096 (w1/w3) and a 4096x14336 (w2) matrix in each CPU format of
engine/runtime/cpu_experts.py (hqq2/3/4: the stored HQQ expert run in place by engine/kernels/hqq_cpu.py;
"hqq2-expert" times a whole 2-bit expert, gate + up + down, in one call), plus two references: a bf16 matmul and a pure-torch 2-bit attempt
(unpack the codes to int8, then the int8 kernel). Each timed call uses the next of enough
copies of the matrix that together they exceed --rotate-gib, so the L3 cannot serve them.
GB/s counts the bytes the kernel must read (codes + scales/zeros). Weights are random codes:
speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moeferry.engine.kernels import hqq_cpu
from moeferry.engine.kernels.torch_cpu import CpuMatrix
from moeferry.engine.storage import quant

SHAPES = ((14336, 4096), (4096, 14336))  # (outputs N, inputs K)


def ram_read_gbps(gib: float, reps: int = 5) -> float:
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def random_matrix(fmt: str, N: int, K: int, gen) -> CpuMatrix:
    if fmt.startswith("int4"):
        g = int(fmt.split("g")[1])
        q = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=gen)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        meta = (torch.rand(K // g, N, 2, generator=gen) * 0.01).bfloat16()
        return CpuMatrix("int4", N, K, packed, meta, g)
    if fmt == "int8":
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
        return CpuMatrix("int8", N, K, q, (torch.rand(N, generator=gen) * 0.01).bfloat16())
    if fmt == "bf16":
        return CpuMatrix("dense", N, K, (torch.randn(N, K, generator=gen) * 0.01).bfloat16())
    if fmt == "2bit-unpack":  # codes 4 per byte; meta = per-row scale for the int8 kernel
        packed = torch.randint(0, 256, (N // 4, K), dtype=torch.uint8, generator=gen)
        return CpuMatrix("2bit", N, K, packed, (torch.rand(N, generator=gen) * 0.01).bfloat16())
    raise ValueError(fmt)


def random_qmatrix(bits: int, N: int, K: int, gen) -> quant.QMatrix:
    """A random N x K matrix at the engine's expert spec for `bits` (quant.random_qmatrix)."""
    return quant.random_qmatrix(N, K, quant.EXPERT_SPECS[bits], gen, plausible=True)


def random_hqq(bits: int, N: int, K: int, gen) -> hqq_cpu.CpuQMatrix:
    return hqq_cpu.from_qmatrix(random_qmatrix(bits, N, K, gen))


class HqqMatrix:
    """Adapter so the timing loop treats the in-place kernel like a CpuMatrix."""

    def __init__(self, m: hqq_cpu.CpuQMatrix):
        self.m = m

    def nbytes(self) -> int:
        return self.m.nbytes()

    def matmul(self, x: torch.Tensor):
        return hqq_cpu.matmul(x.float().numpy(), self.m)


class HqqExpertTimed:
    def __init__(self, w1, w3, w2):
        self.w = (w1, w3, w2)
        self.addresses = hqq_cpu.expert_addresses(w1, w3, w2)  # kept, as the engine's HqqExpert keeps them

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in self.w)

    def matmul(self, x: torch.Tensor):
        return hqq_cpu.swiglu_expert(x.float().numpy(), *self.w, self.addresses)


def time_hqq(fmt: str, N: int, K: int, rotate_gib: float, reps: int) -> dict:
    bits = int(fmt[3])
    gen = torch.Generator().manual_seed(N + bits)
    if fmt.endswith("-expert"):  # Mixtral's expert: w1, w3 [I, H], w2 [H, I]; N, K = I, H
        make = lambda: HqqExpertTimed(random_hqq(bits, N, K, gen), random_hqq(bits, N, K, gen),  # noqa: E731
                                      random_hqq(bits, K, N, gen))
        shape = f"expert {N}x{K}"
    else:
        make = lambda: HqqMatrix(random_hqq(bits, N, K, gen))  # noqa: E731
        shape = f"{N}x{K}"
    first = make()
    copies = max(2, int(rotate_gib * (1 << 30) // first.nbytes()) + 1)
    mats = [first] + [make() for _ in range(copies - 1)]
    x = torch.randn(1, K, generator=gen)
    for m in mats[:2]:
        m.matmul(x)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        mats[i % copies].matmul(x)
        times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    return {"format": fmt, "shape": shape, "us": round(med * 1e6, 1), "us_best": round(times[0] * 1e6, 1),
            "gb_per_s": round(first.nbytes() / med / 1e9, 2), "bytes": first.nbytes(), "copies": copies}


def run(m: CpuMatrix, x: torch.Tensor) -> torch.Tensor:
    if m.fmt == "2bit":  # the best a compiler-free 2-bit path can do: unpack, then int8 kernel
        codes = torch.cat([((m.packed >> s) & 3) for s in (6, 4, 2, 0)]).view(torch.int8)
        return torch.ops.aten._weight_int8pack_mm(x, codes, m.meta)
    return m.matmul(x)


def time_format(fmt: str, N: int, K: int, rotate_gib: float, reps: int) -> dict:
    gen = torch.Generator().manual_seed(N)
    first = random_matrix(fmt, N, K, gen)
    copies = max(2, int(rotate_gib * (1 << 30) // first.nbytes()) + 1)
    mats = [first] + [CpuMatrix(first.fmt, N, K, first.packed.clone(), first.meta.clone()
                                if first.meta is not None else None, first.group_size)
                      for _ in range(copies - 1)]
    x = torch.randn(1, K, generator=gen).bfloat16()  # the kernels' fast path (cpu_experts.py)
    for m in mats[:2]:
        run(m, x)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        run(mats[i % copies], x)
        times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    return {"format": fmt, "shape": f"{N}x{K}", "us": round(med * 1e6, 1),
            "us_best": round(times[0] * 1e6, 1), "gb_per_s": round(first.nbytes() / med / 1e9, 2),
            "bytes": first.nbytes(), "copies": copies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--formats", nargs="+", default=["hqq2", "hqq3", "hqq4", "hqq2-expert", "int4g128",
                                                      "int4g256", "int8", "bf16"])
    ap.add_argument("--rotate-gib", type=float, default=1.0, help="total size of the rotated copies")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for t in args.threads:
        torch.set_num_threads(t)
        hqq_cpu.set_threads(t)
        ram = ram_read_gbps(min(2.0, 2 * args.rotate_gib))
        print(f"threads {t}: RAM read {ram:.1f} GB/s", flush=True)
        for fmt in args.formats:
            for N, K in SHAPES[:1] if fmt.endswith("-expert") else SHAPES:
                timer = time_hqq if fmt.startswith("hqq") else time_format
                r = timer(fmt, N, K, args.rotate_gib, args.reps)
                r.update(threads=t, ram_read_gb_per_s=round(ram, 1),
                         of_ram=round(r["gb_per_s"] / ram, 2))
                rows.append(r)
                print(f"  {fmt:12s} {r['shape']:>10s} {r['us']:9.1f} us (best {r['us_best']:.1f})"
                      f" {r['gb_per_s']:6.2f} GB/s = {r['of_ram']:.2f} of RAM read", flush=True)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
