"""Developer benchmark (not shipped): several versions of engine/kernels/hqq_cpu.py, interleaved in one process.

    python -m benchmarks.hqq_cpu_variants 370a175 engine/kernels/hqq_cpu.py --threads 16 8 --group 32
    python -m benchmarks.hqq_cpu_variants OLD.py engine/kernels/hqq_cpu.py --threads 16 8 --expert

Each KERNEL is a kernel module's file or a git revision (benchmarks/hqq_cpu_ab.load_old). All
run the same random 2-bit (--bits) matrices in groups of --group rows: the w1/w3 (14336x4096)
and w2 (4096x14336) shapes, or with --expert whole experts (gate, up and down in one call; --shape
for others), on
--tokens rows of input (1: decoding; more: a prompt).
Calls are interleaved (kernel 1, kernel 2, ..., kernel 1, ...), each on the next of enough
copies that the L3 cannot serve them (--rotate-gib). Prints the median time and GB/s (of the
stored bytes) per kernel and thread count, and each one's relative difference from the first's
result. benchmarks/hqq_cpu_ab.py compares one revision against the working tree, with CPU time.
With --expert each module's swiglu_expert is called as it is: since it runs through
swiglu_experts it finds the expert's addresses on every call (about 35 us on the 2-core box),
which the engine keeps.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.hqq_cpu_ab import load_old
from moeferry.engine.storage import quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="+", help="kernel files or git revisions; the first is the reference")
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--rotate-gib", type=float, default=0.6)
    ap.add_argument("--expert", action="store_true", help="whole experts instead of lone matrices")
    ap.add_argument("--shape", default="4096x14336", help="the experts' HIDDENxINTERMEDIATE (4096x3584: a unit)")
    ap.add_argument("--tokens", type=int, default=1, help="rows of the input (a prompt's tokens; default 1)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    mods = [load_old(k, tmp, f"v{i}_" + re.sub(r"\W", "_", Path(k).stem)) for i, k in enumerate(args.kernels)]
    gen = torch.Generator().manual_seed(0)
    spec = quant.QuantSpec(args.bits, args.group, 128)

    def matrix(rows: int, cols: int):
        return quant.random_qmatrix(rows, cols, spec, gen, plausible=True)

    for mod in mods:
        t0 = time.perf_counter()
        mod.matmul(np.ones((1, 64), np.float32), mod.from_qmatrix(matrix(64, 64)))
        print(f"{Path(mod.__file__).stem}: first call (compile or cache load) {time.perf_counter() - t0:.1f} s", flush=True)
    if args.expert:
        H, inter = (int(v) for v in args.shape.split("x"))
        shapes = {f"expert {args.shape}": ((inter, H), (inter, H), (H, inter))}
    else:
        shapes = {"w1": ((14336, 4096),), "w2": ((4096, 14336),)}
    rng = np.random.default_rng(1)
    for name, parts in shapes.items():
        first = [matrix(*p) for p in parts]
        nbytes = sum(mods[0].from_qmatrix(m).nbytes() for m in first)
        copies = max(2, int(args.rotate_gib * (1 << 30) // nbytes) + 1)
        mats = [first] + [[matrix(*p) for p in parts] for _ in range(copies - 1)]
        views = [[[mod.from_qmatrix(m) for m in c] for c in mats] for mod in mods]

        def call(mod, view, x):
            return mod.swiglu_expert(x, *view) if args.expert else mod.matmul(x, view[0])

        x = rng.standard_normal((args.tokens, parts[0][1]), dtype=np.float32)
        ref = call(mods[0], views[0][0], x)
        errs = [np.linalg.norm(call(m, v[0], x) - ref) / np.linalg.norm(ref) for m, v in zip(mods, views)]
        for threads in args.threads:
            for mod, v in zip(mods, views):
                mod.set_threads(threads)
                call(mod, v[1], x)
            times = [[] for _ in mods]
            i = 0
            for _ in range(args.rounds):
                for mi, mod in enumerate(mods):
                    view = views[mi][i % copies]
                    i += 1
                    t0 = time.perf_counter()
                    call(mod, view, x)
                    times[mi].append(time.perf_counter() - t0)
            for mod, t, err in zip(mods, times, errs):
                med = float(np.median(t))
                print(f"{name} {args.bits}-bit g{args.group} T={args.tokens} threads {threads:2d} {Path(mod.__file__).stem:12s} "
                      f"{med * 1e3:7.3f} ms {nbytes / med / 1e9:6.2f} GB/s, rel. difference from the first {err:.1e}",
                      flush=True)


if __name__ == "__main__":
    main()
