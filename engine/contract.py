"""The types the app and the engine share, and the engine's interface as the app calls it.

Importable without torch: the app builds SamplingSettings and reads GenerationStats and
ExpertTrace before (and without) loading the engine. The download progress type is
moeferry.engine.setup.download.FetchProgress (torch-free too); long operations (load_engine, convert,
the paper import) report progress(fraction, message) (`Progress`).

EngineProtocol is what the app's worker thread uses of moeferry.engine.runtime.generate.Engine; the app's tests
fake it (tests/app/fakes.py) and tests/app/test_engine_contract.py runs the fake and the real
engine on the demo store through the same checks.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Protocol, runtime_checkable

Progress = Callable[[float, str], None]
MAX_SEED = 2**64 - 1  # the largest sampling seed (torch.Generator.manual_seed takes 0..2**64-1)


@dataclass
class SamplingSettings:
    """How the next token is chosen. None for a repetition control: the store's default.

    repeat_penalty follows llama.cpp: over the last repeat_last_n tokens of the context
    (prompt included; -1 = all of it, 0 = none) a token's positive logit is divided by the
    penalty and a negative one multiplied (1.0 = off). no_repeat_ngram follows transformers:
    a token that would complete an n-gram already in the context is never chosen (0 = off).
    """
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 512
    seed: int | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int = 64
    no_repeat_ngram: int | None = None


@dataclass
class TokenPiece:
    token_id: int
    text: str


@dataclass
class GenerationStats:
    tokens_per_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    bytes_h2d: int = 0
    peak_vram_bytes: int = 0
    # the whole GPU after the reply as the driver counts it (nvidia-smi's memory.used): the engine's
    # allocations, this process's CUDA context and allocator reserve, and other programs; 0 on the CPU
    gpu_memory_used_bytes: int = 0
    gpu_memory_total_bytes: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    vram_budget_bytes: int | None = None
    h2d_gb_per_s: float = 0.0
    misses_cpu: int = 0  # misses computed on the CPU (--cpu-experts), counted in cache_misses
    misses_copied: int = 0  # misses copied over the link
    misses_both: int = 0  # computed on the CPU and copied for later
    cpu_expert_runs: int = 0  # expert uses computed on the CPU (all of them without a GPU)
    cpu_gb_per_s: float = 0.0  # the CPU kernels' achieved read speed
    cpu_s: float = 0.0  # time the CPU computed experts
    cpu_wait_s: float = 0.0  # of it, time the layers waited for the CPU: all of it (the host thread computes them)

    def contract(self) -> dict:
        """The fields `moeferry generate --json` promises, first, then the rest."""
        d = asdict(self)
        keys = ("tokens_per_s", "prefill_s", "decode_s", "cache_hits", "cache_misses",
                "prefetch_issued", "prefetch_used", "bytes_h2d", "peak_vram_bytes")
        return {**{k: d[k] for k in keys}, **{k: v for k, v in d.items() if k not in keys}}


@dataclass
class ExpertTrace:
    num_layers: int
    num_experts: int
    selected: list = field(default_factory=list)  # [token][layer] -> tuple of expert ids
    resident_before: list = field(default_factory=list)  # [token][layer] -> experts resident then


class ModelShape(Protocol):
    num_layers: int
    num_experts: int
    top_k: int


class Device(Protocol):
    type: str  # "cuda" or "cpu" (a torch.device)


@runtime_checkable
class EngineProtocol(Protocol):
    config: ModelShape
    device: Device
    note: str          # a sentence for the user when loading fell back (e.g. no pinned memory), else ""
    max_context: int   # tokens of prompt + reply
    last_stats: GenerationStats
    last_trace: ExpertTrace

    def set_prefetch(self, depth: int) -> None: ...

    def set_cache_experts(self, k: int) -> None: ...

    def set_cpu_threads(self, n: int) -> None: ...

    def stream(self, prompt: str | list[dict], sampling: SamplingSettings,
               cancel: threading.Event | None = None) -> Iterator[TokenPiece]: ...

    def close(self) -> None: ...
