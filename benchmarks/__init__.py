"""Developer tools: kernel, decode-step, conversion and planner benchmarks. Not shipped.

Run from the repository root, e.g. `python -m benchmarks.kernel_bench --moe`. The one
user-facing benchmark is `moeferry bench` (engine/measure/bench.py).
"""
