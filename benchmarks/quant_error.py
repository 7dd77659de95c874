"""Developer benchmark (not shipped): how much 2-bit formats lose, at their bits per weight.

    python -m benchmarks.quant_error          # ~30 s on 2 cores
    python -m benchmarks.quant_error --demo   # + the demo model's held-out perplexity (~1 min)

Relative error ||W' - W|| / ||W|| (and of W' x for Gaussian x) of a 2048x4096 matrix of
std 0.015 (Mixtral's experts are 0.01-0.02), Gaussian and Student-t (4 degrees of freedom:
heavier tails, as trained weights have), for the store's 2-bit HQQ (engine/storage/quant.py, with
HQQ's optimizer, as `moeferry convert` runs it) in groups of 16, 32 and 64 rows, and for
llama.cpp's Q2_K layout (blocks of 16 along a row, 2-bit codes, a 4-bit scale and min per
block on the 256-block's float16 pair; 2.625 bits per weight) quantized by a simple L2 search
written here: llama.cpp's own search (make_qkx2_quants) is more thorough, so its Q2_K error is
likely no higher than the figure printed. "L2 search" is the store's own layout with its scale and
zero chosen by the same kind of search instead of HQQ's optimizer (an Lp objective, p < 1).

--demo: the shipped demo store dequantized (4-bit experts) as the reference model, its experts
quantized again to 2 bits each way, held-out perplexity on 64 windows of 512 tokens
(training/data/tokens.npz): does the lower L2 error buy a better language model?
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
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


def l2_search(w: torch.Tensor, spec: quant.QuantSpec) -> quant.QMatrix:
    """w in the store's layout (groups of g rows j, j + G, ...; 8-bit scale and zero), each
    group's range [lo, hi] the SHRINK pair of least squared error; codes against the stored
    (8-bit) scale and zero."""
    rows, cols = w.shape
    g, levels = spec.group_size, 2 ** spec.bits - 1
    G = rows // g
    W = w.detach().float().view(g, G, cols)
    lo, hi = W.amin(0), W.amax(0)
    best = None
    for c_lo in SHRINK:
        for c_hi in SHRINK:
            low, s = lo * c_lo, ((hi * c_hi - lo * c_lo) / levels).clamp(min=1e-10)
            err = ((((W - low) / s).round().clamp(0, levels) * s + low - W) ** 2).sum(0)
            cand = (err, s, low)
            best = cand if best is None else tuple(torch.where(cand[0] < best[0], n, o) for n, o in zip(cand, best))
    _, scale, low = best
    sq, sm = quant.quantize_meta8(scale, quant.meta_groups(G * cols, spec.meta_group))
    zq, zm = quant.quantize_meta8(-low / scale, quant.meta_groups(G * cols, spec.meta_group))
    codes = (W / quant.decode_meta(sq, sm) + quant.decode_meta(zq, zm)).round().clamp(0, levels)
    codes = codes.to(torch.uint8).reshape(rows, cols)
    return quant.QMatrix(rows, cols, spec.bits, g, quant.pack_codes(codes, spec.bits), sq, zq, sm, zm)


def demo_perplexity() -> None:
    from moeferry.engine.storage.manifest import resolve_store_path
    from moeferry.engine.storage.store import load_dequantized_hf_model
    from training.release_demo import perplexity

    base = load_dequantized_hf_model(resolve_store_path("demo")).eval()
    stream = torch.from_numpy(np.load("training/data/tokens.npz")["heldout_text"].astype(np.int64))[:512 * 64 + 1]
    print(f"\ndemo, held-out perplexity: 4-bit store (the reference) {perplexity(base, stream)[0]:.2f}")
    for g in (16, 32):
        spec = quant.QuantSpec(2, g, 128)
        for name, fn in (("HQQ", lambda w, spec=spec: quant.quantize_matrix(w, spec, optimize=True)),
                         ("L2 search", lambda w, spec=spec: l2_search(w, spec))):
            m = copy.deepcopy(base)
            with torch.no_grad():
                for layer in m.model.layers:
                    ex = layer.mlp.experts  # gate_up_proj [E, 2I, H], down_proj [E, H, I]: outputs first
                    half = ex.gate_up_proj.shape[1] // 2
                    for e in range(ex.gate_up_proj.shape[0]):
                        for part in (slice(0, half), slice(half, 2 * half)):
                            ex.gate_up_proj[e, part] = quant.dequantize(fn(ex.gate_up_proj[e, part].clone()))
                        ex.down_proj[e] = quant.dequantize(fn(ex.down_proj[e].clone()))
            print(f"  2-bit, groups of {g}, {name}: {perplexity(m, stream)[0]:.2f}", flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description="2-bit formats' error per bit (developer benchmark)")
    p.add_argument("--demo", action="store_true", help="also the demo model's held-out perplexity")
    args = p.parse_args()
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
            d = quant.dequantize(l2_search(w, spec), torch.float32)
            cells += [rel(d, w), rel(x @ d.T, x @ w.T)]
        print(f"| store layout, L2 search, groups of {g} | {bpw:.2f} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    cells = []
    for w in mats.values():
        d = q2k_layout(w)
        cells += [rel(d, w), rel(x @ d.T, x @ w.T)]
    print("| Q2_K layout, simple search (llama.cpp's likely no worse) | 2.62 | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    if args.demo:
        demo_perplexity()


if __name__ == "__main__":
    main()
