"""Fakes for the app's injected backends: an engine that streams words, a setup backend on tmp dirs.

FakeEngine implements moeferry.engine.contract.EngineProtocol with the engine's own types (TokenPiece,
GenerationStats, ExpertTrace) and nothing more the app could come to rely on;
tests/app/test_engine_contract.py runs it and the real engine through the same checks.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from moeferry.app.engine_backend import EngineBackend, LoadOptions
from moeferry.app.setup_backend import PlanSummary, SetupBackend
from moeferry.engine.contract import ExpertTrace, GenerationStats, SamplingSettings, TokenPiece
from moeferry.engine.setup.catalog import CatalogEntry
from moeferry.engine.setup.download import FetchProgress


@dataclass
class FakeConfig:
    num_layers: int
    num_experts: int
    top_k: int


@dataclass
class FakeDevice:
    type: str


def default_reply(messages: list[dict], sampling: SamplingSettings) -> str:
    last = messages[-1]["content"] if messages else ""
    return (f"You said: {last}\n\nHere is some code:\n\n```python\nprint('hi')\n```\n\n"
            f"Temperature was {sampling.temperature}.")


class FakeEngine:
    def __init__(self, opts: LoadOptions, reply=default_reply, delay: float = 0.002, layers: int = 4,
                 experts: int = 8, top_k: int = 2, fail_with: Exception | None = None, device: str = "cuda"):
        self.opts = opts
        self.device = FakeDevice(device)
        self.reply = reply
        self.delay = delay
        self.fail_with = fail_with
        self.config = FakeConfig(layers, experts, top_k)
        self.note = ""
        self.max_context = 4096
        self.prefetch = opts.prefetch
        self.cache_experts = opts.cache_experts or 2
        self.cpu_threads = 0
        self.calls: list[tuple[list[dict], SamplingSettings]] = []
        self.last_stats = GenerationStats()
        self.last_trace = ExpertTrace(layers, experts)
        self.closed = False
        self.gate = threading.Event()   # tests may hold the stream half-way
        self.gate.set()

    def set_prefetch(self, depth: int) -> None:
        self.prefetch = depth

    def set_cache_experts(self, k: int) -> None:
        self.cache_experts = k

    def set_cpu_threads(self, n: int) -> None:
        self.cpu_threads = n

    def stream(self, messages, sampling: SamplingSettings, cancel=None):
        self.calls.append((messages, sampling))
        text = self.reply(messages, sampling)
        words = text.split(" ")
        rng = random.Random(sampling.seed or 0)
        layers, experts, k = self.config.num_layers, self.config.num_experts, self.config.top_k
        caches = [OrderedDict() for _ in range(layers)]
        trace = ExpertTrace(num_layers=layers, num_experts=experts)
        hits = misses = 0
        start = time.monotonic()
        for i, word in enumerate(words[: sampling.max_new_tokens]):
            self.gate.wait(5)
            if cancel is not None and cancel.is_set():
                break
            if self.fail_with is not None and i == 3:
                raise self.fail_with
            sel, res = [], []
            for layer in range(layers):
                chosen = tuple(rng.sample(range(experts), k)) if rng.random() > 0.5 or not caches[layer] \
                    else tuple(list(caches[layer])[-k:])
                res.append(tuple(caches[layer]))
                for e in chosen:
                    if e in res[-1]:  # counted like the engine: resident when the token reached the layer
                        hits += 1
                    else:
                        misses += 1
                    if e in caches[layer]:
                        caches[layer].move_to_end(e)
                    else:
                        caches[layer][e] = True
                        if len(caches[layer]) > self.cache_experts:
                            caches[layer].popitem(last=False)
                sel.append(chosen)
            trace.selected.append(sel)
            trace.resident_before.append(res)
            time.sleep(self.delay)
            yield TokenPiece(token_id=i, text=word if i == 0 else " " + word)
        elapsed = max(time.monotonic() - start, 1e-6)
        n = len(trace.selected)
        self.last_trace = trace
        self.last_stats = GenerationStats(tokens_per_s=n / elapsed, decode_s=elapsed, first_token_s=0.05,
                                    cache_hits=hits, cache_misses=misses, prefetch_issued=misses,
                                    prefetch_used=misses // 2, bytes_h2d=misses * 66_000_000,
                                    peak_vram_bytes=9_100_000_000, new_tokens=n,
                                    vram_budget_bytes=11_000_000_000, h2d_gb_per_s=21.4)

    def close(self) -> None:
        self.closed = True


class FakeEngineBackend:
    """load() makes a FakeEngine; set `load_error` or `engine_kwargs` to change what it does."""

    def __init__(self, **engine_kwargs):
        self.engine_kwargs = engine_kwargs
        self.load_error: Exception | None = None
        self.engines: list[FakeEngine] = []
        self.loads: list[LoadOptions] = []

    def load(self, opts: LoadOptions, progress) -> FakeEngine:
        self.loads.append(opts)
        progress(0.5, "Reading weights")
        if self.load_error is not None:
            raise self.load_error
        engine = FakeEngine(opts, **self.engine_kwargs)
        self.engines.append(engine)
        return engine

    @property
    def engine(self) -> FakeEngine:
        return self.engines[-1]

    def as_backend(self) -> EngineBackend:
        return EngineBackend(load=self.load)


def write_settings(folder: Path, **values) -> None:
    (folder / "settings.json").write_text(json.dumps({"version": 1, **values}))


def make_store(path: Path, expert_bits: int = 2, source: str = "tiny/mixtral") -> Path:
    """A folder that looks like a MoE Ferry store to the app (manifest only)."""
    path.mkdir(parents=True, exist_ok=True)
    manifest = {"format": "moeferry-store", "version": 1, "source": {"repo": source},
                "quantization": {"experts": {"bits": expert_bits}, "attention": {"bits": 4}}, "files": {}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


RTX_3060 = {"gpu_name": "NVIDIA GeForce RTX 3060", "vram_total_bytes": 12 * 1024**3, "pcie_gen": 4,
            "pcie_width": 16, "h2d_gb_per_s": 24.8, "ram_total_bytes": 32 * 1024**3,
            "disk_free_bytes": 500 * 1024**3, "driver_version": "550.54", "cpu_name": "AMD Ryzen 5 5600X"}
NO_GPU = {"gpu_name": None, "vram_total_bytes": None, "ram_total_bytes": 16 * 1024**3,
          "disk_free_bytes": 200 * 1024**3, "cpu_name": "Intel Core i5-8250U"}


def fake_setup_backend(tmp: Path, hw: dict | None = None, fetch=None, convert=None) -> SetupBackend:
    hw = hw if hw is not None else RTX_3060
    catalog = [
        CatalogEntry(id="mixtral-2bit", name="Mixtral-8x7B Instruct, 2-bit experts", repo_id="tiny/mixtral-store",
                     download_bytes=17_500_000_000, disk_bytes=17_500_000_000,
                     quality="WikiText2 perplexity 4.61 (fp16: 3.59)"),
        CatalogEntry(id="mixtral-src", name="Mixtral-8x7B Instruct, converted here", repo_id="tiny/mixtral",
                     needs_convert=True, expert_bits=3, download_bytes=93_000_000_000,
                     disk_bytes=114_000_000_000, quality="WikiText2 perplexity 4.05"),
    ]

    def plan(hw_, entry, budget, cache_experts=None):
        vram = budget or hw_.get("vram_total_bytes") or 0
        return PlanSummary(cache_experts_per_layer=cache_experts or max(1, min(8, int(vram / 1024**3 / 4))),
                           predicted_tokens_per_s=2.3 if hw_.get("gpu_name") else None,
                           verdict="Fits: attention on the GPU, experts in RAM.")

    def default_fetch(repo_id, dest, revision=None, endpoint=None, progress=None, cancel=None, **_):
        dest = Path(dest)
        total = 4_000_000
        for i in range(1, 5):
            if cancel is not None and cancel.is_set():
                raise RuntimeError("cancelled")
            progress(FetchProgress("model.safetensors", i * total // 4, total, i * total // 4, total, 2e6,
                                   (4 - i) * 0.5, i // 4, 1))
            time.sleep(0.01)
        if repo_id.endswith("-store"):
            return make_store(dest)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"0")
        return dest

    def default_convert(src, dest, expert_bits, attn_bits, progress=None, cancel=None, **_):
        for i in range(1, 5):
            progress(i / 4, f"layer {i} of 4")
        make_store(Path(dest), expert_bits)

    def recommend(hw_, entries):  # the real one (moeferry.engine.setup.hardware.recommend_model) reads catalog sizes
        return entries[0].id if hw_.get("gpu_name") and entries else "demo"

    demo = make_store(tmp / "demo-store", source="demo")
    return SetupBackend(probe=lambda: dict(hw), catalog=lambda: list(catalog), plan=plan, recommend=recommend,
                        fetch=fetch or default_fetch, find_in_hf_cache=lambda repo: None,
                        convert=convert or default_convert, verify=lambda p: [], demo_path=lambda: demo)
