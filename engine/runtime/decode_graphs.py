"""Batch-1 decode with CUDA graphs of the model's own layer (OffloadedMixtral.layer).

Eager decode launches ~60 small kernels per layer and the host must stay ahead of the GPU
between the per-layer routing syncs; at a few microseconds per launch that alone caps decode
near 100 tokens/s. GraphedDecode runs the same layer function on one fixed set of buffers
(a model.Step) and hands it a `run` that captures each device segment of the layer once and
replays it afterwards; the host part between the segments (routing sync, cache, prefetch,
the CPU hybrid) is the layer's own and runs as in the eager forward. The segments run on
kernels/decode.FusedOps (the fused kernels) wherever the fused GEMVs
run, else on the eager operations. The routed experts run in one of four ways:
  * every expert resident (the cache holds all of them): nothing is ever copied, so the MoE
    layers have no host part and the whole token - all layers and the head - is ONE graph,
    with no host sync until the logits. Greedy decoding (decode_greedy) then uses a variant
    that reads the token's embedding on the device and ends with the argmax into the next
    token's slot, so the host queues token t+1's graph before it reads token t;
  * the same ONE graph at any cache size with `model.stream_misses` (STREAM_MISSES): the cache
    stays as the prompt left it, and the grouped kernel reads an expert it does not hold where
    it lies in page-locked host memory, over the link (the GPU's own loads, no copy engine).
    With a prefetch depth, each MoE layer's guesses for the next one that the cache lacks are
    copied by a kernel on a stream of their own (FusedOps.fetch_ahead) while the layer runs,
    and the next layer reads those copies (STREAM_FETCH);
  * the grouped expert kernel (FusedOps.moe_decode, where the cache's expert format allows it):
    one graph per layer runs all routed experts (reading each one's slot from the cache's
    device table). With HQQ experts it runs before the host reads the routing, on the experts
    already in place (OffloadedMixtral.hits_first); a second graph per count runs the misses
    once copied. Otherwise it runs after the host's routing sync has made sure they are in place;
  * otherwise one graph per (layer, cache slot, top-k position) and expert.
A forced routing (`model.routing`, engine/measure/routing.py) is written over the router's on the
device before dispatch reads it: the graphs copy it from `forced`, which the host fills once
per token (three copies, where the eager forward makes three per layer). With the CPU+GPU
hybrid some of a layer's experts run on the CPU: the grouped launch then runs only the others
(a graph per count) and the CPU's sum is added to `out` eagerly before the next graph reads it.
An embedding kept in host memory (untied, on a GPU) is gathered there and copied into the
residual stream before the first graph (OffloadedMixtral.embed_into), so no graph holds the lookup.

Graphs read the token position from a device tensor, so they replay at any position (on the
eager operations an attention graph is keyed on the span it reads). Each graph is captured the first
time it is needed, right after running its function eagerly for that token (which also
compiles the Triton kernels). A new KV cache or expert cache drops all graphs, and so does a
new prefetch depth unless every expert is resident. With capture=False nothing is captured
and every segment runs as it comes (the CPU tests run the fused path so, under the Triton
interpreter).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import torch

from moeferry.engine.kernels import hqq_gpu
from moeferry.engine.kernels.decode import FusedOps, add_rms_norm, embed_row, rope_attention, route_topk
from moeferry.engine.runtime.model import EagerOps, attention_options, distinct_ids

HITS_FIRST = True  # the developer benchmark (benchmarks/hits_first_ab.py) turns it off to compare
RUN_AHEAD = True  # benchmarks/token_anatomy.py turns it off to compare
STREAM_MISSES = True  # with model.stream_misses: the one-graph token at any cache size (streams)
STREAM_FETCH = True  # streaming with a prefetch depth: the next layer's guessed misses copied ahead (FusedOps.fetch_ahead)


def use_cuda_graphs(model, on: bool = True) -> None:
    """Decode one token at a time through CUDA graphs of the model's layer on a CUDA device
    (every family); off, or on another device, the eager forward."""
    model.graphs = GraphedDecode(model) if on and model.device.type == "cuda" else None

class GraphedDecode:
    def __init__(self, model, capture: bool = True):
        self.m, self.capture = model, capture
        cfg, dev = model.cfg, model.device
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.s = model.new_step(torch.zeros(1, dtype=torch.long, device=dev), *self.rope_tables(), pos=self.pos)
        self.logits = torch.zeros(1, cfg.vocab_size, dtype=torch.float32, device=dev)
        cuda = dev.type == "cuda"  # else the tests' capture=False on the CPU
        self.token_host = torch.zeros(1, dtype=torch.long, pin_memory=cuda)
        self.token_copied = torch.cuda.Event() if cuda else None
        # decode_greedy's tokens on their way back: two page-locked words, each with its event
        self.ring = [torch.zeros(1, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.ring_ready = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.runs_ahead = False  # set per expert cache in check_keys
        self.streams = False  # a one-graph token whose misses are read from host memory (check_keys)
        self.streamed: list[torch.Tensor] = []  # streaming tokens' routing, not yet counted (count_streamed)
        self.unfenced = False  # streaming graphs queued since the cache's last fence (fence())
        moe = max(1, cfg.num_moe_layers)  # a forced routing's choice: weights, ids, guesses [.., D, k]
        self.forced = (torch.zeros(moe, cfg.top_k, dtype=torch.float32, device=dev),
                       distinct_ids((moe, cfg.top_k), dev), distinct_ids((moe, 1, cfg.top_k), dev))
        if capture:
            self.pool = torch.cuda.graph_pool_handle()
            self.capture_stream = shared_stream(dev, "capture")
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}  # capture=False: the keys run
        self.key = None
        # the fused operations wherever the fused GEMVs run; whether the expert cache allows the
        # grouped expert kernel is decided per cache in check_keys
        self.fast = (model.kernels != "reference" and hqq_gpu.fused_available(dev)
                     and self.m.fast_path_works(self.probe_decode_kernels, "fused decode kernels"))
        self.ops = (FusedOps(model, side=shared_stream(dev, "side") if capture else None,
                             fetcher=shared_stream(dev, "fetch") if capture else None)
                    if self.fast else EagerOps(model))

    def rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [P, 1, D] for the positions the KV cache holds (P = its capacity), which
        the graphs index with pos. Not for the model's whole context: Qwen3's 262144 positions
        took 0.5 GiB while being made, past what the VRAM budget sizes."""
        m = self.m
        positions = torch.arange(m.kv.capacity if m.kv is not None else 1, device=m.device)
        return m.rope(positions, each=True)

    @property
    def grouped(self) -> bool:
        return self.ops.grouped

    # -- one decode step --------------------------------------------------------------------------

    def step(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """One token's logits [1, vocab]. tokens [1]: on the host (the decode loop's case: the
        device waits for no read of it) or on the device."""
        m, s = self.m, self.s
        self.check_keys()
        if tokens.device.type == "cpu" and m.embed_on_host:  # x filled before the graphs, which then hold no lookup
            m.embed_into(s, tokens.view(1))
        else:
            self.send_token(tokens)
            if m.embed_on_host:
                m.embed_into(s)
        forced = self.begin_token(start)
        if self.one_graph:
            self.run(("token", forced), self.token_segment)
            self.token_done()
            return self.logits.clone()
        self.fence()
        step = [] if m.trace is not None else None
        for i in range(m.cfg.num_layers):
            m.layer(i, s, self.ops, self.run, step)
        if step is not None:
            m.trace.append(step)
        self.run(("head",), self.head_segment)
        return self.logits.clone()

    def decode_greedy(self, token: int, start: int, n: int) -> Iterator[int]:
        """The n tokens that greedy decoding makes after `token` (at position start), with every
        expert resident (runs_ahead): each token's graph also picks the next token (the argmax)
        and reads its embedding on the device, so the graph of token t+1 is queued before the
        host reads token t, and the GPU never waits for Python. Closed early, one more graph has
        run: it wrote the keys and values of the position after the last token read, which a
        later decode rewrites before reading."""
        s = self.s
        if not self.can_run_ahead():
            raise RuntimeError("decode_greedy needs every expert resident (can_run_ahead)")
        self.send_token(torch.tensor([token]))
        for i in range(n):
            forced = self.begin_token(start + i)
            self.run(("ahead", forced), self.ahead_segment)
            self.token_done()
            self.ring[i % 2].copy_(s.tokens, non_blocking=True)  # read back when the next one is queued
            if self.ring_ready[i % 2] is not None:
                self.ring_ready[i % 2].record()
            if i:
                yield self.read_token((i - 1) % 2)
        if n:
            yield self.read_token((n - 1) % 2)

    def can_run_ahead(self) -> bool:
        """Whether decode_greedy can run (for the current caches)."""
        self.check_keys()
        return self.runs_ahead

    def read_token(self, j: int) -> int:
        if self.ring_ready[j] is not None:
            self.ring_ready[j].synchronize()
        return int(self.ring[j][0])

    def send_token(self, tokens: torch.Tensor) -> None:
        """s.tokens = tokens [1], from the host through page-locked memory (written once its last
        copy has run), or from the device."""
        if tokens.device.type == "cpu" and self.token_copied is not None:
            self.token_copied.synchronize()
            self.token_host.copy_(tokens.view(1))
            tokens = self.token_host
        self.s.tokens.copy_(tokens.view(1), non_blocking=True)
        if self.token_copied is not None:
            self.token_copied.record()

    def begin_token(self, start: int) -> bool:
        """The position, and a forced routing's choice for this token; whether it is forced."""
        m, s = self.m, self.s
        self.pos.fill_(start)
        s.span = attention_span(start, m.kv.capacity)
        if m.routing is not None:
            m.routing.begin(1)
        forced = self.is_forced()
        if forced:
            weights, ids, guesses = m.routing.token_table()
            self.forced[0].copy_(weights)
            self.forced[1].copy_(ids)
            if m.prefetch_depth and (not self.one_graph or self.s.fetch):
                self.forced[2].copy_(guesses[:, :self.forced[2].shape[1]])
        s.forced = self.forced if forced else None
        if self.one_graph:  # the cache does not change while its graphs run (the prompt may have changed it)
            m.cache.settle()
            m.cache.sync_tables()
        return forced

    def token_done(self) -> None:
        """A one-graph token's cache counts and trace entry (read at model.take_trace, not now);
        a streaming token's counts wait for count_streamed."""
        m = self.m
        ids = self.s.ids[:m.cfg.num_moe_layers, 0]
        if self.streams:  # the routing, and with fetching the guesses each layer made for the next
            self.streamed.append(torch.stack([ids, self.s.guesses[:m.cfg.num_moe_layers, 0]]) if self.s.fetch
                                 else ids.clone())
            self.unfenced = True
        else:
            m.cache.count_hits(m.cfg.num_moe_layers * m.cfg.top_k)
        if m.trace is not None:
            resident = [m.cache.resident(i) for i in range(m.cfg.num_moe_layers)] if self.streams else self.resident
            m.trace.append((ids.clone(), resident))

    def fence(self) -> None:
        """Before anything may copy into the cache again (a prompt, a step that is not one graph):
        the copies wait for the streaming graphs queued so far, which read slots unannounced
        (one may still run past the last token read: decode_greedy's)."""
        if self.unfenced:
            self.m.cache.fence()
            self.unfenced = False

    def count_streamed(self) -> None:
        """Add the streaming tokens' hits and misses to the cache's counts, their routing read now
        rather than once a token. What crosses the link: the misses read from host memory, and
        with fetching the guesses the cache lacked (counted as prefetches; a miss among them
        as a prefetch used, read from its copy)."""
        if not self.streamed:
            return
        cache, stats = self.m.cache, self.m.cache.stats
        routed = torch.stack(self.streamed).cpu().numpy()  # [tokens, MoE layers, top-k], or [tokens, 2, ...]
        self.streamed = []
        ids = routed[:, 0] if routed.ndim == 4 else routed
        layers = np.arange(ids.shape[1])[None, :, None]
        absent = cache.table_np[layers, ids] < 0
        fetched_used = 0
        if routed.ndim == 4:  # guesses[t, l] were fetched for layer l + 1, where the cache lacked them
            guesses = routed[:, 1, :-1]
            fetched = cache.table_np[layers[:, 1:], guesses] < 0
            found = (ids[:, 1:, :, None] == guesses[:, :, None, :]).any(-1) & absent[:, 1:]
            fetched_used = int(found.sum())
            stats.prefetch_issued += int(fetched.sum())
            stats.prefetch_used += fetched_used
            stats.bytes_h2d += int(fetched.sum()) * cache.slot_bytes
        misses = int(absent.sum())  # a fetched copy used is a hit, as a prefetched expert's is
        stats.hits += int(absent.size - misses) + fetched_used
        stats.misses += misses - fetched_used
        stats.bytes_h2d += (misses - fetched_used) * cache.slot_bytes

    def ahead_segment(self) -> None:
        """token_segment for the token in s.tokens, whose embedding it reads (an embedding in
        host memory over the link), ending with the next token, the argmax, in s.tokens."""
        m, s = self.m, self.s
        if m.embed_on_host:
            embed_row(m.embed, s.tokens, s.x)
        self.token_segment()
        torch.argmax(self.logits, dim=-1, out=s.tokens)

    def token_segment(self) -> None:
        """Every layer and the head, for a cache that holds every expert (no host part)."""
        for i in range(self.m.cfg.num_layers):
            self.m.layer(i, self.s, self.ops)
        self.head_segment()

    def head_segment(self) -> None:
        self.m.head(self.s, self.ops, out=self.logits)

    def is_forced(self) -> bool:
        return self.m.routing is not None and self.m.routing.forces

    def check_keys(self) -> None:
        """Drop every graph when a buffer it bakes in changed (the expert cache's slots, the KV
        cache, the prefetch depth). A fresh memory pool goes with them: a pool whose graphs
        were all freed must not be captured into again."""
        m = self.m
        # with every expert resident there are no guesses: a new depth keeps the graphs
        depth = 0 if m.cache.holds_every_expert else m.prefetch_depth
        key = (m.kv.serial, m.cache.serial, depth, m.stream_misses)
        if key != self.key:
            if self.key is None or key[1:] != self.key[1:]:  # a new expert cache, or streaming turned on or off
                self.ops.grouped = self.fast and self.can_group()
                if self.key is not None and key[1] != self.key[1]:
                    self.streamed = []  # tokens of a cache that is gone: its table cannot count them
                self.count_streamed()
                self.streams = (STREAM_MISSES and m.stream_misses and self.ops.grouped and m.hybrid is None
                                and not m.cache.holds_every_expert and self.can_stream())
                self.ops.stream = self.streams
                # streaming with prefetch: the next layer's guessed misses fetched while this one runs
                self.s.fetch = self.streams and STREAM_FETCH and depth > 0
                self.ops.staging = (torch.empty((2, m.cfg.top_k, m.cache.slot_bytes), dtype=torch.uint8, device=m.device)
                                    if self.s.fetch else None)
                self.one_graph = self.ops.grouped and (m.cache.holds_every_expert or self.streams)
                self.s.resident = self.one_graph
                if self.one_graph:  # each MoE layer's experts in place, which then never change
                    self.resident = [m.cache.resident(i) for i in range(m.cfg.num_moe_layers)]
                self.runs_ahead = RUN_AHEAD and self.one_graph and self.embedding_readable()
                self.ops.hits_first = (HITS_FIRST and self.ops.grouped and not self.one_graph and m.cache.in_place_rows
                                       and self.ops.late_supported(m.cache.slot_weights(0, 0)))
            if self.s.cos.shape[0] != m.kv.capacity:  # a new KV cache: RoPE for its positions
                self.s.cos, self.s.sin = self.rope_tables()
            self.graphs = {}
            if self.capture:
                self.pool = torch.cuda.graph_pool_handle()
            if depth and depth != self.forced[2].shape[1]:
                self.forced = (*self.forced[:2], distinct_ids((self.forced[1].shape[0], depth, m.cfg.top_k), m.device))
            self.key = key

    def prepare(self, max_position: int, progress=None) -> None:
        """Capture every graph decode can need up to max_position, before any generation: the
        keys OffloadedMixtral.layer hands to run().

        Must run before a prefill: the eager warm-up writes position 0 of the KV cache.
        """
        m, s, ops, cache = self.m, self.s, self.ops, self.m.cache
        self.check_keys()
        self.pos.zero_()
        jobs: dict[tuple, object] = {}
        forced = self.is_forced()
        s.forced = self.forced if forced else None
        if self.one_graph:
            jobs[("token", forced)] = self.token_segment
            if self.runs_ahead:
                jobs[("ahead", forced)] = self.ahead_segment
        else:
            spans = sorted({attention_span(p, m.kv.capacity) for p in range(0, max_position, 256)}
                           | {attention_span(max_position - 1, m.kv.capacity)})
            for span in spans:
                for i, layer in enumerate(m.layers):
                    s.span = span
                    jobs.setdefault(("attention", i, ops.span(layer, s), forced),
                                    lambda i=i, layer=layer, span=span: self.attention_job(i, layer, span))
            for i, layer in enumerate(m.layers):
                if "mlp" in layer:
                    jobs[("mlp", i)] = lambda layer=layer: s.out.copy_(m.expert(layer["mlp"], s.h))
                    continue
                mi = layer["moe_index"]
                if ops.grouped:
                    jobs[("moe", i)] = lambda mi=mi: ops.experts(mi, s, s.ids[mi])
                    if ops.hits_first:  # the experts that were not in place, n of them
                        for n in range(1, m.cfg.top_k + 1):
                            jobs[("late", i, n)] = lambda mi=mi, n=n: ops.late_experts(mi, s, n)
                    if m.hybrid is not None:  # the GPU part of a layer that also runs CPU experts
                        for n in range(1, m.cfg.top_k):
                            jobs[("moe", i, n)] = lambda mi=mi, n=n: ops.experts(mi, s, s.ids[mi], n)
                else:
                    for slot in range(cache.slots_in(mi)):
                        w = cache.slot_weights(mi, slot)
                        for k in range(m.cfg.top_k):
                            jobs[("expert", i, slot, k)] = lambda w=w, k=k: m.add_expert(w, s, -1, k)
                if "shared" in layer:
                    jobs[("shared", i)] = lambda layer=layer: m.shared_expert(layer, s)
            jobs[("head",)] = self.head_segment
        for n, (key, fn) in enumerate(jobs.items()):
            self.run(key, fn)
            if progress and n % 32 == 0:
                progress(n / len(jobs), "preparing CUDA graphs")

    def attention_job(self, i: int, layer: dict, span: int) -> None:
        self.s.span = span
        self.m.attention_block(i, layer, self.s, self.ops)

    def run(self, key: tuple, fn) -> None:
        """One device segment of the layer: replayed if captured, else run and captured."""
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            return
        if not self.capture:
            self.graphs[key] = None
            fn()
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

    # -- whether the fast paths work on this machine ----------------------------------------------

    def can_stream(self) -> bool:
        """Whether the grouped kernel can read experts where they lie in host memory (STREAM_MISSES)."""
        m, cache, s = self.m, self.m.cache, self.s
        host_off = cache.host_offset(0)
        if host_off is None:
            return False
        absent = torch.full((m.cfg.num_experts,), -1, dtype=torch.int32, device=m.device)
        return m.fast_path_works(lambda: self.ops.moe_decode(
            s.h, cache.slot_weights(0, 0), cache.slot_bytes, torch.arange(m.cfg.top_k, device=m.device),
            s.weights[0], absent, torch.empty_like(s.out), host_off), "experts read from host memory")

    def probe_decode_kernels(self) -> None:
        """Each fused kernel of the attention segment once, on scratch outputs."""
        m, s, cfg, dev = self.m, self.s, self.m.cfg, self.m.device
        layer = m.layers[0]
        add_rms_norm(torch.zeros_like(s.x), s.x, layer["attn_norm"], cfg.rms_norm_eps, torch.empty_like(s.x))
        if m.moe_layers:
            route_topk(s.x, m.moe_layers[0]["router"], cfg.top_k, torch.empty_like(s.weights[0]),
                       torch.empty_like(s.ids[0, 0]), m.moe_layers[0].get("router_bias"))
        q = torch.zeros(cfg.num_heads, cfg.head_dim, dtype=m.dtype, device=dev)
        kv = torch.zeros(cfg.num_kv_heads, cfg.head_dim, dtype=m.dtype, device=dev)
        cache = torch.zeros(1, cfg.num_kv_heads, cfg.head_dim, dtype=m.dtype, device=dev)
        rope_attention(q, kv, kv, s.cos, s.sin, torch.zeros_like(self.pos), cache, cache.clone(),
                       cfg.sliding_window, torch.empty(1, cfg.num_heads * cfg.head_dim, dtype=m.dtype, device=dev),
                       **attention_options(layer, cfg.rms_norm_eps))
        if hqq_gpu.pair_supported(layer["k_proj"], layer["v_proj"]):
            out = torch.empty(1, cfg.num_kv_heads * cfg.head_dim, dtype=m.dtype, device=dev)
            hqq_gpu.gemv_pair(s.x, layer["k_proj"], layer["v_proj"], out, torch.empty_like(out))

    def embedding_readable(self) -> bool:
        """Whether the graphs can read a token's embedding: on the device, or in host memory the
        GPU reads over the link (page-locked here, once: 1.2 GB for gpt-oss-20b)."""
        m = self.m
        if not m.embed_on_host:
            return True
        if not self.capture:  # the tests' capture=False run on the CPU
            return True
        if not m.embed.is_pinned():
            try:
                m.embed = m.embed.pin_memory()
            except RuntimeError as e:  # page-locked memory refused: the host reads each token first
                warnings.warn(f"the embedding could not be page-locked ({e}); decoding waits for each token", stacklevel=2)
                return False
        s = self.s
        return m.fast_path_works(lambda: embed_row(m.embed, s.tokens, s.x), "the embedding read by the GPU")

    def can_group(self) -> bool:
        """Whether a grouped expert kernel (FusedOps.moe_decode) can run this model's experts from this cache."""
        m, cache = self.m, self.m.cache
        if (not m.moe_layers or cache.decode is not None or cache.slots_per_layer < m.cfg.top_k
                or not self.ops.grouped_supported(cache.slot_weights(0, 0))):
            return False
        # slot 0 for every expert: a valid address whatever the slots hold
        s = self.s
        return self.m.fast_path_works(lambda: self.ops.moe_decode(
            s.h, cache.slot_weights(0, 0), cache.slot_bytes, torch.arange(m.cfg.top_k, device=m.device),
            s.weights[0], torch.zeros(m.cfg.num_experts, dtype=torch.int32, device=m.device),
            torch.empty_like(s.out)), "grouped expert kernels")


_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def shared_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """The device's one stream for a role ("capture": the graphs are captured on it; "side": the
    k and v GEMVs beside q; "fetch": FusedOps.fetch_ahead's copies), shared by every GraphedDecode. The fused kernels keep their scratch
    per stream (hqq_gpu._Scratch, which never shrinks): a new stream for each new set of graphs
    (a new expert cache, each run of the benchmark) left the last one's scratch allocated,
    about 0.1 GiB each time, past what the VRAM budget sizes."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, role) not in _STREAMS:
        _STREAMS[index, role] = torch.cuda.Stream(device)
    return _STREAMS[index, role]


def attention_span(start: int, capacity: int) -> int:
    """Positions an eager attention reads at `start`: a power of two >= start+1 (min 256), so a
    graph serves many positions and the masked tail stays small."""
    span = 256
    while span < start + 1:
        span *= 2
    return min(span, capacity)
