"""How a prompt runs its experts (OffloadedMixtral.prompt_grouped, prompt_chunk), on stated costs.

The kernels themselves are checked in test_graphed_decode.py (Triton interpreter) and
tests/engine/kernels/test_hqq_gpu.py; here only the choices, on a stand-in for the model.
"""

from types import SimpleNamespace

import pytest

from moeferry.engine.runtime import model as model_mod
from moeferry.engine.runtime.model import OffloadedMixtral

MB = 10**6


def stand_in(experts: int, top_k: int, slots: int, expert_bytes: int, layers: int = 3, hybrid=None):
    """What the two methods read of a model whose grouped kernel takes its experts; its first
    layer caches one expert more (the budget's extra slots)."""
    cfg = SimpleNamespace(num_experts=experts, top_k=top_k, num_moe_layers=layers)
    cache = SimpleNamespace(slot_bytes=expert_bytes, slots_in=lambda mi: min(experts, slots + (mi == 0)))
    m = SimpleNamespace(cfg=cfg, cache=cache, hybrid=hybrid, grouped_prompt_kernel=True)
    m.prompt_grouped = lambda T: OffloadedMixtral.prompt_grouped(m, T)
    return m


def test_grouped_while_reading_every_tokens_experts_costs_less_than_the_hosts_calls():
    # Qwen3-30B-A3B's shape, 2.5 MB experts: E (0.3 ms x 400 GB/s + B) / (k B) = 784 tokens
    qwen3 = stand_in(128, 8, 128, int(2.5 * MB))
    assert OffloadedMixtral.prompt_grouped(qwen3, 783)
    assert not OffloadedMixtral.prompt_grouped(qwen3, 785)
    assert not OffloadedMixtral.prompt_grouped(qwen3, 1)  # a decoded token has its own path
    # Mixtral's, 55 MB experts: 12 tokens
    mixtral = stand_in(8, 2, 8, 55 * MB)
    assert OffloadedMixtral.prompt_grouped(mixtral, 12)
    assert not OffloadedMixtral.prompt_grouped(mixtral, 13)
    # experts on the CPU, or a kernel that does not take them: one at a time
    assert not OffloadedMixtral.prompt_grouped(stand_in(128, 8, 128, MB, hybrid=object()), 16)
    off = stand_in(128, 8, 128, MB)
    off.grouped_prompt_kernel = False
    assert not OffloadedMixtral.prompt_grouped(off, 16)


@pytest.mark.parametrize("slots,want", [(128, 100), (96, 14), (60, 100)])
def test_prompt_pieces_fit_the_smallest_layers_cache(slots, want):
    """Qwen3's shape with `slots` in most layers: the whole prompt when every expert fits;
    pieces of c tokens whose expected distinct experts, 128 (1 - (15/16)^c), stay within 4/5
    of the smallest layer's slots (96: c = 14); the whole prompt when pieces would be under 8
    tokens."""
    m = stand_in(128, 8, slots, int(2.5 * MB))
    c = OffloadedMixtral.prompt_chunk(m, 100)
    assert c == want
    if c < 100:
        assert 128 * (1 - (1 - 8 / 128) ** c) <= 0.8 * slots < 128 * (1 - (1 - 8 / 128) ** (c + 1))
        assert c >= model_mod.MIN_PROMPT_CHUNK
