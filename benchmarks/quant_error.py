"""Developer benchmark (not shipped): how much 2-bit formats lose, at their bits per weight.

    python -m benchmarks.quant_error          # ~30 s on 2 cores

Relative error ||W' - W|| / ||W|| (and of W' x for Gaussian x) of a 2048x4096 matrix of
std 0.015 (Mixtral's experts are 0.01-0.02), Gaussian and Student-t (4 degrees of freedom:
heavier tails, as trained weights have), for the store's 2-bit HQQ (engine/storage/quant.py, with
HQQ's optimizer, as `moeferry convert` runs it) in groups of 16, 32 and 64 rows, and for
llama.cpp's Q2_K layout (blocks of 16 along a row, 2-bit codes, a 4-bit scale and min per
block on the 256-block's float16 pair; 2.625 bits per weight) quantized by a simple L2 search
written here: llama.cpp's own search (make_qkx2_quants) is more thorough, so its Q2_K error is
likely no higher than the figure printed.
"""

from __future__ import annotations

import torch

from moeferry.engine.storage import quant

ROWS, COLS, STD = 2048, 4096, 0.015
SHRINK = (1.0, 0.9, 0.8, 0.7)  # range ends tried per Q2_K block


def q2k_layout(w: torch.Tensor) -> torch.Tensor:
    """w quantized and dequantized in Q2_K's layout (w ~ q * scale - min per block of 16)."""
    b = w.reshape(-1, 16)
    lo, hi = b.amin(1, keepdim=True).clamp(max=0), b.amax(1, keepdim=True)
    best = None
    for c_lo in SHRINK:
        for c_hi in SHRINK:
            low, s = lo * c_lo, ((hi * c_hi - lo * c_lo) / 3).clamp(min=1e-12)
            err = ((((b - low) / s).round().clamp(0, 3) * s + low - b) ** 2).sum(1, keepdim=True)
            cand = (err, s, -low)
            best = cand if best is None else tuple(torch.where(cand[0] < best[0], n, o) for n, o in zip(cand, best))
    _, s, m = (t.reshape(-1, 16) for t in best)  # 16 blocks per super-block of 256

    def four_bit(v):  # a super-block's float16 step, then 4-bit multiples of it per block
        d = (v.amax(1, keepdim=True) / 15).half().float().clamp(min=1e-12)
        return ((v / d).round().clamp(0, 15) * d).reshape(-1, 1)
    s, m = four_bit(s), four_bit(m)
    return (((b + m) / s.clamp(min=1e-12)).round().clamp(0, 3) * s - m).reshape(w.shape)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    mats = {"gaussian": torch.randn(ROWS, COLS, generator=gen) * STD,
            "student-t4": torch.distributions.StudentT(4.0).sample((ROWS, COLS)) * (STD / 2 ** 0.5)}
    x = torch.randn(64, COLS, generator=gen)
    print("| format | bits/weight | " + " | ".join(f"{n} weight err | {n} output err" for n in mats) + " |")
    print("|---|---|" + "---|---|" * len(mats))
    for g in (16, 32, 64):
        spec = quant.QuantSpec(2, g, 128)
        cells, bpw = [], None
        for w in mats.values():
            qm = quant.quantize_matrix(w, spec, optimize=True)
            bpw = quant.bits_per_weight(qm)
            d = quant.dequantize(qm, torch.float32)
            cells += [rel(d, w), rel(x @ d.T, x @ w.T)]
        print(f"| HQQ 2-bit, groups of {g} | {bpw:.2f} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    cells = []
    for w in mats.values():
        d = q2k_layout(w)
        cells += [rel(d, w), rel(x @ d.T, x @ w.T)]
    print("| Q2_K layout, simple search (llama.cpp's likely no worse) | 2.62 | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
