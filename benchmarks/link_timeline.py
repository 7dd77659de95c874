"""Does the link overlap the compute? The GPU's own timeline of decoded tokens under a VRAM budget.

    python3 benchmarks/link_timeline.py OUT.json qwen3-30b-a3b:4:1 mixtral-8x7b:2:1:32

MODEL:BITS:PREFETCH[:GROUP] on the benchmark's synthetic full-size model (uniform routing, 12 GiB,
fused kernels, CUDA graphs, a 128-token prompt and 8 warm tokens first). torch.profiler records
TOKENS decoded tokens; from the kernels' and the host->device copies' intervals on the GPU it
sums, over the recorded window: the time the GPU computes, the time the link copies, both,
neither, the compute's idle time while a copy runs (waiting for the link, or a copy the host
queued late) and while none does (waiting for the host), the bytes copied and the link's rate
while busy. The profiler adds host time per launch, so the window's tok/s is below bench's; the
split is the figure.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moeferry.engine.measure import bench  # noqa: E402
from moeferry.engine.runtime.decode_graphs import use_cuda_graphs  # noqa: E402
from moeferry.engine.runtime.generate import parse_size  # noqa: E402

PROMPT, WARM, TOKENS = 128, 8, 24


def main(out: str, *specs: str) -> int:
    results = {}
    for spec in specs:
        model_name, bits, depth, *group = spec.split(":")
        s = bench.build(None, int(bits), 4, log=lambda m: None, model=model_name,
                        group_size=int(group[0]) if group else None)
        results[spec] = timeline(s, int(depth))
        print(spec, json.dumps(results[spec]), flush=True)
        del s
        torch.cuda.empty_cache()
    Path(out).write_text(json.dumps(results, indent=1))
    return 0


def timeline(s, depth: int) -> dict:
    cfg, device = s.cfg, s.device
    context = PROMPT + WARM + TOKENS
    k, extra = bench.cache_size_for(parse_size("12GiB"), cfg, s.dense_bytes, s.host.shape[2], context, device)
    model = s.model("lru", k, depth, "fused", extra_slot_layers=extra)
    model.routing = bench.Conditions(routing="uniform").routing_source(cfg, device, max(depth, 1))
    model.setup_kv(context)
    use_cuda_graphs(model, True)
    model.graphs.prepare(context)
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0))
    tok = int(model.forward(prompt.to(device), 0)[-1].argmax())
    for n in range(WARM):
        tok = int(model.forward(torch.tensor([tok], device=device), PROMPT + n)[-1].argmax())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for n in range(WARM, WARM + TOKENS):
            tok = int(model.forward(torch.tensor([tok], device=device), PROMPT + n)[-1].argmax())
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("cat") == "kernel"]
    copies = [e for e in trace if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    h2d = [(e["ts"], e["ts"] + e["dur"]) for e in copies]
    h2d_bytes = sum(e.get("args", {}).get("bytes", 0) for e in copies)
    model.graphs = None
    return split(kernels, h2d, h2d_bytes, k)


def split(kernels: list, h2d: list, h2d_bytes: int, k: int) -> dict:
    """Per token (us): the union of kernel time, of copy time, their overlap and what is left."""
    start = min(a for a, _ in kernels + h2d)
    end = max(b for _, b in kernels + h2d)
    compute, link = union(kernels), union(h2d)
    both = union_len(intersect(compute, link))
    c, lk = union_len(compute), union_len(link)
    window = end - start
    per = 1 / TOKENS
    return {
        "cached_per_layer": k, "window_us_per_token": window * per, "compute_us_per_token": c * per,
        "link_us_per_token": lk * per, "both_us_per_token": both * per,
        "compute_idle_link_busy_us_per_token": (lk - both) * per,
        "neither_us_per_token": (window - c - lk + both) * per,
        "h2d_copies_per_token": len(h2d) * per, "h2d_mb_per_token": h2d_bytes * per / 1e6,
        "link_gb_per_s_while_busy": h2d_bytes / lk / 1e3 if lk else 0.0,
        "kernels_per_token": len(kernels) * per,
    }


def union(intervals: list) -> list:
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def intersect(x: list, y: list) -> list:
    i = j = 0
    out = []
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append([a, b])
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def union_len(intervals: list) -> float:
    return sum(b - a for a, b in intervals)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
