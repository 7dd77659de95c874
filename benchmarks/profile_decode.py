"""Where a decode step's time goes: each piece of a layer captured as its own CUDA graph and
replayed alone (GPU time per replay, median of 3 x 50), on the synthetic full-size Mixtral
with every expert resident. Only decode_graphs' fused path (the CUDA default) is profiled.

    python -m benchmarks.profile_decode [--layers 32] [--expert-bits 2] [--json FILE]

The sum of the pieces against one whole-token graph tells what the pieces' boundaries cost.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from moeferry.engine.kernels import decode as dk, hqq_gpu
from moeferry.engine.measure import bench
from moeferry.engine.runtime.decode_graphs import use_cuda_graphs
from moeferry.engine.runtime.expert_cache import ExpertCache
from moeferry.engine.runtime.model import OffloadedMixtral


def graph_us(fn, reps: int = 50) -> float:
    """GPU microseconds per replay of fn captured as a CUDA graph (fn is run once first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(times)[1]


def profile(layers: int, expert_bits: int, log=print) -> dict:
    s = bench.build(layers=layers, expert_bits=expert_bits, log=log)
    cfg = s.cfg

    cache = ExpertCache(s.host, cfg.num_experts, s.device, bench.expert_views(cfg, s.fields, s.eq))
    m = OffloadedMixtral(cfg, s.dense, cache, s.device, torch.bfloat16, "fused")
    m.setup_kv(256)
    use_cuda_graphs(m)
    g, st, ops = m.graphs, m.graphs.s, m.graphs.ops
    g.check_keys()
    cache.sync_tables()
    g.pos.fill_(100)
    L0 = m.layers[0]
    H, D = cfg.num_heads, cfg.head_dim
    q = torch.zeros(H, D, device=s.device, dtype=torch.bfloat16)
    k = torch.zeros(cfg.num_kv_heads, D, device=s.device, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    pieces = {
        "add_rms_norm": lambda: dk.add_rms_norm(st.x, st.out, L0["attn_norm"], 1e-5, st.hn),
        "q GEMV 4096x4096": lambda: m.linear(st.hn, L0["q_proj"]),
        "k GEMV 1024x4096": lambda: m.linear(st.hn, L0["k_proj"]),
        "k and v GEMVs, one launch (gemv_pair)": lambda: hqq_gpu.gemv_pair(st.hn, L0["k_proj"], L0["v_proj"],
                                                                           ops.k_new, ops.v_new),
        "rope_attention (pos 100)": lambda: dk.rope_attention(q, k, v, st.cos, st.sin, g.pos, m.kv.k[0], m.kv.v[0],
                                                              None, ops.attn),
        "o GEMV 4096x4096": lambda: m.linear(ops.attn, L0["o_proj"]),
        "route_topk": lambda: dk.route_topk(st.h, L0["router"], cfg.top_k, st.weights[0], st.ids[0, 0]),
        "moe_decode (2 experts)": lambda: ops.experts(0, st, st.ids[0]),
        "layer_segment (all of attention + routing)": lambda: m.attention_block(0, L0, st, ops),
        "head (norm + lm_head + float)": g.head_segment,
    }
    res = {name: graph_us(fn) for name, fn in pieces.items()}
    res["whole token (one graph)"] = graph_us(lambda: g.token_segment(False), reps=10)
    per_layer = res["layer_segment (all of attention + routing)"] + res["moe_decode (2 experts)"]
    res["sum: layers x (layer_segment + moe_decode) + head"] = cfg.num_layers * per_layer + res[
        "head (norm + lm_head + float)"]
    for name, us in res.items():
        log(f"{us:10.1f} us  {name}")
    return {"layers": layers, "expert_bits": expert_bits, "device": torch.cuda.get_device_name(), "us": res}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--expert-bits", type=int, default=2, choices=(2, 3, 4))
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    res = profile(a.layers, a.expert_bits)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
