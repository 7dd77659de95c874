"""Instruction count of the decode GEMV's inner loop, without a GPU.

    python -m benchmarks.kernel_sass [--bits 2] [--shape 14336x4096] [--float32-loop] [--fp16-meta]

Compiles moeferry.engine.kernels.hqq_gpu' `_gemv_kernel` for sm_90 with the launch constants `gemv` would use
for that matrix and bf16 activations (Triton's bundled ptxas), reads the SASS with Triton's cuobjdump and prints the
loop body's length, its opcode histogram and the registers per thread. The numbers in
docs/KERNELS.md ("SASS of the loop body") come from here. Needs Triton (no CUDA device).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch

from benchmarks.kernel_bench import SPECS, random_qmatrix
from moeferry.engine.kernels import hqq_gpu as K

_TYPES = {torch.uint8: "*u8", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32",
          torch.int32: "*i32"}


def compile_gemv(rows: int, cols: int, bits: int, packed: bool = True, meta8: bool = True):
    """The compiled kernel (a Triton CompiledKernel) for bf16 activations; packed=False: the
    float32 inner loop (which float32 activations get)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    g, mg = SPECS[bits]
    w = random_qmatrix(rows, cols, bits, g, meta8, mg, None, "cpu", seed=0)
    cfg = dict(K.gemv_config(rows, cols, bits, g, 132), H2=packed)
    n_j, split, k_per_split, bk, consts = K._gemv_launch(rows, cols, bits, g, 132, tuple(sorted(cfg.items())))
    tensors = dict(zip(("p0_ptr", "p1_ptr", "s_ptr", "z_ptr", "sm_ptr", "zm_ptr"), K._common_args(w)))
    ints = dict(zip(("G", "rows", "cols", "Ms", "Mz"), K._sizes(w)), k_per_split=k_per_split, n_split=split)
    constexprs = dict(K._format(w, bk), SPLIT=split > 1, **consts)
    num_warps = constexprs.pop("num_warps")
    constexprs.pop("num_stages")
    fn = K._gemv_kernel
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in tensors:
            sig[name] = _TYPES[tensors[name].dtype]
        elif name in ("x_ptr", "out_ptr"):
            sig[name] = "*bf16"
        elif name == "ws_ptr":
            sig[name] = "*fp32"
        elif name == "cnt_ptr":
            sig[name] = "*i32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or ints.get(name, 1) % 16 == 0:  # as Triton specialises
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_report(kernel) -> dict:
    """Length and opcode histogram of the longest loop of the kernel's SASS, and registers."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    code = [(int(m.group(1), 16), m.group(2)) for m in
            (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    loops = [(int(m.group(1), 16), a) for a, text in code
             if (m := re.search(r"BRA (0x[0-9a-f]+)", text)) and int(m.group(1), 16) < a]
    start, end = max(loops, key=lambda l: l[1] - l[0])
    body = [text for a, text in code if start <= a <= end]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    return {"loop_instructions": len(body), "registers": regs, "opcodes": dict(ops.most_common())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=2, choices=sorted(SPECS))
    ap.add_argument("--shape", default="14336x4096", help="ROWSxCOLS")
    ap.add_argument("--float32-loop", action="store_true", help="the float32 inner loop, not packed fp16")
    ap.add_argument("--fp16-meta", action="store_true", help="plain fp16 scale/zero instead of 8-bit")
    a = ap.parse_args(argv)
    if K.triton is None:
        print("kernel_sass needs Triton", file=sys.stderr)
        return 2
    rows, cols = (int(v) for v in a.shape.lower().split("x"))
    r = loop_report(compile_gemv(rows, cols, a.bits, not a.float32_loop, not a.fp16_meta))
    print(f"{rows}x{cols} {a.bits}-bit: {r['loop_instructions']} instructions per k tile, "
          f"{r['registers']} registers")
    print("  " + ", ".join(f"{op} {n}" for op, n in r["opcodes"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
