"""engine/runtime/generate.py sample(): the repetition tables kept token by token give the tokens that
rebuilding them from the whole context gives."""

from __future__ import annotations

import random

import pytest
import torch

from moeferry.engine.contract import SamplingSettings
from moeferry.engine.paths import demo_store_path
from moeferry.engine.runtime import generate
from moeferry.engine.runtime.generate import Repetition, load_engine


def from_scratch(logits: torch.Tensor, s: SamplingSettings, context: list[int]) -> torch.Tensor:
    """The controls read off the whole context, in plain Python (the reference)."""
    penalty, n, out = s.repeat_penalty or 1.0, s.no_repeat_ngram or 0, logits.clone()
    last = s.repeat_last_n
    window = context if last < 0 else context[-last:] if last > 0 else []
    for t in set(window) if penalty != 1.0 else ():
        v = out[t].clone()  # in float32, as the engine computes
        out[t] = v / penalty if v > 0 else v * penalty
    if n >= 1 and len(context) >= n:
        tail = context[len(context) - n + 1:]
        for i in range(len(context) - n + 1):
            if context[i:i + n - 1] == tail:
                out[context[i + n - 1]] = float("-inf")
    return out


@pytest.mark.parametrize("penalty,last_n,n", [(1.3, -1, 0), (1.3, 5, 0), (0.8, 1, 2), (1.0, 0, 1),
                                              (1.2, 64, 3), (1.1, 3, 4), (1.0, -1, 0)])
def test_the_kept_tables_equal_a_rebuild_at_every_token(penalty, last_n, n):
    rng = random.Random(f"{penalty}{last_n}{n}")
    s = SamplingSettings(repeat_penalty=penalty, repeat_last_n=last_n, no_repeat_ngram=n)
    tokens = [rng.randrange(12) for _ in range(200)]
    rep = Repetition(s, tokens[:7])
    for i in range(7, len(tokens)):
        logits = torch.randn(12, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(rep.apply(logits), from_scratch(logits, s, tokens[:i]), rtol=0, atol=0)
        rep.add(tokens[i])


@pytest.mark.parametrize("settings", [
    SamplingSettings(temperature=0, max_new_tokens=40, repeat_penalty=1.3, no_repeat_ngram=3),
    SamplingSettings(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=40, repeat_penalty=1.15,
                     repeat_last_n=16, no_repeat_ngram=2),
], ids=["greedy", "seeded"])
def test_the_demo_model_gives_the_same_tokens_as_with_tables_rebuilt_per_token(settings, monkeypatch):
    engine = load_engine(demo_store_path(), device="cpu")
    prompt = engine.encode("Tell me about the sea and the sea and the sea.", chat=True)
    kept = list(engine.generate_ids(prompt, settings))
    sample = generate.sample
    calls = []

    def rebuilt(logits, s, gen, context):
        calls.append(len(context.tokens))
        return sample(logits, s, gen, list(context.tokens))  # tables built from the whole context

    monkeypatch.setattr(generate, "sample", rebuilt)
    again = list(engine.generate_ids(prompt, settings))
    engine.close()
    assert len(kept) > 10 and again == kept and len(calls) == len(kept)
