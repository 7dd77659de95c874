"""The per-layer LRU expert cache on a scripted routing sequence (CPU: copies are memcpy), and
the benchmark's baseline caches (naive, no-copy: engine/measure/bench.py)."""

import sys

import pytest
import torch

from moeferry.engine.measure.bench import CACHES

L, E, B = 2, 6, 16


def make_cache(k, policy="lru"):
    host = torch.arange(L * E, dtype=torch.uint8)[:, None].repeat(1, B).view(L, E, B)  # expert id in every byte
    return CACHES[policy](host, k, torch.device("cpu"), lambda buf: buf)


def use(cache, layer, expert):
    w, slot = cache.acquire(layer, expert)
    assert int(w[0]) == layer * E + expert  # the slot really holds that expert's bytes
    cache.release(layer)


def test_lru_order_hits_and_misses_on_a_scripted_sequence():
    cache = make_cache(3)
    # layer 0 sequence, with the LRU contents (oldest first) after each use worked out by hand:
    # 0 -> [0] miss; 1 -> [0,1] miss; 2 -> [0,1,2] miss; 0 -> [1,2,0] hit; 3 -> evicts 1: [2,0,3] miss;
    # 1 -> evicts 2: [0,3,1] miss; 0 -> [3,1,0] hit; 2 -> evicts 3: [1,0,2] miss
    seq = [0, 1, 2, 0, 3, 1, 0, 2]
    lru_after = [[0], [0, 1], [0, 1, 2], [1, 2, 0], [2, 0, 3], [0, 3, 1], [3, 1, 0], [1, 0, 2]]
    for e, want in zip(seq, lru_after):
        use(cache, 0, e)
        assert list(cache.lru[0]) == want
        assert len(cache.lru[0]) <= 3
    assert (cache.stats.hits, cache.stats.misses) == (2, 6)
    assert cache.stats.hits + cache.stats.misses == len(seq)
    assert cache.stats.bytes_h2d == 6 * B
    assert cache.resident(1) == ()  # layers are independent


def test_never_more_than_k_resident_under_random_use():
    gen = torch.Generator().manual_seed(0)
    for k in range(1, E + 1):
        cache = make_cache(k)
        uses = 0
        for _ in range(200):
            layer = int(torch.randint(L, (1,), generator=gen))
            use(cache, layer, int(torch.randint(E, (1,), generator=gen)))
            uses += 1
            assert all(len(cache.lru[l]) <= k for l in range(L))
        assert cache.stats.hits + cache.stats.misses == uses


def test_the_first_layers_get_the_extra_slots_and_hold_one_expert_more():
    host = torch.arange(3 * E, dtype=torch.uint8)[:, None].repeat(1, B).view(3, E, B)
    cache = CACHES["lru"](host, 2, torch.device("cpu"), lambda buf: buf, extra_slot_layers=2)
    assert [cache.slots_in(layer) for layer in range(3)] == [3, 3, 2] and cache.slots_per_layer == 2
    assert cache.device_bytes() == (3 + 3 + 2) * B
    for layer in range(3):
        for e in (0, 1, 2, 3):
            w, slot = cache.acquire(layer, e)
            assert int(w[0]) == layer * E + e and slot < cache.slots_in(layer)
            assert int(cache.layer_slots[layer][slot, 0]) == layer * E + e  # a layer's slots are its own bytes
            cache.release(layer)
        assert len(cache.lru[layer]) == cache.slots_in(layer)
        assert sorted(cache.lru[layer]) == ([1, 2, 3] if layer < 2 else [2, 3])  # the oldest went
    cache.prefetch(2, [4, 5, 0])  # never more guesses than the layer's slots
    assert sorted(cache.lru[2]) == [4, 5]
    with pytest.raises(ValueError):
        CACHES["lru"](host, 2, torch.device("cpu"), lambda buf: buf, extra_slot_layers=3)  # every layer: k + 1
    with pytest.raises(ValueError):
        CACHES["lru"](host, E, torch.device("cpu"), lambda buf: buf, extra_slot_layers=1)  # no slot left to add


def test_prefetch_loads_marks_mru_and_counts_used():
    cache = make_cache(2)
    use(cache, 1, 0)
    use(cache, 1, 1)  # LRU: [0, 1]
    cache.prefetch(1, [4])  # evicts 0
    assert list(cache.lru[1]) == [1, 4] and cache.stats.prefetch_issued == 1
    cache.prefetch(1, [1])  # already resident: becomes most recently used, nothing copied
    assert list(cache.lru[1]) == [4, 1] and cache.stats.prefetch_issued == 1
    use(cache, 1, 4)  # a hit thanks to the prefetch
    assert cache.stats.prefetch_used == 1 and cache.stats.hits == 1
    use(cache, 1, 4)  # used again: counted once
    assert cache.stats.prefetch_used == 1


def test_a_miss_keeps_experts_needed_in_the_same_step():
    cache = make_cache(2)
    use(cache, 0, 0)
    use(cache, 0, 1)  # LRU: [0, 1]; the next step needs 1 and 5
    w, slot = cache.acquire(0, 5, keep=[1, 5])
    cache.release(0)
    assert 1 in cache.lru[0] and 0 not in cache.lru[0]


def test_all_experts_resident_copies_once_and_never_misses():
    cache = make_cache(E)
    for e in range(E):
        use(cache, 0, e)
    assert cache.stats.misses == 0 and cache.stats.bytes_h2d == 0 and cache.host is None


def test_the_device_slot_table_follows_every_load():
    """kernels.moe_decode finds an expert through cache.table: after any mix of demand loads,
    prefetches and evictions, and a sync of the layer, the table gives the slot that really
    holds each resident expert's bytes; the LRU cache's is -1 for every other expert, in the
    row send_in_place sends too (hits first: the grouped launch runs only the experts listed)."""
    gen = torch.Generator().manual_seed(1)
    for policy, k in (("lru", 2), ("lru", 4), ("naive", 2)):
        cache = make_cache(k, policy)
        for _ in range(100):
            layer = int(torch.randint(L, (1,), generator=gen))
            needed = torch.randperm(E, generator=gen)[:2].tolist()
            for e in needed:
                cache.acquire(layer, e, keep=needed)
                cache.release(layer)
            cache.prefetch((layer + 1) % L, torch.randperm(E, generator=gen)[:2].tolist())
            cache.sync_table(layer)
            assert layer not in cache.table_dirty
            for e in set(needed) | set(cache.lru[layer]):  # this step's experts and all resident
                slot = int(cache.table[layer, e])
                assert int(cache.layer_slots[layer][slot, 0]) == layer * E + e
            if policy == "lru":
                want = [cache.lru[layer].get(e, -1) for e in range(E)]
                assert cache.table[layer].tolist() == want
                assert cache.send_in_place(layer).tolist() == want == cache.table[layer].tolist()


def test_a_fully_resident_or_no_copy_cache_has_a_fixed_table():
    for cache, want in ((make_cache(E), torch.arange(E)), (make_cache(3, "no-copy"), torch.arange(E) % 3)):
        for layer in range(L):
            cache.sync_table(layer)
            assert cache.table[layer].tolist() == want.tolist()
        assert not cache.table_dirty
        for layer in range(L):  # using and prefetching experts changes nothing
            for e in range(E):
                cache.acquire(layer, e)
                cache.release(layer)
            cache.prefetch(layer, list(range(E)))
            assert not cache.table_dirty and cache.table_host[layer].tolist() == want.tolist()


def test_the_naive_cache_copies_every_use_and_keeps_nothing():
    cache = make_cache(2, "naive")
    assert not cache.holds_every_expert
    for e in (1, 1, 4, 1):
        use(cache, 0, e)
    cache.prefetch(1, [2, 3])
    assert cache.stats.misses == 4 and cache.stats.hits == 0 and cache.stats.prefetch_issued == 0
    assert cache.stats.bytes_h2d == 4 * B and cache.resident(1) == ()


def test_what_the_hybrid_reads_goes_through_methods():
    cache = make_cache(2)
    assert cache.link_free_time() == 0.0 and cache.landing(0, [3]) == [(3, None)]
    cache.plan_link(1e-9, 0.5)
    use(cache, 0, 3)
    assert cache.landing(0, [3, 4]) == [(3, 0.0), (4, None)]  # CPU copies are done when acquire returns
    assert cache.holds(0, [3]) and not cache.holds(0, [3, 4]) and cache.holds(0, [])
    cache.count_cpu_misses(2, 1)
    assert (cache.stats.misses, cache.stats.misses_cpu, cache.stats.misses_both) == (3, 2, 1)
    assert make_cache(E).holds_every_expert and not make_cache(E - 1).holds_every_expert


class FakeCudart:
    """torch.cuda.cudart() as pinned_empty uses it: registration answers `status`."""

    def __init__(self, status: int):
        self.status, self.registered, self.unregistered = status, [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size))
        return self.status

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


@pytest.mark.skipif(sys.platform != "linux", reason="huge pages are Linux's; elsewhere torch's pinned allocator")
@pytest.mark.parametrize("thp", [True, False])
def test_the_experts_home_is_registered_huge_page_memory_and_unregistered_when_freed(monkeypatch, thp):
    """pinned_empty on Linux: a 2 MB-aligned mapping, advised into huge pages (a kernel without
    them refuses the advice and the memory is registered all the same), registered once with
    CUDA and unregistered when the last view goes."""
    import gc
    import mmap
    from types import SimpleNamespace

    from moeferry.engine.runtime import expert_cache as ec

    class NoHugePages(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    if not thp:
        monkeypatch.setattr(ec, "mmap", SimpleNamespace(**{n: getattr(mmap, n) for n in dir(mmap) if n.isupper()},
                                                        mmap=NoHugePages))
    cudart = FakeCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    host = ec.pinned_empty((3, 5, ec.HUGE_PAGE // 4))
    assert host.shape == (3, 5, ec.HUGE_PAGE // 4) and host.dtype == torch.uint8
    assert host.data_ptr() % ec.HUGE_PAGE == 0
    assert cudart.registered == [(host.data_ptr(), host.numel())]
    host[2, 4, -1] = 7  # the whole range is writable
    ptr = host.data_ptr()
    del host
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_the_experts_home_falls_back_to_torchs_pinned_memory_when_registration_fails(monkeypatch):
    from moeferry.engine.runtime import expert_cache as ec

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(1))
    asked = []
    real_empty = torch.empty

    def empty(*shape, **kw):
        asked.append(kw.get("pin_memory"))
        return real_empty(*shape, **{k: v for k, v in kw.items() if k != "pin_memory"})

    monkeypatch.setattr(torch, "empty", empty)
    host = ec.pinned_empty((2, ec.HUGE_PAGE))
    assert host.shape == (2, ec.HUGE_PAGE) and asked == [True]


def test_a_driver_library_that_cannot_be_loaded_is_one_sentence(monkeypatch):
    from moeferry.engine.errors import UserError
    from moeferry.engine.runtime import cuda_driver

    monkeypatch.setattr(cuda_driver, "LIBRARY", "libcuda-that-is-not-there.so.1")
    cuda_driver.library.cache_clear()
    try:
        with pytest.raises(UserError, match="libcuda-that-is-not-there.so.1 cannot be loaded; reinstall"):
            cuda_driver.library()
    finally:
        cuda_driver.library.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k", [2, 4])
def test_cuda_copies_and_the_compute_stream_wait_for_each_other(k):
    """Through the driver's calls (engine/runtime/cuda_driver.py): the compute stream reads a
    slot's new bytes even behind slow copies (a GPU spin after each), and a copy over a slot
    waits for the reads queued on it before the layer's release, however late they run."""
    gen = torch.Generator().manual_seed(2)
    host = torch.arange(L * E, dtype=torch.uint8)[:, None].repeat(1, 1 << 16).view(L, E, 1 << 16)
    cache = CACHES["lru"](host, k, torch.device("cuda"), lambda buf: buf, pace_cycles=2_000_000)
    reads = []
    for _ in range(40):
        layer = int(torch.randint(L, (1,), generator=gen))
        needed = sorted(torch.randperm(E, generator=gen)[:2].tolist())
        for e in needed:
            cache.acquire(layer, e, keep=needed)
        cache.sync_table(layer)
        torch.cuda._sleep(1_000_000)  # the reads run late: a copy that did not wait would overwrite first
        slots = cache.table[layer, needed].long()
        reads.append((cache.layer_slots[layer][slots, 0].clone(), [layer * E + e for e in needed]))
        cache.release(layer)
        if torch.randint(3, (1,), generator=gen) == 0:
            cache.prefetch((layer + 1) % L, torch.randperm(E, generator=gen)[:1].tolist())
    torch.cuda.synchronize()
    assert [got.tolist() for got, _ in reads] == [want for _, want in reads]
    assert cache.stats.misses > 10
