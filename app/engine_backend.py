"""How the app loads the engine, behind one injectable object. No Qt.

`moeferry.engine.runtime.generate` (torch) is imported only when a model is loaded, in the worker thread; what
the app exchanges with the engine (SamplingSettings, GenerationStats, ExpertTrace, the
EngineProtocol it calls) comes from the torch-free engine/contract.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moeferry.engine.contract import EngineProtocol, Progress


@dataclass(frozen=True)
class LoadOptions:
    store: str
    device: str = "auto"
    cache_experts: int | None = None   # None: from the VRAM budget
    vram_budget: int | None = None     # bytes; None: the engine decides
    prefetch: int = 1
    cpu_experts: str = "off"           # off | auto | all (engine/runtime/cpu_experts.py), on a GPU


@dataclass
class EngineBackend:
    load: Callable[[LoadOptions, Progress], EngineProtocol]


def real_load(opts: LoadOptions, progress: Progress) -> EngineProtocol:
    from moeferry.engine.runtime.generate import load_engine, resolve_device

    # Without a GPU the settings hide this choice: the engine's default runs a model too big for
    # the CPU's expert cache on the CPU kernels (generate.default_cpu_experts).
    cpu_experts = None if resolve_device(opts.device).type == "cpu" else opts.cpu_experts
    return load_engine(opts.store, device=opts.device, cache_experts=opts.cache_experts,
                       vram_budget=opts.vram_budget, prefetch=opts.prefetch, cpu_experts=cpu_experts,
                       progress=progress)


def real_engine_backend() -> EngineBackend:
    return EngineBackend(load=real_load)
