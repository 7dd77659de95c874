"""What a hybrid layer's CPU experts cost around the kernel, on the GPU machine (a developer
benchmark, not shipped).

    python3 benchmarks/hand_off.py [--threads 16,15,8] [--pool 48]

For Mixtral's 2-bit units (a quarter expert, groups of 32) read in turn from RAM, per thread
count: one matrix alone (a unit's w1 and a whole expert's: one parallel loop), then
hqq_cpu.swiglu_experts on 1, 2 and 4 units (the intercept is the kernel's cost per call),
then the host's hand-up of a decoded token (the CPU sum weighted, sent up through a pinned
buffer, added on the device: what CpuJob.add does) timed right after a kernel call and after a
pause with no kernel, to tell whether the kernel leaves the host slower (threads spinning,
caches). Medians in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from moeferry.engine.kernels import hqq_cpu
from moeferry.engine.storage import quant

H, I, BITS, GROUP, UNITS = 4096, 14336, 2, 32, 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="16,15,8")
    ap.add_argument("--pool", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args()
    hqq_cpu.spin_between_layers()  # as the GPU engine's hybrid runs it
    spec = quant.QuantSpec(BITS, GROUP, 128)
    gen = torch.Generator().manual_seed(0)
    inter = I // UNITS
    pool = [tuple(hqq_cpu.from_qmatrix(quant.random_qmatrix(r, c, spec, gen, plausible=True))
                  for r, c in ((inter, H), (inter, H), (H, inter))) for _ in range(a.pool)]
    addresses = [hqq_cpu.expert_addresses(*e) for e in pool]
    unit_bytes = sum(w.nbytes() for w in pool[0])
    x = np.random.default_rng(0).standard_normal((1, H)).astype(np.float32)
    cuda = torch.cuda.is_available()  # without one, the hand-up stays on the host (the kernel's figures hold)
    dev = torch.device("cuda" if cuda else "cpu")
    out = torch.zeros(1, H, dtype=torch.bfloat16, device=dev)
    stage = torch.empty(1, H, dtype=torch.float32, pin_memory=cuda)
    stage_dev = torch.empty(1, H, dtype=torch.float32, device=dev)
    weights = torch.rand(1, 8, pin_memory=cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def hand_up(ys) -> float:  # as CpuJob.add: weighted into the pinned stage in numpy, one copy, one add
        t0 = time.perf_counter()
        w, total = weights[0].numpy(), stage.numpy()[0]
        np.multiply(ys[0][0], w[0], out=total)
        for k, y in enumerate(ys[1:], 1):
            total += y[0] * w[k]
        stage_dev.copy_(stage, non_blocking=True)
        out.add_(stage_dev)
        return time.perf_counter() - t0

    print(f"unit: {inter}x{H} x3, {BITS}-bit groups of {GROUP}, {unit_bytes / 1e6:.1f} MB; pool {a.pool}", flush=True)
    # one parallel loop alone (hqq_cpu.matmul: the tables, then one loop): a unit's w1 against a
    # whole expert's, the intercept of a loop beside its bytes
    whole = [hqq_cpu.from_qmatrix(quant.random_qmatrix(I, H, spec, gen, plausible=True)) for _ in range(a.pool // 4)]
    for threads in (int(t) for t in a.threads.split(",")):
        hqq_cpu.set_threads(threads)
        for name, mats in ((f"{inter}x{H}", [e[0] for e in pool]), (f"{I}x{H}", whole)):
            times = []
            for r in range(a.rounds + 2):
                w = mats[r % len(mats)]
                t0 = time.perf_counter()
                hqq_cpu.matmul(x, w)
                if r >= 2:
                    times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            print(f"threads {threads:2d}, one {name} matrix: {med * 1e6:7.1f} us ({w.nbytes() / med / 1e9:5.1f} GB/s)",
                  flush=True)
    turn = 0
    for threads in (int(t) for t in a.threads.split(",")):
        hqq_cpu.set_threads(threads)
        for n in (1, 2, 4):
            kern, after, idle = [], [], []
            for r in range(a.rounds + 2):
                chosen = [(turn + j) % a.pool for j in range(n)]
                turn += n
                t0 = time.perf_counter()
                y = hqq_cpu.swiglu_experts(x, [pool[j] for j in chosen], np.stack([addresses[j] for j in chosen]))
                dt = time.perf_counter() - t0
                up = hand_up(list(y))
                sync()
                time.sleep(0.002)
                base = hand_up(list(y))
                sync()
                if r >= 2:  # the first calls compile or load
                    kern.append(dt)
                    after.append(up)
                    idle.append(base)
            med = statistics.median(kern)
            print(f"threads {threads:2d}, {n} unit(s) per call: kernel {med * 1e6:7.1f} us "
                  f"({n * unit_bytes / med / 1e9:5.1f} GB/s); hand-up right after it {statistics.median(after) * 1e6:6.1f} us, "
                  f"after a pause {statistics.median(idle) * 1e6:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
