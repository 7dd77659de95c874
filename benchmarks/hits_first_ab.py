"""The hits-first layer (OffloadedMixtral.hits_first) against reading the routing first, timed,
then prefetch depth.

    python3 benchmarks/hits_first_ab.py [MODEL:BITS[:GROUP] ...]    # default qwen3-30b-a3b:4 mixtral-8x7b:2:32

On the benchmark's full-size synthetic model (uniform routing, 12 GiB, fused kernels, prompt 128,
64 new tokens), in one process, taking turns: the routing read first (the layer's grouped launch
after the host's sync and copies), hits first (the engine's default, landing copies awaited up to
expert_cache.LANDING_WAIT_BYTES), the first again; lru (no prefetch) and full (prefetch 1) each.
Then hits first with prefetch 2 and 3: guesses further ahead (right with probability 0.85^d)
give the link more time to overlap the compute. Needs a CUDA GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moeferry.engine.measure import bench  # noqa: E402
from moeferry.engine.runtime import decode_graphs  # noqa: E402

WAYS = (("routing first", False), ("hits first", True), ("routing first", False))


def main(*specs: str) -> int:
    for spec in specs or ("qwen3-30b-a3b:4", "mixtral-8x7b:2:32"):
        model, bits, s = build_spec(spec)
        for name, hits_first in WAYS:
            decode_graphs.HITS_FIRST = hits_first
            report(model, bits, name, measure(s, ("lru", "full"), 1))
        decode_graphs.HITS_FIRST = True
        for depth in (2, 3):
            report(model, bits, f"hits first, prefetch {depth}", measure(s, ("full",), depth))
        del s
    return 0


def build_spec(spec: str, **build_args) -> tuple[str, str, bench.Synthetic]:
    """MODEL:BITS[:GROUP] -> (model, bits, the full-size synthetic model with 4-bit attention);
    build_args: bench.build's others."""
    model, bits, *group = spec.split(":")
    torch.cuda.empty_cache()
    return model, bits, bench.build(None, int(bits), 4, log=lambda m: None, model=model,
                                    group_size=int(group[0]) if group else None, **build_args)


def measure(s, modes: tuple, prefetch: int) -> list:
    return bench.measure(s, "12GiB", 128, 64, modes, ("fused",), prefetch, log=lambda m: None,
                         cond=bench.Conditions(routing="uniform"))["results"]


def report(model: str, bits: str, name: str, rows: list) -> None:
    for r in rows:
        print(f"{model} {bits}-bit 12GiB {r['mode']:4s} {name:28s} {r['decode_tokens_per_s']:7.2f} tok/s, "
              f"hit rate {r['hit_rate']:.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
