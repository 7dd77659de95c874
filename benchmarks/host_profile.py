"""Where the host's Python goes while decoding under a VRAM budget: cProfile of the decoded
tokens only (not the build, the prompt or the graph captures), per mode, on the GPU machine.

    python3 benchmarks/host_profile.py OUT.txt 2g32u4                  # 12 GiB, lru then hybrid
    python3 benchmarks/host_profile.py OUT.txt 2g32u4 12GiB desktop    # and copies paced to 25 GB/s, 8 threads
    python3 benchmarks/host_profile.py OUT.txt qwen3-30b-a3b:4         # another bench shape, HQQ 4-bit (MODES=lru: lru alone)

The width as in benchmarks/hybrid_suite.py (Mixtral's shape), or MODEL[:BITS] as `bench --model`
takes it (gpt-oss: its MXFP4). cProfile slows Python down (about 2x), so the
tok/s of these runs are not figures; what counts is where the host's share goes, by function
(own time and cumulative), written to OUT.txt and its head printed.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeferry.engine.measure import bench  # noqa: E402
from moeferry.engine.runtime.model import OffloadedMixtral  # noqa: E402


def main(out: str, width: str, *wheres: str) -> int:
    if width[0].isdigit():
        bits, group, units = re.fullmatch(r"(\d)(?:g(\d+))?(?:u(\d+))?", width).groups()
        s = bench.build(32, int(bits), 4, log=lambda m: None, group_size=int(group) if group else None,
                        expert_units=int(units or 1))
    else:
        model, _, bits = width.partition(":")
        s = bench.build(None, int(bits or 4), 4, log=lambda m: None, model=model)
    forward, profiler = OffloadedMixtral.forward, [None]

    def profiled(self, tokens, start, last_only=True):
        if tokens.shape[0] != 1 or profiler[0] is None or self.cache.policy != "lru":  # not the warm-ups
            return forward(self, tokens, start, last_only)
        profiler[0].enable()
        try:
            return forward(self, tokens, start, last_only)
        finally:
            profiler[0].disable()

    OffloadedMixtral.forward = profiled
    text, threads = [], torch.get_num_threads()
    for where, mode in ((w, m) for w in wheres or ("12GiB",) for m in os.environ.get("MODES", "lru,hybrid").split(",")):
        cond = bench.Conditions(h2d_gbps=25.0) if where == "desktop" else bench.Conditions()
        torch.set_num_threads(8 if where == "desktop" else threads)
        profiler[0] = cProfile.Profile()
        report = bench.measure(s, "12GiB", 128, 64, (mode,), ("fused",), 0, log=lambda m: None, cond=cond)
        r = report["results"][0]
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            stats = pstats.Stats(profiler[0], stream=buf).sort_stats(key)
            stats.print_stats(40)
            if key == "cumulative" and mode == "hybrid":  # what the CPU path's steps call
                stats.print_callees(r"cpu_experts.py:\d+\((run|add|start|compute|_down|_up|choose_in_time)\)")
            text.append(f"## {width} {where} {mode} ({r['decode_tokens_per_s']:.2f} tok/s under the profiler), "
                        f"by {key}\n{buf.getvalue()}")
        profiler[0] = None
        Path(out).write_text("\n".join(text))
        print(text[-2][:5000], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
