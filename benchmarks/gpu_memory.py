"""Where the GPU memory of a budgeted run goes beyond what the engine allocates.

    python3 benchmarks/gpu_memory.py [MODEL[:BITS] ...]    # default qwen3-30b-a3b:4 gpt-oss-20b

The VRAM budget bounds torch's allocations; llama.cpp's figures are nvidia-smi's memory.used.
This prints the GPU's memory in use (total - free) after CUDA starts, after a cuBLAS product
and a Triton kernel (the int8 head's), then for each model `moeferry bench`'s lru decode at 11 GiB (uniform
routing, fused kernels, P=128, T=64) right after its decode: the driver's count, torch's reserve
and what is allocated, and the driver's count again after torch's unused reserve is returned
(the model still loaded). The allocator's segments grow in place as the engine asks
(vram.use_expandable_segments); `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False` measures
fixed ones. Needs a CUDA GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moeferry.engine.kernels import int8_gpu  # noqa: E402
from moeferry.engine.measure import bench  # noqa: E402
from moeferry.engine.runtime import vram  # noqa: E402
from moeferry.engine.runtime.generate import gpu_memory  # noqa: E402

GiB = 2**30


def used() -> int:
    return gpu_memory(torch.device("cuda"))[0]


def main(*specs: str) -> int:
    vram.use_expandable_segments()
    torch.zeros(1, device="cuda")
    print(f"CUDA context: {used() / GiB:.3f} GiB", flush=True)
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    print(f"+ a cuBLAS product: {used() / GiB:.3f} GiB", flush=True)
    int8_gpu.quantize(a).matmul(a[:1])
    torch.cuda.synchronize()
    print(f"+ a Triton kernel: {used() / GiB:.3f} GiB; torch reserves {torch.cuda.memory_reserved() / GiB:.3f}",
          flush=True)
    at_end = []

    def recorded(device) -> tuple[int, int]:
        n, total = gpu_memory(device)
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        torch.cuda.empty_cache()
        at_end.append((n, reserved, allocated, torch.cuda.max_memory_allocated(device), used()))
        return n, total

    bench.gpu_memory = recorded
    for spec in specs or ("qwen3-30b-a3b:4", "gpt-oss-20b"):
        model, *bits = spec.split(":")
        torch.cuda.empty_cache()
        s = bench.build(None, int(bits[0]) if bits else 4, 4, log=lambda m: None, model=model)
        r = bench.measure(s, "11GiB", 128, 64, ("lru",), ("fused",), 0, log=lambda m: None,
                          cond=bench.Conditions(routing="uniform"))["results"][0]
        n, reserved, allocated, peak, after = at_end[-1]
        print(f"{spec} 11GiB lru {r['decode_tokens_per_s']:.2f} tok/s: GPU memory used {n / GiB:.3f} GiB = "
              f"torch's reserve {reserved / GiB:.3f} (allocated {allocated / GiB:.3f}, peak {peak / GiB:.3f}) "
              f"+ outside torch {(n - reserved) / GiB:.3f}; after returning the unused reserve "
              f"{after / GiB:.3f}", flush=True)
        del s
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
