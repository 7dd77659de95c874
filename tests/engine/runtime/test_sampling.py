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


def nucleus_by_sorting(z: torch.Tensor, top_p: float) -> tuple[list[int], torch.Tensor]:
    """Top-p's nucleus from a sort of the whole vocabulary (the reference)."""
    p, order = torch.sort(torch.softmax(z.double(), -1), descending=True)
    keep = int(((torch.cumsum(p, -1) - p) <= top_p).sum())
    return order[:keep].tolist(), p[:keep]


@pytest.mark.parametrize("vocab,peak,top_p,span", [(50, 0, 0.9, 16.0), (5000, 12, 0.9, 16.0), (5000, 12, 0.5, 16.0),
                                                   (5000, 0, 0.95, 16.0), (5000, 6, 0.99, 2.0), (7, 3, 0.1, 16.0)])
def test_the_nucleus_is_the_one_a_sort_of_the_whole_vocabulary_gives(vocab, peak, top_p, span):
    """Looked for among the likeliest tokens first (span), and in the whole vocabulary when those
    hold no more than top_p (span 2 with 40 likely tokens: they hold too little)."""
    g = torch.Generator().manual_seed(vocab + peak)
    for _ in range(5):
        z = torch.randn(vocab, generator=g) * 2
        z[torch.randperm(vocab, generator=g)[:40]] += peak
        ids, p = generate.nucleus(z, top_p, span)
        want_ids, want_p = nucleus_by_sorting(z, top_p)
        assert ids.tolist() == want_ids
        torch.testing.assert_close(p.double(), want_p, rtol=1e-5, atol=1e-7)


def test_a_draw_takes_each_index_with_its_share_of_the_probability():
    p = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.125]) * 3  # unnormalised, one never drawn
    grid = [(i + 0.5) / 4000 for i in range(4000)]
    counts = torch.bincount(torch.tensor([generate.draw(p, u) for u in grid]), minlength=5)
    assert counts.tolist() == [2000, 0, 1000, 500, 500]
    assert generate.draw(p, 0.0) == 0 and generate.draw(p, 0.9999999) == 4


def test_sampling_follows_the_nucleus_probabilities():
    """sample() drawn 6000 times: each token's frequency within a few standard errors of its
    probability in the nucleus (renormalised), none outside it."""
    z = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -4.0])
    s = SamplingSettings(temperature=0.8, top_p=0.8)
    ids, p = nucleus_by_sorting(z / 0.8, 0.8)
    want = torch.zeros(6, dtype=torch.float64)
    want[ids] = p / p.sum()
    n = 6000
    gen = torch.Generator().manual_seed(1)
    freq = torch.bincount(torch.tensor([generate.sample(z, s, gen) for _ in range(n)]), minlength=6).double() / n
    assert set(torch.nonzero(freq).squeeze(1).tolist()) <= set(ids)
    assert torch.all((freq - want).abs() <= 4 * torch.sqrt(want * (1 - want) / n) + 1e-9)
