"""Where a resident decoded token's time goes, on the GPU machine: the host's share between
tokens, and the GPU kernels of the token's CUDA graph alone (no prompt, no warm-up).

    python3 benchmarks/token_anatomy.py OUT.md gpt-oss-20b qwen3-30b-a3b:4 mixtral-8x7b:2

MODEL[:BITS] as `bench --model` takes it (gpt-oss: its MXFP4), every expert resident (one CUDA
graph per token), uniform routing. For each model, three sets of graphs, each captured once,
taking turns: the engine's (the attention's k and v GEMVs beside q, decode.KV_BESIDE: two
branches of the graph; small q and o GEMVs in 2 row parts, hqq_gpu.SMALL_GEMV_NQ), k and v
after q, and the GEMVs in gemv_config's row parts:
- ms per token of the greedy loop that queues each token's graph before it reads the token
  before (model.decode_greedy: the bench's and the engine's loop), and of the loop that sends
  each token from the host and waits for its logits (model.forward, argmax, read);
- the token's graph replayed back to back with nothing between (CUDA events): the GPU's floor;
  the difference is what the host adds between tokens;
- torch.profiler over 8 back-to-back replays of the first set: the graph's kernels by GPU time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeferry.engine.kernels import decode, hqq_gpu  # noqa: E402
from moeferry.engine.measure import bench  # noqa: E402
from moeferry.engine.runtime.decode_graphs import GraphedDecode  # noqa: E402

PROMPT, TOKENS, REPLAYS, TURNS = 16, 32, 64, 2
SETS = {"engine": (True, 2), "k and v after q": (False, 2), "GEMVs in 4 row parts": (True, 0)}  # KV_BESIDE, SMALL_GEMV_NQ


def resident_model(spec: str, capacity: int):
    """The synthetic model of MODEL[:BITS] (as `bench --model` takes it) on the GPU, every expert
    resident, its routing uniform, its KV cache of `capacity` positions."""
    name, _, bits = spec.partition(":")
    s = bench.build(None, int(bits or 4), 4, log=lambda m: None, model=name)
    model = s.model("lru", s.cfg.num_experts, 0, "fused")
    model.routing = bench.Conditions().routing_source(s.cfg, s.device, 1)
    model.setup_kv(capacity)
    return model


def anatomy(spec: str) -> list[str]:
    capacity = PROMPT + 8 + len(SETS) * 2 * TURNS * TOKENS + 8
    model = resident_model(spec, capacity)
    sets = {}
    for name, (beside, nq) in SETS.items():  # each captured before the prompt: prepare writes position 0
        decode.KV_BESIDE, hqq_gpu.SMALL_GEMV_NQ = beside, nq
        model.graphs = sets[name] = GraphedDecode(model)
        sets[name].prepare(capacity)
    decode.KV_BESIDE, hqq_gpu.SMALL_GEMV_NQ = SETS["engine"]
    model.routing.reserve(PROMPT, capacity)  # the routing's tables drawn now, as the bench does
    tok = int(model.forward(torch.arange(PROMPT, device=model.device), 0)[-1].argmax())
    pos = PROMPT

    def timed(loop, n: int) -> float:
        """ms per token of n tokens of loop(tok, pos, n) -> the last token."""
        nonlocal tok, pos
        torch.cuda.synchronize()
        t = time.perf_counter()
        tok = loop(tok, pos, n)
        torch.cuda.synchronize()
        pos += n
        return (time.perf_counter() - t) / n * 1e3

    def ahead(tok: int, pos: int, n: int) -> int:
        return [tok, *model.decode_greedy(tok, pos, n)][-1]

    def from_host(tok: int, pos: int, n: int) -> int:
        for i in range(n):
            tok = int(model.forward(torch.tensor([tok]), pos + i)[-1].argmax())
        return tok

    def back_to_back(g: GraphedDecode) -> float:
        graph = g.graphs[("ahead", g.is_forced())]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(REPLAYS):
            graph.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / REPLAYS

    model.graphs = sets["engine"]
    timed(ahead, 8)  # warm
    times = {}
    for _ in range(TURNS):
        for name, g in sets.items():
            model.graphs = g
            for loop in (ahead, from_host):
                times.setdefault((name, loop.__name__), []).append(timed(loop, TOKENS))
            times.setdefault((name, "back to back"), []).append(back_to_back(g))
    lines = [f"## {spec}: ms a token (best of {TURNS} turns of {TOKENS} tokens; back to back: {REPLAYS} replays)",
             "| graphs | greedy loop, the graph queued ahead | the token sent from the host | the graph back to back "
             "| the host adds (ahead) |", "|---|---|---|---|---|"]
    for name in SETS:
        a, h, g = (min(times[name, k]) for k in ("ahead", "from_host", "back to back"))
        lines.append(f"| {name} | {a:.3f} ({1e3 / a:.2f} tok/s) | {h:.3f} "
                     f"({1e3 / h:.2f} tok/s) | {g:.3f} ({1e3 / g:.2f} tok/s) | {(a - g) * 1e3:.0f} us |")
    graph = sets["engine"].graphs[("ahead", sets["engine"].is_forced())]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / 8
    lines += ["", f"kernels of one token's graph, the engine's set (profiled, {total / 1e3:.3f} ms of kernels a token; "
              "branches overlap, so the sum can pass the time):",
              "| kernel | calls a token | us per call | us a token | share |", "|---|---|---|---|---|"]
    for e in sorted(events, key=lambda e: -e.device_time_total)[:16]:
        lines.append(f"| {e.key[:90]} | {e.count / 8:.0f} | {e.device_time_total / e.count:.1f} | "
                     f"{e.device_time_total / 8:.1f} | {e.device_time_total / 8 / total:.1%} |")
    model.graphs = None
    sets.clear()
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
