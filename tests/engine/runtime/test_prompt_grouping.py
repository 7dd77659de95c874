"""Whether a prompt runs its experts grouped (OffloadedMixtral.prompt_grouped), on stated costs.

The grouped path itself is checked in test_graphed_decode.py (Triton interpreter),
test_engine_cuda.py and tests/engine/kernels/test_hqq_gpu.py; here only the choice, on a
stand-in for the model.
"""

from types import SimpleNamespace

from moeferry.engine.runtime.model import OffloadedMixtral

MB = 10**6


def stand_in(experts: int, top_k: int, expert_bytes: int, hybrid=None):
    """What prompt_grouped reads of a model whose grouped kernel takes its experts."""
    return SimpleNamespace(cfg=SimpleNamespace(num_experts=experts, top_k=top_k),
                           cache=SimpleNamespace(slot_bytes=expert_bytes), hybrid=hybrid, grouped_prompt_kernel=True)


def test_grouped_while_reading_every_tokens_experts_costs_less_than_the_hosts_calls():
    # Qwen3-30B-A3B's shape, 2.5 MB experts: E (0.3 ms x 400 GB/s + B) / (k B) = 784 tokens
    qwen3 = stand_in(128, 8, int(2.5 * MB))
    assert OffloadedMixtral.prompt_grouped(qwen3, 783)
    assert not OffloadedMixtral.prompt_grouped(qwen3, 785)
    assert not OffloadedMixtral.prompt_grouped(qwen3, 1)  # a decoded token has its own path
    # Mixtral's, 55 MB experts: 12 tokens
    mixtral = stand_in(8, 2, 55 * MB)
    assert OffloadedMixtral.prompt_grouped(mixtral, 12)
    assert not OffloadedMixtral.prompt_grouped(mixtral, 13)
    # experts on the CPU, or a kernel that does not take them: one at a time
    assert not OffloadedMixtral.prompt_grouped(stand_in(128, 8, MB, hybrid=object()), 16)
    off = stand_in(128, 8, MB)
    off.grouped_prompt_kernel = False
    assert not OffloadedMixtral.prompt_grouped(off, 16)
