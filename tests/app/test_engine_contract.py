"""engine/contract.py: the fake engine the app's tests use and the real engine on the demo store
pass the same checks, through the app's own worker (app/engine_worker.py) and directly."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from moeferry.app.engine_backend import EngineBackend, LoadOptions, real_load
from moeferry.app.engine_worker import EngineWorker, GenerateRequest, LoadedInfo, ReplyResult
from moeferry.engine.contract import EngineProtocol, ExpertTrace, GenerationStats, SamplingSettings, TokenPiece
from tests.app.fakes import FakeEngineBackend

MESSAGES = [{"role": "user", "content": "What is a list in Python?"}]
GREEDY = SamplingSettings(temperature=0.0, top_p=1.0, max_new_tokens=6, seed=1)


def fake_backend() -> EngineBackend:
    return FakeEngineBackend().as_backend()


def demo_backend() -> EngineBackend:
    return EngineBackend(load=real_load)


@pytest.fixture(params=[fake_backend, demo_backend], ids=["fake", "real-demo"])
def backend(request) -> EngineBackend:
    return request.param()


def test_the_engine_keeps_the_contract(backend):
    steps = []
    engine = backend.load(LoadOptions("demo", device="cpu"), lambda f, m: steps.append((f, m)))
    try:
        assert isinstance(engine, EngineProtocol)
        assert steps and all(isinstance(f, float) and isinstance(m, str) for f, m in steps)
        cfg = engine.config
        assert all(isinstance(v, int) and v > 0 for v in (cfg.num_layers, cfg.num_experts, cfg.top_k))
        assert engine.device.type in ("cpu", "cuda") and isinstance(engine.note, str)
        assert isinstance(engine.max_context, int) and engine.max_context > 100
        assert type(engine.last_stats) is GenerationStats and type(engine.last_trace) is ExpertTrace
        engine.set_prefetch(1)
        engine.set_cache_experts(2)

        pieces = list(engine.stream(MESSAGES, GREEDY))
        assert 1 <= len(pieces) <= GREEDY.max_new_tokens
        assert all(type(p) is TokenPiece and isinstance(p.token_id, int) and isinstance(p.text, str)
                   for p in pieces)
        stats, trace = engine.last_stats, engine.last_trace
        assert type(stats) is GenerationStats and stats.new_tokens == len(pieces) and stats.tokens_per_s > 0
        assert stats.cache_hits + stats.cache_misses > 0
        assert (trace.num_layers, trace.num_experts) == (cfg.num_layers, cfg.num_experts)
        assert 1 <= len(trace.selected) <= len(pieces) and len(trace.resident_before) == len(trace.selected)
        for per_layer in trace.selected:
            assert len(per_layer) == cfg.num_layers
            assert all(len(experts) == cfg.top_k and all(0 <= e < cfg.num_experts for e in experts)
                       for experts in per_layer)

        stop = threading.Event()
        stopped = []
        for piece in engine.stream(MESSAGES, dataclasses.replace(GREEDY, max_new_tokens=50), cancel=stop):
            stopped.append(piece)
            stop.set()
        assert len(stopped) <= 2, "a set cancel event ends the stream"
    finally:
        engine.close()


def test_the_apps_worker_reads_the_engine_by_its_own_fields(backend, qapp):
    worker = EngineWorker(backend)
    loaded, replies, failed = [], [], []
    worker.loaded.connect(loaded.append)
    worker.reply_done.connect(replies.append)
    worker.load_failed.connect(failed.append)
    opts = LoadOptions("demo", device="cpu", cache_experts=2)
    worker.load(opts)
    assert not failed and len(loaded) == 1
    info: LoadedInfo = loaded[0]
    assert info.options == opts and info.num_experts > 0 and info.max_context > 100
    assert info.device in ("cpu", "cuda") and isinstance(info.note, str)
    worker.generate(GenerateRequest(1, MESSAGES, GREEDY, prefetch=1, cache_experts=2))
    reply: ReplyResult = replies[0]
    assert reply.error is None and reply.text and not reply.stopped
    assert type(reply.stats) is GenerationStats and type(reply.trace) is ExpertTrace
    assert reply.stats.new_tokens >= 1
    worker._close_engine()


def test_without_a_gpu_the_hidden_cpu_experts_setting_leaves_the_choice_to_the_engine(monkeypatch):
    """The settings hide *Experts not on the GPU* on a CPU device, so what they hold (default
    off) must not keep a model too big for the CPU's expert cache off the CPU kernels: the
    engine's default decides there; on a GPU the setting is passed as it is."""
    from moeferry.engine.runtime import generate

    seen = []
    monkeypatch.setattr(generate, "load_engine", lambda store, **kw: seen.append(kw["cpu_experts"]))
    real_load(LoadOptions("demo", device="cpu", cpu_experts="off"), lambda f, m: None)
    monkeypatch.setattr(generate, "resolve_device", lambda device: generate.torch.device("cuda"))
    real_load(LoadOptions("demo", device="cuda", cpu_experts="auto"), lambda f, m: None)
    assert seen == [None, "auto"]
