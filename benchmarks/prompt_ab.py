"""A prompt's experts one at a time against grouped (OffloadedMixtral.prompt_grouped), timed.

    python3 benchmarks/prompt_ab.py [MODEL:BITS[:GROUP] ...]    # default qwen3-30b-a3b:4 olmoe-1b-7b:4

On the benchmark's full-size synthetic model (uniform routing, fused kernels, lru, 16 new
tokens), in one process, taking turns: the prompt's experts one at a time, grouped (the
engine's default: at 12 GiB in passes, the cached experts first, then the others as the slots
take them), one at a time again; every expert resident and 12 GiB; prompts of 128 and 512 tokens. A first run of each budget
compiles the kernels and is not reported. Also the largest relative difference between the two
ways' logits of the last prompt token. Needs a CUDA GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.hits_first_ab import build_spec  # noqa: E402
from moeferry.engine.measure import bench  # noqa: E402
from moeferry.engine.runtime.model import OffloadedMixtral  # noqa: E402

GROUPED = OffloadedMixtral.prompt_grouped


def one_at_a_time(self, T: int) -> bool:
    return False


WAYS = (("one at a time", one_at_a_time), ("grouped", GROUPED), ("one at a time", one_at_a_time))


def main(*specs: str) -> int:
    for spec in specs or ("qwen3-30b-a3b:4", "olmoe-1b-7b:4"):
        model, bits, s = build_spec(spec)
        for budget in ("none", "12GiB"):
            measure(s, budget, 32)  # compiles
            for prompt in (128, 512):
                for name, way in WAYS:
                    OffloadedMixtral.prompt_grouped = way
                    r = measure(s, budget, prompt)
                    print(f"{model} {bits}-bit {budget:5s} P={prompt:3d} {name:14s} first token "
                          f"{r['first_token_s']:6.3f} s, decode {r['decode_tokens_per_s']:7.2f} tok/s, "
                          f"peak {r['peak_vram_bytes'] / 2**30:.2f} GiB", flush=True)
                OffloadedMixtral.prompt_grouped = GROUPED
        logits_differ(s)
        del s
    return 0


def measure(s, budget: str, prompt: int) -> dict:
    return bench.measure(s, budget, prompt, 16, ("lru",), ("fused",), 1, log=lambda m: None,
                         cond=bench.Conditions(routing="uniform"))["results"][0]


def logits_differ(s) -> None:
    """The last prompt token's logits both ways (every expert resident, the model's own routing)."""
    model = s.model("lru", s.cfg.num_experts, 0, "fused", 0, 0)
    model.setup_kv(256)
    tokens = torch.randint(0, s.cfg.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).to(s.device)
    out = {}
    for name, way in WAYS[:2]:
        OffloadedMixtral.prompt_grouped = way
        out[name] = model.forward(tokens, 0).float()
    OffloadedMixtral.prompt_grouped = GROUPED
    a, b = out["one at a time"], out["grouped"]
    print(f"{s.shape}: logits of the last prompt token, grouped against one at a time: relative "
          f"difference {float((a - b).norm() / a.norm()):.2e}, same argmax {bool(a.argmax() == b.argmax())}",
          flush=True)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
