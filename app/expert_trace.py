"""What the expert map draws, computed from the engine's ExpertTrace. No Qt."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from moeferry.engine.contract import ExpertTrace


# Cell states of the per-layer token timeline.
class Cell(IntEnum):
    IDLE = 0       # not selected, not on the GPU
    RESIDENT = 1   # on the GPU, not selected for this token
    HIT = 2        # selected and already on the GPU
    MISS = 3       # selected and copied over PCIe


@dataclass
class TraceSummary:
    num_layers: int
    num_experts: int
    num_tokens: int
    counts: list[list[int]]            # [layer][expert] times selected
    hits: list[list[int]]              # [layer][expert] times selected while already resident
    resident: list[list[float]]        # [layer][expert] share of tokens it was resident
    cells: list[list[list[Cell]]]      # [layer][expert][token]

    def layer_hit_rate(self, layer: int) -> float | None:
        total = sum(self.counts[layer])
        return sum(self.hits[layer]) / total if total else None

    def hit_rate(self) -> float | None:
        total = sum(map(sum, self.counts))
        return sum(map(sum, self.hits)) / total if total else None

    @property
    def max_count(self) -> int:
        return max((max(row) for row in self.counts), default=0)


def summarize_trace(trace: ExpertTrace | None) -> TraceSummary | None:
    """Summarize `trace` (.selected and .resident_before per token per layer); None when empty."""
    if trace is None or not trace.selected:
        return None
    selected, resident_before = trace.selected, trace.resident_before
    num_layers, num_experts = trace.num_layers, trace.num_experts
    num_tokens = len(selected)
    counts = [[0] * num_experts for _ in range(num_layers)]
    hits = [[0] * num_experts for _ in range(num_layers)]
    resident_n = [[0] * num_experts for _ in range(num_layers)]
    cells = [[[Cell.IDLE] * num_tokens for _ in range(num_experts)] for _ in range(num_layers)]
    for t, per_layer in enumerate(selected):
        res_t = resident_before[t] if t < len(resident_before) else ()
        for layer, experts in enumerate(per_layer[:num_layers]):
            resident = set(res_t[layer]) if layer < len(res_t) else set()
            for e in resident:
                if 0 <= e < num_experts:
                    resident_n[layer][e] += 1
                    cells[layer][e][t] = Cell.RESIDENT
            for e in experts:
                if not 0 <= e < num_experts:
                    continue
                counts[layer][e] += 1
                if e in resident:
                    hits[layer][e] += 1
                    cells[layer][e][t] = Cell.HIT
                else:
                    cells[layer][e][t] = Cell.MISS
    resident = [[n / num_tokens for n in row] for row in resident_n]
    return TraceSummary(num_layers, num_experts, num_tokens, counts, hits, resident, cells)
