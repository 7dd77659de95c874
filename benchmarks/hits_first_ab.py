"""The hits-first layer (OffloadedMixtral.hits_first) against reading the routing first, timed.

    python3 benchmarks/hits_first_ab.py [MODEL:BITS ...]    # default qwen3-30b-a3b:4 mixtral-8x7b:2

On the benchmark's full-size synthetic model (uniform routing, 12 GiB, fused kernels, prompt 128,
64 new tokens), in one process, taking turns: the routing read first (the layer's grouped launch
after the host's sync and copies), hits first with experts whose copy is still landing run late,
hits first waiting on those copies instead (expert_cache.LANDING_WAIT_BYTES), the first again;
lru (no prefetch) and full (prefetch 1) each. Then the engine's default (hits first, its landing
rule) with prefetch 2: guesses two layers ahead give the link more time to overlap the compute.
Needs a CUDA GPU.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moeferry.engine.measure import bench  # noqa: E402
from moeferry.engine.runtime import decode_graphs, expert_cache  # noqa: E402

WAYS = (("routing first", False, False), ("hits first", True, False), ("hits first, landing awaited", True, True),
        ("routing first", False, False))


def main(*specs: str) -> int:
    wait_bytes = expert_cache.LANDING_WAIT_BYTES
    for spec in specs or ("qwen3-30b-a3b:4", "mixtral-8x7b:2"):
        model, bits = spec.split(":")
        torch.cuda.empty_cache()
        s = bench.build(None, int(bits), 4, log=lambda m: None, model=model)
        for name, hits_first, landing in WAYS:
            decode_graphs.HITS_FIRST = hits_first
            expert_cache.LANDING_WAIT_BYTES = math.inf if landing else 0
            rows = bench.measure(s, "12GiB", 128, 64, ("lru", "full"), ("fused",), 1, log=lambda m: None,
                                 cond=bench.Conditions(routing="uniform"))["results"]
            report(model, bits, name, rows)
        decode_graphs.HITS_FIRST, expert_cache.LANDING_WAIT_BYTES = True, wait_bytes
        rows = bench.measure(s, "12GiB", 128, 64, ("full",), ("fused",), 2, log=lambda m: None,
                             cond=bench.Conditions(routing="uniform"))["results"]
        report(model, bits, "default, prefetch 2", rows)
        del s
    return 0


def report(model: str, bits: str, name: str, rows: list) -> None:
    for r in rows:
        print(f"{model} {bits}-bit 12GiB {r['mode']:4s} {name:28s} {r['decode_tokens_per_s']:7.2f} tok/s, "
              f"hit rate {r['hit_rate']:.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
