"""The CPU+GPU hybrid's figures (issue 16) in one process per bit-width, on the GPU machine.

    python3 benchmarks/hybrid_suite.py OUT.json 2     # 2-bit GPU experts
    python3 benchmarks/hybrid_suite.py OUT.json 4     # 4-bit GPU experts
    python3 benchmarks/hybrid_suite.py OUT.json 2g32  # 2-bit in groups of 32 (2.5 bits/weight)
    python3 benchmarks/hybrid_suite.py OUT.json 2g32u2  # the same, each expert cut into 2 units
    python3 benchmarks/hybrid_suite.py OUT.json 2 hybrid-12GiB    # only the runs named

Uniform routing (the headline), fused kernels, P=128, T=64. Each budget runs lru, full (cache +
prefetch) and hybrid (full + misses computed on the CPU from the stored HQQ bytes in place,
chosen per expert by the cost model) on one build, so the rows compare the same weights and
routing; 12GiB also runs the hybrid with prefetch 0 and 2, and the desktop stand-in (copies
paced to 25 GB/s, 8 CPU threads); "none" (every expert resident) checks nothing got slower. Writes the reports as one
JSON list and prints their markdown tables.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.routing_suite import run_all  # noqa: E402
from moeferry.engine.measure import bench  # noqa: E402

LADDER = ("lru", "full", "hybrid")
RUNS = {
    "2": [("hybrid-12GiB", "12GiB", LADDER, bench.Conditions(), None),
          ("hybrid-12GiB-prefetch0", "12GiB", ("hybrid",), bench.Conditions(), None, 0),
          ("hybrid-12GiB-prefetch2", "12GiB", ("full", "hybrid"), bench.Conditions(), None, 2),
          ("hybrid-12GiB-25GBps-8threads", "12GiB", LADDER, bench.Conditions(h2d_gbps=25.0), 8),
          ("hybrid-12GiB-25GBps-8threads-prefetch0", "12GiB", ("hybrid",), bench.Conditions(h2d_gbps=25.0), 8, 0),
          ("none", "none", ("lru",), bench.Conditions(), None),
          ("hybrid-8GiB", "8GiB", ("full", "hybrid"), bench.Conditions(), None),
          ("hybrid-16GiB", "16GiB", ("full", "hybrid"), bench.Conditions(), None)],
    "4": [("hybrid-12GiB-4bit", "12GiB", LADDER, bench.Conditions(), None),
          ("hybrid-12GiB-4bit-prefetch0", "12GiB", ("hybrid",), bench.Conditions(), None, 0),
          ("hybrid-12GiB-4bit-25GBps-8threads", "12GiB", LADDER, bench.Conditions(h2d_gbps=25.0), 8)],
    # 2-bit in groups of 32 rows: 2.5 bits per weight (Q2_K: 2.6), so a budget caches more experts
    "2g32": [("hybrid-12GiB-g32", "12GiB", LADDER, bench.Conditions(), None),
             ("hybrid-12GiB-g32-prefetch0", "12GiB", ("hybrid",), bench.Conditions(), None, 0),
             ("hybrid-12GiB-g32-25GBps-8threads", "12GiB", LADDER, bench.Conditions(h2d_gbps=25.0), 8),
             ("none-g32", "none", ("lru",), bench.Conditions(), None)],
    # the same, each expert cut into 2 units (--expert-units 2): one miss served by link and CPU at once
    "2g32u2": [("hybrid-12GiB-g32-u2", "12GiB", LADDER, bench.Conditions(), None),
               ("hybrid-12GiB-g32-u2-prefetch0", "12GiB", ("hybrid",), bench.Conditions(), None, 0),
               ("hybrid-12GiB-g32-u2-25GBps-8threads", "12GiB", LADDER, bench.Conditions(h2d_gbps=25.0), 8),
               ("hybrid-12GiB-g32-u2-25GBps-8threads-prefetch0", "12GiB", ("hybrid",), bench.Conditions(h2d_gbps=25.0), 8, 0),
               ("none-g32-u2", "none", ("lru",), bench.Conditions(), None)],
}


def main(out: str, width: str, only: list[str]) -> int:
    """width: a key of RUNS: the bits, then "g" and the group size where it is not the default,
    then "u" and the units per expert where experts are cut."""
    bits, group, units = re.fullmatch(r"(\d)(?:g(\d+))?(?:u(\d+))?", width).groups()
    reports = run_all(int(bits), [r for r in RUNS[width] if not only or r[0] in only], int(group) if group else None,
                      int(units or 1))
    Path(out).write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
