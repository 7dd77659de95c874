"""A decoded layer's CPU experts in one kernel call against one call each (a developer benchmark,
not shipped).

    python -m benchmarks.hqq_cpu_layer --shape qwen3 --threads 2
    python -m benchmarks.hqq_cpu_layer --shape olmoe --threads 16 --experts 8

Builds --pool random experts of the shape (read in turn, so that they come from RAM as in
decoding), then times --experts of them on one token: hqq_cpu.swiglu_experts (one call, what
cpu_experts.run_together does) against hqq_cpu.swiglu_expert for each, alternating, and prints
the medians in microseconds per layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from moeferry.engine.kernels import hqq_cpu
from moeferry.engine.storage import quant

# (hidden, expert intermediate, bits, group size) of the models' experts as the catalog converts them
SHAPES = {"qwen3": (2048, 768, 4, 64), "olmoe": (2048, 1024, 4, 64), "mixtral-unit": (4096, 3584, 2, 32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8, help="experts of the layer on the CPU")
    ap.add_argument("--pool", type=int, default=128, help="different experts read in turn")
    ap.add_argument("--rounds", type=int, default=60)
    a = ap.parse_args()
    H, I, bits, g = SHAPES[a.shape]
    spec = quant.QuantSpec(bits, g, 128)
    gen = torch.Generator().manual_seed(0)
    pool = [tuple(hqq_cpu.from_qmatrix(quant.random_qmatrix(r, c, spec, gen, plausible=True))
                  for r, c in ((I, H), (I, H), (H, I))) for _ in range(a.pool)]
    addresses = [hqq_cpu.expert_addresses(*e) for e in pool]
    hqq_cpu.kernels()
    hqq_cpu.set_threads(a.threads)
    x = np.random.default_rng(0).standard_normal((1, H), dtype=np.float32)
    rng = np.random.default_rng(1)
    times: dict[str, list[float]] = {"one call each": [], "one call": []}
    for r in range(a.rounds + 1):
        chosen = rng.choice(a.pool, a.experts, replace=False)
        for how in times:
            t0 = time.perf_counter()
            if how == "one call":
                hqq_cpu.swiglu_experts(x, [pool[i] for i in chosen], np.stack([addresses[i] for i in chosen]))
            else:
                for i in chosen:
                    hqq_cpu.swiglu_expert(x, *pool[i], addresses[i])
            if r:  # the first round compiles or loads the kernels
                times[how].append(time.perf_counter() - t0)
    nbytes = sum(m.nbytes() for m in pool[0]) * a.experts
    print(f"{a.experts} {a.shape} experts ({nbytes / 1e6:.1f} MB) on {a.threads} threads, "
          f"from {a.pool} read in turn, median of {a.rounds}:")
    for how, t in times.items():
        m = statistics.median(t)
        print(f"  {how}: {m * 1e6:.0f} us, {nbytes / m / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
