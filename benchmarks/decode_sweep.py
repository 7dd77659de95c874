"""Launch parameters of a decoded layer's small kernels on the families' shapes, timed.

    python3 benchmarks/decode_sweep.py [OUT.json]

On the GPU machine, bf16 activations, each kernel in a CUDA graph of 64 calls whose inputs
rotate over 8 matrices (so that the 50 MB L2 does not serve them), median of 5 replays, us per
call; every variant's outputs are checked against the default's:
  * the router (decode.route_topk) of gpt-oss-20b (32 x 2880, bias) and Qwen3-30B-A3B
    (128 x 2048) with 1, 2, 4 and 8 experts per logits program (decode.LOGIT_ROWS);
  * the 4-bit attention GEMVs (hqq_gpu.gemv, groups of 64, the store's 8-bit metadata) of
    gpt-oss-20b (q 4096 x 2880, o 2880 x 4096) and Qwen3-30B-A3B (q 4096 x 2048, o 2048 x 4096)
    over benchmarks/kernel_bench.gemv_variants' packed-fp16 (H2) ones;
  * Qwen3-30B-A3B's grouped 4-bit experts (hqq_gpu.moe_decode: 8 of 128 experts, each call its
    own routing over one layer's 128 experts): the up kernel's launch parameters with the
    default down, then the down kernel's with the best up.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_bench import gemv_variants, random_qmatrix, rel_err  # noqa: E402
from moeferry.engine.kernels import decode, hqq_gpu  # noqa: E402
from moeferry.engine.storage.quant import ATTN_SPECS  # noqa: E402

CALLS, ROTATE = 64, 8
ROUTERS = {"gpt-oss-20b": (32, 2880, 4, True), "qwen3-30b-a3b": (128, 2048, 8, False)}  # E, H, top-k, bias
ATTENTION = {"gpt-oss-20b q": (4096, 2880), "gpt-oss-20b o": (2880, 4096),
             "qwen3-30b-a3b q": (4096, 2048), "qwen3-30b-a3b o": (2048, 4096)}


def graph_us(calls, n_calls: int = CALLS) -> float:
    """Median us per call of `calls` (n_calls calls) replayed as one CUDA graph: no launch gaps."""
    calls()  # compiles, fills the scratch buffers
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n_calls)
    return statistics.median(times)


def route_calls(h, ws, k, weights, ids, bias) -> None:
    for n in range(CALLS):
        decode.route_topk(h[n], ws[n % ROTATE], k, weights[n], ids[n], bias, renormalize=True)


def gemv_calls(x, qms, y, cfg) -> None:
    for n in range(CALLS):
        hqq_gpu.gemv(x[n], qms[n % ROTATE], y[n], cfg)


def routers(rows: list) -> None:
    default = decode.LOGIT_ROWS
    for name, (E, H, k, bias) in ROUTERS.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        ws = [torch.randn(E, H, device="cuda", generator=gen).to(torch.bfloat16) / H ** 0.5 for _ in range(ROTATE)]
        b = torch.randn(E, device="cuda", generator=gen).to(torch.bfloat16) if bias else None
        h = torch.randn(CALLS, 1, H, device="cuda", generator=gen).to(torch.bfloat16)
        weights = torch.empty(CALLS, k, device="cuda")
        ids = torch.empty(CALLS, k, dtype=torch.int64, device="cuda")
        want = None
        for per_program in (default, *(n for n in (1, 2, 4, 8) if n != default)):  # the default first: the ids to match
            decode.LOGIT_ROWS = per_program
            us = graph_us(partial(route_calls, h, ws, k, weights, ids, b))
            got = ids.clone()
            want = got if want is None else want
            same = bool(torch.equal(got, want))
            rows.append(dict(kind="router", model=name, logit_rows=per_program, us=us, same_ids=same))
            print(f"router {name} ({E} x {H}), {per_program} experts a program: {us:.2f} us"
                  f"{'' if same else ', ids differ from the default'}", flush=True)
    decode.LOGIT_ROWS = default


def attention(rows: list) -> None:
    spec = ATTN_SPECS[4]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (r, c) in ATTENTION.items():
        qms = [random_qmatrix(r, c, 4, spec.group_size, True, spec.meta_group, None, "cuda", seed=i)
               for i in range(ROTATE)]
        x = torch.randn(CALLS, 1, c, device="cuda").to(torch.bfloat16)
        y = torch.empty(CALLS, 1, r, device="cuda", dtype=torch.bfloat16)
        want, best, default_us = None, None, None
        for cfg in [None] + [v for v in gemv_variants(4, spec.group_size, sms) if v["H2"]]:
            try:
                us = graph_us(partial(gemv_calls, x, qms, y, cfg))
            except Exception as e:  # noqa: BLE001 - a variant Triton cannot build
                print(f"attention {name} {cfg}: failed ({type(e).__name__})", flush=True)
                continue
            got = y.clone()
            want = got if want is None else want
            err = rel_err(got, want)
            rows.append(dict(kind="attention", shape=name, cfg=cfg or "default", us=us, rel_err=err))
            default_us = us if cfg is None else default_us
            if err < 1e-2 and (best is None or us < best[0]):
                best = (us, cfg or "default")
            print(f"attention {name} {cfg or 'default'}: {us:.2f} us, rel err {err:.1e}", flush=True)
        print(f"best attention {name}: {best[0]:.2f} us with {best[1]} (default {default_us:.2f} us)", flush=True)


def moe_calls(h, experts, stride, ids, weights, table, out, cfg) -> None:
    for n in range(CALLS):
        hqq_gpu.moe_decode(h, experts, stride, ids[n], weights[n], table, out[n:n + 1], cfg)


def one_layer(model: str):
    """Layer 0 of the benchmark's synthetic `model` (4-bit where HQQ), its E experts in cache slots
    0..E-1, and CALLS tokens' routings: (synthetic, slot 0's expert views, table, ids, weights,
    h [1, H] bf16, out [CALLS, H] bf16)."""
    from moeferry.engine.measure import bench
    s = bench.build(1, 4, 4, log=lambda m: None, model=model)
    cfg, dev = s.cfg, s.device
    E, k = cfg.num_experts, cfg.top_k
    slots = s.host[0].to(dev)  # [E, stride]: expert e in slot e
    experts = bench.expert_views(cfg, s.fields, s.eq)(slots[0])
    table = torch.arange(E, dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(CALLS)]).to(dev)
    weights = torch.softmax(torch.randn(CALLS, k, generator=gen), -1).to(dev)
    h = torch.randn(1, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
    out = torch.zeros(CALLS, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
    return s, experts, table, ids, weights, h, out


def qwen3_experts(rows: list) -> None:
    s, experts, table, ids, weights, h, out = one_layer("qwen3-30b-a3b")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w1, w2 = experts["w1"], experts["w2"]
    base = [hqq_gpu.gemv_config(w.rows, w.cols, w.bits, w.group_size, sms) for w in (w1, w2)]
    run = partial(moe_calls, h, experts, s.host.shape[2], ids, weights, table, out)
    default_us = graph_us(partial(run, None))
    want = out.clone()
    rows.append(dict(kind="qwen3-experts", part="default", up=base[0], down=base[1], us=default_us))
    print(f"qwen3 experts default: {default_us:.2f} us per call", flush=True)
    best, top = [dict(base[0]), dict(base[1])], default_us
    for which in (0, 1):
        for warps, nq, progs in itertools.product((4, 8), (1, 2, 4), (2, 4, 8)):
            c = dict(base[which], BKO=32 * warps, NQ=nq, num_warps=warps, programs=progs * sms)
            pair = (c, best[1]) if which == 0 else (best[0], c)
            try:
                us = graph_us(partial(run, pair))
            except Exception as e:  # noqa: BLE001 - a variant Triton cannot build
                print(f"qwen3 experts {c}: failed ({type(e).__name__})", flush=True)
                continue
            err = rel_err(out, want)
            part = "up" if which == 0 else "down"
            rows.append(dict(kind="qwen3-experts", part=part, up=pair[0], down=pair[1], us=us, rel_err=err))
            print(f"qwen3 experts {part} warps {warps} NQ {nq} programs {progs}xSM: {us:.2f} us, "
                  f"rel err {err:.1e}", flush=True)
            if err < 1e-2 and us < top:
                top, best[which] = us, c
    print(f"best qwen3 experts: up {best[0]} down {best[1]} (default {default_us:.2f} us)", flush=True)


def main(out: str | None = None) -> int:
    rows: list = []
    routers(rows)
    attention(rows)
    qwen3_experts(rows)
    if out:
        Path(out).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
