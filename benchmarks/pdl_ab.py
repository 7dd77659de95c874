"""Programmatic dependent launch (hqq_gpu.PDL) on and off, timed.

    python3 benchmarks/pdl_ab.py [MODEL:BITS[:GROUP] ...]    # default qwen3-30b-a3b:4

On the benchmark's full-size synthetic model (uniform routing, fused kernels, prompt 128, 64 new
tokens), in one process taking turns off, on, off, on: every expert resident (lru), then 12 GiB
(lru, and full = prefetch 1). Each run captures its own CUDA graphs, so each has the launches of
its turn. Needs a CUDA GPU (Hopper or later for PDL to differ).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.hits_first_ab import build_spec  # noqa: E402
from moeferry.engine.kernels import hqq_gpu  # noqa: E402
from moeferry.engine.measure import bench  # noqa: E402

RUNS = (("none", ("lru",)), ("12GiB", ("lru", "full")))


def main(*specs: str) -> int:
    for spec in specs or ("qwen3-30b-a3b:4",):
        model, bits, s = build_spec(spec)
        for pdl in (False, True, False, True):
            hqq_gpu.PDL = pdl
            for budget, modes in RUNS:
                rows = bench.measure(s, budget, 128, 64, modes, ("fused",), 1, log=lambda m: None,
                                     cond=bench.Conditions(routing="uniform"))["results"]
                for r in rows:
                    print(f"{model} {bits}-bit {budget:5s} {r['mode']:4s} PDL {'on ' if pdl else 'off'} "
                          f"{r['decode_tokens_per_s']:7.2f} tok/s, hit rate {r['hit_rate']:.2f}", flush=True)
        hqq_gpu.PDL = True
        del s
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
