"""What drawing one token costs the host, by vocabulary size: the engine's sample() against the
way it sampled before 2026-12-07 (softmax on the host, a sort of the whole vocabulary for top-p,
torch.multinomial), on the CPU and, where there is one, on the GPU where the logits lie.

    python -m benchmarks.sampling_cost

The logits are an LM's in shape: normal noise (sd 2) with 40 tokens raised by 18, so that at
temperature 0.7 a few tens of tokens hold nearly all the probability. ms per token, the median
of 50 draws after 5 unmeasured.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from moeferry.engine.contract import SamplingSettings
from moeferry.engine.runtime.generate import sample

VOCABS = {"Mixtral (32000)": 32000, "Qwen3 (151936)": 151936, "gpt-oss (201088)": 201088}
SETTINGS = {"greedy": SamplingSettings(temperature=0), "T 0.7": SamplingSettings(temperature=0.7, top_p=1.0),
            "T 0.7, top-p 0.9": SamplingSettings(temperature=0.7, top_p=0.9)}


def sample_before(logits: torch.Tensor, s: SamplingSettings, gen: torch.Generator) -> int:
    """generate.sample as it was (no repetition controls)."""
    if s.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / s.temperature, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p > s.top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen))


def ms(fn, logits: torch.Tensor, s: SamplingSettings) -> float:
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        fn(logits, s, gen)
    times = []
    for _ in range(50):
        t = time.perf_counter()
        fn(logits, s, gen)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> int:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads"
          + (f", {torch.cuda.get_device_name()}" if "cuda" in devices else ""))
    print("| logits on | vocabulary | sampling | before, ms | now, ms |")
    print("|---|---|---|---|---|")
    for dev in devices:
        for vname, vocab in VOCABS.items():
            g = torch.Generator().manual_seed(vocab)
            logits = torch.randn(vocab, generator=g) * 2
            logits[torch.randperm(vocab, generator=g)[:40]] += 18
            logits = logits.to(dev)
            for sname, s in SETTINGS.items():
                before, now = ms(sample_before, logits, s), ms(sample, logits, s)
                print(f"| {dev} | {vname} | {sname} | {before:.3f} | {now:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
