"""Where a resident decoded token's time goes, on the GPU machine: the host's share between
tokens, and the GPU kernels of the token's CUDA graph alone (no prompt, no warm-up).

    python3 benchmarks/token_anatomy.py OUT.md gpt-oss-20b qwen3-30b-a3b:4 mixtral-8x7b:2

MODEL[:BITS] as `bench --model` takes it (gpt-oss: its MXFP4), every expert resident (one CUDA
graph per token), uniform routing. For each model:
- the bench's decode loop (model.forward, then argmax and its read), ms per token, the token
  sent from the host and, taking turns with it, made on the device first (the loop before);
- the host loop's median token split at its launch (the call, then the wait for the token), and
  cProfile's top functions over 32 tokens; the least a host loop can do (no routing step, no
  checks), timed the same way;
- the token's graph replayed back to back with nothing between (CUDA events): the GPU's floor;
  the difference is what the host adds between tokens;
- torch.profiler over 8 back-to-back replays: the graph's kernels by GPU time.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeferry.engine.measure import bench  # noqa: E402
from moeferry.engine.runtime.decode_graphs import use_cuda_graphs  # noqa: E402

PROMPT, TOKENS, REPLAYS = 16, 64, 64


def anatomy(spec: str) -> list[str]:
    name, _, bits = spec.partition(":")
    s = bench.build(None, int(bits or 4), 4, log=lambda m: None, model=name)
    cfg, dev = s.cfg, s.device
    model = s.model("lru", cfg.num_experts, 0, "fused")
    model.routing = bench.Conditions().routing_source(cfg, dev, 1)
    model.setup_kv(PROMPT + 3 * TOKENS + REPLAYS + 8)
    use_cuda_graphs(model)
    model.graphs.prepare(PROMPT + 3 * TOKENS + REPLAYS + 8)
    model.routing.reserve(PROMPT, 3 * TOKENS + 8)  # the routing's tables drawn now, as the bench does
    tok = int(model.forward(torch.arange(PROMPT, device=dev), 0)[-1].argmax())

    def loop(n: int, start: int, on: torch.device | None = None) -> float:
        """ms per token of the decode loop, the token sent from the host (the engine's loop) or
        made on the device `on` first (its loop before 2026-12-07)."""
        nonlocal tok
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(n):
            tok = int(model.forward(torch.tensor([tok], device=on), start + i)[-1].argmax())
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    loop(8, PROMPT)  # warm
    old = [loop(TOKENS // 2, PROMPT + 8, dev)]
    new = [loop(TOKENS // 2, PROMPT + 8)]
    old.append(loop(TOKENS // 2, PROMPT + 8, dev))
    new.append(loop(TOKENS // 2, PROMPT + 8))
    per_token, before = min(new), min(old)
    start = PROMPT + 8 + 2 * TOKENS
    marks = []  # per token: host clock at the call, once the graph is launched, once the token is read
    for i in range(TOKENS // 2):
        t0 = time.perf_counter()
        logits = model.forward(torch.tensor([tok]), start + i)
        t1 = time.perf_counter()
        tok = int(logits[-1].argmax())
        marks.append((t0, t1, time.perf_counter()))
    launch = sorted(b - a for a, b, _ in marks)[len(marks) // 2]
    wait = sorted(c - b for _, b, c in marks)[len(marks) // 2]
    prof_py = cProfile.Profile()
    prof_py.enable()
    loop(TOKENS // 2, start + TOKENS // 2)
    prof_py.disable()
    py = io.StringIO()
    pstats.Stats(prof_py, stream=py).sort_stats("tottime").print_stats(14)
    graph = model.graphs.graphs[("token", model.graphs.is_forced())]
    g, step = model.graphs, model.graphs.s

    def bare(n: int, start: int) -> float:
        """ms per token of the least a host loop does: the token's row (or id) up, its position,
        the graph, the argmax read; no routing step, no check, no copy of the logits."""
        nonlocal tok
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(n):
            if model.embed_on_host:
                model.embed_into(step, torch.tensor([tok]))
            else:
                step.tokens.copy_(torch.tensor([tok]), non_blocking=True)
            g.pos.fill_(start + i)
            graph.replay()
            tok = int(g.logits[-1].argmax())
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    least = min(bare(TOKENS // 2, start), bare(TOKENS // 2, start))
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(REPLAYS):
        graph.replay()
    b.record()
    b.synchronize()
    gpu = a.elapsed_time(b) / 1e3 / REPLAYS
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / 8
    lines = [f"## {spec}: {1 / per_token:.2f} tok/s in the bench's loop ({per_token * 1e3:.3f} ms a token); "
             f"the graph back to back {gpu * 1e3:.3f} ms ({1 / gpu:.2f} tok/s); the host adds "
             f"{(per_token - gpu) * 1e6:.0f} us a token (the token made on the device first, as before: "
             f"{before * 1e3:.3f} ms, {1 / before:.2f} tok/s)",
             f"the least host loop (row up, position, graph, argmax read): {least * 1e3:.3f} ms a token",
             f"median per token: {launch * 1e6:.0f} us from the call to the graph's launch (forward), then "
             f"{wait * 1e6:.0f} us until the token is read (argmax and its read)",
             "host functions of 32 tokens of the loop (cProfile, by own time):", "```",
             *[line for line in py.getvalue().splitlines() if line.strip()][-18:], "```",
             f"kernels of one token's graph (profiled, {total / 1e3:.3f} ms of kernels a token):",
             "| kernel | calls a token | us per call | us a token | share |", "|---|---|---|---|---|"]
    for e in sorted(events, key=lambda e: -e.device_time_total)[:24]:
        lines.append(f"| {e.key[:90]} | {e.count / 8:.0f} | {e.device_time_total / e.count:.1f} | "
                     f"{e.device_time_total / 8:.1f} | {e.device_time_total / 8 / total:.1%} |")
    model.graphs = None
    return lines


def main(out: str, *specs: str) -> int:
    text = []
    for spec in specs:
        text += anatomy(spec) + [""]
        print("\n".join(text[-30:]), flush=True)
        torch.cuda.empty_cache()
    Path(out).write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
