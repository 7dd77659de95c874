"""How the HQQ CPU kernel's time splits between preparing each group's inputs and the integer
products, on one thread, for one matrix read from the cache (a developer benchmark, not shipped).

    python -m benchmarks.hqq_cpu_split --bits 2 --groups 16 32 64

HQQ groups rows, so each group of g rows has its own scale and zero per input: the kernel
(engine/kernels/hqq_cpu.py) scales the input by them and rounds the result to int8 once per
group (group_inputs, K inputs) before the g rows' integer products. Its share is therefore about
twice as large at g = 16 as at g = 32. Prints, per group size, the median time of group_inputs
over every group of a 14336x4096 matrix (with the product's one decode of the metadata tables), and of the whole product (hqq_cpu.matmul).
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import numpy as np
import torch

from moeferry.engine.kernels import hqq_cpu
from moeferry.engine.storage import quant


def median_s(fn, reps: int) -> float:
    fn()  # numba's compile, the caches
    return statistics.median(timeit.repeat(fn, number=1, repeat=reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=2, choices=(2, 3, 4))
    ap.add_argument("--groups", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--rows", type=int, default=14336)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=11)
    a = ap.parse_args()
    hqq_cpu.kernels()
    hqq_cpu.set_threads(1)
    from numba import njit

    group_inputs, decoded_meta, scratch = hqq_cpu.group_inputs, hqq_cpu.decoded_meta, hqq_cpu.scratch

    @njit(fastmath=True)
    def every_group(x, scale, smeta, zero, zmeta, center):
        K = x.shape[1]
        s_meta, z_meta = decoded_meta((smeta, zmeta), (K, K), (np.float32(0.0), -center))
        xs, amax, q, m, _, _ = scratch(K, 1)
        total = np.float32(0.0)
        for j in range(scale.shape[0]):
            total += group_inputs(x, 0, j, scale, zero, s_meta, z_meta, center, xs, amax, q, m)[0]
        return total

    gen = torch.Generator().manual_seed(0)
    x = np.random.default_rng(0).standard_normal((1, a.cols)).astype(np.float32)
    print(f"{a.bits}-bit, {a.rows}x{a.cols}, 1 thread, from the cache (medians of {a.reps})")
    print("| rows per group | group_inputs, every group | whole product | its share |")
    print("|---|---|---|---|")
    for g in a.groups:
        w = hqq_cpu.from_qmatrix(quant.random_qmatrix(a.rows, a.cols, quant.QuantSpec(a.bits, g, 128), gen,
                                                      plausible=True))
        prep = median_s(lambda w=w: every_group(x, w.scale, w.scale_meta, w.zero, w.zero_meta, np.float32(1.5)),
                        a.reps)
        whole = median_s(lambda w=w: hqq_cpu.matmul(x, w), a.reps)
        print(f"| {g} | {prep * 1e3:.2f} ms | {whole * 1e3:.2f} ms | {prep / whole:.0%} |")


if __name__ == "__main__":
    main()
