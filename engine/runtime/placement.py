"""Where experts live and where each miss is computed: a cost model of measured costs.

Every expert has a home: a GPU cache slot (the per-layer LRU of engine/runtime/expert_cache.py, which
keeps the frequently used ones), and, RAM permitting, a CPU copy (engine/runtime/cpu_experts.py).
For each miss of a layer the engine picks one of
  copy  bring it over the link into the cache, then compute it on the GPU;
  cpu   compute it on the CPU from its CPU copy (the activation goes down, the result up);
  both  compute it on the CPU now and copy it for later use, when the link would otherwise
        sit idle while this layer waits for the CPU.
Layers run one after another, so the model minimises each layer's critical path:
  GPU side: the copies, one after another on the link, then the GPU's experts;
  CPU side: the hand-off, then its experts one after another;
and takes max(GPU side, CPU side). For T tokens (prefill) a CPU expert reads its weights once
and does 2 * params * T flops; a copy costs the same for any T, which is why long prompts copy
and short ones compute.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a decoded layer that runs a CPU expert spends beside the kernel on a GPU machine: the
# host's queuing of the layer's copies before the kernel starts, the activation down, the
# results up. On the GPU machine such a layer spent 0.1-0.6 ms more on the host than one that
# copies (docs/BENCHMARKS.md, 2026-12-03); the engine starts from this and learns its own
# (cpu_experts.learned_costs), which ended at 0.8-2.8 ms in the runs of that day.
CUDA_HAND_OFF_S = 0.3e-3


@dataclass
class Costs:
    """Measured (or stated) speeds; see measure_costs in engine/runtime/generate.py."""
    link_gbps: float  # host -> device for one expert (pinned), GB/s
    cpu_gbps: float  # the CPU kernel's read speed for the CPU copies, at the threads in use
    gpu_expert_s: float  # one cached expert on the GPU at batch 1
    cpu_gflops: float = 1000.0  # the CPU kernel at many tokens (prefill); measured at load
    cpu_overhead_s: float = 50e-6  # the hand-off: from the choice to the kernel's start, and its results up


@dataclass(frozen=True)
class ExpertSizes:
    gpu_bytes: int  # one expert as stored and copied (the link moves this)
    cpu_bytes: int  # its CPU copy (the CPU kernel reads this)
    params: int  # weights in one expert (3 * hidden * intermediate)


@dataclass(frozen=True)
class MissPlan:
    cpu: tuple[int, ...]  # computed on the CPU (including `both`)
    copy: tuple[int, ...]  # copied, then computed on the GPU
    both: tuple[int, ...]  # computed on the CPU and copied for later
    seconds: float  # the layer's predicted critical path


def copy_s(c: Costs, s: ExpertSizes) -> float:
    return s.gpu_bytes / (c.link_gbps * 1e9)


def cpu_s(c: Costs, s: ExpertSizes, tokens: int) -> float:
    return max(s.cpu_bytes / (c.cpu_gbps * 1e9), 2 * s.params * tokens / (c.cpu_gflops * 1e9))


def layer_s(c: Costs, s: ExpertSizes, hits: int, copied: list[int], on_cpu: list[int],
            tokens: dict[int, int]) -> float:
    gpu = len(copied) * copy_s(c, s) + (hits + len(copied)) * c.gpu_expert_s
    cpu = c.cpu_overhead_s + sum(cpu_s(c, s, tokens[e]) for e in on_cpu) if on_cpu else 0.0
    return max(gpu, cpu)


def choose_misses(c: Costs, s: ExpertSizes, misses: list[int], hits: int, can_cpu: set[int],
                  tokens: dict[int, int]) -> MissPlan:
    """Split one layer's misses between the link and the CPU (see the module docstring).

    tokens: expert -> how many of the step's tokens it serves. Every copy costs the same, so
    for n experts on the CPU the best are the n that serve the fewest tokens: the split is the
    best of those len(able) + 1 prefixes (a prompt can miss every expert of a layer: 128 for
    Qwen3-30B-A3B, whose subsets could never all be tried). Ties go to copying (the cache then
    learns). `both` takes CPU experts, most tokens first, while the link stays within the
    layer's critical path.
    """
    able = sorted((e for e in misses if e in can_cpu), key=lambda e: tokens[e])  # stable: misses' order
    best = None
    for n in range(len(able) + 1):
        on_cpu = tuple(sorted(able[:n], key=misses.index))
        copied = [e for e in misses if e not in on_cpu]
        t = layer_s(c, s, hits, copied, list(on_cpu), tokens)
        if best is None or t < best[0] * (1 - 1e-9):
            best = (t, on_cpu, copied)
    t, on_cpu, copied = best
    link, both = len(copied) * copy_s(c, s), []
    for e in sorted(on_cpu, key=lambda e: -tokens[e]):
        if link + copy_s(c, s) <= t:
            both.append(e)
            link += copy_s(c, s)
    return MissPlan(tuple(on_cpu), tuple(copied), tuple(both), t)


def choose_by_finish(c: Costs, s: ExpertSizes, now: float, link_free_at: float,
                     experts: list[tuple[int, float | None]], can_cpu: set[int]) -> set[int]:
    """Decode (one token): the experts of a layer to compute on the CPU, each going where it
    finishes first. experts: (expert, when its copy lands on the device, for a resident one
    whose copy may still be in flight; None for a miss, which would queue behind the link's
    queue, free at link_free_at). On the CPU the layer's experts run one after another after
    the hand-off. The expert the device would finish last is offered to the CPU first."""
    copy, gpu, one = copy_s(c, s), c.gpu_expert_s, cpu_s(c, s, 1)
    link, finish = max(now, link_free_at), []
    for e, ready in experts:
        if ready is None:
            link += copy
            finish.append((link + gpu, e))
        else:
            finish.append((max(now, ready) + gpu, e))
    finish.sort(key=lambda fe: fe[0], reverse=True)  # stable: ties keep the experts' order
    cpu_free, on_cpu = now + c.cpu_overhead_s, set()
    for f, e in finish:
        if e in can_cpu and cpu_free + one < f:
            on_cpu.add(e)
            cpu_free += one
    return on_cpu


def cpu_copies(num_layers: int, num_experts: int, cpu_bytes: int, ram_budget: int | None,
               slots: int, counts: list[list[int]] | None = None) -> list[tuple[int, int]]:
    """Which experts get a CPU copy within ram_budget (None = all): (layer, expert) pairs.

    The experts that miss most are worth a copy most: per layer, ranked by use (counts from a
    trace, else all equal), the ones just outside the `slots` most used come first (they are
    used often and usually not cached), then the rest of the uncached, then the cached ones.
    Layers take turns, so a partial budget spreads over all layers.
    """
    order = []
    for layer in range(num_layers):
        use = counts[layer] if counts else [0] * num_experts
        ranked = sorted(range(num_experts), key=lambda e: (-use[e], e))
        order.append(ranked[slots:] + ranked[:slots])
    fit = num_layers * num_experts if ram_budget is None else max(0, ram_budget // max(cpu_bytes, 1))
    picks = [(layer, order[layer][r]) for r in range(num_experts) for layer in range(num_layers)]
    return picks[:fit]


def predicted_miss_s(c: Costs, s: ExpertSizes, misses_per_layer: int,
                     hits_per_layer: int) -> tuple[float, float]:
    """(GPU-only, hybrid) seconds for one layer with that many misses at batch 1: what the
    probe and the plan quote for the hybrid's speed."""
    misses = list(range(misses_per_layer))
    tokens = {e: 1 for e in misses}
    gpu_only = layer_s(c, s, hits_per_layer, misses, [], tokens)
    return gpu_only, choose_misses(c, s, misses, hits_per_layer, set(misses), tokens).seconds
