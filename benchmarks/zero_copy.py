"""Can the GPU's own loads bring experts over the link as fast as its copy engine?

    python3 benchmarks/zero_copy.py [OUT.md]

A decode step that never waits for the host (the whole token one CUDA graph) cannot ask the
copy engine for an expert the router picks: the graph's copies have fixed addresses. Its
kernels can instead read the experts' page-locked home in host memory over the link (the
expert cache pins it as engine/runtime/expert_cache.pinned_empty does). Measured here, GB/s
(bytes / median of 15 CUDA-event timings):
- the copy engine: N experts host -> device, one cudaMemcpyAsync each;
- decode.fetch_experts copying the same experts with P programs each (loads from host memory);
- the same kernel beside the copy engine on another stream (both channels at once);
- the fused HQQ GEMV (hqq_gpu.gemv) of an expert's matrix in device memory and in host memory;
- one MoE layer's routed experts (hqq_gpu.moe_decode) from the cache, read from host memory, and
  fetched by fetch_experts first (Qwen3-30B-A3B 4-bit, Mixtral 2-bit), each checked against the
  cached experts' output.
Needs a CUDA GPU.
"""

from __future__ import annotations

import statistics
import sys

import torch

from moeferry.engine.kernels import hqq_gpu
from moeferry.engine.kernels.decode import fetch_experts
from moeferry.engine.measure import bench
from moeferry.engine.runtime import cuda_driver
from moeferry.engine.runtime.expert_cache import pinned_empty
from moeferry.engine.storage import quant, store as store_mod

REPS = 15


def timed(fn, reps: int = REPS) -> float:
    """Median seconds of fn() on the current stream (events), after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def copies(src: torch.Tensor, dst: torch.Tensor, experts: list[int]) -> None:
    for m, e in enumerate(experts):
        dst[m].copy_(src[e], non_blocking=True)


def copy_rows(n: int, mb: float, dev) -> list[str]:
    """The table's rows for n experts of mb MB each."""
    B = int(mb * 2**20) // 256 * 256
    src = pinned_empty((32, B))
    src.view(torch.int32).random_()
    dst, dst2 = (torch.empty((n, B), dtype=torch.uint8, device=dev) for _ in range(2))
    experts = list(range(3, 3 + 3 * n, 3))
    ids = torch.tensor(experts, dtype=torch.int32, device=dev)
    absent = torch.full((src.shape[0],), -1, dtype=torch.int32, device=dev)  # a cache that holds no expert
    host_off = cuda_driver.device_pointer(src.data_ptr()) - dst.data_ptr()
    other, half, rows = torch.cuda.Stream(), n // 2, []

    def fetch(ids: torch.Tensor, programs: int) -> None:
        fetch_experts(ids, absent, dst, host_off, programs)

    def row(way: str, s: float) -> None:
        rows.append(f"| {n} | {B / 2**20:.1f} | {way} | {s * 1e3:.3f} | {n * B / s / 1e9:.1f} |")
        print(rows[-1], flush=True)

    def both() -> None:  # half the experts each way, at once
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            copies(src, dst2, experts[:half])
        fetch(ids[half:], 32)
        torch.cuda.current_stream().wait_stream(other)

    row("copy engine", timed(lambda: copies(src, dst, experts)))
    fetch(ids, 16)
    torch.cuda.synchronize()
    assert torch.equal(dst[0].cpu(), src[experts[0]]), "the fetch kernel copied wrong bytes"
    for p in (4, 8, 16, 32, 64, 128):
        row(f"kernel, {p} programs an expert", timed(lambda p=p: fetch(ids, p)))
    row("half copy engine, half kernel (32 programs)", timed(both))
    return rows


def gemv_rows(name: str, rows: int, cols: int, bits: int, dev) -> list[str]:
    spec = quant.QuantSpec(bits, 64 if bits == 4 else 32, 128)
    w = quant.random_qmatrix(rows, cols, spec, torch.Generator(device="cpu").manual_seed(0))
    nbytes = sum(t.nbytes for t in w.tensors().values())
    x = torch.randn(1, cols, dtype=torch.bfloat16, device=dev)
    out = torch.empty(1, rows, dtype=torch.bfloat16, device=dev)
    on_dev = quant.QMatrix.from_tensors(w.info(), {k: t.to(dev) for k, t in w.tensors().items()})
    on_host = quant.QMatrix.from_tensors(w.info(), {k: t.pin_memory() for k, t in w.tensors().items()})
    lines = []
    for where, m in (("device", on_dev), ("host (pinned)", on_host)):
        s = timed(lambda m=m: hqq_gpu.gemv(x, m, out))
        lines.append(f"| {name} | {where} | {s * 1e6:.1f} | {nbytes / s / 1e9:.1f} |")
        print(lines[-1], flush=True)
    ref = hqq_gpu.gemv(x, on_dev, torch.empty_like(out))
    assert torch.equal(hqq_gpu.gemv(x, on_host, out), ref), "the GEMV from host memory differs"
    return lines


def layer_case(model: str, bits: int, device, experts: int = 32):
    """One MoE layer of `model` (`experts` of its experts, random HQQ codes at `bits`) and a
    token's routing: run(way) -> out for way "cached" (every expert in a device slot),
    "host" (every routed expert read from page-locked host memory), "fetched" (copied by
    fetch_experts first, then read from those copies; the copy is part of the time)."""
    cfg = bench.shape_config(model, 1)
    eq = bench.expert_quantization("hqq", bits)
    fields, stride = store_mod.expert_layout(cfg, eq)
    gen = torch.Generator(device=device).manual_seed(0)
    on_device = torch.stack([bench.random_expert(cfg, eq, fields, stride, device, gen) for _ in range(experts)])
    cuda = torch.device(device).type == "cuda"
    host = pinned_empty(tuple(on_device.shape)) if cuda else torch.empty_like(on_device)
    host.copy_(on_device)
    staging = torch.empty((cfg.top_k, stride), dtype=torch.uint8, device=device)
    views = bench.expert_views(cfg, fields, eq)(on_device[0])
    h = torch.randn(1, cfg.hidden_size, generator=gen, device=device).to(torch.bfloat16) * 0.1
    ids = torch.randperm(experts, generator=gen, device=device)[:cfg.top_k].to(torch.int32)
    weights = torch.softmax(torch.randn(cfg.top_k, generator=gen, device=device), -1)
    every = torch.arange(experts, dtype=torch.int32, device=device)
    absent = torch.full((experts,), -1, dtype=torch.int32, device=device)
    host_at = cuda_driver.device_pointer(host.data_ptr()) if cuda else host.data_ptr()
    host_off, stage_off = host_at - on_device.data_ptr(), staging.data_ptr() - on_device.data_ptr()
    out = torch.empty_like(h)

    def run(way: str) -> torch.Tensor:
        if way == "cached":
            return hqq_gpu.moe_decode(h, views, stride, ids, weights, every, out)
        if way == "host":
            return hqq_gpu.moe_decode(h, views, stride, ids, weights, absent, out, host_off=host_off)
        fetch_experts(ids, absent, staging, host_off - stage_off)
        return hqq_gpu.moe_decode(h, views, stride, ids, weights, absent, out, host_off=host_off,
                                  fetched=(ids, stage_off))
    run.host = host  # the experts' home in host memory lives as long as run: kernels read it by address
    return run, cfg.top_k * stride


def layer_rows(model: str, bits: int, dev, experts: int) -> list[str]:
    run, nbytes = layer_case(model, bits, dev, experts)
    want = run("cached").clone()
    rows = []
    for way in ("cached", "host", "fetched"):
        assert torch.equal(run(way), want), f"{way}: the layer's output differs from the cached experts'"
        s = timed(lambda way=way: run(way))
        rows.append(f"| {model} {bits}-bit | {way} | {s * 1e6:.1f} | {nbytes / s / 1e9:.1f} |")
        print(rows[-1], flush=True)
    return rows


def main(out_path: str | None = None) -> int:
    dev = torch.device("cuda")
    lines = [f"# Zero-copy reads of experts ({torch.cuda.get_device_name(dev)})", ""]
    lines += ["| experts | MB each | way | ms | GB/s |", "|---|---|---|---|---|"]
    for n, mb in ((8, 2.5), (4, 13.0), (2, 55.0)):  # Qwen3-30B-A3B 4-bit, gpt-oss-20b MXFP4, Mixtral 2-bit
        lines += copy_rows(n, mb, dev)
    lines += ["", "| matrix | where | us | GB/s |", "|---|---|---|---|"]
    for shape in (("Qwen3 w1 768x2048 4-bit g64", 768, 2048, 4), ("Qwen3 w2 2048x768 4-bit g64", 2048, 768, 4),
                  ("Mixtral w1 14336x4096 2-bit g32", 14336, 4096, 2)):
        lines += gemv_rows(*shape, dev)
    lines += ["", "One MoE layer's routed experts (hqq_gpu.moe_decode, both launches; GB/s: the experts' bytes / time)",
              "", "| layer | experts | us | GB/s |", "|---|---|---|---|"]
    lines += layer_rows("qwen3-30b-a3b", 4, dev, 32)
    lines += layer_rows("mixtral-8x7b", 2, dev, 8)
    if out_path:
        with open(out_path, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
