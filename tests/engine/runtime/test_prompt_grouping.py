"""Whether a prompt runs its experts grouped (OffloadedMixtral.prompt_grouped), on stated costs.

The grouped path itself is checked in test_graphed_decode.py (Triton interpreter),
test_engine_cuda.py and tests/engine/kernels/test_hqq_gpu.py; here only the choice, on a
stand-in for the model.
"""

from types import SimpleNamespace

import pytest

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


@pytest.mark.parametrize("kernels", ["auto", "fused"])
def test_a_grouped_kernel_that_cannot_run_means_one_at_a_time_with_a_warning(monkeypatch, kernels):
    """fast_path_works runs the prompt kernel's probe once: when it fails (Triton cannot build it
    on this machine, say), "auto" warns and takes the slower path, a prompt's experts one at a
    time; "fused" raises."""
    import torch

    from moeferry.engine.kernels import hqq_gpu

    def broken(*args):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(hqq_gpu, "moe_prompt", broken)
    m = SimpleNamespace(cfg=SimpleNamespace(top_k=2, hidden_size=8), dtype=torch.float32, device=torch.device("cpu"),
                        kernels=kernels, cache=SimpleNamespace(slot_weights=lambda layer, slot: {}, slot_bytes=64))
    m.device_ints = lambda values: OffloadedMixtral.device_ints(m, values)
    works = lambda: OffloadedMixtral.fast_path_works(  # noqa: E731
        m, lambda: OffloadedMixtral.probe_prompt_kernel(m), "the grouped prompt kernel")
    if kernels == "fused":
        with pytest.raises(RuntimeError, match="no C compiler"):
            works()
    else:
        with pytest.warns(UserWarning, match="grouped prompt kernel unavailable"):
            assert not works()
    monkeypatch.setattr(hqq_gpu, "moe_prompt", lambda *args: None)
    assert works()
