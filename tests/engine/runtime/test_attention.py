"""grouped_attention (the CPU's attention, and gpt_oss's with sinks everywhere) against
torch's scaled_dot_product_attention and a plain reference with the key/value heads repeated."""

import pytest
import torch
import torch.nn.functional as F

from moeferry.engine.runtime import model as model_mod
from moeferry.engine.runtime.model import grouped_attention


def repeated_reference(q, k, v, mask, sinks):
    """[T, heads, D] from q [T, heads, D], k/v [S, kv heads, D], with sinks as one more logit."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.transpose(0, 1).double(), k.repeat_interleave(rep, 1).transpose(0, 1).double(), \
        v.repeat_interleave(rep, 1).transpose(0, 1).double()
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(-1, 1, 1).expand(-1, scores.shape[1], 1)], -1)
    probs = scores.softmax(-1)[..., :v.shape[1]]
    return (probs @ v).transpose(0, 1)


def case(T, S, heads, kv_heads, D, window=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, D, generator=g) for n, h in ((T, heads), (S, kv_heads), (S, kv_heads)))
    qpos, kpos = torch.arange(S - T, S)[:, None], torch.arange(S)[None, :]
    mask = kpos <= qpos
    if window:
        mask = mask & (qpos - kpos < window)
    return q, k, v, mask


@pytest.mark.parametrize("T,S,heads,kv_heads,D,window", [
    (1, 1, 4, 4, 8, None), (1, 37, 8, 2, 16, None), (1, 37, 8, 2, 16, 5), (5, 5, 6, 3, 12, None),
    (9, 20, 8, 1, 16, 4), (16, 16, 32, 4, 128, None)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_grouped_attention_equals_the_repeated_reference(T, S, heads, kv_heads, D, window, with_sinks):
    q, k, v, mask = case(T, S, heads, kv_heads, D, window)
    sinks = torch.randn(heads) if with_sinks else None
    got = grouped_attention(q, k, v, mask if T > 1 or window else None, sinks)
    want = repeated_reference(q, k, v, mask, sinks)
    assert got.shape == (T, heads, D)
    assert torch.allclose(got.double(), want, atol=2e-6), float((got.double() - want).abs().max())
    if not with_sinks:
        sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=mask, enable_gqa=heads != kv_heads).transpose(0, 1)
        assert torch.allclose(got, sdpa, atol=2e-6)


def test_a_long_prompt_is_scored_a_block_of_tokens_at_a_time(monkeypatch):
    """The same result when the scores fit only 3 query tokens at a time, and no block holds more."""
    q, k, v, mask = case(11, 14, 8, 2, 16, window=6)
    sinks = torch.randn(8)
    whole = grouped_attention(q, k, v, mask, sinks)
    sizes = []
    real_bmm = torch.bmm

    def counting_bmm(a, b):
        if b.shape[1] == 16:  # the scores' product: [kv heads, tokens * group, D] x [kv heads, D, S]
            sizes.append(a.shape[1] // 4)
        return real_bmm(a, b)

    monkeypatch.setattr(model_mod, "ATTENTION_FLOATS", 3 * 8 * 14)
    monkeypatch.setattr(torch, "bmm", counting_bmm)
    blocks = grouped_attention(q, k, v, mask, sinks)
    assert sizes == [3, 3, 3, 2]
    assert torch.allclose(blocks, whole, atol=1e-6)


def test_bfloat16_attention_keeps_float32_scores():
    q, k, v, mask = case(4, 9, 8, 2, 16)
    got = grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    want = repeated_reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), mask, None)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), want, atol=2e-2)
