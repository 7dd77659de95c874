"""Developer benchmark (not shipped): engine/kernels/hqq_cpu.py at a git revision against the working tree's, in one process.

    python -m benchmarks.hqq_cpu_ab --old HEAD~1 --threads 1 --rounds 15
    python -m benchmarks.hqq_cpu_ab --old HEAD~1 --threads 16 --bits 2 --tokens 1 --group-size 32

The old kernel is the module's source at --old, imported from a temporary file. Both run the
same random Mixtral-shaped matrices (benchmarks/cpu_experts.random_hqq: w1/w3 14336x4096,
w2 4096x14336) for each bit width and batch size T, interleaved call by call (old, new, old,
new, ...), each call on the next of enough copies that the L3 cannot serve them; a noisy shared
box then slows both alike. Prints medians in ms and GB/s (of the stored matrix's bytes), of
wall time and of process CPU time (steadier where other processes take turns on the cores;
meaningful with --threads 1), the new/old speedup, the first-call time of each (the old one
compiles; the new one compiles or loads numba's cache), and the relative error of the new
result against the old one's.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.cpu_experts import random_qmatrix
from moeferry.engine.kernels import hqq_cpu
from moeferry.engine.storage import quant

SHAPES = {"w1": (14336, 4096), "w2": (4096, 14336)}


def load_old(rev: str, where: Path, name: str = "hqq_cpu_old"):
    """The kernel module of an older revision (or a kernel file), imported as `name`; one from before
    the moeferry.* layout (engine/hqq_cpu.py) gets its quant import rewritten to today's."""
    if Path(rev).is_file():  # a kernel file itself (a machine without the git history)
        src = Path(rev).read_text()
    else:
        show = lambda path: subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)  # noqa: E731
        got = show("engine/kernels/hqq_cpu.py")
        src = got.stdout if got.returncode == 0 else show("engine/hqq_cpu.py").stdout
    src = src.replace("from engine.quant import", "from moeferry.engine.storage.quant import")
    path = where / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def first_call_s(mod, m, x) -> float:
    t0 = time.perf_counter()
    mod.matmul(x, m)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="HEAD", help="a git revision, or the path of an older hqq_cpu.py")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rotate-gib", type=float, default=0.5)
    ap.add_argument("--group-size", type=int, help="rows per HQQ group (default: the engine's expert spec)")
    args = ap.parse_args()
    if args.group_size:
        for bits in args.bits:
            quant.EXPERT_SPECS[bits] = replace(quant.EXPERT_SPECS[bits], group_size=args.group_size)
    tmp = Path(tempfile.mkdtemp())
    old = load_old(args.old, tmp)
    gen = torch.Generator().manual_seed(0)
    probe = random_qmatrix(2, 64, 64, gen)
    x = np.random.default_rng(0).standard_normal((1, 64), dtype=np.float32)
    print(f"first call (compile or cache load): old {first_call_s(old, old.from_qmatrix(probe), x):.2f} s, "
          f"new {first_call_s(hqq_cpu, hqq_cpu.from_qmatrix(probe), x):.2f} s", flush=True)
    old.set_threads(args.threads)
    hqq_cpu.set_threads(args.threads)
    rng = np.random.default_rng(1)
    for bits in args.bits:
        for name, (N, K) in SHAPES.items():
            first = random_qmatrix(bits, N, K, gen)
            copies = max(2, int(args.rotate_gib * (1 << 30) // first.nbytes()) + 1)
            mats = [first] + [random_qmatrix(bits, N, K, gen) for _ in range(copies - 1)]
            views = {"old": [old.from_qmatrix(m) for m in mats], "new": [hqq_cpu.from_qmatrix(m) for m in mats]}
            for T in args.tokens:
                x = rng.standard_normal((T, K), dtype=np.float32)
                ref, got = old.matmul(x, views['old'][0]), hqq_cpu.matmul(x, views['new'][0])
                rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
                wall, cpu = {"old": [], "new": []}, {"old": [], "new": []}
                for i in range(args.rounds):
                    for label, mod in (("old", old), ("new", hqq_cpu)):
                        m = views[label][(2 * i + (label == "new")) % copies]
                        t0, c0 = time.perf_counter(), time.process_time()
                        mod.matmul(x, m)
                        wall[label].append(time.perf_counter() - t0)
                        cpu[label].append(time.process_time() - c0)
                line = f"{bits}-bit {name} {N}x{K} T={T}:"
                for what, times in (("wall", wall), ("cpu", cpu)):
                    med = {k: float(np.median(v)) for k, v in times.items()}
                    gbs = {k: first.nbytes() / v / 1e9 for k, v in med.items()}
                    line += (f" {what} old {med['old'] * 1e3:6.2f} ms {gbs['old']:5.2f} GB/s, new {med['new'] * 1e3:6.2f} ms"
                             f" {gbs['new']:5.2f} GB/s, x{med['old'] / med['new']:.2f} |")
                print(f"{line} rel. error vs old {rel:.2e}", flush=True)


if __name__ == "__main__":
    main()
