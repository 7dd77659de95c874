"""The figures of issue 15 in one process per bit-width (one synthetic build each): `moeferry
bench` under stated routing, on the GPU machine.

    python3 benchmarks/routing_suite.py OUT.json

2-bit experts: uniform routing at none, 8, 12 and 16 GiB (lru, full; naive too at 12GiB), the
demo's held-out trace mapped onto 32 layers at 12GiB, the model's own routing at 12GiB (only to
show its degeneracy), and 12GiB with copies paced to 25 GB/s on 8 CPU threads. 3-bit experts:
uniform at 12GiB. Fused kernels only. Writes every report (moeferry.engine.measure.bench.measure's JSON plus a
"name") as one JSON list, prints the markdown tables and the issue's acceptance checks
(uniform at 12GiB: lru hit ratio within 0.03 of k/E, guess recall within 0.05 of 0.85).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeferry.engine.measure import bench  # noqa: E402

TRACE = f"trace:{ROOT / 'benchmarks' / 'traces' / 'demo-heldout.safetensors'}"
LRU_FULL = ("lru", "full")
# (name, budget, modes, conditions, cpu threads or None)
RUNS_2BIT = [
    ("uniform-none", "none", LRU_FULL, bench.Conditions(), None),
    ("uniform-8GiB", "8GiB", LRU_FULL, bench.Conditions(), None),
    ("uniform-12GiB", "12GiB", ("naive", "lru", "full"), bench.Conditions(), None),
    ("uniform-16GiB", "16GiB", LRU_FULL, bench.Conditions(), None),
    ("trace-12GiB", "12GiB", LRU_FULL, bench.Conditions(routing=TRACE), None),
    ("model-12GiB", "12GiB", LRU_FULL, bench.Conditions(routing="model"), None),
    ("uniform-12GiB-25GBps-8threads", "12GiB", LRU_FULL, bench.Conditions(h2d_gbps=25.0), 8),
]
RUNS_3BIT = [("uniform-12GiB-3bit", "12GiB", LRU_FULL, bench.Conditions(), None)]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_all(bits: int, runs: list, group_size: int | None = None, expert_units: int = 1) -> list[dict]:
    s = bench.build(32, bits, 4, log=log, group_size=group_size, expert_units=expert_units)
    reports = []
    default_threads = torch.get_num_threads()
    for name, budget, modes, cond, threads, *depth in runs:  # depth: prefetch layers (default 1)
        t = time.perf_counter()
        torch.set_num_threads(threads or default_threads)
        report = bench.measure(s, budget, 128, 64, modes, ("fused",), depth[0] if depth else 1, log=log, cond=cond)
        reports.append({"name": name, "wall_s": round(time.perf_counter() - t, 1), **report})
        print(f"### {name}\n\n{bench.markdown_table(report)}\n", flush=True)
    torch.set_num_threads(default_threads)
    del s
    torch.cuda.empty_cache()
    return reports


def acceptance(reports: list[dict]) -> list[str]:
    r = next(x for x in reports if x["name"] == "uniform-12GiB")
    lines = []
    for res in r["results"]:
        want = res["cache_experts"] / 8
        if res["mode"] == "lru":
            ok = abs(res["hit_rate"] - want) <= 0.03
            verdict = "ok" if ok else "FAILED"
            lines.append(f"uniform 12GiB lru hit ratio {res['hit_rate']:.3f} vs k/E {want:.3f}: {verdict}")
        if res["mode"] == "full":
            got = res["guess_recall"].get(1, res["guess_recall"].get("1"))
            ok = got is not None and abs(got - 0.85) <= 0.05
            lines.append(f"uniform 12GiB guess recall {got:.3f} vs stated 0.85: {'ok' if ok else 'FAILED'}")
    return lines


def main(out: str) -> int:
    reports = run_all(2, RUNS_2BIT) + run_all(3, RUNS_3BIT)
    Path(out).write_text(json.dumps(reports, indent=1))
    checks = acceptance(reports)
    print("\n".join(checks))
    return 0 if all(line.endswith("ok") for line in checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "routing.json"))
