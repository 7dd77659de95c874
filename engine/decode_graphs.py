"""Batch-1 decode with CUDA graphs: the same maths as OffloadedMixtral.forward, fewer launches.

Eager decode launches ~60 small kernels per layer and the host must stay ahead of the GPU
between the per-layer routing syncs; at a few microseconds per launch that alone caps decode
near 100 tokens/s. Here each layer's attention + routing (+ the prefetch guesses) is one graph.
The routed experts run in one of three ways, fastest first:
  * every expert resident (the cache holds all of them): nothing is ever copied, so the whole
    token - all layers and the head - is ONE graph, with no host sync until the logits;
  * quantized experts on the fused kernels: one graph per layer runs all routed experts
    (kernels.moe_decode reads each expert's slot from the cache's device table), after the
    host's routing sync has made sure they are in place;
  * otherwise one graph per (layer, cache slot, top-k position) and expert.
The host part (which experts to copy, LRU, prefetch) is the model's own `dispatch`.
A forced routing (`model.routing`, engine/routing.py: the benchmark's uniform or replayed
routing) overwrites, on the device, the `ids`/`weights`/`guesses` a layer graph wrote before
`dispatch` reads them; the one-graph path is captured with copies from `forced_ids` /
`forced_weights`, which the host fills before each replay. With the CPU+GPU hybrid
(model.hybrid) some of a layer's experts run on the CPU: the grouped launch then runs only the
others (a graph per count, `run_moe`) and the CPU's sum is added to `out` eagerly before the
next layer's graph reads it.

Graphs read and write fixed buffers (`x`, `h`, `out`, `weights`, `ids`, `guesses`, `logits`)
and the token position from a device tensor, so they replay at any position. Each graph is
captured the first time it is needed, right after running its function eagerly for that token
(which also compiles the Triton kernels). A new KV cache or expert cache drops all graphs, and
so does a new prefetch depth unless every expert is resident.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from engine import decode_kernels as dk, kernels
from engine.model import rms_norm, rope_cos_sin


class GraphedDecode:
    def __init__(self, model):
        self.m = model
        cfg, dev, dt = model.cfg, model.device, model.dtype
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.x = torch.zeros(1, cfg.hidden_size, dtype=dt, device=dev)  # the residual stream
        self.h = torch.zeros_like(self.x)  # input of the experts (normed)
        self.hn = torch.zeros_like(self.x)  # input of attention / of a guess's router (normed)
        self.attn = torch.zeros(1, cfg.num_heads * cfg.head_dim, dtype=dt, device=dev)
        self.k_new = torch.zeros(1, cfg.num_kv_heads * cfg.head_dim, dtype=dt, device=dev)
        self.v_new = torch.zeros_like(self.k_new)
        self.guess_weights = torch.zeros(cfg.top_k, dtype=torch.float32, device=dev)
        self.out = torch.zeros_like(self.x)  # sum of the experts' outputs
        self.weights = torch.zeros(1, cfg.top_k, dtype=torch.float32, device=dev)
        self.ids = torch.zeros(1, cfg.top_k, dtype=torch.long, device=dev)
        self.guesses = torch.zeros(max(1, cfg.num_layers), cfg.top_k, dtype=torch.long, device=dev)
        self.logits = torch.zeros(1, cfg.vocab_size, dtype=torch.float32, device=dev)
        self.routed = torch.zeros(cfg.num_layers, cfg.top_k, dtype=torch.long, device=dev)  # one-graph trace
        # a forced routing's choice for the one graph, written before each replay
        self.forced_ids = torch.zeros_like(self.routed)
        self.forced_weights = torch.zeros(cfg.num_layers, cfg.top_k, dtype=torch.float32, device=dev)
        # the hybrid's GPU part of a layer (run_moe): which top-k positions, their ids and weights
        self.pos_host = torch.zeros(cfg.top_k, dtype=torch.long, pin_memory=True)
        self.sub_pos = torch.zeros(cfg.top_k, dtype=torch.long, device=dev)
        self.sub_ids = torch.zeros(cfg.top_k, dtype=torch.long, device=dev)
        self.sub_weights = torch.zeros(cfg.top_k, dtype=torch.float32, device=dev)
        positions = torch.arange(cfg.max_position_embeddings, device=dev)
        self.cos, self.sin = rope_cos_sin(model.inv_freq, positions, dt)  # [P, 1, D] each
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = torch.cuda.Stream(dev)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.key = None
        # the fused small kernels (decode_kernels) wherever the fused GEMVs run; whether the
        # expert cache allows the grouped expert kernels is decided per cache in check_keys
        self.fast = (model.kernels != "reference" and kernels.fused_available(dev)
                     and self.works(self.probe_decode_kernels, "fused decode kernels"))

    # -- one decode step --------------------------------------------------------------------------

    def check_keys(self) -> None:
        """Drop every graph when a buffer it bakes in changed (the expert cache's slots, the KV
        cache, the prefetch depth). A fresh memory pool goes with them: a pool whose graphs
        were all freed must not be captured into again."""
        m = self.m
        # with every expert resident the guesses change nothing: a new depth keeps the graphs
        depth = m.prefetch_depth if m.cache.K < m.cfg.num_experts else 0
        key = (m.kv.serial, m.cache.serial, depth)
        if key != self.key:
            if self.key is None or key[1] != self.key[1]:  # a new expert cache
                self.grouped = self.fast and self.can_group()
                self.one_graph = self.grouped and m.cache.K == m.cfg.num_experts and m.cache.policy == "lru"
            self.graphs = {}
            self.pool = torch.cuda.graph_pool_handle()
            self.key = key

    def works(self, probe, what: str) -> bool:
        """Run probe() once, on scratch buffers. Under kernels="auto" a failure (Triton cannot
        build a kernel on this machine, say) means the slower path and a warning; under
        kernels="fused" it is raised."""
        if self.m.kernels == "fused":
            probe()
            return True
        try:
            probe()
            torch.cuda.synchronize(self.m.device)
            return True
        except Exception as e:  # noqa: BLE001 - any failure of the optional fast path
            warnings.warn(f"{what} unavailable ({type(e).__name__}: {e}); using the slower path", stacklevel=2)
            return False

    def probe_decode_kernels(self) -> None:
        """Each kernel of fused_layer_segment once, on layer 0's weights and scratch outputs."""
        m, cfg, dev = self.m, self.m.cfg, self.m.device
        layer = m.layers[0]
        dk.add_rms_norm(torch.zeros_like(self.x), self.x, layer["attn_norm"], cfg.rms_norm_eps,
                        torch.empty_like(self.x))
        dk.route_topk(self.x, layer["router"], cfg.top_k, torch.empty_like(self.guess_weights),
                      torch.empty_like(self.ids[0]))
        q = torch.zeros(cfg.num_heads, cfg.head_dim, dtype=m.dtype, device=dev)
        kv = torch.zeros(cfg.num_kv_heads, cfg.head_dim, dtype=m.dtype, device=dev)
        cache = torch.zeros(1, cfg.num_kv_heads, cfg.head_dim, dtype=m.dtype, device=dev)
        dk.rope_attention(q, kv, kv, self.cos, self.sin, torch.zeros_like(self.pos), cache, cache.clone(),
                          cfg.sliding_window, torch.empty_like(self.attn))
        if kernels.pair_supported(layer["k_proj"], layer["v_proj"]):
            kernels.gemv_pair(self.x, layer["k_proj"], layer["v_proj"], torch.empty_like(self.k_new),
                              torch.empty_like(self.v_new))

    def can_group(self) -> bool:
        """Whether kernels.moe_decode can run this model's experts."""
        m, cache = self.m, self.m.cache
        if cache.decode is not None or cache.K < m.cfg.top_k or not kernels.moe_supported(cache.views[0][0]):
            return False
        # slot 0 for every expert: a valid address whatever the slots hold
        return self.works(lambda: kernels.moe_decode(
            self.h, cache.views[0][0], cache.B, torch.arange(m.cfg.top_k, device=m.device), self.weights[0],
            torch.zeros(m.cfg.num_experts, dtype=torch.int32, device=m.device), torch.empty_like(self.out)),
            "grouped expert kernels")

    def prepare(self, max_position: int, progress=None) -> None:
        """Capture every graph decode can need up to max_position, before any generation.

        Must run before a prefill: the eager warm-up writes position 0 of the KV cache.
        """
        m = self.m
        self.check_keys()
        self.pos.zero_()
        layers = range(m.cfg.num_layers)
        if self.one_graph:
            forced = self.forced()
            jobs = [(("token", forced), lambda: self.token_segment(forced))]
        else:
            spans = sorted({self.span(p) for p in range(0, max_position, 256)} | {self.span(max_position - 1)})
            jobs = [(("layer", i, s), lambda i=i, s=s: self.layer_segment(i, s)) for s in spans for i in layers]
            if self.grouped:
                jobs += [(("moe", i), lambda i=i: self.moe_segment(i)) for i in layers]
                if m.hybrid is not None:  # the GPU part of a layer that also runs CPU experts
                    jobs += [(("moe", i, n), lambda i=i, n=n: self.moe_subset_segment(i, n))
                             for i in layers for n in range(1, m.cfg.top_k)]
            else:
                jobs += [(("expert", i, slot, k), lambda i=i, slot=slot, k=k: self.expert_segment(m.cache.views[i][slot], k))
                         for i in layers for slot in range(m.cache.K) for k in range(m.cfg.top_k)]
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
        if m.routing is not None:
            m.routing.begin(1)
        if self.one_graph:
            for i in list(m.cache.table_dirty):  # once: a fully resident cache never changes
                m.cache.sync_table(i)
            forced = self.forced()
            if forced:
                weights, ids = m.routing.token_table()
                self.forced_weights.copy_(weights)
                self.forced_ids.copy_(ids)
            self.run(("token", forced), lambda: self.token_segment(forced))
            m.cache.stats.hits += m.cfg.num_layers * m.cfg.top_k
            if m.trace is not None:
                m.trace.append([(tuple(ids), m.cache.resident(i)) for i, ids in enumerate(self.routed.tolist())])
            return self.logits.clone()
        span = self.span(start)
        step = [] if m.trace is not None else None
        for i in range(m.cfg.num_layers):
            self.run(("layer", i, span), lambda i=i: self.layer_segment(i, span))
            depth = min(m.prefetch_depth, m.cfg.num_layers - 1 - i)
            guesses = self.guesses[:depth] if depth else None
            if m.routing is not None:
                self.force(i, guesses)
            io = (self.h, self.weights, self.out)  # for experts run on the CPU (model.hybrid)
            if self.grouped:
                m.dispatch(i, self.ids, guesses, step, add_all=lambda pos, i=i: self.run_moe(i, pos), io=io)
            else:
                def add_expert(w, slot, e, k, i=i):
                    self.run(("expert", i, slot, k), lambda: self.expert_segment(w, k))

                m.dispatch(i, self.ids, guesses, step, add_expert, io=io)
        if step is not None:
            m.trace.append(step)
        self.run(("head",), self.head_segment)
        return self.logits.clone()

    def forced(self) -> bool:
        return self.m.routing is not None and self.m.routing.forces

    def force(self, i: int, guesses: torch.Tensor | None) -> None:
        """Hand layer i's routing, as its graph wrote it, to the model's routing source; write
        back on the device what it chose instead (before dispatch reads it)."""
        weights, ids, g = self.m.routing.choose(self.m, i, self.x, self.weights, self.ids, guesses)
        if ids is not self.ids:
            self.ids.copy_(ids)
            self.weights.copy_(weights)
        if g is not None and g is not guesses:
            guesses.copy_(g)

    def span(self, start: int) -> int:
        """What a layer graph at position `start` is keyed on: the eager attention's span; the
        fused attention reads the position on the device, so one graph (span 0) serves all."""
        return 0 if self.fast else attention_span(start, self.m.kv.capacity)

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

    def token_segment(self, forced: bool = False) -> None:
        """Every layer and the head, for a cache that holds every expert (no copies, no guesses);
        each layer's routing goes to its row of `routed` (the trace). Forced: the router's choice
        is overwritten by the rows of forced_ids / forced_weights."""
        for i in range(self.m.cfg.num_layers):
            self.fused_layer_segment(i, self.routed[i:i + 1], guess=False)
            if forced:
                self.routed[i].copy_(self.forced_ids[i])
                self.weights[0].copy_(self.forced_weights[i])
            self.moe_segment(i, ids=self.routed[i:i + 1])
        self.head_segment()

    def layer_segment(self, i: int, span: int) -> None:
        """Attention, routing and the prefetch guesses of layer i."""
        if self.fast:
            return self.fused_layer_segment(i, self.ids, guess=True)
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
        self.out.zero_()  # the per-expert graphs add to it

    def fused_layer_segment(self, i: int, ids: torch.Tensor, guess: bool) -> None:
        """layer_segment with decode_kernels: 8 launches instead of ~45."""
        m, layer, cfg = self.m, self.m.layers[i], self.m.cfg
        eps = cfg.rms_norm_eps
        if i == 0:
            self.x.copy_(F.embedding(self.tok, m.embed))
        dk.add_rms_norm(self.x, self.out if i > 0 else None, layer["attn_norm"], eps, self.hn)
        q = m.linear(self.hn, layer["q_proj"]).view(cfg.num_heads, cfg.head_dim)
        if kernels.pair_supported(layer["k_proj"], layer["v_proj"]):
            kernels.gemv_pair(self.hn, layer["k_proj"], layer["v_proj"], self.k_new, self.v_new)
            k, v = self.k_new, self.v_new
        else:
            k, v = m.linear(self.hn, layer["k_proj"]), m.linear(self.hn, layer["v_proj"])
        dk.rope_attention(q, k.view(cfg.num_kv_heads, cfg.head_dim), v.view(cfg.num_kv_heads, cfg.head_dim),
                          self.cos, self.sin, self.pos, m.kv.k[i], m.kv.v[i], cfg.sliding_window, self.attn)
        dk.add_rms_norm(self.x, m.linear(self.attn, layer["o_proj"]), layer["moe_norm"], eps, self.h)
        dk.route_topk(self.h, layer["router"], cfg.top_k, self.weights[0], ids[0])
        for d, j in enumerate(range(i + 1, min(i + 1 + m.prefetch_depth, cfg.num_layers)) if guess else ()):
            dk.add_rms_norm(self.x, None, m.layers[j]["moe_norm"], eps, self.hn)
            dk.route_topk(self.hn, m.layers[j]["router"], cfg.top_k, self.guess_weights, self.guesses[d])
        if not self.grouped:  # moe_decode writes out whole; the per-expert graphs add to it
            self.out.zero_()

    def run_moe(self, i: int, positions: list[int]) -> None:
        """The grouped experts of layer i at these top-k positions (the others run on the CPU
        and are added to `out` later). All k: the ("moe", i) graph. Fewer: a graph per count n
        that gathers the n ids and weights first, so no GEMV runs for a CPU expert (a zero
        weight on a valid slot would still read the whole expert). None: out = 0."""
        n = len(positions)
        if n == self.m.cfg.top_k:
            return self.run(("moe", i), lambda: self.moe_segment(i))
        if n == 0:
            self.out.zero_()
            return
        for j, p in enumerate(positions):  # no tensor made per layer and token
            self.pos_host[j] = p
        self.sub_pos[:n].copy_(self.pos_host[:n], non_blocking=True)  # rewritten after the next sync
        self.run(("moe", i, n), lambda: self.moe_subset_segment(i, n))

    def moe_subset_segment(self, i: int, n: int) -> None:
        pos = self.sub_pos[:n]
        torch.index_select(self.ids[0], 0, pos, out=self.sub_ids[:n])
        torch.index_select(self.weights[0], 0, pos, out=self.sub_weights[:n])
        cache = self.m.cache
        kernels.moe_decode(self.h, cache.views[i][0], cache.B, self.sub_ids[:n], self.sub_weights[:n],
                           cache.table[i], self.out)

    def moe_segment(self, i: int, ids: torch.Tensor | None = None) -> None:
        """All routed experts of layer i at once (out = their weighted sum)."""
        cache = self.m.cache
        kernels.moe_decode(self.h, cache.views[i][0], cache.B, (self.ids if ids is None else ids)[0],
                           self.weights[0], cache.table[i], self.out)

    def expert_segment(self, w: dict, k: int) -> None:
        self.out.add_((self.m.expert(w, self.h) * self.weights[:, k:k + 1]).to(self.out.dtype))

    def head_segment(self) -> None:
        m = self.m
        if self.fast:
            dk.add_rms_norm(self.x, self.out, m.norm, m.cfg.rms_norm_eps, self.hn)
            self.logits.copy_(F.linear(self.hn, m.lm_head))
            return
        self.x.add_(self.out)
        self.logits.copy_(F.linear(rms_norm(self.x, m.norm, m.cfg.rms_norm_eps), m.lm_head).float())


def attention_span(start: int, capacity: int) -> int:
    """Positions attention reads at `start`: a power of two >= start+1 (min 256), so a graph
    serves many positions and the masked tail stays small."""
    span = 256
    while span < start + 1:
        span *= 2
    return min(span, capacity)
