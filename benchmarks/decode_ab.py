"""The int8 LM head against a bfloat16 one, timed.

    python3 benchmarks/decode_ab.py [MODEL:BITS[:GROUP] ...]    # default qwen3-30b-a3b:4

First the head alone (CUDA events over 200 products of one token): bfloat16 F.linear against
int8_gpu's kernel at each model's head shape, and the kernel's block sizes swept. Then, on the benchmark's full-size synthetic model
(uniform routing, 12 GiB, fused kernels, prompt 128, 64 new tokens, lru and full = prefetch 1),
in one process taking turns: a bfloat16 head (its cache sized for it), the int8 head (the
engine's default: a larger cache), bfloat16 again. Needs a CUDA GPU.

(At 28bbbdc it also timed a deferred release of each layer's slots, hits_first's release and
prefetches after the next layer's attention was queued: no faster, so not kept;
docs/bench/2026-12-07-head/.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.hits_first_ab import build_spec, measure  # noqa: E402
from moeferry.engine.kernels import int8_gpu  # noqa: E402
from moeferry.engine.measure.bench_shapes import MODEL_SHAPES  # noqa: E402


def main(*specs: str) -> int:
    for name, shape in MODEL_SHAPES.items():
        head_alone(name, shape["vocab_size"], shape["hidden_size"])
    for spec in specs or ("qwen3-30b-a3b:4",):
        for int8 in (False, True, False):
            model, bits, s = build_spec(spec, int8_head=int8)
            head = "int8" if int8 else "bfloat16"
            for r in measure(s, ("lru", "full"), 1):
                print(f"{model} {bits}-bit 12GiB head {head:8s} {r['mode']:4s} {r['decode_tokens_per_s']:7.2f} tok/s, "
                      f"hit rate {r['hit_rate']:.2f}, {r['gb_per_token']:.3f} GB/token, "
                      f"peak {r['peak_vram_bytes'] / 2**30:.2f} GiB", flush=True)
            del s
    return 0


def head_alone(name: str, rows: int, cols: int, reps: int = 200) -> None:
    w = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
    m = int8_gpu.quantize(w)
    err = ((m.matmul(x) - F.linear(x, w).float()).norm() / F.linear(x, w).float().norm()).item()
    ways = {"bfloat16": lambda: F.linear(x, w), "int8": lambda: m.matmul(x)}
    times = {k: timed(f, reps) for k, f in ways.items()}
    default = int8_gpu.BLOCK_N, int8_gpu.BLOCK_K
    sweep = {}
    for bn in (16, 32, 64):
        for bk in (128, 256, 512):
            int8_gpu.BLOCK_N, int8_gpu.BLOCK_K = bn, bk
            sweep[bn, bk] = timed(ways["int8"], reps)
    int8_gpu.BLOCK_N, int8_gpu.BLOCK_K = default
    best = min(sweep, key=sweep.get)
    print("  int8 blocks (rows, columns): " + ", ".join(f"{k}: {v:.1f}" for k, v in sweep.items())
          + f" us; best {best}", flush=True)
    print(f"head {name} {rows}x{cols}: bfloat16 {times['bfloat16']:.1f} us ({2 * rows * cols / times['bfloat16'] / 1e3:.0f} "
          f"GB/s), int8 {times['int8']:.1f} us ({rows * cols / times['int8'] / 1e3:.0f} GB/s); "
          f"logits' relative error {err:.2e}", flush=True)


def timed(f, reps: int) -> float:
    for _ in range(5):
        f()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        f()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
