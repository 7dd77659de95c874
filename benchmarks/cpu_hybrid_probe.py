"""Developer benchmark (GPU machine): why the CPU expert kernel is slower inside the engine.

    python3 benchmarks/cpu_hybrid_probe.py OUT.json [--bench]

One whole 2-bit Mixtral expert in groups of 32 (55.4 MB; engine/kernels/hqq_cpu.py's swiglu)
is timed, rotating over enough experts that no cache holds them, under the conditions that
differ between the kernel's own benchmark and the engine:
  memory   where the experts lie: pageable (torch.empty), torch's pinned allocator, or huge
           pages registered with CUDA (expert_cache.pinned_empty);
  threads  16, 15, 12 and 8 numba threads;
  link     alone, or while the copy stream streams other experts to the GPU (the engine's
           copies read the same RAM), with the link's achieved rate over the same time;
  thread   the calling thread, or a second thread while the calling thread waits or keeps the
           GIL busy in Python (as the engine's host thread does while it queues GPU work).
With --bench it then runs the engine's hybrid at 12 GiB (`moeferry bench`'s measure, groups of
32, prefetch 0 and 1) with the experts' home in huge pages or in torch's pinned memory.

    python3 benchmarks/cpu_hybrid_probe.py OUT.json --cadence

only times the kernel at the engine's cadence: one expert, then a gap in which the host
sleeps or runs Python (as it queues a layer's GPU work), at 16 and 8 threads. Run it under
different OMP_WAIT_POLICY / GOMP_SPINCOUNT / NUMBA_THREADING_LAYER settings (one process
each: they are read once) to see whether the kernel's threads, asleep after a gap, cost it.
docs/BENCHMARKS.md has the figures of 2026-12-03 (when the hybrid still had a worker thread).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeferry.engine.kernels import hqq_cpu  # noqa: E402
from moeferry.engine.measure import bench  # noqa: E402
from moeferry.engine.runtime import cpu_experts, expert_cache  # noqa: E402

ROTATE_BYTES = 4 << 30


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def machine() -> dict:
    def read(path):
        try:
            return Path(path).read_text().strip()
        except OSError as e:
            return f"unreadable: {e}"
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "NUMA node", "L3", "L2", "Flags")
    lines = [line for line in lscpu.splitlines() if line.split(":")[0].strip().startswith(keep)]
    lines = [line if not line.startswith("Flags") else "vector flags: " + " ".join(
             f for f in line.split() if f.startswith(("avx512", "amx", "avx_vnni"))) for line in lines]
    return {"lscpu": lines, "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag")}


def anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages"):
            return int(line.split()[1])
    return -1


def experts_in(kind: str, s: bench.Synthetic, n: int) -> tuple[torch.Tensor, list]:
    """n experts (cycling over the synthetic model's) in memory of this kind, and their HqqExperts."""
    stride = s.host.shape[2]
    if kind == "pageable":
        buf = torch.empty((n, stride), dtype=torch.uint8)
    elif kind == "pinned":
        buf = torch.empty((n, stride), dtype=torch.uint8, pin_memory=True)
    else:
        buf = expert_cache.pinned_empty((n, stride))
    flat = s.host.view(-1, stride)
    for i in range(n):
        buf[i].copy_(flat[i % flat.shape[0]])
    view = bench.expert_views(s.cfg, s.fields, s.eq)
    return buf, [cpu_experts.hqq_expert(view(buf[i])) for i in range(n)]


def time_experts(experts: list, reps: int, x: torch.Tensor, start: int = 0) -> list[float]:
    times = []
    for r in range(reps):
        e = experts[(start + r) % len(experts)]
        t0 = time.perf_counter()
        e.forward(x)
        times.append(time.perf_counter() - t0)
    return times


def summary(times: list[float], nbytes: int) -> dict:
    times = sorted(times)
    med = times[len(times) // 2]
    return {"us": round(med * 1e6, 1), "us_best": round(times[0] * 1e6, 1), "gb_per_s": round(nbytes / med / 1e9, 1)}


def streaming_copies(src: torch.Tensor, dst: torch.Tensor, stream, count: int):
    """Queue `count` copies of src's rows to dst on `stream`; events around them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for i in range(count):
            dst.copy_(src[i % src.shape[0]], non_blocking=True)
        end.record()
    return start, end


def kernel_rows(s: bench.Synthetic) -> list[dict]:
    rows = []
    stride = s.host.shape[2]
    n = ROTATE_BYTES // stride + 1
    x = torch.randn(1, s.cfg.hidden_size)
    dev = torch.device("cuda")
    stream = torch.cuda.Stream(dev)
    dst = torch.empty(stride, dtype=torch.uint8, device=dev)
    for kind in ("pageable", "pinned", "huge"):
        huge0 = anon_huge_kb()
        buf, experts = experts_in(kind, s, n)
        nbytes = experts[0].nbytes()
        log(f"{kind}: {n} experts of {nbytes / 1e6:.1f} MB, anon huge pages +{(anon_huge_kb() - huge0) / 1e6:.2f} GB")
        for t in (16, 15, 12, 8):
            hqq_cpu.set_threads(t)
            time_experts(experts, 3, x)
            r = {"memory": kind, "threads": t, "link": "idle", "thread": "caller",
                 **summary(time_experts(experts, 24, x, 3), nbytes)}
            rows.append(r)
            log(f"  {t:2d} threads, link idle: {r['us']:8.1f} us {r['gb_per_s']:6.1f} GB/s")
        if kind == "pageable":
            del buf, experts
            continue
        copy_src = buf[n // 2:]  # copies read other experts than the CPU's
        for t in (16, 15):
            hqq_cpu.set_threads(t)
            torch.cuda.synchronize()
            start, end = streaming_copies(copy_src, dst, stream, 60)
            t0 = time.perf_counter()
            times = time_experts(experts[:n // 2], 16, x)
            cpu_wall = time.perf_counter() - t0
            end.synchronize()
            link = 60 * stride / (start.elapsed_time(end) / 1e3) / 1e9
            r = {"memory": kind, "threads": t, "link": "copying", "thread": "caller", "link_gb_per_s": round(link, 1),
                 "cpu_wall_ms": round(cpu_wall * 1e3, 1), **summary(times, nbytes)}
            rows.append(r)
            log(f"  {t:2d} threads, link copying: {r['us']:8.1f} us {r['gb_per_s']:6.1f} GB/s; link {link:.1f} GB/s "
                f"over {start.elapsed_time(end):.0f} ms (CPU busy {cpu_wall * 1e3:.0f} ms)")
        rows += thread_rows(experts, x, kind)
        del buf, experts
    return rows


def thread_rows(experts: list, x: torch.Tensor, kind: str) -> list[dict]:
    """The kernel (16 threads) on a second Python thread, the calling thread waiting for it or
    keeping the GIL busy in Python meanwhile: what a worker thread beside the engine's host
    thread would see (why the CPU experts run on the host thread)."""
    rows = []
    for busy in (False, True):
        done = threading.Event()
        times = []

        def jobs(done=done, times=times):
            hqq_cpu.set_threads(16)
            for i in range(16):
                t0 = time.perf_counter()
                experts[i % len(experts)].forward(x)
                times.append(time.perf_counter() - t0)
            done.set()

        runner = threading.Thread(target=jobs)
        runner.start()
        spins = 0
        while busy and not done.is_set():  # Python work holding the GIL between switch intervals
            spins += sum(i * i for i in range(200))
        runner.join()
        r = {"memory": kind, "threads": 16, "link": "idle", "thread": "second, caller " + ("busy" if busy else "waiting"),
             **summary(times, experts[0].nbytes())}
        rows.append(r)
        log(f"  16 threads, second thread, caller {'busy in Python' if busy else 'waiting'}: {r['us']:8.1f} us "
            f"{r['gb_per_s']:6.1f} GB/s")
    return rows


GAPS = (("back to back", None, 0.0), ("sleep 0.3 ms", "sleep", 0.3e-3), ("sleep 2 ms", "sleep", 2e-3),
        ("Python 0.3 ms", "python", 0.3e-3), ("Python 2 ms", "python", 2e-3))


def cadence_rows(s: bench.Synthetic) -> list[dict]:
    """The kernel with a gap after each call, as the engine calls it (a layer's CPU expert, then
    the host queues the next layers' GPU work): are the threads' wake-ups part of its time?"""
    stride = s.host.shape[2]
    n = ROTATE_BYTES // stride + 1
    x = torch.randn(1, s.cfg.hidden_size)
    buf, experts = experts_in("huge", s, n)
    nbytes = experts[0].nbytes()
    rows = []
    for t in (16, 8):
        hqq_cpu.set_threads(t)
        time_experts(experts, 3, x)
        for name, kind, gap in GAPS:
            times = []
            for r in range(24):
                e = experts[(3 + r) % len(experts)]
                t0 = time.perf_counter()
                e.forward(x)
                t1 = time.perf_counter()
                times.append(t1 - t0)
                if kind == "sleep":
                    time.sleep(gap)
                elif kind == "python":
                    spins = 0
                    while time.perf_counter() - t1 < gap:
                        spins += 1
            row = {"threads": t, "gap": name, **summary(times, nbytes)}
            rows.append(row)
            log(f"  {t:2d} threads, {name:>13}: {row['us']:8.1f} us (best {row['us_best']:8.1f}) {row['gb_per_s']:6.1f} GB/s")
    del buf, experts
    return rows


def engine_rows(s: bench.Synthetic) -> list[dict]:
    """The engine's hybrid at 12 GiB with the experts' home in huge pages, then in torch's pinned memory."""
    reports = []
    for huge in (True, False):
        if huge != expert_cache.HUGE_PAGES:
            expert_cache.HUGE_PAGES = huge
            host = expert_cache.pinned_empty(s.host.shape) if huge else torch.empty(
                s.host.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(s.host)
            s.host, s.cpu_copies = host, None
            torch.cuda.synchronize()
        name = "huge pages" if huge else "torch's pinned memory"
        for depth in (0, 1):
            t = time.perf_counter()
            modes = ("lru", "hybrid") if depth == 0 and huge else ("hybrid",)
            report = bench.measure(s, "12GiB", 128, 64, modes, ("fused",), depth, log=log)
            reports.append({"name": f"12GiB, prefetch {depth}, experts in {name}",
                            "wall_s": round(time.perf_counter() - t, 1), **report})
            print(f"### {reports[-1]['name']}\n\n{bench.markdown_table(report)}\n", flush=True)
    return reports


def main() -> int:
    out = Path(sys.argv[1])
    t = time.perf_counter()
    result = {"machine": machine(), "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "NUMBA_"))}}
    log(json.dumps(result, indent=1))
    if "--cadence" in sys.argv:
        s = bench.build(8, 2, 4, log=log, group_size=32)
        result["cadence"] = cadence_rows(s)
        result["threading_layer"] = hqq_cpu.kernels().numba.threading_layer()
        log(f"numba threading layer {result['threading_layer']}")
        out.write_text(json.dumps(result, indent=1))
        return 0
    s = bench.build(32, 2, 4, log=log, group_size=32)
    log(f"built in {time.perf_counter() - t:.0f} s; host experts huge pages: {anon_huge_kb() / 1e6:.1f} GB")
    result["kernel"] = kernel_rows(s)
    out.write_text(json.dumps(result, indent=1))
    log(f"kernel rows done at {time.perf_counter() - t:.0f} s")
    if "--bench" in sys.argv:
        result["engine"] = engine_rows(s)
        out.write_text(json.dumps(result, indent=1))
    log(f"done at {time.perf_counter() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
