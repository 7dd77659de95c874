"""Which GPU kernels a decoded token spends its time in, every expert resident: torch.profiler
over `bench`'s run on a synthetic full-size model (a 16-token prompt, then NEW_TOKENS tokens
with their warm-up: the prompt's kernels are in the totals too), kernels by total GPU time.

    python3 benchmarks/kernel_profile.py OUT.txt qwen3-30b-a3b:4 gpt-oss-20b mixtral-8x7b:2

MODEL[:BITS]: the bench shape and its HQQ expert bits (gpt-oss: its MXFP4). The profiler adds
a little host time per launch; the tok/s printed are not figures, the kernels' shares are.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeferry.engine.measure import bench  # noqa: E402

NEW_TOKENS = 32


def main(out: str, *models: str) -> int:
    text = []
    for spec in models:
        model, _, bits = spec.partition(":")
        s = bench.build(None, int(bits or 4), 4, log=lambda m: None, model=model)
        bench.measure(s, "none", 16, 8, ("lru",), ("fused",), 0, log=lambda m: None)  # warm: compiles, captures
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            report = bench.measure(s, "none", 16, NEW_TOKENS, ("lru",), ("fused",), 0, log=lambda m: None)
        r = report["results"][0]
        events = [e for e in prof.key_averages() if e.device_time_total > 0 and not e.key.startswith("Memcpy")]
        total = sum(e.device_time_total for e in events)
        lines = [f"## {spec}: {r['decode_tokens_per_s']:.2f} tok/s under the profiler; GPU kernels (copies left out: "
                 f"the cache's fill) {total / 1e3:.1f} ms in all",
                 "| kernel | calls | us per call | ms in all | share |", "|---|---|---|---|---|"]
        for e in sorted(events, key=lambda e: -e.device_time_total)[:25]:
            lines.append(f"| {e.key[:90]} | {e.count} | {e.device_time_total / max(e.count, 1):.1f} "
                         f"| {e.device_time_total / 1e3:.2f} | {e.device_time_total / total:.1%} |")
        text.append("\n".join(lines))
        print(text[-1], flush=True)
        del s
        torch.cuda.empty_cache()
    Path(out).write_text("\n\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
