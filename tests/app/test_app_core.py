"""The app's Qt-free helpers: error sentences, stats, trace summary, hardware words, catalog, install."""

from __future__ import annotations

import threading

from moeferry.app.errors import Action, describe_error
from moeferry.app.expert_trace import Cell, summarize_trace
from moeferry.app.hardware_words import describe_hardware
from moeferry.app.install import InstallRequest, download_progress, run_install
from moeferry.app.setup_backend import PlanSummary
from moeferry.app.stats_format import stats_items
from moeferry.engine.contract import ExpertTrace, GenerationStats
from moeferry.engine.units import fmt_duration
from tests.app.fakes import NO_GPU, RTX_3060, fake_setup_backend


def test_errors_become_one_sentence_and_an_action():
    from moeferry.engine.errors import UserError

    class OutOfMemoryError(RuntimeError):
        pass

    assert describe_error(OutOfMemoryError("CUDA out of memory")).action == Action.SMALLER_CACHE
    damaged = describe_error(UserError("x: contents changed (sha256 mismatch); run moeferry verify.", 1))
    assert damaged.action == Action.REVERIFY
    missing = describe_error(FileNotFoundError("nope"))
    assert missing.action == Action.REDOWNLOAD and missing.message.endswith(".")
    other = describe_error(ValueError("weird"))
    assert other.action == Action.NONE and "ValueError: weird" in other.detail
    for info in (damaged, missing, other):
        assert info.message.count(". ") == 0, "one sentence"


def test_stats_items_words():
    stats = GenerationStats(tokens_per_s=2.31, first_token_s=0.8, cache_hits=60, cache_misses=40,
                            prefetch_issued=50, prefetch_used=35, peak_vram_bytes=int(9.1 * 1024**3),
                            vram_budget_bytes=11 * 1024**3, h2d_gb_per_s=21.44)
    words = [i.text for i in stats_items(stats)]
    assert words == ["2.3 tok/s", "first token 0.80 s", "cache hits 60%", "prefetch 70%",
                     "GPU memory 9.1 / 11.0 GB", "copies to GPU 21.4 GB/s"]
    assert all("–" in t for t in (i.text for i in stats_items(None)))
    vram = {i.key: i for i in stats_items(stats)}["vram"]
    assert "whole card" not in vram.tooltip  # no driver's count given
    stats.gpu_memory_used_bytes, stats.gpu_memory_total_bytes = int(11.7 * 1024**3), 12 * 1024**3
    assert "the whole card: 11.7 of 12.0 GB in use" in {i.key: i for i in stats_items(stats)}["vram"].tooltip
    assert fmt_duration(3725) == "1 h 02 min" and fmt_duration(75) == "1 min 15 s"


def test_trace_summary_marks_hits_misses_and_residency():
    trace = ExpertTrace(num_layers=2, num_experts=4,
                        selected=[[(0, 1), (2, 3)], [(0, 2), (2, 3)]],
                        resident_before=[[(), ()], [(0, 1), (2, 3)]])
    s = summarize_trace(trace)
    assert s.num_tokens == 2 and s.counts[0] == [2, 1, 1, 0]
    assert s.cells[0][0] == [Cell.MISS, Cell.HIT]
    assert s.cells[0][1] == [Cell.MISS, Cell.RESIDENT]
    assert s.layer_hit_rate(1) == 0.5 and s.hit_rate() == 0.375
    assert summarize_trace(ExpertTrace(4, 8)) is None


def test_hardware_words():
    good = describe_hardware(RTX_3060, PlanSummary(3, 2.3, "fits"), 2)
    assert good.headline == ("NVIDIA GeForce RTX 3060, 12 GB, PCIe 4 x16: good; "
                             "expect about 2.3 tokens/s with 2-bit experts.")
    none = describe_hardware(NO_GPU)
    assert none.level == "none" and "demo model" in none.headline and not none.has_gpu
    assert any("less than" in d for d in none.details), "16 GB RAM is short for Mixtral's experts"
    small = describe_hardware({"gpu_name": "GTX 1650", "vram_total_bytes": 4 * 1024**3, "pcie_gen": 3,
                               "pcie_width": 4})
    assert small.level == "poor" and any("slow link" in d for d in small.details)


def test_the_demo_model_is_offered_when_shipped():
    from moeferry.app.setup_backend import real_demo_path

    demo = real_demo_path()
    if demo is not None:
        assert (demo / "manifest.json").is_file()


def test_download_progress_from_the_engines_fetch_progress():
    from moeferry.engine.setup.download import FetchProgress

    p = download_progress(FetchProgress("a.safetensors", 5, 10, 500, 1000, 50.0, 10.0, 0, 2))
    assert (p.fraction, p.bytes_done, p.bytes_total, p.rate, p.eta_s) == (0.5, 500, 1000, 50.0, 10.0)


def test_run_install_download_then_convert(tmp_path):
    backend = fake_setup_backend(tmp_path)
    req = InstallRequest(source="catalog", name="x", repo_id="tiny/mixtral", src_path=str(tmp_path / "dl"),
                         needs_convert=True, expert_bits=3, dest=str(tmp_path / "st"))
    steps, verified = [], []
    verify = backend.verify
    backend.verify = lambda path: verified.append(path) or verify(path)
    path = run_install(req, backend, lambda p: steps.append(p.step), threading.Event())
    assert path == tmp_path / "st" and (path / "manifest.json").exists()
    assert steps[0] == "download" and "convert" in steps and steps[-1] == "done"
    assert "verify" not in steps and not verified, "the conversion already hashed the new store"
    # after a restart the finished store is only checked, once
    steps.clear()
    assert run_install(req, backend, lambda p: steps.append(p.step), threading.Event()) == path
    assert "convert" not in steps and "verify" in steps and verified == [path]
    assert InstallRequest.from_dict(req.to_dict() | {"unknown": 1}) == req


def test_install_steps_are_the_steps_run_install_takes(tmp_path):
    from moeferry.app.install import install_steps

    def steps_run(req) -> list[str]:
        steps = []
        run_install(req, backend, lambda p: steps.append(p.step), threading.Event())
        return [s for s in dict.fromkeys(steps) if s != "done"]

    backend = fake_setup_backend(tmp_path)
    convert = InstallRequest(source="catalog", name="x", repo_id="tiny/mixtral", src_path=str(tmp_path / "dl"),
                             needs_convert=True, expert_bits=2, dest=str(tmp_path / "st"))
    ready_made = InstallRequest(source="catalog", name="x", repo_id="tiny/mixtral-store",
                                src_path=str(tmp_path / "st2"))
    folder = InstallRequest(source="folder", name="x", src_path=str(tmp_path / "ckpt"), needs_convert=True,
                            tokenizer_repo_id="tiny/tokenizer", dest=str(tmp_path / "st3"))
    for req, expected in ((ready_made, ["download", "verify"]),
                          (folder, ["download", "convert"]),  # the tokenizer it lacks is fetched
                          (convert, ["download", "convert"]),  # converting verifies what it writes
                          (convert, ["verify"])):  # restarted after the conversion: only the check
        assert install_steps(req) == expected
        assert steps_run(req) == expected
