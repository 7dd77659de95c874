"""Batch-1 decode with CUDA graphs: the same maths as OffloadedMixtral.forward, fewer launches.

Eager decode launches ~60 small kernels per layer and the host must stay ahead of the GPU
between the per-layer routing syncs; at a few microseconds per launch that alone caps decode
near 100 tokens/s. Here each layer's attention + routing (+ the prefetch guesses) is one graph,
and each expert is one graph per (layer, cache slot, top-k position), so a token costs about
3 graph launches and 1 routing sync per layer. The host part (which experts to copy, LRU,
prefetch) is the model's own `dispatch`.

Graphs read and write fixed buffers (`x`, `h`, `out`, `weights`, `ids`, `guesses`, `logits`)
and the token position from a device tensor, so they replay at any position. Each graph is
captured the first time it is needed, right after running its function eagerly for that token
(which also compiles the Triton kernels). A new KV cache, expert cache or prefetch depth drops
all graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model import rms_norm, rope_cos_sin


class GraphedDecode:
    def __init__(self, model):
        self.m = model
        cfg, dev, dt = model.cfg, model.device, model.dtype
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.x = torch.zeros(1, cfg.hidden_size, dtype=dt, device=dev)  # the residual stream
        self.h = torch.zeros_like(self.x)  # input of the experts (normed)
        self.out = torch.zeros_like(self.x)  # sum of the experts' outputs
        self.weights = torch.zeros(1, cfg.top_k, dtype=torch.float32, device=dev)
        self.ids = torch.zeros(1, cfg.top_k, dtype=torch.long, device=dev)
        self.guesses = torch.zeros(max(1, cfg.num_layers), cfg.top_k, dtype=torch.long, device=dev)
        self.logits = torch.zeros(1, cfg.vocab_size, dtype=torch.float32, device=dev)
        positions = torch.arange(cfg.max_position_embeddings, device=dev)
        self.cos, self.sin = rope_cos_sin(model.inv_freq, positions, dt)  # [P, 1, D] each
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = torch.cuda.Stream(dev)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.key = None

    # -- one decode step --------------------------------------------------------------------------

    def check_keys(self) -> None:
        """Drop every graph when a buffer it bakes in changed (the expert cache's slots, the KV
        cache, the prefetch depth). A fresh memory pool goes with them: a pool whose graphs
        were all freed must not be captured into again."""
        m = self.m
        key = (m.kv.serial, m.cache.serial, m.prefetch_depth)
        if key != self.key:
            self.graphs = {}
            self.pool = torch.cuda.graph_pool_handle()
            self.key = key

    def prepare(self, max_position: int, progress=None) -> None:
        """Capture every graph decode can need up to max_position, before any generation.

        Must run before a prefill: the eager warm-up writes position 0 of the KV cache.
        """
        m = self.m
        self.check_keys()
        self.pos.zero_()
        spans = sorted({attention_span(p, m.kv.capacity) for p in range(0, max_position, 256)} |
                       {attention_span(max_position - 1, m.kv.capacity)})
        jobs = [(("layer", i, s), lambda i=i, s=s: self.layer_segment(i, s))
                for s in spans for i in range(m.cfg.num_layers)]
        jobs += [(("expert", i, slot, k), lambda i=i, slot=slot, k=k: self.expert_segment(m.cache.views[i][slot], k))
                 for i in range(m.cfg.num_layers) for slot in range(m.cache.K) for k in range(m.cfg.top_k)]
        jobs.append((("head",), self.head_segment))
        for n, (key, fn) in enumerate(jobs):
            self.run(key, fn)
            if progress and n % 32 == 0:
                progress(n / len(jobs), "preparing CUDA graphs")

    def step(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        m = self.m
        self.check_keys()
        self.tok.copy_(tokens.view(1))
        self.pos.fill_(start)
        span = attention_span(start, m.kv.capacity)
        step = [] if m.trace is not None else None
        for i in range(m.cfg.num_layers):
            self.run(("layer", i, span), lambda i=i: self.layer_segment(i, span))
            depth = min(m.prefetch_depth, m.cfg.num_layers - 1 - i)
            guesses = self.guesses[:depth] if depth else None

            def add_expert(w, slot, e, k, i=i):
                self.run(("expert", i, slot, k), lambda: self.expert_segment(w, k))

            m.dispatch(i, self.ids, guesses, step, add_expert)
        if step is not None:
            m.trace.append(step)
        self.run(("head",), self.head_segment)
        return self.logits.clone()

    def run(self, key: tuple, fn) -> None:
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            return
        # Captured by hand: torch.cuda.graph() would also synchronize, collect garbage and empty
        # the allocator's cache for each of the hundreds of small graphs.
        g = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream()
        self.capture_stream.wait_stream(main)
        with torch.cuda.stream(self.capture_stream):
            # This token's result, eagerly, on the capture stream: Triton compiles and per-stream
            # workspaces (cuBLAS, split-K scratch) are made here, outside the graph's memory pool.
            fn()
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                fn()  # recorded, not executed
            finally:
                g.capture_end()
        main.wait_stream(self.capture_stream)
        self.graphs[key] = g

    # -- the captured segments --------------------------------------------------------------------

    def layer_segment(self, i: int, span: int) -> None:
        m, layer = self.m, self.m.layers[i]
        eps = m.cfg.rms_norm_eps
        if i == 0:
            self.x.copy_(F.embedding(self.tok, m.embed))
        else:
            self.x.add_(self.out)
        cos, sin = self.cos[self.pos], self.sin[self.pos]  # [1, 1, D]
        self.x.add_(m.attention(i, layer, rms_norm(self.x, layer["attn_norm"], eps), cos, sin, 0,
                                pos=self.pos, span=span))
        self.h.copy_(rms_norm(self.x, layer["moe_norm"], eps))
        weights, ids = m.route(layer, self.h)
        self.weights.copy_(weights)
        self.ids.copy_(ids)
        guesses = m.guess_next_experts(i, self.x)
        if guesses is not None:
            self.guesses[:guesses.shape[0]].copy_(guesses)
        self.out.zero_()

    def expert_segment(self, w: dict, k: int) -> None:
        self.out.add_((self.m.expert(w, self.h) * self.weights[:, k:k + 1]).to(self.out.dtype))

    def head_segment(self) -> None:
        m = self.m
        self.x.add_(self.out)
        self.logits.copy_(F.linear(rms_norm(self.x, m.norm, m.cfg.rms_norm_eps), m.lm_head).float())


def attention_span(start: int, capacity: int) -> int:
    """Positions attention reads at `start`: a power of two >= start+1 (min 256), so a graph
    serves many positions and the masked tail stays small."""
    span = 256
    while span < start + 1:
        span *= 2
    return min(span, capacity)
