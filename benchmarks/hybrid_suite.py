"""The CPU+GPU hybrid's figures (issue 16) in one process per expert width, on the GPU machine.

    python3 benchmarks/hybrid_suite.py OUT.json 2g32      # 2-bit in groups of 32 (2.5 bits/weight)
    python3 benchmarks/hybrid_suite.py OUT.json 2g32u2    # the same, each expert cut into 2 units
    python3 benchmarks/hybrid_suite.py OUT.json 4         # 4-bit experts (default groups)
    python3 benchmarks/hybrid_suite.py OUT.json 2g32 12GiB-p0 none   # only the runs named

The width: the bits, then "g" and the group size where it is not the default, then "u" and
the units per expert where experts are cut (one miss can then go partly over the link and
partly to the CPU). Uniform routing (the headline), fused kernels, P=128, T=64, on one build,
so the rows compare the same weights and routing: lru (cache only) beside hybrid (misses
computed on the CPU from the stored HQQ bytes in place where that finishes first) with
prefetch 0 (and the hybrid with 15 and 14 of the 16 cores), full (cache + prefetch) beside hybrid
with prefetch 1, the same on the desktop stand-in (copies paced to 25 GB/s, 8 CPU threads),
and "none" (every expert resident).
Writes the reports as one JSON list and prints their markdown tables.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.routing_suite import run_all  # noqa: E402
from moeferry.engine.measure import bench  # noqa: E402

DESKTOP = bench.Conditions(h2d_gbps=25.0)
# (name, budget, modes, conditions, CPU threads or None, prefetch depth)
RUNS = [("12GiB-p0", "12GiB", ("lru", "hybrid"), bench.Conditions(), None, 0),
        ("12GiB-p1", "12GiB", ("full", "hybrid"), bench.Conditions(), None, 1),
        ("12GiB-p0-15threads", "12GiB", ("hybrid",), bench.Conditions(), 15, 0),
        ("12GiB-p0-14threads", "12GiB", ("hybrid",), bench.Conditions(), 14, 0),
        ("desktop-p0", "12GiB", ("lru", "hybrid"), DESKTOP, 8, 0),
        ("desktop-p1", "12GiB", ("full", "hybrid"), DESKTOP, 8, 1),
        ("none", "none", ("lru",), bench.Conditions(), None, 0)]


def main(out: str, width: str, only: list[str]) -> int:
    bits, group, units = re.fullmatch(r"(\d)(?:g(\d+))?(?:u(\d+))?", width).groups()
    reports = run_all(int(bits), [r for r in RUNS if not only or r[0] in only], int(group) if group else None,
                      int(units or 1))
    Path(out).write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
