"""What a model takes on the GPU, and how many cached experts per layer fit a VRAM budget.

One sizing for the planner (engine/setup/plan.py: the wizard's and `moeferry probe`'s cache sizes),
the engine (engine/runtime/generate.py: --vram-budget) and the benchmark (engine/measure/bench.py), so that a
cache size the planner offers is one the engine accepts. Imports nothing heavy.

    fixed  = dense weights on the GPU + KV cache (every layer, full context) + workspace
    slots  = min(experts, (budget - fixed) // (MoE layers * expert stride))
    extra  = layers given one slot more from what is left (fewer than every MoE layer)

The dense weights on the GPU are all but an embedding not tied to the LM head, which stays in
host RAM (generate.embedding_on_host); a large LM head of a model with quantized attention is
rounded to int8 there (int8_head, engine/kernels/int8_gpu.py). Without a budget on a GPU the engine takes what is free
before loading, less AUTO_BUDGET_SLACK_BYTES for the CUDA context and the allocator.
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass

from moeferry.engine.units import GiB, MiB

WORKSPACE_BASE_BYTES = 256 * MiB  # activations and the allocator's rounding
AUTO_BUDGET_SLACK_BYTES = 512 * MiB
COMPUTE_ITEMSIZE = 2  # bfloat16, the engine's default dtype on a GPU


# A GPU's LM head is rounded to int8 per row when its 16-bit copy is at least this large (Mixtral's
# is 262 MB, Qwen3-30B-A3B's 622 MB, gpt-oss-20b's 1.16 GB): a small head frees too little memory
# to be worth its rounding, and a tiny test model keeps its head exact.
INT8_HEAD_MIN_BYTES = 64 * MiB


def int8_head(params: int, attn_bits: int | None) -> bool:
    """Whether the engine on a GPU rounds an untied LM head of `params` weights to int8: with
    quantized attention (a 16-bit store, which the tests compare with transformers, keeps it
    exact) and a head of at least INT8_HEAD_MIN_BYTES. Its bytes are then a byte a weight and a
    float32 scale a row."""
    return attn_bits is not None and attn_bits < 16 and params * COMPUTE_ITEMSIZE >= INT8_HEAD_MIN_BYTES


def kv_cache_bytes(num_layers: int, context: int, num_kv_heads: int, head_dim: int,
                   itemsize: int = COMPUTE_ITEMSIZE) -> int:
    """Keys and values of every layer for `context` positions (allocated once, at full size)."""
    return 2 * num_layers * context * num_kv_heads * head_dim * itemsize


def workspace_bytes(ffn_matrix_params: int, itemsize: int = COMPUTE_ITEMSIZE, kernels: str = "auto",
                    on_gpu: bool = True) -> int:
    """Room for activations and transient matrices on the GPU (0 on the CPU).

    The fused path dequantizes at most one expert matrix (hidden x expert FFN width,
    `ffn_matrix_params`) into a workspace for long prompts, plus its inputs and outputs; the
    reference path builds float32 codes, scales and the dequantized matrix at every product
    (measured: ~1 GB for Mixtral's 14336x4096 at once).
    """
    if not on_gpu:
        return 0
    if kernels == "reference":
        return 14 * ffn_matrix_params + WORKSPACE_BASE_BYTES
    return 3 * ffn_matrix_params * itemsize + WORKSPACE_BASE_BYTES


def use_expandable_segments(environ=os.environ, platform: str = sys.platform) -> None:
    """Have torch's CUDA allocator grow its segments in place (Linux; torch has them nowhere
    else) unless the user set PYTORCH_CUDA_ALLOC_CONF. With fixed segments, blocks freed while
    the model loads and warms up stayed reserved and split: on an H100 at an 11 GiB budget the
    GPU held 0.47 GiB (Qwen3-30B-A3B) to 1.42 GiB (gpt-oss-20b) more than was allocated, past the
    budget's slack; with them 0.04-0.13 GiB (docs/BENCHMARKS.md). Read at the first CUDA
    allocation, so the command lines call it first, and bench.build for the developer scripts."""
    if platform == "linux":
        environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def auto_budget(free_bytes: int) -> int:
    """The budget when none is given: the GPU's free memory before the model is loaded."""
    return free_bytes - AUTO_BUDGET_SLACK_BYTES


@dataclass(frozen=True)
class DeviceBytes:
    """Bytes a model holds on the GPU apart from its expert cache, and one cache slot's bytes."""
    dense: int  # the non-expert weights the GPU holds, as it holds them
    kv_cache: int
    workspace: int
    per_slot: int  # one cached expert in every MoE layer
    num_experts: int
    moe_layers: int

    @property
    def fixed(self) -> int:
        return self.dense + self.kv_cache + self.workspace

    def needed(self, slots: int) -> int:
        """Bytes with `slots` cached experts per layer."""
        return self.fixed + slots * self.per_slot

    def slots(self, budget: int) -> int:
        """Cached experts per layer that fit `budget` (0 when not even one does)."""
        return int(max(0, min(self.num_experts, (budget - self.fixed) // max(self.per_slot, 1))))

    def extra_slot_layers(self, budget: int, slots: int) -> int:
        """MoE layers that get one cached expert more than `slots` from what `budget` leaves
        after them: up to a slot a layer of unused memory otherwise (1.77 GB for Mixtral's
        2-bit experts). Fewer than every layer, else `slots` + 1 would fit."""
        if slots < 1 or slots >= self.num_experts:
            return 0
        one_expert = max(self.per_slot // max(self.moe_layers, 1), 1)
        return int(max(0, min(self.moe_layers - 1, (budget - self.needed(slots)) // one_expert)))


# Below this many weights per expert matrix (the demo), the CPU engine runs on one thread: small
# matrices gain nothing from threads, and OpenMP's spinning threads collapse when another
# process holds a core (measured 1.4 vs 130 tokens/s on 2 cores). The planner predicts with it.
CPU_ONE_THREAD_MATRIX_PARAMS = 1 << 22


def cpu_one_thread(matrix_params: int) -> bool:
    """True when the CPU engine runs a model whose expert matrices have this many weights on one thread."""
    return matrix_params < CPU_ONE_THREAD_MATRIX_PARAMS


# The CPU engine's expert cache keeps its experts dequantized to float32 (all of them for the
# demo model): as many per layer as fit in this many bytes of float32.
CPU_EXPERT_CACHE_BYTES = 4 * GiB


def cpu_cache_slots(num_moe_layers: int, expert_params: int, num_experts: int) -> int:
    """Experts per layer the CPU engine keeps when no cache size is given. Counted in float32
    bytes, not stored ones: at 4 bits an expert takes 7.5x its stored bytes once dequantized."""
    per_slot = num_moe_layers * expert_params * 4
    return int(min(num_experts, CPU_EXPERT_CACHE_BYTES // max(per_slot, 1)))


_QUANT_FIELD = re.compile(r"plane\d+|scale|zero|scale_meta|zero_meta|blocks|scales")


def dense_bytes(header: dict) -> int:
    """The dense weights' bytes as the engine holds them, from dense.safetensors' header:
    quantized matrices' fields as stored, every other tensor in the compute dtype (what
    generate.move_dense makes; on a GPU an untied embedding among them stays in host RAM)."""
    total = 0
    for name, entry in header.items():
        n = math.prod(entry["shape"])
        if _QUANT_FIELD.fullmatch(name.rpartition(".")[2]):
            total += entry["data_offsets"][1] - entry["data_offsets"][0]
        else:
            total += n * COMPUTE_ITEMSIZE
    return total
