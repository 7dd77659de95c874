"""Per-layer LRU cache of experts on the compute device, filled from host memory.

Each layer owns K slots (the first `extra_slot_layers` layers K + 1: what the VRAM budget leaves
after K a layer, engine/runtime/vram.py); a slot holds one packed expert (one contiguous byte
range, so one copy moves it), and a layer's slots lie one after another. On CUDA the host copy
is pinned and copies run on their own stream:
- before a copy overwrites a slot of a layer, the copy stream waits for the compute stream's
  `free` event of that layer, recorded after the layer's experts (release: once per layer and
  step, not per slot: a few CUDA calls fewer per layer, and the copy waits at most for the
  layer's other experts, which ran long before the next step's routing asks for it);
- before compute first uses a slot after a copy, the compute stream waits for the copy's
  `ready` event; once it has, everything later on that stream comes after the copy, so hits
  on a slot that was not copied again make no CUDA call at all.
The host never waits for a copy. These CUDA calls go straight to the driver
(engine/runtime/cuda_driver.py), cheaper on the host than torch's stream switches. On the CPU
"device" is host memory and copies are memcpy.
Pacing (the benchmark's stand-in for a slower link): with pace_cycles > 0 every copy is
followed on the copy stream by a GPU spin of that many cycles before its `ready` event, so
later copies and every use of the slot wait as they would behind a slower link.
"""

from __future__ import annotations

import itertools
import math
import mmap
import sys
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from . import cuda_driver


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    bytes_h2d: int = 0  # over the link to the device: copies, and experts read where they lie (stream_misses)
    misses_cpu: int = 0  # misses computed on the CPU (engine/runtime/cpu_experts.py), counted in misses
    misses_both: int = 0  # of those, also copied in for later use


SERIALS = itertools.count()


class ExpertCache:
    policy = "lru"  # the benchmark's baselines (engine/measure/bench.py) are other policies
    in_place_rows = True  # send_in_place's rows hold: its table is -1 wherever no expert is resident

    def __init__(self, host: torch.Tensor, slots_per_layer: int, device: torch.device, make_views,
                 progress=None, decode=None, pace_cycles: int = 0, extra_slot_layers: int = 0):
        """host: uint8 [layers, experts, stride]; make_views(byte range) -> expert weights;
        the first extra_slot_layers layers get slots_per_layer + 1 slots."""
        self.pace_cycles = pace_cycles  # GPU cycles spun after each copy (see pace_cycles())
        # decode(weights) -> compute-ready weights, applied once per load (the CPU dequantizes
        # an expert when it arrives instead of at every product); None = use the views as they are
        self.decode = decode
        self.serial = next(SERIALS)  # never reused, unlike id(): CUDA graphs key on it
        L, E, B = host.shape
        if not 1 <= slots_per_layer <= E:
            raise ValueError(f"slots_per_layer must be in 1..{E}")
        if not 0 <= extra_slot_layers < (L if slots_per_layer < E else 1):
            raise ValueError(f"extra_slot_layers must be in 0..{L - 1}, and 0 when every expert has a slot")
        self.L, self.E, self.B, self.K = L, E, B, slots_per_layer
        self.Ks = [self.K + (layer < extra_slot_layers) for layer in range(L)]  # each layer's slots
        self.device = device
        self.cuda = device.type == "cuda"
        self.host, self.pinned = host, False
        self.host_on_device: int | None = None  # the page-locked host copy's address for kernels (host_offset)
        self.slots = torch.empty((sum(self.Ks), B), dtype=torch.uint8, device=device)
        first = np.cumsum([0] + self.Ks[:-1]).tolist()
        self.layer_slots = [self.slots[f:f + k] for f, k in zip(first, self.Ks)]  # [K of the layer, B]
        self.decoded: list[list] = [[None] * k for k in self.Ks]
        self.views = [[make_views(self.layer_slots[l][s]) for s in range(self.Ks[l])] for l in range(L)]
        self.lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(L)]  # expert -> slot
        # The slot of each expert, -1 if not resident, on the device for kernels that pick their
        # expert there (kernels.moe_decode); a host mirror takes the updates, sync_table() sends a
        # layer's row. send_in_place() sends instead the row a launch may trust before the routing
        # is read: experts whose copy may not have landed are -1 there (own pinned rows, so that
        # changes to the mirror made before that send has run cannot reach it).
        self.table_host = torch.full((L, E), -1, dtype=torch.int32, pin_memory=self.cuda)
        self.table_np = self.table_host.numpy()  # writes through numpy: 20x cheaper than a tensor's
        self.in_place_host = torch.full((L, E), -1, dtype=torch.int32, pin_memory=self.cuda)
        self.in_place_np = self.in_place_host.numpy()
        self.table = torch.full((L, E), -1, dtype=torch.int32, device=device)
        self.table_dirty: set[int] = set()
        self.unused_prefetch: list[set[int]] = [set() for _ in range(L)]
        self.stats = CacheStats()
        # The link's queue on the host clock, for the CPU+GPU hybrid (engine/runtime/cpu_experts.py):
        # when each slot's copy should land and when the link is free again. Kept only once
        # link_s_per_byte is set (the hybrid sets it from its measured or paced link rate).
        self.link_s_per_byte: float | None = None
        self.link_free_at = 0.0
        self.ready_at = [[0.0] * k for k in self.Ks]
        self.prefetch_horizon_s = 0.0  # with the above: no prefetch while the link is busier than this
        if self.cuda:
            # streams looked up by index: torch.cuda.current_stream(torch.device("cuda")) resolves
            # the device again on every call, which cost more host time per copy than the copy itself
            cuda_driver.library()  # a driver that cannot be loaded is said now, not at the first copy
            self.device_index = device.index if device.index is not None else torch.cuda.current_device()
            self.copy_stream = torch.cuda.Stream(device)
            self.ready = [[cuda_driver.new_event(self.copy_stream) for _ in range(k)] for k in self.Ks]
            self.free = [cuda_driver.new_event(self.copy_stream) for _ in range(L)]
            # the copy stream has waited for the layer's last `free` (copies after the first skip the wait)
            self.free_awaited = [True] * L
        # slot -> expert of the copies the compute stream has not waited for (CUDA): a slot not
        # here needs no wait before its next use
        self.landing_slots: list[dict[int, int]] = [{} for _ in range(L)]
        self.in_use: list[set[int]] = [set() for _ in range(L)]  # slots acquired since the layer's last release
        self._fill(progress)
        # each copy's source and destination, made once: a view costs microseconds per copy
        self.slot_views = [list(self.layer_slots[l]) for l in range(L)]
        self.host_views = None if self.host is None else [[self.host[l, e] for e in range(E)] for l in range(L)]
        if self.cuda:  # the same as addresses and handles, for the driver's calls
            self.slot_at = [[v.data_ptr() for v in row] for row in self.slot_views]
            self.host_at = None if self.host is None else [[v.data_ptr() for v in row] for row in self.host_views]
            self.copy_handle = self.copy_stream.cuda_stream
            self.ready_handles = [[ev.cuda_event for ev in row] for row in self.ready]
            self.free_handles = [ev.cuda_event for ev in self.free]

    def _fill(self, progress) -> None:
        """Everything fits: load once, never copy again. Else pin the host copy (CUDA)."""
        if self.K == self.E:
            for layer in range(self.L):
                self.layer_slots[layer].copy_(self.host[layer])
                self.lru[layer].update((e, e) for e in range(self.E))
                self.table_host[layer] = torch.arange(self.E, dtype=torch.int32)
                self.table_dirty.add(layer)
                for e in range(self.E):
                    self._decode(layer, e)
                if progress:
                    progress((layer + 1) / self.L, "loading experts onto the device")
            self.host = None
        elif self.cuda:
            self.host, self.pinned = pin(self.host, progress)

    # -- what the model, the graph runner and the prefetcher call ----------------------------------

    @property
    def holds_every_expert(self) -> bool:
        """Every expert resident for good: nothing is ever copied (nor worth guessing)."""
        return self.K == self.E

    @property
    def slots_per_layer(self) -> int:
        """The fewest slots a layer has (slots_in says each layer's)."""
        return self.K

    def slots_in(self, layer: int) -> int:
        return self.Ks[layer]

    @property
    def slot_bytes(self) -> int:
        """Bytes of one packed expert: slot s of a layer lies s * slot_bytes after slot 0."""
        return self.B

    def slot_weights(self, layer: int, slot: int):
        """The weights in a slot, whichever expert it holds (CUDA graphs bake them in): the
        packed views until a decoding cache (the CPU's) has loaded the slot."""
        decoded = self.decoded[layer][slot] if self.decode is not None else None
        return self.views[layer][slot] if decoded is None else decoded

    def device_table(self, layer: int) -> torch.Tensor:
        """The layer's expert -> slot table on the device [experts] int32 (kernels.moe_decode)."""
        return self.table[layer]

    def host_offset(self, layer: int) -> int | None:
        """Bytes from the layer's slot 0 to its expert 0 in host memory as kernels address it,
        for kernels that read an expert not in place where it lies (experts lie slot_bytes
        apart there too); None where the GPU cannot read it (not page-locked) or nothing lies
        there (every expert resident)."""
        if self.host is None or (self.cuda and not self.pinned):
            return None
        if self.host_on_device is None:  # registered memory's device address need not be the host's
            base = self.host.data_ptr()
            self.host_on_device = cuda_driver.device_pointer(base) if self.cuda else base
        return self.offset_to(layer, self.host[layer]) + self.host_on_device - self.host.data_ptr()

    def offset_to(self, layer: int, t: torch.Tensor) -> int:
        """Bytes from the layer's slot 0 to t's first byte (the grouped kernels address an
        expert outside the cache so)."""
        return t.data_ptr() - self.layer_slots[layer].data_ptr()

    def settle(self) -> None:
        """Make the compute stream wait for every copy still landing (before work that reads
        slots without acquiring them: a decode step that streams its misses)."""
        for layer, landing in enumerate(self.landing_slots):
            for slot in landing:
                cuda_driver.wait(self._compute_handle(), self.ready_handles[layer][slot])
            landing.clear()

    def sync_tables(self) -> None:
        for layer in list(self.table_dirty):
            self.sync_table(layer)

    def count_hits(self, n: int) -> None:
        """n uses served from the device that did not go through acquire (the one-graph token)."""
        self.stats.hits += n

    # -- what the CPU+GPU hybrid (engine/runtime/cpu_experts.py) reads and sets --------------------------

    def plan_link(self, s_per_byte: float, prefetch_horizon_s: float) -> None:
        """Keep the link's queue on the host clock at this rate; no prefetch while it reaches
        further than prefetch_horizon_s."""
        self.link_s_per_byte, self.prefetch_horizon_s = s_per_byte, prefetch_horizon_s

    def landing(self, layer: int, experts) -> list[tuple[int, float | None]]:
        """(expert, when its copy lands: host clock, 0 if long done; None if not resident) for
        each of these experts of the layer."""
        lru, ready = self.lru[layer], self.ready_at[layer]
        return [(e, None if (slot := lru.get(e)) is None else ready[slot]) for e in experts]

    def holds(self, layer: int, experts) -> bool:
        """Whether every one of these experts is resident in the layer (copies maybe in flight)."""
        lru = self.lru[layer]
        return all(e in lru for e in experts)

    def link_free_time(self) -> float:
        """When the link has done every copy queued so far (host clock)."""
        return self.link_free_at

    def count_cpu_misses(self, cpu: int, both: int) -> None:
        """Misses computed on the CPU (both: of those, also copied in for later)."""
        self.stats.misses += cpu
        self.stats.misses_cpu += cpu
        self.stats.misses_both += both

    def resident(self, layer: int) -> tuple[int, ...]:
        return tuple(sorted(self.lru[layer]))

    def acquire(self, layer: int, expert: int, keep=()):
        """Weights of `expert` on the device, copying it in if it misses; then use, and once the
        layer's experts of this step are queued, release(layer).

        keep: experts needed in the same step, which a miss does not evict while others can go.
        """
        lru = self.lru[layer]
        if expert in lru:
            self.stats.hits += 1
            lru.move_to_end(expert)
            if expert in self.unused_prefetch[layer]:
                self.unused_prefetch[layer].discard(expert)
                self.stats.prefetch_used += 1
            slot = lru[expert]
        else:
            self.stats.misses += 1
            slot = self._load(layer, expert, keep)
        if slot in self.landing_slots[layer]:
            cuda_driver.wait(self._compute_handle(), self.ready_handles[layer][slot])
            del self.landing_slots[layer][slot]
        self.in_use[layer].add(slot)
        return self._weights(layer, slot), slot

    def sync_table(self, layer: int) -> None:
        """Send layer's expert -> slot row to the device, in the compute stream's order, if the
        host changed it. The previous send of the row has run: the host syncs on routing in
        between (and a fully resident cache never changes)."""
        if layer in self.table_dirty:
            self._send_row(layer, self.table_host[layer])
            self.table_dirty.discard(layer)

    def send_in_place(self, layer: int) -> np.ndarray:
        """Send the layer's row as a launch queued now may read it, before the routing is read
        and anything acquired (the model's hits-first launch): an expert whose copy has not
        landed is -1, one whose copy has is awaited from now on; a row the device holds already is
        not sent again. The row (host, int32 [E]).

        The row's last send has run: the host has synced on a routing since (each layer's)."""
        row = self.in_place_np[layer]
        row[:] = self.table_np[layer]
        landing = self.landing_slots[layer]
        wait, absent = self.B <= LANDING_WAIT_BYTES, False
        for slot, expert in list(landing.items()):
            if wait:
                cuda_driver.wait(self._compute_handle(), self.ready_handles[layer][slot])
            elif not cuda_driver.done(self.ready_handles[layer][slot]):
                row[expert], absent = -1, True
                continue
            del landing[slot]  # landed, or waited for: later work comes after it
        if absent or layer in self.table_dirty:  # else the device holds this row already
            self._send_row(layer, self.in_place_host[layer])
            if absent:  # sync_table sends the whole row before a late launch
                self.table_dirty.add(layer)
            else:
                self.table_dirty.discard(layer)
        return row

    def release(self, layer: int) -> None:
        """After the layer's experts of this step are queued: its slots may be copied over once
        the device has run them."""
        self.in_use[layer].clear()
        if self.cuda:
            cuda_driver.record(self.free_handles[layer], self._compute_handle())
            self.free_awaited[layer] = False

    def fence(self) -> None:
        """Make later copies into any slot wait for the work queued on the compute stream so far:
        graphs that read slots without acquiring them (a streaming token's) may still be running."""
        if self.cuda:
            for layer in range(self.L):
                self.release(layer)

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Start copying predicted experts (best guess first); never more than the layer's slots."""
        if self.link_backed_up():
            return
        experts = experts[:self.Ks[layer]]
        lru = self.lru[layer]
        for e in reversed(experts):  # best guess last = most recently used
            if e in lru:
                lru.move_to_end(e)
        for e in experts:
            if e not in lru:
                self._load(layer, e, keep=experts)
                self.unused_prefetch[layer].add(e)
                self.stats.prefetch_issued += 1

    def link_backed_up(self) -> bool:
        """The link's queue reaches further than prefetch_horizon_s (the hybrid's CPU then takes
        the misses a guess would have copied: a copy queued now would land too late to help)."""
        return bool(self.link_s_per_byte and self.prefetch_horizon_s
                    and self.link_free_at - time.perf_counter() > self.prefetch_horizon_s)

    def admit(self, layer: int, expert: int) -> None:
        """Copy `expert` in for later use, not for this step (the hybrid's "both": computed on
        the CPU now, cached for the next time). Counted as a copy, not as a prefetch."""
        if expert not in self.lru[layer]:
            self._load(layer, expert, keep=(expert,))

    # -- inside ---------------------------------------------------------------------------------

    def _load(self, layer: int, expert: int, keep, slot: int | None = None) -> int:
        lru = self.lru[layer]
        if slot is None:  # else the caller's choice (the benchmark's naive cache)
            slot = len(lru) if len(lru) < self.Ks[layer] else self._evict(layer, keep)
        lru[expert] = slot
        self.table_np[layer, expert] = slot
        self.table_dirty.add(layer)
        if self.cuda:
            if slot in self.in_use[layer]:  # used earlier in this step (a cache smaller than top-k)
                self.release(layer)  # the copy waits for the work queued on it so far
            if not self.free_awaited[layer]:
                cuda_driver.wait(self.copy_handle, self.free_handles[layer])
                self.free_awaited[layer] = True
            cuda_driver.copy_to_device(self.slot_at[layer][slot], self.host_at[layer][expert], self.B, self.copy_handle)
            if self.pace_cycles:
                self._pace()
            cuda_driver.record(self.ready_handles[layer][slot], self.copy_handle)
            self.landing_slots[layer][slot] = expert
            if self.link_s_per_byte:
                start = max(time.perf_counter(), self.link_free_at)
                self.link_free_at = self.ready_at[layer][slot] = start + self.B * self.link_s_per_byte
        else:
            self.slot_views[layer][slot].copy_(self.host_views[layer][expert])
            self._decode(layer, slot)
        self.stats.bytes_h2d += self.B
        return slot

    def _send_row(self, layer: int, row: torch.Tensor) -> None:
        """The device table's row of the layer = row (host, int32 [E]), in the compute stream's order."""
        if self.cuda:
            cuda_driver.copy_to_device(self.table[layer].data_ptr(), row.data_ptr(), row.nbytes, self._compute_handle())
        else:
            self.table[layer].copy_(row)

    def _compute_handle(self) -> int:
        # the raw handle, as Triton's launches read it: torch.cuda.current_stream() builds a
        # Stream object through several Python calls (about 3 us, three times per layer)
        return torch._C._cuda_getCurrentRawStream(self.device_index)

    def _pace(self) -> None:
        """The benchmark's slower link: a GPU spin on the copy stream after the copy."""
        compute = torch.cuda.current_stream(self.device_index)
        torch.cuda.set_stream(self.copy_stream)  # not torch.cuda.stream(): it resolves the device twice
        try:
            torch.cuda._sleep(self.pace_cycles)
        finally:
            torch.cuda.set_stream(compute)

    def _evict(self, layer: int, keep) -> int:
        """Drop the least recently used expert not in keep (else the oldest); its slot."""
        lru = self.lru[layer]
        victim = next((e for e in lru if e not in keep), next(iter(lru)))
        self.unused_prefetch[layer].discard(victim)
        self.table_np[layer, victim] = -1
        return lru.pop(victim)

    def _decode(self, layer: int, slot: int) -> None:
        if self.decode is not None:
            self.decoded[layer][slot] = self.decode(self.views[layer][slot])

    def _weights(self, layer: int, slot: int):
        return self.decoded[layer][slot] if self.decode is not None else self.views[layer][slot]

    def device_bytes(self) -> int:
        return self.slots.numel()


def pin(host: torch.Tensor, progress=None) -> tuple[torch.Tensor, bool]:
    """Copy experts into page-locked memory so copies can overlap compute.

    Pinning can fail (Windows limits page-locked memory); then copies fall back to pageable
    memory: correct, slower (7-12 GB/s instead of ~25-55), and said so by the caller.
    """
    if host.is_pinned():  # a new cache over the same experts (Engine.set_cache_experts)
        return host, True
    try:
        pinned = pinned_empty(host.shape)
    except RuntimeError:
        return host, False
    for layer in range(host.shape[0]):
        pinned[layer].copy_(host[layer])
        if progress:
            progress((layer + 1) / host.shape[0], "loading experts into pinned memory")
    return pinned, True


# send_in_place: the hits-first launch waits for an expert still landing if it is at most this
# big, else leaves it to the late launch, which waits only for the experts the routing needs.
# Waiting for Qwen3-30B-A3B's 2.5 MB experts decoded 4-9 % faster at 12 GiB on an H100
# (benchmarks/hits_first_ab.py; docs/BENCHMARKS.md, 2026-12-05): a prefetched expert has mostly
# landed by then, and a late launch costs more than the rest of its copy. A wrong guess of
# Mixtral's 50-66 MB would hold the launch for a millisecond (not measured).
LANDING_WAIT_BYTES = 8 << 20

HUGE_PAGE = 2 << 20
HUGE_PAGES = True  # pinned_empty's first choice; the developer benchmarks turn it off to compare


def pinned_empty(shape) -> torch.Tensor:
    """Page-locked host memory (uint8 of this shape) for the experts' home in RAM.

    On Linux: an anonymous mapping advised into transparent huge pages, then registered with
    CUDA. The CPU experts' kernel (engine/kernels/hqq_cpu.py), which reads an expert in rows of a
    few KB spread over megabytes, ran 11-12 % faster there than in the 4 KB pages of torch's
    pinned allocator (docs/BENCHMARKS.md, 2026-12-03); copies to the GPU keep their rate.
    Elsewhere, or where either step fails, torch's pinned allocator."""
    n = math.prod(shape)
    if HUGE_PAGES and sys.platform == "linux" and n >= HUGE_PAGE:
        t = _registered_huge_pages(n)
        if t is not None:
            return t.view(shape)
    return torch.empty(shape, dtype=torch.uint8, pin_memory=True)


def _registered_huge_pages(n: int) -> torch.Tensor | None:
    size = -(-n // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # one more page: start on a 2 MB boundary
    try:
        area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    whole = np.frombuffer(area, dtype=np.uint8)
    skip = -whole.ctypes.data % HUGE_PAGE
    try:  # a kernel without transparent huge pages refuses the advice: 4 KB pages, still pinned
        area.madvise(mmap.MADV_HUGEPAGE, skip, size - HUGE_PAGE)
    except (AttributeError, OSError):
        pass
    buf = whole[skip:skip + n]
    try:
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(buf.ctypes.data, n, 0)) != 0:  # e.g. WSL 2, or too little RAM
            return None
    except (AttributeError, RuntimeError):
        return None
    weakref.finalize(buf, cudart.cudaHostUnregister, buf.ctypes.data)
    return torch.from_numpy(buf)


def sleep_cycles_per_s(device) -> float:
    """How many torch.cuda._sleep cycles the GPU spins per second (timed with CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    cycles = 50_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def pace_cycles(nbytes: int, target_bytes_per_s: float, link_bytes_per_s: float, cycles_per_s: float) -> int:
    """Spin after a copy of nbytes so that it takes nbytes / target instead of nbytes / link."""
    extra = nbytes / target_bytes_per_s - nbytes / link_bytes_per_s
    return max(0, int(extra * cycles_per_s))
