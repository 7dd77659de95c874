"""The prefetcher: copies the experts the next layers will probably need while this one runs.

The residual stream changes slowly from layer to layer, so MoE layer j's router applied to an
earlier layer i's residual stream guesses which experts j will route to. For each of the next
`depth` MoE layers the guess is made on the device inside layer i's attention segment
(`guess`, with the layer's operations: eager or fused), read on the host together with i's
routing (the layer's one sync, no other), and handed to the cache behind i's own copies
(`issue`). ExpertCache.prefetch is its one call into the cache. Only timing depends on the
guesses: a wrong one costs a copy, never a different output.
"""

from __future__ import annotations


class Prefetcher:
    def __init__(self, depth: int = 0):
        self.depth = depth  # MoE layers guessed ahead; 0 = off

    def ahead(self, model, i: int) -> range:
        """The MoE layers whose experts MoE layer i guesses: the next `depth`, none when the
        cache holds every expert (nothing would be copied)."""
        if model.cache.holds_every_expert:
            return range(0)
        return range(i + 1, min(i + 1 + self.depth, model.cfg.num_moe_layers))

    def guess(self, model, ops, i: int, s) -> None:
        """On the device: the guesses of MoE layer i into s.guesses[i] (row d: layer i+1+d)."""
        for d, j in enumerate(self.ahead(model, i)):
            ops.guess(j, s.x, s.hn, s.guesses[i, d])

    def pending(self, model, i: int, s):
        """The guesses `guess` wrote for MoE layer i: [D, k] on the device, or None."""
        n = len(self.ahead(model, i))
        return s.guesses[i, :n] if n else None

    def issue(self, cache, i: int, guesses: list[list[int]]) -> None:
        """Start the copies of the guesses read on the host (row d - 1: MoE layer i + d)."""
        for d, experts in enumerate(guesses, start=1):
            cache.prefetch(i + d, experts)
