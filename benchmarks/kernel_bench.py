"""Correctness check and timing of the fused kernels (engine/kernels/hqq_gpu.py), per shape and width.

    python -m benchmarks.kernel_bench [--quick] [--check-only] [--gemlite] [--json FILE]

On a CUDA machine: checks every kernel against quant.dequantize on fresh random matrices
(all widths, both metadata kinds, tiny and real shapes, T = 1, 8, 128; outputs poisoned with
NaN first), then times them with triton.testing.do_bench (median; it flushes L2 before every
run, and the inputs rotate over several matrices anyway) and prints us and GB/s, where GB/s
counts every byte the product must move (planes, scale/zero, meta, x, y).
`--warm I/N` only makes the calls numbered I mod N (compiling their kernels into Triton's
cache): N such processes started together compile everything in parallel before the real run.
`random_qmatrix` is also what tests/engine/kernels/test_hqq_gpu.py uses.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

from moeferry.engine.kernels import hqq_gpu as K
from moeferry.engine.storage.quant import (
    ATTN_SPECS,
    EXPERT_SPECS as QUANT_SPECS,
    QMatrix,
    QuantSpec,
    dequantize,
    random_qmatrix as quant_random_qmatrix,
)

# Mixtral-8x7B matrices: expert w1/w3 (and w2, the down projection), attention q/o and k/v.
SHAPES = {"w1 14336x4096": (14336, 4096), "w2 4096x14336": (4096, 14336),
          "q 4096x4096": (4096, 4096), "kv 1024x4096": (1024, 4096)}
# bits: (group, meta group), the store's formats (8-bit: attention's)
SPECS = {b: (q.group_size, q.meta_group) for b, q in {**QUANT_SPECS, 8: ATTN_SPECS[8]}.items()}
TARGET_US = {2: 20.0, 3: 30.0, 4: 30.0}  # issue 3: one expert matrix at batch 1


def random_qmatrix(rows: int, cols: int, bits: int, group_size: int, meta8: bool = True,
                   meta_group: int = 128, zero_meta_group: int | None = None,
                   device="cpu", seed: int | None = None) -> QMatrix:
    """quant.random_qmatrix with random metadata, by width and groups, made on `device`. Meta
    groups follow quant.meta_groups: one that does not divide G * cols (e.g. 1 << 40) gives a
    single meta pair (M == 1), as the paper's zeros have."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(6), "little"))
    spec = QuantSpec(bits, group_size, meta_group, zero_meta_group, 8 if meta8 else 16)
    return quant_random_qmatrix(rows, cols, spec, gen, device)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def bytes_moved(qm: QMatrix, T: int, elem: int = 2) -> int:
    """The fewest bytes one y = x @ W.T must move: all of W's tensors, x and y, once each."""
    return qm.nbytes() + T * (qm.cols + qm.rows) * elem


class Runner:
    """Runs (or, in warm mode, only compiles a share of) the kernel calls of a bench run."""

    def __init__(self, warm: tuple[int, int] | None = None):
        self.warm, self.n = warm, 0

    def call(self, fn) -> bool:
        self.n += 1
        if self.warm and (self.n - 1) % self.warm[1] != self.warm[0]:
            return False
        fn()
        return True

    def time(self, fn, rep_ms: int = 100, log=print) -> float | None:
        """Median us of fn (None in warm mode, or when it fails: a variant that does not
        compile, e.g. too much shared memory, is reported and skipped)."""
        try:
            if not self.call(fn) or self.warm:
                return None
            from triton.testing import do_bench
            return do_bench(fn, warmup=20, rep=rep_ms, return_mode="median") * 1000.0
        except Exception as e:  # noqa: BLE001
            if not self.warm:
                log(f"  failed: {type(e).__name__}: {str(e)[:200]}")
            return None


# ---------------------------------------------------------------------------------------------


CHECK_CASES = [  # rows, cols, bits, group: tiny, odd-width, and real shapes
    (64, 32, 2, 16), (128, 96, 3, 64), (64, 48, 4, 32), (256, 64, 8, 64), (16, 40, 4, 8),
    (512, 1000, 2, 32), (1024, 4096, 3, 64), (4096, 1024, 4, 64), (192, 2048, 2, 16),
    (14336, 4096, 2, 16), (4096, 14336, 3, 64), (4096, 4096, 8, 64), (1024, 4096, 4, 64)]
META_KINDS = [("8bit", True, 128, None), ("8bit M=n/3|1, zero M=1", True, 3, 1 << 40),
              ("fp16", False, 0, None)]


def check(R: Runner, log=print) -> list[dict]:
    """Fused vs the reference (and float64) on fresh random inputs, all kernels."""
    out = []
    for rows, cols, bits, g in CHECK_CASES:
        for mname, meta8, mg, zmg in META_KINDS:
            qm = random_qmatrix(rows, cols, bits, g, meta8, mg or 128, zmg, "cuda")
            W64 = None if R.warm else dequantize(qm, torch.float64)
            for T in (1, 8, 128):
                for dtype in (torch.bfloat16, torch.float16):
                    x = torch.randn(T, cols, device="cuda").to(dtype)
                    y = torch.full((T, rows), float("nan"), device="cuda", dtype=dtype)
                    if not R.call(lambda: K.qlinear(x, qm, "fused", out=y)) or R.warm:
                        continue
                    torch.cuda.synchronize()
                    ref64 = x.double() @ W64.T
                    ref = K.qlinear(x, qm, "reference")
                    r = dict(rows=rows, cols=cols, bits=bits, g=g, meta=mname, T=T,
                             dtype=str(dtype)[6:], err_vs_ref=rel_err(y, ref),
                             err_vs_f64=rel_err(y, ref64), ref_vs_f64=rel_err(ref, ref64),
                             nan=bool(torch.isnan(y).any()))
                    r["ok"] = not r["nan"] and r["err_vs_ref"] <= 1e-2 and r["err_vs_f64"] <= 1e-2
                    out.append(r)
                    if not r["ok"]:
                        log(f"FAIL {r}")
            d = torch.full((rows, cols), float("nan"), device="cuda")
            if R.call(lambda: K.dequantize_fused(qm, torch.float32, out=d)) and not R.warm:
                e = rel_err(d, W64)
                out.append(dict(rows=rows, cols=cols, bits=bits, g=g, meta=mname, kernel="dequant",
                                err_vs_f64=e, ok=e <= 1e-6))
                if e > 1e-6:
                    log(f"FAIL dequantize_fused {rows}x{cols} {bits}-bit {mname}: {e:.2e}")
    if not R.warm:
        bad = sum(not r["ok"] for r in out)
        worst = max(r["err_vs_f64"] for r in out)
        worst_ref = max(r.get("ref_vs_f64", 0) for r in out)
        log(f"check: {len(out)} cases, {bad} failed; worst error vs float64: fused {worst:.2e}, "
            f"reference {worst_ref:.2e}")
    return out


def gemv_variants(bits: int, g: int, sms: int) -> list[dict]:
    """The GEMV sweep: inner loop x row parts x vector width x programs in flight (num_stages does not
    matter: Triton does not pipeline loads that feed no tl.dot; 8 warps lost in run 1)."""
    out = []
    for h2 in (True, False):  # packed fp16 (KV = 8 only) or float32 inner loop
        for nq in (1, 2, 4, 8):
            if nq > K._max_nq(bits, g):
                continue
            for kv in (8,) if h2 else (4, 8):
                for programs in (2, 4, 8):
                    out.append(dict(BJ=1, BKO=128, KV=kv, NQ=nq, programs=programs * sms, num_warps=4,
                                    H2=h2))
    return out


def gemm_variants(T: int, g: int, sms: int) -> list[dict]:
    out = []
    tiles = [(16, 128, 128), (16, 64, 128)] if T <= 16 else [(32, 128, 64)] if T <= 32 else \
        [(64, 128, 64), (64, 64, 64)]
    for bt, bn, bk in tiles:
        for warps, stages in ((4, 2), (8, 3)):
            for programs in (1, 2):
                out.append(dict(BT=bt, BJ=max(1, bn // g), BK=bk, programs=programs * sms,
                                num_warps=warps, num_stages=stages))
    return out


def bench(R: Runner, quick: bool = False, sweep_all: bool = True, log=print,
          prefill_too: bool = True) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results, n_rot = [], 4  # 4 matrices of >= 22 MB rotate (L2 is 60 MB), on top of do_bench's flush
    combos = [(s, b) for s in ("w1 14336x4096", "w2 4096x14336") for b in (2, 3, 4)]
    if not quick:
        combos += [("q 4096x4096", 4), ("q 4096x4096", 8), ("kv 1024x4096", 4)]
    for name, bits in combos:
        rows, cols = SHAPES[name]
        g, mg = SPECS[bits]
        expert = name[:2] in ("w1", "w2")
        for meta8 in (True, False):
            qms = [random_qmatrix(rows, cols, bits, g, meta8, mg, None, "cuda") for _ in range(n_rot)]
            xs = [torch.randn(1, cols, device="cuda", dtype=torch.bfloat16) for _ in range(n_rot)]
            ys = [torch.empty(1, rows, device="cuda", dtype=torch.bfloat16) for _ in range(n_rot)]
            nbytes = bytes_moved(qms[0], 1)
            sweep = expert and meta8 and sweep_all
            # without the sweep the default config is timed twice: the spread is the noise
            variants = [None] + (gemv_variants(bits, g, sms) if sweep else [None])
            ref = [None if R.warm else K.qlinear(xs[i], qms[i], "reference") for i in range(n_rot)]
            best, us_default = None, None
            for cfg in variants:
                it = itertools.count()

                def run(cfg=cfg, it=it):
                    i = next(it) % n_rot
                    K.gemv(xs[i], qms[i], ys[i], cfg)
                us = R.time(run, 100 if sweep else 300)
                if us is None:
                    continue
                cfg_used = cfg or K.gemv_config(rows, cols, bits, g, sms)
                err = max(rel_err(ys[i], ref[i]) for i in range(n_rot))  # every variant checked
                if err > 1e-2:
                    log(f"  FAIL {name} {bits}-bit {cfg_used}: error {err:.2e}")
                    continue
                if sweep:
                    results.append(dict(kind="gemv-sweep", shape=name, bits=bits, cfg=cfg_used, us=us,
                                        err=err))
                if cfg is None:
                    us_default = us if us_default is None else us_default
                    if not sweep:
                        results.append(dict(kind="gemv-repeat", shape=name, bits=bits,
                                            meta="8bit" if meta8 else "fp16", us=us))
                if best is None or us < best[0]:
                    best = (us, cfg_used, cfg is None)
            if best is not None:
                r = dict(kind="gemv", shape=name, bits=bits, g=g, meta="8bit" if meta8 else "fp16",
                         us=best[0], GBps=nbytes / best[0] / 1e3, MB=nbytes / 1e6, cfg=best[1],
                         default_us=us_default if us_default is not None else float("nan"),
                         target_us=TARGET_US.get(bits) if expert else None)
                # host cost of one qlinear call (Python + launch), the GPU never the bottleneck
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    K.qlinear(xs[0], qms[0], "fused", out=ys[0])
                r["host_us"] = (time.perf_counter() - t0) / 200 * 1e6
                torch.cuda.synchronize()
                results.append(r)
                log(f"gemv {name} {bits}-bit {r['meta']}: best {best[0]:.1f} us {r['GBps']:.0f} GB/s "
                    f"({r['MB']:.1f} MB), default cfg {r['default_us']:.1f} us, host {r['host_us']:.0f} us/call; "
                    f"best cfg {best[1]}")
            if meta8 and expert and prefill_too:
                results += prefill(R, name, qms, bits, g, sms, n_rot, sweep_all, log)
            qms = None  # frees the matrices before the next width
    return results


def prefill(R, name, qms, bits, g, sms, n_rot, sweep, log) -> list[dict]:
    """T > 1: the fused GEMM (variants), dequantize + cuBLAS, plain bf16 cuBLAS, and qlinear
    (which picks one of the first two by T)."""
    rows, cols = SHAPES[name]
    out = []
    for T in ((8, 32, 64, 128) if sweep else (8, 16, 32, 128)):
        xt = [torch.randn(T, cols, device="cuda", dtype=torch.bfloat16) for _ in range(n_rot)]
        yt = [torch.empty(T, rows, device="cuda", dtype=torch.bfloat16) for _ in range(n_rot)]
        it = itertools.count()
        best, default_us = None, None
        for cfg in [None] + (gemm_variants(T, g, sms) if sweep else []):
            def run_gemm(cfg=cfg):
                i = next(it) % n_rot
                K.gemm(xt[i], qms[i], yt[i], cfg)
            us = R.time(run_gemm)
            if us is not None and (best is None or us < best[0]):
                best = (us, cfg or K.gemm_config(T, rows, cols, bits, g, sms))
            if us is not None and cfg is None:
                default_us = us

        def run_dq():
            i = next(it) % n_rot
            torch.matmul(xt[i], K.dequantize_fused(qms[i], torch.bfloat16).T, out=yt[i])

        def run_dq_only():
            K.dequantize_fused(qms[next(it) % n_rot], torch.bfloat16)
        def run_qlinear():
            i = next(it) % n_rot
            K.qlinear(xt[i], qms[i], "fused", out=yt[i])
        t_dq, t_dq_only, t_q = R.time(run_dq), R.time(run_dq_only), R.time(run_qlinear)
        if R.warm or best is None:
            continue
        K.gemm(xt[0], qms[0], yt[0], best[1])
        err = rel_err(yt[0], K.qlinear(xt[0], qms[0], "reference"))
        wd = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        t_dense = R.time(lambda: torch.matmul(xt[0], wd.T, out=yt[0]))
        wd = None
        default_us = float("nan") if default_us is None else default_us
        r = dict(kind="prefill", shape=name, bits=bits, T=T, gemm_us=best[0], gemm_default_us=default_us,
                 gemm_cfg=best[1], dequant_cublas_us=t_dq, dequant_only_us=t_dq_only, dense_bf16_us=t_dense,
                 gemm_tflops=2 * T * rows * cols / best[0] / 1e6, gemm_err=err, qlinear_us=t_q)
        out.append(r)
        log(f"prefill {name} {bits}-bit T={T}: fused gemm {best[0]:.1f} us (default cfg {default_us:.1f}, "
            f"{r['gemm_tflops']:.0f} TFLOP/s) best {best[1]}; dequant+cuBLAS {t_dq:.1f} "
            f"(dequant alone {t_dq_only:.1f}); dense bf16 cuBLAS {t_dense:.1f}; qlinear {t_q:.1f}")
    return out


def profile(bench_json: str) -> None:
    """One launch of each expert matrix's best GEMV config from a bench run (for ncu)."""
    best = {}
    for r in json.load(open(bench_json))["bench"]:
        if r["kind"] == "gemv" and r["meta"] == "8bit" and r["target_us"]:
            best[(r["shape"], r["bits"])] = r["cfg"]
    for (name, bits), cfg in best.items():
        rows, cols = SHAPES[name]
        qm = random_qmatrix(rows, cols, bits, SPECS[bits][0], True, SPECS[bits][1], None, "cuda")
        x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, rows, device="cuda", dtype=torch.bfloat16)
        K.gemv(x, qm, y, cfg)
        torch.cuda.synchronize()
        print(f"profiled {name} {bits}-bit {cfg}", flush=True)


def variance(reps: int = 4, log=print) -> list[dict]:
    """The same default GEMV timed on fresh allocations, twice each, with the SM clock: tells
    run-to-run (allocation) spread from back-to-back (temporal) spread."""
    from triton.testing import do_bench
    out = []
    for rep in range(reps):
        for name, bits in (("w1 14336x4096", 2), ("w2 4096x14336", 2), ("w2 4096x14336", 3)):
            rows, cols = SHAPES[name]
            g, mg = SPECS[bits]
            qm = random_qmatrix(rows, cols, bits, g, True, mg, None, "cuda")
            x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(1, rows, device="cuda", dtype=torch.bfloat16)
            run = lambda: K.gemv(x, qm, y)  # noqa: E731
            run()
            us = [do_bench(run, warmup=20, rep=100, return_mode="median") * 1000 for _ in range(2)]
            try:
                mhz = torch.cuda.clock_rate()
            except Exception:  # noqa: BLE001 - pynvml may be missing
                mhz = -1
            r = dict(rep=rep, shape=name, bits=bits, us=us, sm_mhz=mhz,
                     plane_mb_offset=(qm.planes[0].data_ptr() % (1 << 30)) / (1 << 20))
            out.append(r)
            log(f"{rep} {name} {bits}-bit: {us[0]:.1f} / {us[1]:.1f} us, SM {mhz} MHz, "
                f"plane at {r['plane_mb_offset']:.1f} MiB mod 1 GiB")
            qm = None
    return out


def moe_timing(log=print, sweep: bool = False) -> list[dict]:
    """One token through one Mixtral layer's 2 routed experts (6 matrices): kernels.moe_decode
    (2 launches) against the same 6 matrices as single GEMVs (the per-expert path's kernels)."""
    from triton.testing import do_bench

    from moeferry.engine.measure import bench
    from moeferry.engine.storage import store
    out = []
    for bits in (2, 3, 4):
        cfg = bench.ModelConfig(**{**bench.MIXTRAL, "num_layers": 1})
        es = QUANT_SPECS[bits]
        eq = {"bits": bits, "group_size": es.group_size, "meta_group": es.meta_group}
        gen = torch.Generator(device="cuda").manual_seed(bits)
        fields, stride = store.expert_layout(cfg, eq)
        slots = torch.stack([bench.random_expert(cfg, es, fields, stride, "cuda", gen)
                             for _ in range(cfg.num_experts)])
        views = [bench.expert_views(cfg, fields, eq)(slot) for slot in slots]
        table = torch.arange(cfg.num_experts, dtype=torch.int32, device="cuda")
        ids = torch.tensor([3, 6], device="cuda")
        weights = torch.tensor([0.6, 0.4], device="cuda")
        h = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(h)
        grouped = do_bench(lambda: K.moe_decode(h, views[0], stride, ids, weights, table, y),
                           warmup=20, rep=200, return_mode="median") * 1000
        act = torch.randn(1, cfg.intermediate_size, device="cuda", dtype=torch.bfloat16)
        y1 = torch.empty_like(act)
        single = 0.0
        for e in (3, 6):
            for m, x, o in (("w1", h, y1), ("w3", h, y1), ("w2", act, y)):
                single += do_bench(lambda: K.gemv(x, views[e][m], o), warmup=20, rep=100,
                                   return_mode="median") * 1000
        nbytes = 2 * sum(views[0][m].nbytes() for m in store.EXPERT_MATRICES)
        r = dict(kind="moe", bits=bits, moe_decode_us=grouped, six_gemv_us=single, MB=nbytes / 1e6,
                 GBps=nbytes / grouped / 1e3)
        out.append(r)
        log(f"moe layer {bits}-bit (2 experts, {nbytes / 1e6:.0f} MB): moe_decode {grouped:.1f} us "
            f"({r['GBps']:.0f} GB/s); 6 single GEMVs {single:.1f} us")
        if sweep and bits in (2, 3):
            out += moe_sweep(bits, h, views, stride, ids, weights, table, y, log)
        slots = views = None
    return out


def moe_sweep(bits, h, views, stride, ids, weights, table, y, log=print) -> list[dict]:
    """moe_decode's up and down launch parameters, each varied with the other at its default;
    every variant checked against the default's result."""
    from triton.testing import do_bench
    sms = K._sm_count(h.device)
    w1, w2 = views[0]["w1"], views[0]["w2"]
    base = (K.gemv_config(w1.rows, w1.cols, bits, w1.group_size, sms),
            K.gemv_config(w2.rows, w2.cols, bits, w2.group_size, sms))
    K.moe_decode(h, views[0], stride, ids, weights, table, y, base)
    want = y.clone()
    out = []
    for which in (0, 1):
        w = (w1, w2)[which]
        for warps, kv, nq, progs in itertools.product((4, 8), (8, 16), (1, 2, 4), (2, 4, 8)):
            if nq > K._max_nq(bits, w.group_size) or (which == 0 and progs != 4):
                continue
            c = dict(base[which], BKO=32 * warps, KV=kv, NQ=nq, num_warps=warps, programs=progs * sms)
            cfg = (c, base[1]) if which == 0 else (base[0], c)
            try:
                K.moe_decode(h, views[0], stride, ids, weights, table, y, cfg)
                err = rel_err(y, want)
                us = do_bench(lambda: K.moe_decode(h, views[0], stride, ids, weights, table, y, cfg),
                              warmup=10, rep=60, return_mode="median") * 1000
            except Exception as e:  # noqa: BLE001 - a variant that does not compile or fit
                log(f"  sweep {bits}-bit {'up' if which == 0 else 'down'} {c}: {type(e).__name__}")
                continue
            r = dict(kind="moe-sweep", bits=bits, part="up" if which == 0 else "down", warps=warps,
                     KV=kv, NQ=nq, programs_per_sm=progs, us=us, err=err)
            out.append(r)
            log(f"  sweep {bits}-bit {r['part']} warps {warps} KV {kv} NQ {nq} programs {progs}xSM: "
                f"{us:.1f} us (err {err:.1e})")
    return out


def bench_gemlite(log=print) -> list[dict]:
    """gemlite 0.6 on the same shapes in its own format (groups along the input dimension;
    it has no 3-bit and no axis-0 grouping, so it cannot run our matrices at all)."""
    try:
        import gemlite
        from gemlite import DType, GemLiteLinear
    except Exception as e:  # noqa: BLE001 - report any import failure and go on
        log(f"gemlite not importable: {type(e).__name__}: {e}")
        return []
    from triton.testing import do_bench
    cfg = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
    out = []
    for use_cfg in (False, True):
        if use_cfg:
            try:
                GemLiteLinear.load_config(cfg)
            except Exception as e:  # noqa: BLE001
                log(f"gemlite h100 config: {e}")
                break
        for name in ("w1 14336x4096", "w2 4096x14336"):
            rows, cols = SHAPES[name]
            for bits, g in ((2, 32), (2, 64), (4, 64)):
                try:
                    gl = GemLiteLinear(bits, group_size=g, in_features=cols, out_features=rows,
                                       input_dtype=DType.BF16, output_dtype=DType.BF16)
                    wq = torch.randint(0, 2**bits, (rows, cols), device="cuda", dtype=torch.uint8)
                    sc = torch.rand(rows, cols // g, device="cuda", dtype=torch.bfloat16) * 0.02
                    zr = torch.rand(rows, cols // g, device="cuda", dtype=torch.bfloat16) * (2**bits - 1)
                    gl.pack(wq, sc, zr, None)
                    x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
                    t0 = time.perf_counter()
                    gl(x)
                    torch.cuda.synchronize()
                    first_s = time.perf_counter() - t0
                    us = do_bench(lambda: gl(x), warmup=20, rep=100, return_mode="median") * 1000
                    nbytes = rows * cols * bits // 8 + 2 * sc.numel() * 2 + 2 * (rows + cols)
                    out.append(dict(kind="gemlite", shape=name, bits=bits, g=g, h100_config=use_cfg,
                                    us=us, GBps=nbytes / us / 1e3, first_call_s=first_s))
                    log(f"gemlite {name} {bits}-bit g{g} (h100 config {use_cfg}): {us:.1f} us "
                        f"{nbytes / us / 1e3:.0f} GB/s (first call {first_s:.1f} s)")
                except Exception as e:  # noqa: BLE001
                    log(f"gemlite {name} {bits}-bit g{g} failed: {type(e).__name__}: {str(e)[:300]}")
    return out


def ceilings(log=print) -> dict:
    """Measured device-to-device copy bandwidth (read + write) and bf16 matmul rate."""
    from triton.testing import do_bench
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = do_bench(lambda: b.copy_(a), return_mode="median") * 1000
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us_mm = do_bench(lambda: m @ m, return_mode="median") * 1000
    r = dict(copy_GBps=2 * a.numel() / us / 1e3, bf16_TFLOPs=2 * 8192**3 / us_mm / 1e6)
    log(f"ceilings: copy {r['copy_GBps']:.0f} GB/s (read + write), bf16 matmul {r['bf16_TFLOPs']:.0f} TFLOP/s")
    return r


def print_table(res: dict, log=print) -> None:
    rep = {}
    for r in res.get("bench", []):
        if r["kind"] == "gemv-repeat":
            rep.setdefault((r["shape"], r["bits"], r["meta"]), []).append(f"{r['us']:.1f}")
    log("\n| matrix | bits | meta | us | GB/s | MB | target us | default cfg us (repeats) |")
    log("|---|---|---|---|---|---|---|---|")
    for r in res.get("bench", []):
        if r["kind"] == "gemv":
            reps = " / ".join(rep.get((r["shape"], r["bits"], r["meta"]), [f"{r['default_us']:.1f}"]))
            log(f"| {r['shape']} | {r['bits']} | {r['meta']} | {r['us']:.1f} | {r['GBps']:.0f} | "
                f"{r['MB']:.1f} | {r['target_us'] or '-'} | {reps} |")
    for r in res.get("bench", []):
        if r["kind"] == "prefill":
            log(f"prefill {r['shape']} {r['bits']}b T={r['T']}: fused {r['gemm_us']:.1f} / dequant+cuBLAS "
                f"{r['dequant_cublas_us']:.1f} / qlinear {r.get('qlinear_us') or float('nan'):.1f} / "
                f"dense bf16 {r['dense_bf16_us']:.1f} us")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="expert shapes only")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="default configs only, timed twice")
    ap.add_argument("--gemv-only", action="store_true", help="expert shapes, T = 1 only (no prefill)")
    ap.add_argument("--gemlite", action="store_true", help="also time gemlite 0.6 if importable")
    ap.add_argument("--warm", help="I/N: only compile the calls numbered I mod N")
    ap.add_argument("--json", help="write all results to this file")
    ap.add_argument("--profile", help="a bench JSON: launch its best GEMV configs once (for ncu)")
    ap.add_argument("--variance", action="store_true", help="time one kernel on fresh allocations")
    ap.add_argument("--moe", action="store_true", help="time one layer's routed experts (moe_decode)")
    ap.add_argument("--moe-sweep", action="store_true", help="--moe, and vary its launch parameters")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or not K.fused_available("cuda"):
        print("kernel_bench needs CUDA and Triton", file=sys.stderr)
        return 2
    if a.profile:
        profile(a.profile)
        return 0
    if a.variance:
        variance()
        return 0
    if a.moe or a.moe_sweep:
        res = moe_timing(sweep=a.moe_sweep)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    R = Runner(tuple(int(v) for v in a.warm.split("/")) if a.warm else None)
    log = (lambda s: None) if R.warm else (lambda s: print(s, flush=True))
    import triton
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    if not a.no_check:
        res["check"] = check(R, log)
    if not a.check_only:
        if not R.warm:
            res["ceilings"] = ceilings(log)
        res["bench"] = bench(R, a.quick or a.gemv_only, not a.no_sweep, log, not a.gemv_only)
        if a.gemlite and not R.warm:
            res["gemlite"] = bench_gemlite(log)
    if R.warm:
        return 0
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print_table(res, log)
    return 0 if all(r["ok"] for r in res.get("check", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
