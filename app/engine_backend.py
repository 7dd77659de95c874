"""How the app loads the engine, behind one injectable object. No Qt.

`engine.generate` is imported only when a model is loaded, in the worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class LoadOptions:
    store: str
    device: str = "auto"
    cache_experts: int | None = None   # None: from the VRAM budget
    vram_budget: int | None = None     # bytes; None: the engine decides
    prefetch: int = 1


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 512
    seed: int | None = None


@dataclass
class EngineBackend:
    load: Callable[[LoadOptions, Callable[[float, str], None]], Any]
    make_sampling: Callable[[Sampling], Any]


def real_load(opts: LoadOptions, progress: Callable[[float, str], None]) -> Any:
    from engine.generate import load_engine

    return load_engine(opts.store, device=opts.device, cache_experts=opts.cache_experts,
                       vram_budget=opts.vram_budget, prefetch=opts.prefetch, progress=progress)


def real_sampling(s: Sampling) -> Any:
    from engine.generate import SamplingSettings

    return SamplingSettings(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens, seed=s.seed)


def real_engine_backend() -> EngineBackend:
    return EngineBackend(load=real_load, make_sampling=real_sampling)
