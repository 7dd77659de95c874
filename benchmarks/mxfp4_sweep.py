"""Launch parameters of gpt-oss's grouped MXFP4 expert kernels (mxfp4_gpu.moe_decode), timed.

    python3 benchmarks/mxfp4_sweep.py [OUT.json]
    python3 benchmarks/mxfp4_sweep.py OUT.json --decode    # then gpt-oss-20b's decode at 12 GiB with each


On the GPU machine: one layer of the synthetic full-size gpt-oss-20b (32 experts in cache
slots), one token (bf16) through 4 routed experts per call, the routing drawn afresh for each
of 64 calls so that the 422 MB of experts, not the 50 MB L2, serve the reads. First the float32
loop (the launch of 2026-12-05, BR 8 / NB 16) and the default launch (the fp16-pair loop, H2);
then each (BR, NB, warps) of the up kernel with the default down kernel, then each of the down
kernel with the best up, all H2; every output is checked against the float32 loop's. Times are
CUDA-event medians over 5 rounds of a CUDA graph of 64 calls (no launch gaps), in us per call.
With --decode, the benchmark's full-size gpt-oss-20b (uniform routing, 12 GiB, lru, fused)
then decodes with the float32 loop, the default, the best and the float32 loop again, in one
process, so that the tok/s stand side by side.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_sweep import CALLS, graph_us, one_layer  # noqa: E402
from moeferry.engine.kernels import mxfp4_gpu  # noqa: E402
from moeferry.engine.measure import bench  # noqa: E402

CONFIGS = [dict(BR=br, NB=nb, num_warps=w, H2=True) for br, nb, w in itertools.product((4, 8, 16), (8, 16, 32), (4, 8))]
FLOAT32 = dict(BR=8, NB=16, num_warps=4, H2=False)


def main(out: str | None = None, *flags: str) -> int:
    s, experts, table, ids, weights, h, out_buf = one_layer("gpt-oss-20b")
    cfg = s.cfg
    default = (mxfp4_gpu.gemv_config(experts["w1"].rows, experts["w1"].cols),
               mxfp4_gpu.gemv_config(experts["w2"].rows, experts["w2"].cols, br=4, nb=32))

    def calls(c):
        for n in range(CALLS):
            mxfp4_gpu.moe_decode(h, experts, s.host.shape[2], ids[n], weights[n], table, out_buf[n:n + 1],
                                 cfg.swiglu_alpha, cfg.swiglu_limit, c)

    def timed(c) -> tuple[float, torch.Tensor]:
        return graph_us(lambda: calls(c), CALLS), out_buf.clone()

    f32 = (FLOAT32, FLOAT32)
    f32_us, want = timed(f32)
    rows = [{"part": "float32 loop", "up": f32[0], "down": f32[1], "us": f32_us, "max_rel_diff": 0.0}]
    print(f"float32 loop {f32}: {f32_us:.1f} us per call", flush=True)
    best = (float("inf"), default[0])
    for part in ("default", "up", "down"):
        for c in [None] if part == "default" else CONFIGS:
            pair = default if c is None else (c, default[1]) if part == "up" else (best[1], c)
            try:
                us, got = timed(pair)
            except Exception as e:  # noqa: BLE001 - a configuration Triton cannot build
                print(f"{part} {c}: failed ({type(e).__name__}: {e})"[:300], flush=True)
                continue
            diff = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            rows.append({"part": part, "up": pair[0], "down": pair[1], "us": us, "max_rel_diff": diff})
            print(f"{part} {c or pair}: {us:.1f} us per call, max |diff| / max |out| {diff:.3g}", flush=True)
            if part == "up" and us < best[0] and diff < 0.02:
                best = (us, c)
    top = min(rows[1:], key=lambda r: r["us"] if r["max_rel_diff"] < 0.02 else float("inf"))
    print(f"best: up {top['up']} down {top['down']}: {top['us']:.1f} us per call "
          f"(float32 loop {f32_us:.1f}, default {rows[1]['us']:.1f})")
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))
    if "--decode" in flags:
        decode_side_by_side((top["up"], top["down"]), f32)
    return 0


def decode_side_by_side(best: tuple[dict, dict], f32: tuple[dict, dict]) -> None:
    """gpt-oss-20b at 12 GiB, lru: the float32 loop, the default, `best`, the float32 loop again
    (moe_decode's cfg patched in)."""
    torch.cuda.empty_cache()
    s = bench.build(None, 4, 4, log=lambda m: None, model="gpt-oss-20b")
    run = mxfp4_gpu.moe_decode
    for name, cfg in (("float32 loop", f32), ("default", None), ("best", best), ("float32 loop", f32)):
        mxfp4_gpu.moe_decode = (lambda *a, cfg=cfg: run(*a, cfg)) if cfg else run
        r = bench.measure(s, "12GiB", 128, 64, ("lru",), ("fused",), 0, log=lambda m: None,
                          cond=bench.Conditions(routing="uniform"))["results"][0]
        print(f"decode, {name}: {r['decode_tokens_per_s']:.2f} tok/s, "
              f"{r['cache_experts']} experts cached per layer", flush=True)
    mxfp4_gpu.moe_decode = run


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
