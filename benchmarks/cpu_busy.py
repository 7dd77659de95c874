"""The CPU engine's decode with the processor to itself and with one core held by another
program (a busy loop in a child process), at automatic threads (engine/runtime/cpu_threads.py)
and at fixed counts (a developer benchmark, not shipped).

    python -m benchmarks.cpu_busy --model qwen3-30b-a3b --layers 8 --threads 2

Each run decodes --tokens after a 16-token prompt on a synthetic model of the shape's first
layers (4-bit experts in groups of 64, 8-bit attention, uniform routing), timing each token as
Engine._generate does and handing the time to the CPU experts' governor. Prints the rate over
the last two thirds of the tokens (after the governor's first tries) and over all, and the
thread count every tenth token.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from benchmarks.cpu_engine import cpu_model
from moeferry.engine.measure import bench
from moeferry.engine.measure.bench_shapes import MODEL_SHAPES, shape_config
from moeferry.engine.runtime.generate import move_dense


def decode(s, threads: int | None, tokens: int) -> tuple[float, float, list[int]]:
    """(tok/s over the last two thirds, over all, the count every tenth token)."""
    model = cpu_model(s, threads, 16 + tokens + 1)
    times, counts = [], []
    with torch.inference_mode():
        tok = int(model.forward(torch.arange(3, 19), 0)[-1].argmax())
        for i in range(tokens):
            t = time.perf_counter()
            logits = model.forward(torch.tensor([tok]), 16 + i)
            times.append(time.perf_counter() - t)
            model.hybrid.token_done(times[-1])
            counts.append(model.hybrid.threads)
            tok = int(logits[-1].argmax())
    late = times[tokens // 3:]
    return len(late) / sum(late), tokens / sum(times), counts[::10]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_busy")
    p.add_argument("--model", default="qwen3-30b-a3b", choices=tuple(MODEL_SHAPES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="the fixed count beside automatic")
    p.add_argument("--tokens", type=int, default=240)
    a = p.parse_args(argv)
    cpu = torch.device("cpu")
    cfg = shape_config(a.model, a.layers)
    dense_q, _, host, fields, eq = bench.synthetic_model(cfg, 4, 8, cpu, 0, torch.float32, "hqq", 64)
    dense, dense_bytes = move_dense(dense_q, cpu, torch.float32, True)
    s = bench.Synthetic(cfg, dense, dense_bytes, host, fields, eq, cpu, 0.0, 4, 8, torch.float32, a.model)
    decode(s, a.threads, 3)  # numba's compile and the pools' start
    print(f"{a.model}, first {a.layers} layers, {a.tokens} tokens after 16")
    print("| another program | threads | tok/s, last two thirds | tok/s, all | the count every tenth token |")
    print("|---|---|---|---|---|")
    for busy in (False, True):
        loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            for threads in (None, a.threads, 1):
                late, whole, counts = decode(s, threads, a.tokens)
                print(f"| {'a busy loop' if busy else 'none'} | {threads or 'automatic'} | {late:.2f} | {whole:.2f} | "
                      f"{' '.join(map(str, counts))} |", flush=True)
        finally:
            if loop is not None:
                loop.kill()
                loop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
