"""The CPU engine (a machine without a GPU) on a synthetic full-width model: every expert runs on
the HQQ CPU kernel from its stored bytes, as `moeferry generate --device cpu` runs a model too
big for the CPU's expert cache; the dense matrices either in their low-bit forms (2-4 bit ones in
place on the same kernel, 8-bit ones and the head in int8: what load_engine does) or
dequantized to float32, the head too. For llama.cpp beside it on
the same machine, write the same shape with benchmarks/gguf_random.py (--layers) and run
llama-bench -ngl 0 with the same threads, prompt and tokens.

    python -m benchmarks.cpu_engine --layers 8 --expert-bits 2 --group-size 32 --threads 2
    python -m benchmarks.cpu_engine --model qwen3-30b-a3b --layers 8 --expert-bits 4 --threads 2

Routing is uniform (engine/measure/routing.py): a random router sends most tokens to the same
few experts, which the L3 would then serve. Each variant decodes --new-tokens after a prompt of
--prompt-len, --repeats times; the median decode rate is printed with the dense weights' RAM and
the bytes a decoded token reads (the routed experts and the dense matrices; the head included).
--profile then runs the engine as load_engine makes it once more under cProfile (prompt and
decode) and prints the functions that took the most time. --ab-decode-ops ROUNDS compares a lone
token's operations, the compiled ones the engine runs (engine/kernels/decode_cpu.py) and the eager
reference, in one process: ROUNDS times 4 tokens with each in turn, the context growing.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeferry.engine.kernels import hqq_cpu  # noqa: E402
from moeferry.engine.kernels.decode_cpu import use_compiled_decode  # noqa: E402
from moeferry.engine.kernels.torch_cpu import CpuMatrix  # noqa: E402
from moeferry.engine.measure import bench, routing as routing_mod  # noqa: E402
from moeferry.engine.measure.bench_shapes import MODEL_SHAPES, shape_config  # noqa: E402
from moeferry.engine.runtime.generate import cpu_copies_of, cpu_experts_for, move_dense  # noqa: E402
from moeferry.engine.units import fmt_bytes  # noqa: E402


def cpu_model(s: bench.Synthetic, threads: int | None, context: int):
    """The CPU engine over s, as load_engine makes it for a model too big for the CPU's expert
    cache (threads None: automatic), with uniform routing and room for context tokens."""
    model = s.model("lru", 1, 0, "reference")
    views = bench.expert_views(s.cfg, s.fields, s.eq)
    copies = cpu_copies_of(s.cfg, s.host, views, s.device, None, None, 1)
    model.hybrid = cpu_experts_for(copies, s.cfg, s.host, model.cache, "all", threads, every_expert=True)
    use_compiled_decode(model)
    model.routing = routing_mod.parse_routing("uniform", s.cfg, s.device, 0.85, 1, 0)
    model.setup_kv(context)
    return model


def decode_rate(s: bench.Synthetic, prompt: list[int], new_tokens: int, threads: int) -> tuple[float, float]:
    """(first token s, decoded tokens/s) of one run of the CPU engine over s."""
    model = cpu_model(s, threads, len(prompt) + new_tokens)
    with torch.inference_mode():
        t0 = time.perf_counter()
        tok = int(model.forward(torch.tensor(prompt), 0)[-1].argmax())
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        for n in range(new_tokens - 1):
            tok = int(model.forward(torch.tensor([tok]), len(prompt) + n)[-1].argmax())
    return first, (new_tokens - 1) / (time.perf_counter() - t1)


def decode_ops_ab(s: bench.Synthetic, prompt: list[int], rounds: int, threads: int) -> dict[str, float]:
    """Decoded tokens/s of the compiled and the eager decode operations, taking turns every 4
    tokens after 4 warm-up rounds (a shared machine's drift falls on both)."""
    model = cpu_model(s, threads, len(prompt) + 8 * (rounds + 4))
    variants, seconds = {"compiled": model.decode_ops, "eager": model.ops}, {"compiled": 0.0, "eager": 0.0}
    with torch.inference_mode():
        tok, pos = int(model.forward(torch.tensor(prompt), 0)[-1].argmax()), len(prompt)
        for r in range(rounds + 4):
            for name, ops in variants.items():
                model.decode_ops = ops
                t = time.perf_counter()
                for _ in range(4):
                    tok, pos = int(model.forward(torch.tensor([tok]), pos)[-1].argmax()), pos + 1
                if r >= 4:
                    seconds[name] += time.perf_counter() - t
    return {name: 4 * rounds / t for name, t in seconds.items()}


def token_bytes(s: bench.Synthetic, dense: dict) -> int:
    """Bytes one decoded token reads: top_k experts per MoE layer and every dense matrix but the
    embedding (one row of it)."""
    experts = s.cfg.num_moe_layers * s.cfg.top_k * s.host.shape[2]
    matrices = 0
    for name, w in dense.items():
        if "embed_tokens" in name:
            continue
        matrices += w.nbytes() if isinstance(w, (hqq_cpu.CpuQMatrix, CpuMatrix)) else w.numel() * w.element_size()
    return experts + matrices


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_engine")
    p.add_argument("--model", default="mixtral-8x7b", choices=tuple(MODEL_SHAPES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--expert-format", choices=("hqq", "mxfp4"), default="hqq",
                   help="mxfp4: gpt-oss's experts as released (--expert-bits unused)")
    p.add_argument("--expert-bits", type=int, default=2, choices=(2, 3, 4))
    p.add_argument("--group-size", type=int, help="HQQ rows per scale (default: the width's own)")
    p.add_argument("--attn-bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--prompt-len", type=int, nargs="+", default=[16],
                   help="tokens before the decoded ones; several: a row each (the attention's share grows with them)")
    p.add_argument("--dense", choices=("both", "low-bit"), default="both",
                   help="low-bit: leave out the float32 variant (slow: it reads 3-4x the bytes)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also profile one run of the in-place engine")
    p.add_argument("--ab-decode-ops", type=int, metavar="ROUNDS",
                   help="also compare the compiled and the eager operations of a decoded token, taking turns")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cpu = torch.device("cpu")
    cfg = shape_config(a.model, a.layers)
    t = time.perf_counter()
    dense_q, _, host, fields, eq = bench.synthetic_model(cfg, a.expert_bits, a.attn_bits, cpu, 0, torch.float32,
                                                         a.expert_format, a.group_size)
    experts = "MXFP4" if a.expert_format == "mxfp4" else f"{a.expert_bits}-bit, groups of {eq['group_size']}"
    print(f"{a.model}, first {cfg.num_layers} layers, experts {experts} ({host.shape[2] / 1e6:.1f} MB each), "
          f"{a.attn_bits}-bit attention, built in {time.perf_counter() - t:.0f} s; "
          f"{a.threads} threads, T={a.new_tokens}, uniform routing", flush=True)
    print("| dense matrices | their RAM | GB read per token | prompt | first token s | decode tok/s (median; all) |")
    print("|---|---|---|---|---|---|")
    variants = (("low-bit: 2-4 bit in place, 8-bit and the head int8", True), ("dequantized to float32", False))
    for label, in_place in variants[:1 if a.dense == "low-bit" else 2]:
        dense, dense_bytes = move_dense(dense_q, cpu, torch.float32, in_place)
        s = bench.Synthetic(cfg, dense, dense_bytes, host, fields, eq, cpu, 0.0, a.expert_bits, a.attn_bits,
                            torch.float32, a.model)
        for length in a.prompt_len:
            prompt = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()
            decode_rate(s, prompt, 3, a.threads)  # numba's compile and the pools' start
            runs = [decode_rate(s, prompt, a.new_tokens, a.threads) for _ in range(a.repeats)]
            rates = [r for _, r in runs]
            print(f"| {label} | {fmt_bytes(dense_bytes)} | {token_bytes(s, dense) / 1e9:.2f} | {length} | "
                  f"{statistics.median(f for f, _ in runs):.2f} | **{statistics.median(rates):.2f}** "
                  f"({', '.join(f'{r:.2f}' for r in rates)}) |", flush=True)
            if a.ab_decode_ops and in_place:
                ab = decode_ops_ab(s, prompt, a.ab_decode_ops, a.threads)
                print(f"decoded tokens/s, {a.ab_decode_ops} rounds of 4 each, context {length} to "
                      f"{length + 8 * (a.ab_decode_ops + 4)}: compiled {ab['compiled']:.2f}, eager {ab['eager']:.2f} "
                      f"({ab['compiled'] / ab['eager']:.3f}x)", flush=True)
            if a.profile and in_place:
                profile = cProfile.Profile()
                profile.runcall(decode_rate, s, prompt, a.new_tokens, a.threads)
                pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
