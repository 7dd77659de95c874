"""Does a small copy on the compute stream wait behind the copy stream's large host->device copies?

    python3 benchmarks/copy_engines.py [d2d]    # d2d: the big copy device->device (no PCIe) instead

The engine's decoded layer sends small things over the link on its compute stream (the routing's
read to the host, a slot table's row and the late positions to the device) while the cache's
copy stream moves experts of megabytes. If the GPU runs copies of one direction, or all copies, in
one queue, those small copies wait for the experts queued before them, and the host learns a
layer's routing only once its prefetches have landed. Here: a small kernel and then a small copy
on one stream, alone and while another stream copies BIG bytes host->device; the host's wait for
each and the GPU's time for the copy alone (events; median of REPS, microseconds). Needs a CUDA GPU.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

BIG, REPS = 256 << 20, 9


def main(source: str = "host") -> int:
    dev = torch.device("cuda")
    copy, compute, third = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    big_host = torch.empty(BIG, dtype=torch.uint8, pin_memory=source == "host",
                           device=dev if source == "d2d" else "cpu")
    big_dev = torch.empty(BIG, dtype=torch.uint8, device=dev)
    x = torch.zeros(1024, device=dev)
    small_dev = torch.zeros(128, dtype=torch.int32, device=dev)
    small_host = torch.zeros(128, dtype=torch.int32, pin_memory=True)

    def d2h(s):
        small_host.copy_(small_dev, non_blocking=True)

    def h2d(s):
        small_dev.copy_(small_host, non_blocking=True)

    def d2h_other_stream(s):  # the read on a stream of its own, after the kernel
        third.wait_stream(s)
        with torch.cuda.stream(third):
            small_host.copy_(small_dev, non_blocking=True)
            return third

    ops = [("kernel then D2H 512 B", d2h), ("kernel then H2D 512 B", h2d),
           ("kernel, then D2H 512 B on a third stream", d2h_other_stream),
           ("kernel then a fill kernel on the device (no copy)", lambda s: (small_dev.fill_(3), None)[1])]
    try:  # the read as a kernel's stores into page-locked host memory (no copy engine)
        store = host_store_kernel()
        store[(1,)](small_dev, small_host, 128, BLOCK=128)
        torch.cuda.synchronize()
        ops.append(("kernel, then a kernel storing 512 B to pinned host memory",
                    lambda s: (store[(1,)](small_dev, small_host, 128, BLOCK=128), None)[1]))
    except Exception as e:  # noqa: BLE001  (a measurement: say why the variant is left out)
        print(f"a kernel storing into pinned host memory: not possible here ({type(e).__name__}: {e})")
    big_ms = timed_big(copy, big_dev, big_host)
    print(f"big copy alone: {BIG >> 20} MiB in {big_ms:.2f} ms ({BIG / big_ms / 1e6:.1f} GB/s)")
    ops.append(("kernel then D2H 512 B, the host polling", d2h, True))
    for name, op, *poll in ops:
        poll = bool(poll)
        alone = [wait_us(compute, x, op, poll) for _ in range(REPS)]
        beside = []
        for _ in range(REPS):
            with torch.cuda.stream(copy):
                for _copy in range(40 if source == "d2d" else 1):  # device to device: as long as one over PCIe
                    big_dev.copy_(big_host, non_blocking=True)
            time.sleep(0.0002)  # the big copy is running
            beside.append(wait_us(compute, x, op, poll))
            torch.cuda.synchronize()
        print(f"{name}: host wait alone {median(alone, 0):6.1f} us, beside the big copy {median(beside, 0):6.1f} us; "
              f"on the GPU alone {median(alone, 1):6.1f} us, beside {median(beside, 1):6.1f} us", flush=True)
    return 0


def median(pairs: list, i: int) -> float:
    return statistics.median(p[i] for p in pairs)


def host_store_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def store(src, dst, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)
    return store


def timed_big(copy, big_dev, big_host) -> float:
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.cuda.stream(copy):
            big_dev.copy_(big_host, non_blocking=True)
        copy.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return min(times)


def wait_us(stream, x, op, poll: bool = False) -> tuple[float, float]:
    """Queue a small kernel and op on stream: the host's wait until op's event has completed, and
    the GPU's time from the kernel's end to op's (events), microseconds."""
    t = time.perf_counter()
    with torch.cuda.stream(stream):
        x.add_(1)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        s = op(stream) or stream
        after.record(s)
    if poll:  # the host spinning on the event's state instead of the driver's wait
        while not after.query():
            pass
    else:
        after.synchronize()
    return (time.perf_counter() - t) * 1e6, before.elapsed_time(after) * 1e3


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
