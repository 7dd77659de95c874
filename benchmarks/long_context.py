"""A resident token's time as the context grows, on the GPU machine.

    python3 benchmarks/long_context.py OUT.md gpt-oss-20b qwen3-30b-a3b:4

MODEL[:BITS] as `bench --model` takes it, every expert resident, uniform routing. For each
model, the greedy loop (model.decode_greedy, as the bench times it) decodes 32 tokens after
each of POSITIONS tokens of context, and torch.profiler gives the attention kernel's time a
call there. The attention kernel (decode.rope_attention) reads one query head's cached
positions in one program, one block after another, so its time grows with the context while
the rest of the token stays; the bench's P=128, T=64 never shows it. The cached keys and
values are not those of a real prompt (only their count matters to the time).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.token_anatomy import resident_model  # noqa: E402
from moeferry.engine.runtime.decode_graphs import use_cuda_graphs  # noqa: E402

POSITIONS, TOKENS = (128, 1024, 4096, 8192), 32


def at_lengths(spec: str) -> list[str]:
    capacity = max(POSITIONS) + 2 * TOKENS + 8
    model = resident_model(spec, capacity)
    use_cuda_graphs(model)
    model.graphs.prepare(capacity)
    model.routing.reserve(1, len(POSITIONS) * 2 * TOKENS + 8)
    lines = [f"## {spec}: ms a token of the greedy loop, every expert resident, after P tokens of context",
             "| P | ms a token | tok/s | attention kernel, us a call |", "|---|---|---|---|"]
    tok = 1
    for p in POSITIONS:
        tok = [tok, *model.decode_greedy(tok, p, 8)][-1]  # warm, and the routing's chunk in place
        torch.cuda.synchronize()
        t = time.perf_counter()
        tok = [tok, *model.decode_greedy(tok, p + 8, TOKENS)][-1]
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / TOKENS * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            tok = [tok, *model.decode_greedy(tok, p + 8 + TOKENS, 4)][-1]
            torch.cuda.synchronize()
        attention = [e for e in prof.key_averages() if "rope_attention" in e.key]
        us = attention[0].device_time_total / attention[0].count if attention else float("nan")
        lines.append(f"| {p} | {ms:.3f} | {1e3 / ms:.2f} | {us:.1f} |")
        print(lines[-1], flush=True)
    model.graphs = None
    return lines


def main(out: str, *specs: str) -> int:
    text = []
    for spec in specs:
        text += at_lengths(spec) + [""]
        torch.cuda.empty_cache()
    Path(out).write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
