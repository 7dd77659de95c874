"""`moeferry bench`: the offloading benchmark on a synthetic full-size Mixtral-8x7B.

Weights are generated directly in packed form (random codes, 8-bit scales/zeros in
realistic ranges), so a run starts in seconds. In ONE run, on the same weights and prompt,
it measures the paper's Table 2 ladder: naive (every expert copied on demand, synchronously,
no cache), lru (cache, no prefetch), full (cache + prefetch), each with the reference kernels
(dequantize then matmul) and the fused ones, under a VRAM budget that emulates a gaming GPU.

The bound for each mode: max(bytes moved per token / pinned bandwidth measured in this run,
resident compute time per token measured in this run with nothing moving).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import quant, store as store_mod
from engine.errors import UserError
from engine.expert_cache import ExpertCache
from engine.generate import fmt_bytes, parse_size, workspace_bytes
from engine.model import KVCache, ModelConfig, OffloadedMixtral

MIXTRAL = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
               num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, rms_norm_eps=1e-5, rope_theta=1e6,
               max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False)


@dataclass
class ModeResult:
    mode: str
    kernels: str
    cache_experts: int
    prefetch: int
    decode_tokens_per_s: float
    first_token_s: float
    hit_rate: float
    prefetch_precision: float
    prefetch_recall: float
    gb_per_token: float
    h2d_gb_per_s: float
    bound_ms_per_token: float
    achieved_ms_per_token: float
    achieved_over_bound: float
    peak_vram_bytes: int
    under_budget: bool


# ---------------------------------------------------------------------------------------------
# Synthetic weights in packed form


def random_qmatrix(rows: int, cols: int, spec: quant.QuantSpec, device, gen) -> quant.QMatrix:
    """Random codes; zeros anywhere in the code range and scales of 0.012-0.027 / (levels), as
    HQQ produces for weights of standard deviation ~0.01 (Mixtral's are 0.01-0.02): 0.004-0.009
    at 2-bit."""
    f = quant.field_shapes(rows, cols, spec)
    t = {k: torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
         for k, (dtype, shape) in f.items() if dtype == torch.uint8}
    levels = 2 ** spec.bits - 1
    t["scale_meta"] = torch.tensor([[6e-5 / levels], [-200.0]], dtype=torch.float16,
                                   device=device).expand(f["scale_meta"][1]).contiguous()
    t["zero_meta"] = torch.tensor([[levels / 255], [0.0]], dtype=torch.float16, device=device).expand(f["zero_meta"][1]).contiguous()
    return quant.QMatrix.from_tensors({"rows": rows, "cols": cols, "bits": spec.bits,
                                       "group_size": spec.group_size}, t)


def synthetic_model(cfg: ModelConfig, expert_bits: int, attn_bits: int, device, seed: int = 0):
    """(dense weights on device, host experts uint8 [L, E, stride] pinned, expert fields, quantization)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    es, as_ = quant.EXPERT_SPECS[expert_bits], quant.ATTN_SPECS[attn_bits]
    eq = {"bits": expert_bits, "group_size": es.group_size, "meta_group": es.meta_group}
    dtype = torch.bfloat16
    dense = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, device=device,
                                                      dtype=dtype, generator=gen) * 0.02,
             "model.norm.weight": torch.ones(cfg.hidden_size, device=device, dtype=dtype),
             "lm_head.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype,
                                           generator=gen) * 0.02}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        dense[p + "input_layernorm.weight"] = torch.ones(cfg.hidden_size, device=device, dtype=dtype)
        dense[p + "post_attention_layernorm.weight"] = torch.ones(cfg.hidden_size, device=device, dtype=dtype)
        dense[p + "block_sparse_moe.gate.weight"] = torch.randn(cfg.num_experts, cfg.hidden_size, device=device,
                                                                dtype=dtype, generator=gen) * 0.02
        for m in store_mod.ATTN_MATRICES:
            dense[p + f"self_attn.{m}.weight"] = random_qmatrix(*store_mod.attn_shape(cfg, m), as_, device, gen)
    dense_bytes = sum(w.nbytes() if isinstance(w, quant.QMatrix) else w.numel() * w.element_size()
                      for w in dense.values())
    fields, stride = store_mod.expert_layout(cfg, eq)
    host = torch.empty((cfg.num_layers, cfg.num_experts, stride), dtype=torch.uint8, pin_memory=True)
    for layer in range(cfg.num_layers):
        host[layer].copy_(torch.stack([random_expert(cfg, es, fields, stride, device, gen)
                                       for _ in range(cfg.num_experts)]))
    return dense, dense_bytes, host, fields, eq


def random_expert(cfg: ModelConfig, spec: quant.QuantSpec, fields: list[dict], stride: int, device,
                  gen) -> torch.Tensor:
    """One random expert packed as the store lays it out: uint8 [stride] on `device`."""
    buf = torch.zeros(stride, dtype=torch.uint8, device=device)
    tensors = {}
    for m in store_mod.EXPERT_MATRICES:
        qm = random_qmatrix(*store_mod.expert_shape(cfg, m), spec, device, gen)
        tensors.update({f"{m}.{k}": v for k, v in qm.tensors().items()})
    for f in fields:
        buf[f["offset"]:f["offset"] + f["nbytes"]] = tensors[f["name"]].contiguous().view(torch.uint8).reshape(-1)
    return buf


def expert_views(cfg: ModelConfig, fields: list[dict], eq: dict):
    """buf -> the QMatrix views (w1, w3, w2) of the expert packed in buf (an ExpertCache's make_views)."""
    return lambda buf: store_mod.view_expert(buf, fields, eq, cfg)


def pinned_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Host->device bytes/s from pinned memory (median of 5 copies of 1 GiB)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return nbytes / sorted(times[1:])[2]


# ---------------------------------------------------------------------------------------------
# Running one mode


def cache_size_for(budget: int | None, cfg, dense_bytes, stride, context, device, kernels="fused") -> int:
    fixed = (dense_bytes + KVCache.nbytes(cfg, context, torch.bfloat16)
             + workspace_bytes(cfg, torch.bfloat16, device, kernels))
    if budget is None:
        return cfg.num_experts
    k = (budget - fixed) // (cfg.num_layers * stride)
    if k < 1:
        raise UserError(f"A VRAM budget of {fmt_bytes(budget)} cannot hold the resident weights "
                        f"({fmt_bytes(fixed)}) and one expert per layer; raise --vram-budget.")
    return int(min(k, cfg.num_experts))


def run_mode(cfg, dense, host, fields, eq, device, policy, k, prefetch, kernels, prompt, new_tokens,
             graphs=True):
    torch.cuda.synchronize(device)
    gc.collect()  # the previous mode's cache and graphs
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    cache = ExpertCache(host, k, device, expert_views(cfg, fields, eq), policy=policy)
    model = OffloadedMixtral(cfg, dense, cache, device, torch.bfloat16, kernels)
    model.prefetch_depth = prefetch
    model.setup_kv(len(prompt) + new_tokens)
    model.use_cuda_graphs(graphs and kernels == "fused")  # the reference path stays eager, as HQQ's
    if model.graphs is not None:
        model.graphs.prepare(len(prompt) + new_tokens)  # captured before the clock starts
    t0 = time.perf_counter()
    logits = model.forward(torch.tensor(prompt, device=device), 0)
    tok = int(logits[-1].argmax())
    first = time.perf_counter() - t0
    before = asdict(cache.stats)
    t1 = time.perf_counter()
    for n in range(new_tokens - 1):
        logits = model.forward(torch.tensor([tok], device=device), len(prompt) + n)
        tok = int(logits[-1].argmax())
    torch.cuda.synchronize(device)
    decode = time.perf_counter() - t1
    after = asdict(cache.stats)
    d = {key: after[key] - before[key] for key in after}
    peak = torch.cuda.max_memory_allocated(device)
    model.graphs = None  # break the model <-> graphs cycle so the slots go now
    del model, cache
    return first, decode, d, peak


@dataclass
class Synthetic:
    cfg: ModelConfig
    dense: dict
    dense_bytes: int
    host: torch.Tensor
    fields: list
    eq: dict
    device: torch.device
    pinned_bytes_per_s: float
    expert_bits: int
    attn_bits: int


def build(layers: int = 32, expert_bits: int = 2, attn_bits: int = 4, seed: int = 0, log=print) -> Synthetic:
    if not torch.cuda.is_available():
        raise UserError("moeferry bench measures GPU offloading and needs a CUDA GPU; none is visible.")
    device = torch.device("cuda")
    cfg = ModelConfig(**{**MIXTRAL, "num_layers": layers})
    log(f"building a synthetic Mixtral-8x7B ({layers} layers, {expert_bits}-bit experts, {attn_bits}-bit attention)")
    t = time.perf_counter()
    dense, dense_bytes, host, fields, eq = synthetic_model(cfg, expert_bits, attn_bits, device, seed)
    log(f"  built in {time.perf_counter() - t:.1f} s; one expert = {host.shape[2] / 1e6:.1f} MB, "
        f"resident weights {fmt_bytes(dense_bytes)}")
    bw = pinned_bandwidth(device)
    log(f"  pinned host->device bandwidth: {bw / 1e9:.1f} GB/s")
    return Synthetic(cfg, dense, dense_bytes, host, fields, eq, device, bw, expert_bits, attn_bits)


def measure(s: Synthetic, vram_budget: str | None = "12GiB", prompt_len: int = 128, new_tokens: int = 64,
            modes=("naive", "lru", "full"), kernels=("reference", "fused"), prefetch: int = 1, seed: int = 0,
            log=print) -> dict:
    """The ladder under one budget, on the weights of `s`; a report (see markdown_table)."""
    cfg, device, bw = s.cfg, s.device, s.pinned_bytes_per_s
    budget = parse_size(vram_budget)
    stride = s.host.shape[2]
    # each kernel path gets the cache its workspace leaves room for under the budget
    ks = {kern: cache_size_for(budget, cfg, s.dense_bytes, stride, prompt_len + new_tokens, device, kern)
          for kern in kernels}
    k = max(ks.values())
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist()
    common = (cfg, s.dense, s.host, s.fields, s.eq, device)
    log(f"budget {vram_budget}: {ks} experts cached per layer, prompt {prompt_len}, {new_tokens} new tokens")
    compute = {}
    for kern in kernels:  # compile (Triton) and warm caches before anything is timed
        run_mode(*common, "no-copy", ks[kern], 0, kern, prompt, 4)
    for kern in kernels:  # resident compute time per token: nothing moves
        steps = min(new_tokens, 16)
        _, decode, _, _ = run_mode(*common, "no-copy", ks[kern], 0, kern, prompt, steps)
        compute[kern] = decode / (steps - 1)
        log(f"  resident compute per token ({kern}): {compute[kern] * 1e3:.2f} ms")
    results = []
    for mode in modes:
        for kern in kernels:
            policy = "naive" if mode == "naive" else "lru"
            kk = cfg.top_k if mode == "naive" else ks[kern]
            depth = prefetch if mode == "full" else 0
            first, decode, d, peak = run_mode(*common, policy, kk, depth, kern, prompt, new_tokens)
            steps = new_tokens - 1
            per_tok = decode / steps
            moved = d["bytes_h2d"] / steps
            uses = d["hits"] + d["misses"]
            bound = max(moved / bw, compute[kern])
            r = ModeResult(
                mode=mode, kernels=kern, cache_experts=kk, prefetch=depth,
                decode_tokens_per_s=steps / decode, first_token_s=first,
                hit_rate=d["hits"] / uses if uses else 0.0,
                prefetch_precision=d["prefetch_used"] / d["prefetch_issued"] if d["prefetch_issued"] else 0.0,
                prefetch_recall=(d["prefetch_used"] / (d["prefetch_used"] + d["misses"])
                                 if d["prefetch_used"] + d["misses"] else 0.0),
                gb_per_token=moved / 1e9, h2d_gb_per_s=d["bytes_h2d"] / decode / 1e9,
                bound_ms_per_token=bound * 1e3, achieved_ms_per_token=per_tok * 1e3,
                achieved_over_bound=per_tok / bound, peak_vram_bytes=peak,
                under_budget=budget is None or peak <= budget)
            results.append(r)
            log(f"  {mode:5s} {kern:9s} {r.decode_tokens_per_s:7.2f} tok/s  first token {first:.2f} s  "
                f"hits {r.hit_rate:.2f}  {r.gb_per_token:.2f} GB/token  peak {fmt_bytes(peak)}")
    return {
        "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(device),
        "layers": cfg.num_layers, "vram_budget": vram_budget, "vram_budget_bytes": budget,
        "expert_bits": s.expert_bits, "attn_bits": s.attn_bits, "prompt_len": prompt_len,
        "new_tokens": new_tokens, "expert_bytes": stride, "resident_bytes": s.dense_bytes,
        "pinned_gb_per_s": bw / 1e9, "cache_experts": k,
        "resident_compute_ms_per_token": {kk: v * 1e3 for kk, v in compute.items()},
        "results": [asdict(r) for r in results],
    }


def markdown_table(report: dict) -> str:
    lines = [f"Budget {report['vram_budget']}, {report['expert_bits']}-bit experts "
             f"({report['expert_bytes'] / 1e6:.1f} MB each), {report['attn_bits']}-bit attention, "
             f"{report['layers']} layers, P={report['prompt_len']}, T={report['new_tokens']}, "
             f"{report['cache_experts']} experts cached per layer, pinned H2D {report['pinned_gb_per_s']:.1f} GB/s, "
             f"{report['device']}, {report['date']}.", "",
             "| mode | kernels | decode tok/s | first token s | hit rate | prefetch prec/recall | GB/token "
             "| H2D GB/s | bound ms/tok | achieved ms/tok | achieved/bound | peak VRAM GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(
            f"| {r['mode']} | {r['kernels']} | {r['decode_tokens_per_s']:.2f} | {r['first_token_s']:.2f} | "
            f"{r['hit_rate']:.2f} | {r['prefetch_precision']:.2f}/{r['prefetch_recall']:.2f} | "
            f"{r['gb_per_token']:.2f} | {r['h2d_gb_per_s']:.1f} | {r['bound_ms_per_token']:.1f} | "
            f"{r['achieved_ms_per_token']:.1f} | {r['achieved_over_bound']:.2f} | "
            f"{r['peak_vram_bytes'] / 2**30:.2f}{'' if r['under_budget'] else ' (over!)'} |")
    return "\n".join(lines)


def cli_bench(argv: list[str]) -> int:
    if argv and argv[0] == "convert":
        from engine.convert_bench import cli_bench_convert
        return cli_bench_convert(argv[1:])
    p = argparse.ArgumentParser(prog="moeferry bench")
    p.add_argument("--layers", type=int, default=32, help="decoder layers to build (default 32, the full model)")
    p.add_argument("--vram-budget", default="12GiB",
                   help="e.g. 12GiB (RTX 3060), 16GiB, none; several, comma-separated, share one build")
    p.add_argument("--expert-bits", type=int, default=2, choices=(2, 3, 4), help="bits per expert weight")
    p.add_argument("--attn-bits", type=int, default=4, choices=(4, 8), help="bits per attention weight")
    p.add_argument("--prompt-len", default="128", help="one or several, comma-separated")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per measurement")
    p.add_argument("--modes", default="naive,lru,full", help="comma-separated: naive, lru, full (see docs/BENCHMARKS.md)")
    p.add_argument("--kernels", default="reference,fused", help="comma-separated: reference, fused")
    p.add_argument("--prefetch", type=int, default=1, help="layers ahead to prefetch experts (0 = off)")
    p.add_argument("--json", action="store_true", help="print the report(s) as JSON")
    p.add_argument("--json-dir", help="also write one JSON report per budget and prompt length here")
    a = p.parse_args(argv)
    if a.new_tokens < 2 or a.layers < 1:
        raise UserError("--new-tokens must be 2 or more and --layers 1 or more.")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    s = build(a.layers, a.expert_bits, a.attn_bits, log=log)
    reports = []
    for budget in a.vram_budget.split(","):  # one set of weights, several budgets: one build
        for plen in (int(x) for x in str(a.prompt_len).split(",")):
            r = measure(s, budget, plen, a.new_tokens, tuple(a.modes.split(",")), tuple(a.kernels.split(",")),
                        a.prefetch, log=log)
            reports.append(r)
            if a.json_dir:
                Path(a.json_dir).mkdir(parents=True, exist_ok=True)
                name = f"bench-{a.expert_bits}bit-{budget}-p{plen}.json"
                (Path(a.json_dir) / name).write_text(json.dumps(r, indent=1))
    if a.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=1))
    else:
        print("\n\n".join(markdown_table(r) for r in reports))
    return 0
