"""Throwaway: several hqq_cpu.py variants, interleaved call by call on rotated matrices."""
import argparse, importlib.util, sys, time
from pathlib import Path
import numpy as np, torch
from benchmarks.cpu_experts import random_qmatrix
from moeferry.engine.storage import quant

def load(path):
    name = "kv_" + Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
    return mod

ap = argparse.ArgumentParser()
ap.add_argument("files", nargs="+")
ap.add_argument("--threads", type=int, nargs="+", default=[1])
ap.add_argument("--bits", type=int, default=2)
ap.add_argument("--group", type=int, default=32)
ap.add_argument("--rounds", type=int, default=9)
ap.add_argument("--rotate-gib", type=float, default=0.6)
ap.add_argument("--expert", action="store_true")
a = ap.parse_args()
mods = [load(f) for f in a.files]
gen = torch.Generator().manual_seed(0)
spec = quant.QuantSpec(a.bits, a.group, 128)
def rq(N, K): return quant.random_qmatrix(N, K, spec, gen, plausible=True)
for m in mods:
    p = rq(64, 64); t0 = time.perf_counter(); m.matmul(np.ones((1, 64), np.float32), m.from_qmatrix(p))
    print(Path(m.__file__).stem, f"first call {time.perf_counter()-t0:.1f} s", flush=True)
rng = np.random.default_rng(1)
shapes = {"expert": None} if a.expert else {"w1": (14336, 4096), "w2": (4096, 14336)}
for name, shp in shapes.items():
    if a.expert:
        one = lambda: (rq(14336, 4096), rq(14336, 4096), rq(4096, 14336))
        first = one(); nb = sum(m.from_qmatrix(q).nbytes() for q in first) if False else None
        nbytes = sum(mods[0].from_qmatrix(q).nbytes() for q in first)
        copies = max(2, int(a.rotate_gib * (1 << 30) // nbytes) + 1)
        mats = [first] + [one() for _ in range(copies - 1)]
        views = [[tuple(m.from_qmatrix(q) for q in e) for e in mats] for m in mods]
        call = lambda m, v, x: m.swiglu_expert(x, *v)
        K = 4096
    else:
        N, K = shp
        first = rq(N, K); nbytes = mods[0].from_qmatrix(first).nbytes()
        copies = max(2, int(a.rotate_gib * (1 << 30) // nbytes) + 1)
        mats = [first] + [rq(N, K) for _ in range(copies - 1)]
        views = [[m.from_qmatrix(q) for q in mats] for m in mods]
        call = lambda m, v, x: m.matmul(x, v)
    x = rng.standard_normal((1, K), dtype=np.float32)
    ref = call(mods[0], views[0][0], x)
    errs = [np.linalg.norm(call(m, v[0], x) - ref) / np.linalg.norm(ref) for m, v in zip(mods, views)]
    for thr in a.threads:
        for m in mods: m.set_threads(thr)
        for m, v in zip(mods, views): call(m, v[1], x)
        times = [[] for _ in mods]
        i = 0
        for r in range(a.rounds):
            for mi, m in enumerate(mods):
                v = views[mi][i % copies]; i += 1
                t0 = time.perf_counter(); call(m, v, x); times[mi].append(time.perf_counter() - t0)
        for m, t, e in zip(mods, times, errs):
            med = float(np.median(t))
            print(f"{name} {a.bits}-bit g{a.group} thr {thr:2d} {Path(m.__file__).stem:12s} {med*1e3:7.3f} ms {nbytes/med/1e9:6.2f} GB/s rel.err vs first {e:.1e}", flush=True)
