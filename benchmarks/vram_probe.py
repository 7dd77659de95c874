"""Developer benchmark (GPU machine): what the GPU holds at the peak of a budgeted run.

    python3 benchmarks/vram_probe.py [MODEL] [BUDGET] [BITS]     # default: qwen3-30b-a3b 12GiB 4

Runs `moeferry bench`'s lru decode (uniform routing, fused kernels, P=128, T=64) with torch's
allocator history on, then replays the history to the moment the most bytes were allocated
and prints what was alive then, summed by the innermost engine frame that allocated it, beside
engine/runtime/vram.py's sizing (dense + KV cache + workspace + cache slots). It answers where
a run goes over its budget when the sizing does not foresee something.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeferry.engine.measure import bench  # noqa: E402
from moeferry.engine.runtime import vram  # noqa: E402

PROMPT, NEW = 128, 64


def where(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "moeferry" in name or "/engine/" in name:
            return f"{name.split('/engine/')[-1]}:{f.get('line')} {f.get('name')}"
    return frames[0].get("filename", "?").rsplit("/", 1)[-1] + f":{frames[0].get('line')}" if frames else "?"


def live_at_peak(trace: list[dict]) -> tuple[int, dict[int, dict]]:
    live, total, peak, at_peak = {}, 0, 0, {}
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    return peak, at_peak


def main() -> int:
    model, budget, bits = (sys.argv[1:] + ["qwen3-30b-a3b", "12GiB", "4"][len(sys.argv) - 1:])[:3]
    s = bench.build(None, int(bits), 4, model=model)
    dev = s.device
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    report = bench.measure(s, budget, PROMPT, NEW, ("lru",), ("fused",), 0, log=print, cond=bench.Conditions())
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [ev for t in snap["device_traces"] for ev in t]
    peak, alive = live_at_peak(trace)
    cfg = s.cfg
    k = report["cache_experts"]
    sizing = {"dense": s.dense_bytes,
              "kv": vram.kv_cache_bytes(cfg.num_layers, PROMPT + NEW, cfg.num_kv_heads, cfg.head_dim),
              "workspace": vram.workspace_bytes(cfg.hidden_size * cfg.intermediate_size),
              "slots": k * cfg.num_moe_layers * s.host.shape[2]}
    print(f"budget {budget} = {bench.parse_size(budget) / 2**30:.3f} GiB; sizing (GiB): "
          + ", ".join(f"{n} {v / 2**30:.3f}" for n, v in sizing.items())
          + f"; sum {sum(sizing.values()) / 2**30:.3f}")
    print(f"allocated before the run {base / 2**30:.3f} GiB; peak of the run {report['results'][0]['peak_vram_bytes'] / 2**30:.3f} GiB;"
          f" trace events {len(trace)}; most allocated during the run (trace) {peak / 2**30:.3f} GiB")
    by = Counter()
    for ev in alive.values():
        by[where(ev.get("frames", []))] += ev["size"]
    for place, n in by.most_common(25):
        print(f"  {n / 2**20:10.1f} MiB  {place}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
