"""Experts computed on the CPU from host memory.

No compiler is needed on the user's machine. The default, "hqq", is not a copy at all: the
kernel of engine/kernels/hqq_cpu.py (numba) reads an HQQ expert (2, 3 or 4 bits), and that of
engine/kernels/mxfp4_cpu.py an MXFP4 one (gpt-oss's, as released), in the host memory the GPU
cache copies it from, metadata included, so every expert can run on the CPU at no RAM cost.
The other formats are copies in their own layout for torch's prebuilt CPU ops
(engine/kernels/torch_cpu.py: int4, int8, dense), derived from the dequantized expert: for
16-bit stores, or where numba or AVX2 is missing.

An expert is two matrices: w13 = [w1; w3] ([2I, H], one product gives gate and up) and
w2 [H, I]; out = w2 (silu(w1 x) * w3 x). forward() takes and returns float32; inside, x is
rounded to the matrix's activation dtype (bfloat16 for int4/int8, as on the GPU).
torch has no 2- or 3-bit CPU kernel, and a pure-torch one (unpack, then matmul) writes the
unpacked weights back to RAM: about 100x slower than int4 (benchmarks/cpu_experts.py); hence
the numba kernel for the store's own bytes.

The CPU experts run on the host thread once it has queued the rest of the layer: the link's
copies, the GPU's experts and the prefetches (OffloadedMixtral.dispatch): the GPU and the
link work meanwhile, and the kernel's threads (numba's
and torch's pools, which stay warm between calls) have the host to themselves. A
worker thread would overlap the host's queuing too, but then fights it for the GIL at every
Python step around the kernel: measured on the GPU machine (benchmarks/cpu_hybrid_probe.py,
docs/BENCHMARKS.md), a 2-bit expert took 3.4 ms on a worker beside a busy host instead of
1.4 ms, and 20 GB/s inside the engine instead of 35.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from moeferry.engine.kernels import hqq_cpu, mxfp4_cpu
from moeferry.engine.kernels.torch_cpu import FORMATS as COPY_FORMATS, INPUT_MULTIPLE, CpuMatrix, make_matrix
from moeferry.engine.runtime import placement
from moeferry.engine.runtime.cpu_threads import ThreadGovernor
from moeferry.engine.runtime.model import clamped_swiglu
from moeferry.engine.storage.mxfp4 import Mxfp4Matrix

FORMATS = ("hqq",) + COPY_FORMATS  # "hqq": the stored expert, in place; the others copies in their own layout
LEARN = 0.2  # weight of each decoded layer's CPU rate in the cost model's (learned_costs)
OUTLIER = 4.0  # the most a decoded layer's CPU rate or hand-off is taken to differ from the model's


@dataclass
class CpuExpert:
    w13: CpuMatrix
    w2: CpuMatrix

    def nbytes(self) -> int:
        return self.w13.nbytes() + self.w2.nbytes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 [T, H] -> float32 [T, H]."""
        gate, up = self.w13.matmul(x).chunk(2, dim=-1)
        return self.w2.matmul(F.silu(gate) * up)


@dataclass
class HqqExpert:
    """An expert as stored (HQQ QMatrix views of host memory), run by engine/kernels/hqq_cpu.py.
    With biases (gpt_oss) it is the clamped SwiGLU of engine/runtime/model.py's clamped_swiglu_expert."""
    w1: object  # hqq_cpu.CpuQMatrix (Mxfp4Expert: Mxfp4Matrix)
    w3: object
    w2: object
    biases: tuple | None = None  # (b1, b3, b2) float32, gpt_oss
    alpha: float | None = None  # its clamped SwiGLU's constants (ModelConfig.swiglu_*)
    limit: float | None = None
    kernel = hqq_cpu  # the module whose matmul takes its matrices

    def nbytes(self) -> int:
        return self.stored_bytes  # counted for every call (run_jobs): summed once

    @cached_property
    def stored_bytes(self) -> int:
        return self.w1.nbytes() + self.w3.nbytes() + self.w2.nbytes()

    def copied_bytes(self) -> int:
        """RAM this expert takes beyond the stored bytes it reads in place."""
        return self.w1.copied_bytes() + self.w3.copied_bytes() + self.w2.copied_bytes()

    @cached_property
    def addresses(self) -> np.ndarray:
        """hqq_cpu.expert_addresses of its matrices (forward, run_together)."""
        return hqq_cpu.expert_addresses(self.w1, self.w3, self.w2)

    @cached_property
    def layout(self) -> tuple:
        """What experts run together in one call must share (run_together): shapes and quantization."""
        return tuple((w.rows, w.cols, w.bits, w.group_size, w.scale_meta.shape, w.zero_meta.shape)
                     for w in (self.w1, self.w3, self.w2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().numpy()
        if self.biases is None and self.kernel is hqq_cpu:
            return torch.from_numpy(hqq_cpu.swiglu_expert(x, self.w1, self.w3, self.w2, self.addresses))
        b1, b3, b2 = self.biases or (0.0, 0.0, 0.0)
        gate = torch.from_numpy(self.kernel.matmul(x, self.w1)) + b1
        up = torch.from_numpy(self.kernel.matmul(x, self.w3)) + b3
        act = F.silu(gate) * up if self.biases is None else clamped_swiglu(gate, up, self.alpha, self.limit)
        return torch.from_numpy(self.kernel.matmul(act.numpy(), self.w2)) + b2


@dataclass
class Mxfp4Expert(HqqExpert):
    """gpt-oss's expert as released (Mxfp4Matrix views of host memory), run by engine/kernels/mxfp4_cpu.py."""
    kernel = mxfp4_cpu

    def copied_bytes(self) -> int:
        return 0  # the views are the stored bytes


def hqq_expert(w: dict, alpha: float | None = None, limit: float | None = None) -> HqqExpert:
    """The stored expert, run in place. w: its views ("w1", "w3", "w2": HQQ QMatrix or
    Mxfp4Matrix; "b1", "b3", "b2" where the family has biases), in host memory; alpha and limit:
    the clamped SwiGLU's (gpt_oss)."""
    biases = tuple(w[b].float() for b in ("b1", "b3", "b2")) if "b1" in w else None
    if isinstance(w["w1"], Mxfp4Matrix):
        return Mxfp4Expert(w["w1"], w["w3"], w["w2"], biases, alpha, limit)
    return HqqExpert(*(hqq_cpu.from_qmatrix(w[m]) for m in ("w1", "w3", "w2")), biases, alpha, limit)


def hqq_supported(w: dict) -> bool:
    """Whether the stored expert (its views) can run in place ("hqq"), numba installed."""
    return not hqq_unsupported_reason(w)


def hqq_unsupported_reason(w: dict) -> str:
    """"" when the stored expert (its views) can run in place, else why not (one sentence)."""
    missing = hqq_cpu.available()  # numba and AVX2: what both kernels need
    if missing:
        return missing
    if all(hqq_cpu.supported(w.get(m)) or isinstance(w.get(m), Mxfp4Matrix) for m in ("w1", "w3", "w2")):
        return ""
    if any(isinstance(w.get(m), torch.Tensor) for m in ("w1", "w3", "w2")):
        return ("some of this store's expert matrices stayed at 16 bits when it was converted (their sizes do "
                "not divide into the quantization groups), and the CPU kernel runs 2-, 3- and 4-bit HQQ only.")
    return "this store's experts are neither 2-, 3- or 4-bit HQQ nor MXFP4, which is what the CPU kernels run."


# ---------------------------------------------------------------------------------------------
# Making CPU copies


def make_expert(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, fmt: str) -> CpuExpert:
    """The CPU copy of one expert from its float weights (w1, w3 [I, H], w2 [H, I]) on any
    device (quantized there); the copy is in host memory."""
    return CpuExpert(make_matrix(torch.cat([w1, w3]), fmt), make_matrix(w2, fmt))


def supported(fmt: str, hidden: int, intermediate: int) -> bool:
    """Whether `fmt` can hold experts of this shape (its inputs, hidden for w1/w3 and
    intermediate for w2, in multiples of INPUT_MULTIPLE[fmt])."""
    m = INPUT_MULTIPLE[fmt]
    return hidden % m == 0 and intermediate % m == 0


# ---------------------------------------------------------------------------------------------
# Running them


@dataclass
class CpuRunStats:
    experts: int = 0
    bytes_read: int = 0
    seconds: float = 0.0  # the CPU computing, on the host thread: all of it on the layers' critical path
    last_bytes: int = 0  # the last run_jobs call's, for learned_costs
    last_seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


def run_jobs(jobs: list[tuple[CpuExpert, torch.Tensor]], stats: CpuRunStats) -> list[torch.Tensor]:
    """expert(x) for each (expert, x [T, H]), float32 [T, H] each; counts bytes and time."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = run_together(jobs) or [e.forward(x) for e, x in jobs]
    dt = time.perf_counter() - t0
    stats.last_bytes, stats.last_seconds = sum(e.nbytes() for e, _ in jobs), dt
    stats.experts += len(jobs)
    stats.bytes_read += stats.last_bytes
    stats.seconds += dt
    return out


def run_together(jobs: list[tuple[CpuExpert, torch.Tensor]]) -> list[torch.Tensor] | None:
    """The jobs' outputs from one hqq_cpu.swiglu_experts call where they allow it (two or more
    plain HQQ experts of one layout on the same input: a decoded token's experts of a layer),
    else None. One call starts the kernel's threads four times for all of them, not for each."""
    if len(jobs) < 2:
        return None
    first, x = jobs[0]
    if any(type(e) is not HqqExpert or e.biases is not None or xe is not x or e.layout != first.layout
           for e, xe in jobs):
        return None
    y = hqq_cpu.swiglu_experts(x.float().numpy(), [(e.w1, e.w3, e.w2) for e, _ in jobs],
                               np.stack([e.addresses for e, _ in jobs]))
    return [torch.from_numpy(y[i]) for i in range(len(jobs))]


def learned_costs(costs, bytes_read: int, seconds: float, hand_off_s: float | None = None):
    """costs with its CPU rate (and, when given, its hand-off) moved LEARN of the way to what one
    decoded layer's CPU work just achieved. The load-time measurement (generate.measure_costs)
    times the CPU alone; beside the link's copies (which read the same RAM) and the host's
    queuing of GPU work it can be slower, and a cost model that kept the idle rate would then
    send it misses that the link serves sooner. hand_off_s: the seconds from the choice to the
    kernel's start plus those from its end to the results' hand-up (choose_by_finish's
    cpu_overhead_s)."""
    if bytes_read <= 0 or seconds <= 0:
        return costs
    # a layer at most OUTLIER times off counts: one stall (a page fault, the collector, another
    # program) then moves the model by a few per cent, and it never locks the CPU out for good
    rate = min(max(bytes_read / seconds / 1e9, costs.cpu_gbps / OUTLIER), costs.cpu_gbps * OUTLIER)
    learned = replace(costs, cpu_gbps=(1 - LEARN) * costs.cpu_gbps + LEARN * rate)
    if hand_off_s is not None:
        hand_off_s = min(hand_off_s, OUTLIER * max(costs.cpu_overhead_s, 1e-4))
        learned.cpu_overhead_s = (1 - LEARN) * costs.cpu_overhead_s + LEARN * hand_off_s
    return learned


# ---------------------------------------------------------------------------------------------
# The engine's side: which experts of a step run here, and adding their results


class CpuExperts:
    """The CPU copies of some experts and the per-layer choice of what runs here.

    mode "all": every miss that has a CPU copy runs on the CPU, and is copied into the cache
    meanwhile for its next use (the layer never waits for the link; the cache still learns);
    "auto": placement's cost model splits the misses between the link and the CPU.
    every_expert: no device cache at all (a machine without a GPU): every routed expert runs
    on the CPU. Either way they run in the calling thread (the module docstring says why).
    """

    def __init__(self, copies: dict[tuple[int, int], CpuExpert], mode: str, costs=None,
                 gpu_bytes: int = 0, params: int = 0, every_expert: bool = False,
                 threads: int | None = None):
        if mode not in ("auto", "all"):
            raise ValueError(f"unknown CPU expert mode {mode!r}")
        self.copies, self.mode, self.costs, self.every_expert = copies, mode, costs, every_expert
        self.able: dict[int, set[int]] = {}  # layer -> its experts that have a CPU copy
        for layer, e in copies:
            self.able.setdefault(layer, set()).add(e)
        cpu_bytes = max((c.nbytes() for c in copies.values()), default=0)
        self.sizes = placement.ExpertSizes(gpu_bytes, cpu_bytes, params)
        self.numba = any(isinstance(c, HqqExpert) for c in copies.values())
        self.torch_threads = torch.get_num_threads()  # torch's count at most, under the governor
        self.asked_threads = threads  # --cpu-threads (None: automatic)
        self.set_threads(threads)
        self.stats = CpuRunStats()
        self.stage: torch.Tensor | None = None  # pinned float32 [1, H]: a decoded token's CPU sum on its way up
        self.stage_dev: torch.Tensor | None = None  # its twin on the device (on a CPU device: itself)
        self.down: torch.Tensor | None = None  # pinned [1, H]: a decoded token's h on its way down
        self.weights_host: torch.Tensor | None = None  # its routing weights [1, k], beside it
        self.learning = False  # the running step was placed by choose_in_time: its CPU costs are learned
        self.link_planned: tuple | None = None  # (cache, costs) last told to cache.plan_link
        self.chosen_at = 0.0  # when choose_in_time placed it (host clock)

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.copies.values())

    def set_threads(self, n: int | None) -> None:
        """n threads for the CPU's kernels; None: on a machine without a GPU (every_expert, numba's
        kernels), every one of numba's pool but fewer while other programs hold cores
        (engine/runtime/cpu_threads.py), else the pools' own counts. The GPU hybrid's tokens
        vary with its hits and misses more than the governor's tries tell apart (not measured
        there yet)."""
        self.governor = None
        if n is None and self.numba and self.every_expert:
            import numba
            most = numba.config.NUMBA_NUM_THREADS
            self.governor = ThreadGovernor(most) if most > 1 else None
            n = most
        self._take(n)

    def _take(self, n: int | None) -> None:
        """n from now on, in the calling thread's pools and, at their next run, in others'."""
        self.threads, self.threads_set_in = n, None  # the thread whose pools have self.threads (use_threads)
        self.use_threads()

    def use_threads(self) -> None:
        """Give the calling thread's pools (torch's and numba's keep their size per thread) the
        CPU experts' thread count, once per thread: the experts run in the thread that decodes,
        which need not be the one that loaded (the API server decodes on its queue's thread).
        Under the governor torch keeps at most its own count (its pool is sized to the cores,
        numba's to the logical processors)."""
        if self.threads and self.threads_set_in != threading.get_ident():
            torch.set_num_threads(self.threads if self.governor is None else min(self.threads, self.torch_threads))
            if self.numba:
                hqq_cpu.set_threads(self.threads)
            self.threads_set_in = threading.get_ident()

    def token_done(self, seconds: float) -> None:
        """A decoded token took this long: the governor's count for the next (when it has one)."""
        if self.governor is not None:
            n = self.governor.observe(seconds)
            if n != self.threads:
                self._take(n)

    def warm(self) -> None:
        """Run the kernels a decoded layer calls, one expert and two together, once now: numba
        compiles each on its first call (about 10 s, or a disk cache's load). In the first
        token that time would stall it, and the cost model, learning the CPU's rate from it,
        would keep misses off the CPU for long after."""
        copies = list(self.copies.values())[:2]
        if copies:
            x = torch.zeros(1, copies[0].w2.rows)
            self.run([(copies[0], x)])
            self.run([(c, x) for c in copies])

    def run(self, jobs: list[tuple[CpuExpert, torch.Tensor]]) -> list[torch.Tensor]:
        """expert(x) for each (expert, x float32 [T, H]): float32 [T, H] each."""
        self.use_threads()
        return run_jobs(jobs, self.stats)

    def choose(self, layer: int, needed: list[int], ids_host: list[list[int]], cache):
        """-> (rows, both): rows = expert -> [(token, top-k position)] for the experts of this
        step that run on the CPU; both = those of them also copied into the cache for later."""
        if not self.every_expert and cache.policy != "lru":
            return {}, []
        if self.mode == "auto" and len(ids_host) == 1 and cache.cuda and self.costs is not None:
            return self.choose_in_time(layer, needed, ids_host[0], cache)  # decode: where each finishes first
        uses = {e: [(t, row.index(e)) for t, row in enumerate(ids_host) if e in row] for e in needed}
        if self.every_expert:
            return uses, []
        resident = set(cache.resident(layer))
        misses = [e for e in needed if e not in resident]
        able = {e for e in misses if (layer, e) in self.copies}
        if self.mode == "all" or not able:  # all: computed here, copied for later off the critical path
            run = sorted(able)
            both = run if self.mode == "all" else []
        else:
            plan = placement.choose_misses(self.costs, self.sizes, misses, len(needed) - len(misses),
                                           able, {e: len(uses[e]) for e in misses})
            run, both = sorted(plan.cpu), list(plan.both)
        cache.count_cpu_misses(len(run), len(both))
        return {e: uses[e] for e in run}, both

    def choose_in_time(self, layer: int, needed: list[int], row: list[int], cache):
        """choose() for one decoded token on a GPU: the cache keeps the link's queue on the host
        clock (when each copy lands), so an expert whose copy would land later than the CPU
        could compute it runs on the CPU, a miss or a prefetched expert still in flight alike
        (the copy goes on and serves a later token). Prefetch pauses while the link is backed
        up further than the CPU's time for one expert. The CPU's rate is relearned from every
        layer it works (learned_costs)."""
        # told again whenever the costs (learned) or the cache (Engine.set_cache_experts) change;
        # a prefetch queued behind more than one CPU expert's time would land after the CPU could
        # have computed it: it would only take the link from the copies that help
        if self.link_planned is None or self.link_planned[0] is not cache or self.link_planned[1] is not self.costs:
            cache.plan_link(1 / (self.costs.link_gbps * 1e9), placement.cpu_s(self.costs, self.sizes, 1))
            self.link_planned = (cache, self.costs)
        self.chosen_at = time.perf_counter()
        if cache.link_free_time() <= self.chosen_at and cache.holds(layer, needed):
            return {}, []  # every expert in place: nothing can finish sooner on the CPU
        run = sorted(placement.choose_by_finish(self.costs, self.sizes, self.chosen_at, cache.link_free_time(),
                                                cache.landing(layer, needed), self.able.get(layer, frozenset())))
        cache.count_cpu_misses(len(run), 0)
        self.learning = bool(run)
        return {e: [(0, row.index(e))] for e in run}, []

    def start(self, layer: int, rows: dict, h: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> "CpuJob":
        """Send h down for rows' experts (see choose); the job computes them (compute(), once the
        link has its copies) and adds their outputs times their routing weights to out (add(),
        once the device's experts of the layer are queued: they write out). A decoded token's are
        summed in float32 first, as the device's grouped kernel sums its experts, and added in
        one rounding: out = (out + sum of y * weight).to(out.dtype)."""
        experts = sorted(rows)
        if h.shape[0] == 1:  # decode: every expert takes the one token
            x = self._down(h, weights)
            jobs = [(self.copies[layer, e], x) for e in experts]
        else:
            h_host = h.detach().to("cpu", torch.float32)  # the host synced on routing: h is final
            jobs = [(self.copies[layer, e], h_host[[t for t, _ in rows[e]]]) for e in experts]
        return CpuJob(self, experts, rows, jobs, weights, out)

    def _down(self, h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A decoded token's h [1, H] -> float32 on the host, and its routing weights into
        self.weights_host, through pinned buffers (the host synced on routing and has queued
        nothing since: the copies do not wait)."""
        if h.device.type == "cpu":
            self.weights_host = weights
            return h.float()
        if self.down is None or self.down.shape != h.shape or self.down.dtype != h.dtype:
            self.down = torch.empty(h.shape, dtype=h.dtype, pin_memory=True)
        if self.weights_host is None or self.weights_host.shape != weights.shape:
            self.weights_host = torch.empty(weights.shape, dtype=weights.dtype, pin_memory=True)
        self.weights_host.copy_(weights, non_blocking=True)
        return self.down.copy_(h).float()  # waits for both

    def _stage(self, out: torch.Tensor) -> np.ndarray:
        """float32 [H]: where a decoded token's CPU sum is written, the numpy view of a pinned
        buffer (self.stage [1, H]) that _up sends to its device twin (self.stage_dev)."""
        if self.stage is None or self.stage.shape != out.shape or self.stage_dev.device != out.device:
            cuda = out.device.type == "cuda"
            self.stage = torch.empty(out.shape, dtype=torch.float32, pin_memory=cuda)
            self.stage_dev = torch.empty(out.shape, dtype=torch.float32, device=out.device) if cuda else self.stage
        return self.stage.numpy()[0]

    def _up(self) -> torch.Tensor:
        """The staged sum on the device (one copy, not waiting for it). Both buffers are
        rewritten only after the next layer's routing sync, by which time this copy and the
        add reading it have run."""
        if self.stage_dev is self.stage:
            return self.stage
        return self.stage_dev.copy_(self.stage, non_blocking=True)


class CpuJob:
    """One layer's CPU experts of one step (CpuExperts.start): compute() on the host thread,
    then add() their weighted sum into the layer's output."""

    def __init__(self, owner: CpuExperts, experts: list[int], rows: dict, jobs: list, weights, out):
        self.owner, self.experts, self.rows, self.jobs = owner, experts, rows, jobs
        self.weights, self.out = weights, out
        self.ys: list[torch.Tensor] = []
        self.started = 0.0
        self.seconds = 0.0  # compute()'s time on the host clock

    def compute(self) -> None:
        self.started = time.perf_counter()
        self.ys = self.owner.run(self.jobs)
        self.seconds = time.perf_counter() - self.started

    def add(self) -> None:
        o, out = self.owner, self.out
        if out.shape[0] == 1:  # decode: weighted and summed here (the host has the weights), one add there
            w = o.weights_host[0].float().numpy()
            total = o._stage(out)
            for j, (e, y) in enumerate(zip(self.experts, self.ys)):
                if j == 0:
                    np.multiply(y.numpy()[0], w[self.rows[e][0][1]], out=total)
                else:
                    total += y.numpy()[0] * w[self.rows[e][0][1]]
            out.add_(o._up())
        else:
            for e, y in zip(self.experts, self.ys):
                t = torch.tensor([t for t, _ in self.rows[e]], device=out.device)
                k = torch.tensor([k for _, k in self.rows[e]], device=out.device)
                out.index_add_(0, t, (y.to(out.device, out.dtype) * self.weights[t, k, None]).to(out.dtype))
        if o.learning:
            hand_off = time.perf_counter() - o.chosen_at - o.stats.last_seconds
            o.costs = learned_costs(o.costs, o.stats.last_bytes, o.stats.last_seconds,
                                    hand_off if 0 < o.chosen_at < self.started else None)
            o.learning, o.chosen_at = False, 0.0
