"""OffloadedMixtral.hits_first's host part on the CPU, with operations that record what they are
asked (the kernels themselves: tests/engine/kernels/test_hqq_gpu.py and the graphed decode's
tests under the Triton interpreter; on CUDA tests/engine/runtime/test_engine_cuda.py)."""

from types import SimpleNamespace

import torch

from moeferry.engine.runtime.expert_cache import CacheStats, ExpertCache
from moeferry.engine.runtime.model import OffloadedMixtral
from moeferry.engine.runtime.prefetch import Prefetcher

L, E, B, TOP_K = 2, 6, 8, 2


class RecordingOps:
    """The grouped launch sees the table row the cache sent; the late one the positions staged."""

    hits_first = True

    def __init__(self, cache):
        self.cache, self.log = cache, []

    def read_later(self, picks, mi, n):
        self.log.append(("read queued", mi, n))
        return picks[mi, :n].tolist

    def experts(self, mi, s, ids):
        self.log.append(("first launch", mi, self.cache.table[mi].tolist()))

    def stage(self, at):
        self.staged = list(at)

    def late_experts(self, mi, s, n):
        self.log.append(("late launch", mi, self.staged[:n], self.cache.table[mi].tolist()))


def layer_with(cache, routed: list[int], guesses: list[int] | None = None):
    depth = 1 if guesses is not None else 0
    picks = torch.tensor([[routed] + ([guesses] if guesses is not None else []), [routed] * (1 + depth)])
    model = SimpleNamespace(layers=[{"moe_index": 0}, {"moe_index": 1}], cache=cache, timeline=None,
                            prefetcher=Prefetcher(depth), cfg=SimpleNamespace(num_moe_layers=L))
    s = SimpleNamespace(picks=picks, ids=picks[:, :1], guesses=picks[:, 1:])
    ops = RecordingOps(cache)
    send_in_place = cache.send_in_place
    cache.send_in_place = lambda mi: (ops.log.append(("in place sent", mi)), send_in_place(mi))[1]
    ran = []
    OffloadedMixtral.hits_first(model, 0, s, ops, lambda key, fn: (ran.append(key), fn()), [])
    return ops.log, ran


def cache_of(k: int, resident: tuple[int, ...]) -> ExpertCache:
    """A cache of k slots a layer, these experts of layer 0 in it, its counts at zero."""
    host = torch.arange(L * E, dtype=torch.uint8)[:, None].repeat(1, B).view(L, E, B)
    cache = ExpertCache(host, k, torch.device("cpu"), lambda buf: buf)
    for e in resident:
        cache.acquire(0, e)
    cache.release(0)
    cache.stats = CacheStats()
    return cache


def test_a_layer_whose_experts_are_all_in_place_has_no_late_launch():
    cache = cache_of(4, (1, 3))
    log, ran = layer_with(cache, [3, 1])
    assert ran == [("moe", 0)]
    # the read is queued before the waits for landing copies (send_in_place) and the launch
    assert log[:2] == [("read queued", 0, 1), ("in place sent", 0)]
    table = log[2][2]
    assert table[1] >= 0 and table[3] >= 0 and table.count(-1) == E - 2
    assert (cache.stats.hits, cache.stats.misses) == (2, 0)


def test_misses_run_late_at_their_positions_once_copied_and_guesses_are_prefetched():
    cache = cache_of(3, (0, 2, 4))
    log, ran = layer_with(cache, [5, 2], guesses=[1, 0])  # 5 misses (top-k position 0)
    assert ran == [("moe", 0), ("late", 0, 1)]
    first, late = log[2], log[3]
    assert first[2][5] == -1 and first[2][2] >= 0  # the first launch never sees the miss
    assert late[2] == [0] and late[3][5] >= 0 and late[3][2] >= 0  # both in place for the late one
    assert int(cache.layer_slots[0][late[3][5], 0]) == 5  # the slot the late launch reads holds expert 5
    assert late[3][0] == -1  # 0 was evicted for it (least recently used, not routed)
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)
    assert set(cache.lru[1]) == {0, 1} and cache.stats.prefetch_issued == 2  # layer 1's guesses
