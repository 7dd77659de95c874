"""benchmarks/plan_check.py: the plan against `moeferry bench --json` reports (synthetic ones here)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from benchmarks import plan_check as C
from moeferry.engine.setup import plan as P
from moeferry.engine.units import GiB

EXPERT_2BIT = 66_748_416


def report(k: int = 3, full: float = 5.0, budget: int | None = 12 * GiB, pinned: float = 55.0,
           layers: int = 32, hit: float | None = None, lru: float | None = None) -> dict:
    """A report shaped like moeferry.engine.measure.bench.measure's return value."""
    hit = k / 8 if hit is None else hit

    def result(mode, kernels, tps, kk=k, prefetch=0, h=hit):
        return {"mode": mode, "kernels": kernels, "cache_experts": kk, "prefetch": prefetch,
                "decode_tokens_per_s": tps, "first_token_s": 1.0, "hit_rate": h,
                "prefetch_precision": 0.5, "prefetch_recall": 0.4, "gb_per_token": 1.0,
                "h2d_gb_per_s": 5.0, "bound_ms_per_token": 20.0, "achieved_ms_per_token": 1e3 / tps,
                "achieved_over_bound": 2.0, "peak_vram_bytes": 10 * GiB, "under_budget": True}

    return {"date": "2026-12-01", "device": "NVIDIA H200", "layers": layers,
            "vram_budget": "12GiB" if budget else None, "vram_budget_bytes": budget, "expert_bits": 2,
            "attn_bits": 4, "prompt_len": 128, "new_tokens": 64, "expert_bytes": EXPERT_2BIT,
            "resident_bytes": 1_240_604_672, "pinned_gb_per_s": pinned, "cache_experts": k,
            "resident_compute_ms_per_token": {"reference": 150.0, "fused": 60.0},
            "results": [result("naive", "fused", 1.5, kk=2, h=0.0),
                        result("lru", "reference", 2.0), result("lru", "fused", lru or 0.9 * full),
                        result("full", "reference", 2.2, prefetch=1),
                        result("full", "fused", full, prefetch=1)]}


def test_compare_matches_make_plan_for_the_same_budget_and_cache():
    rows = C.compare([report(k=3, full=5.0)])
    assert len(rows) == 1
    r = rows[0]
    for key in ("budget", "cache_experts", "predicted_tokens_per_s", "measured_tokens_per_s", "ratio",
                "within_30pct"):
        assert key in r
    assert (r["budget"], r["cache_experts"], r["measured_tokens_per_s"]) == (12 * GiB, 3, 5.0)
    assert (r["mode"], r["kernels"]) == ("full", "fused")
    hw = {"gpu_name": "H200", "torch_cuda_available": True, "h2d_bytes_per_s": 55e9,
          "gpu_mem_bandwidth_bytes_per_s": 4.8e12}
    sizes = replace(P.ModelSizes.from_config(P.MIXTRAL_8X7B_CONFIG, 2, 4), expert_bytes=EXPERT_2BIT,
                    dense_bytes=1_240_604_672)
    expected = P.make_plan(hw, sizes, 12 * GiB, cache_experts_per_layer=3, prefetch_depth=1)
    assert r["predicted_tokens_per_s"] == pytest.approx(expected.predicted_tokens_per_s)
    assert r["predicted_hit_rate"] == pytest.approx(P.hit_rate(3, 8))
    assert r["ratio"] == pytest.approx(r["predicted_tokens_per_s"] / 5.0)
    assert r["within_30pct"] == (abs(r["ratio"] - 1) <= 0.3)
    assert r["plan_fits"] and r["bound"] in ("pcie", "compute")
    # the plan assumes uniform routing, as the bench does: at the measured 3/8 the two agree
    assert r["predicted_at_measured_hit_rate"] == pytest.approx(r["predicted_tokens_per_s"])


def test_within_30pct_follows_the_measurement():
    predicted = C.compare([report()])[0]["predicted_tokens_per_s"]
    close, far = C.compare([report(full=predicted * 1.2), report(full=predicted * 2)])
    assert close["within_30pct"] and not far["within_30pct"]
    assert far["ratio"] == pytest.approx(0.5)


def test_more_cache_and_more_bandwidth_predict_more_speed():
    rows = C.compare([report(k=2), report(k=5), report(k=5, pinned=12.0)])
    assert rows[0]["predicted_tokens_per_s"] < rows[1]["predicted_tokens_per_s"]
    assert rows[2]["predicted_tokens_per_s"] < rows[1]["predicted_tokens_per_s"]


def test_no_budget_and_fewer_layers():
    r = C.compare([report(budget=None, k=8, layers=4)])[0]
    assert r["budget"] is None and r["layers"] == 4 and r["plan_fits"]
    assert "none" in C.markdown([r])


def test_other_modes_and_a_missing_row():
    r = C.compare([report(full=5.0, lru=4.0)], mode="lru")[0]
    assert r["measured_tokens_per_s"] == 4.0 and r["mode"] == "lru"
    broken = report()
    broken["results"] = [x for x in broken["results"] if x["mode"] != "full"]
    with pytest.raises(ValueError, match="no full/fused result"):
        C.compare([broken])


@pytest.mark.parametrize("truth", [
    replace(P.PAPER_CODE, gpu_layer_overhead_s=1.2e-3, miss_overhead_s=0.5e-3, token_overhead_s=10e-3),
    replace(P.DEFAULT, miss_overhead_s=0.3e-3, overlap_efficiency=0.2, gpu_kernel_efficiency=0.15),
], ids=["paper-like", "ferry-like"])
def test_refit_recovers_known_coefficients(truth):
    reports = []
    for k, pinned in ((1, 55.0), (2, 55.0), (3, 25.0), (4, 55.0), (6, 12.0)):
        r = report(k=k, pinned=pinned)
        for res in r["results"]:
            res["decode_tokens_per_s"] = P.predict_observation(C.observation(r, res), truth)
        reports.append(r)
    fit = C.refit(reports)
    assert fit["runs"] == 10  # lru + full, fused only
    assert fit["rms_log_error_fit"] < 0.005 and fit["rms_log_error_default"] > 0.1
    assert fit["leave_one_out_rms_log_error"] is not None and fit["leave_one_out_rms_log_error"] < 0.02
    # what these runs pin down (one GPU: the per-layer, per-token and kernel costs trade off)
    assert fit["coefficients"]["miss_overhead_s"] == pytest.approx(truth.miss_overhead_s, rel=0.05)
    assert fit["coefficients"]["overlap_efficiency"] == pytest.approx(truth.overlap_efficiency, rel=0.05)
    assert set(fit["names"]) == set(P.FIT_NAMES)
    text = C.markdown_refit(fit)
    assert "Refit on 10 benchmark runs" in text and "leave-one-out" in text
    with_paper = C.refit(reports[:1], with_paper=True)
    assert with_paper["fitted_on"] == 2 + len(P.paper_calibration())
    assert with_paper["leave_one_out_rms_log_error"] is None


def test_markdown_table():
    rows = C.compare([report(k=3), report(k=5)])
    text = C.markdown(rows)
    lines = text.splitlines()
    assert lines[0].startswith("| GPU |") and len(lines) == 4
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "12.0 GiB" in text and "NVIDIA H200" in text


def test_cli(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report(k=2)))
    b.write_text(json.dumps([report(k=4), report(k=6)]))  # a file may hold a list
    assert C.main([str(a), str(b), "--refit"]) == 0
    out = capsys.readouterr().out
    assert out.count("| NVIDIA H200 |") == 3 and "Refit on 6 benchmark runs" in out
    assert C.main([str(a), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["refit"] is None and len(data["rows"]) == 1
    bad = tmp_path / "bad.json"
    bad.write_text("building a synthetic Mixtral-8x7B\n")
    assert C.main([str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert C.main([str(tmp_path / "missing.json")]) == 2
    bad.write_text(json.dumps({"layers": 32}))
    assert C.main([str(bad)]) == 2
    assert "not a `moeferry bench --json` report" in capsys.readouterr().err
    assert math.isfinite(C.compare([report()])[0]["ratio"])


def test_the_shape_comes_from_the_report():
    from moeferry.engine.errors import UserError
    from moeferry.engine.measure.bench_shapes import MODEL_SHAPES

    mixtral = C.report_sizes(report())  # a report from before they named their model: Mixtral
    assert (mixtral.num_experts, mixtral.top_k) == (8, 2)
    qwen = dict(report(layers=4), model="qwen3-30b-a3b", expert_bytes=2_511_360, resident_bytes=300_000_000)
    sizes = C.report_sizes(qwen)
    want = replace(P.ModelSizes.from_config(dict(MODEL_SHAPES["qwen3-30b-a3b"], num_hidden_layers=4), 2, 4),
                   expert_bytes=2_511_360, dense_bytes=300_000_000, name=sizes.name)
    assert sizes == want and (sizes.num_experts, sizes.top_k, sizes.num_layers) == (128, 8, 4)
    assert C.compare([qwen])[0]["predicted_hit_rate"] == pytest.approx(P.hit_rate(3, 128))
    with pytest.raises(UserError, match="does not know"):
        C.report_sizes(dict(report(), model="llama"))


def test_a_report_with_extra_slots_is_predicted_with_them():
    """A report whose budget also gave the first layers one expert more (extra_slot_layers): the
    plan sizes the cache from the budget as the bench did, extra slots included, so it predicts
    the higher hit rate; without them it takes the report's K as given."""
    hw = {"gpu_name": "H200", "torch_cuda_available": True, "h2d_bytes_per_s": 55e9,
          "gpu_mem_bandwidth_bytes_per_s": 4.8e12}
    sizes = replace(P.ModelSizes.from_config(P.MIXTRAL_8X7B_CONFIG, 2, 4), expert_bytes=EXPERT_2BIT,
                    dense_bytes=1_240_604_672)
    sized = P.make_plan(hw, sizes, 12 * GiB, context_tokens=192, prefetch_depth=1)
    assert sized.extra_slot_layers > 0
    r = report(k=sized.cache_experts_per_layer)
    plain = C.compare([r])[0]
    extra = C.compare([dict(r, extra_slot_layers=sized.extra_slot_layers)])[0]
    assert plain["predicted_hit_rate"] == pytest.approx(P.hit_rate(sized.cache_experts_per_layer, 8))
    assert extra["predicted_hit_rate"] == pytest.approx(sized.hit_rate)
    assert extra["predicted_hit_rate"] > plain["predicted_hit_rate"]


def test_a_report_of_experts_cut_into_units_is_planned_in_units():
    """--expert-units 4: the cache's K counts units (25 of 32 a layer), each a quarter of an expert;
    the plan counts them so, and its hit rate is K / (4 E), not K / E."""
    r = dict(report(k=25), expert_units=4, expert_bytes=EXPERT_2BIT // 4)
    sizes = C.report_sizes(r)
    assert (sizes.num_experts, sizes.top_k, sizes.expert_bytes) == (32, 8, EXPERT_2BIT // 4)
    assert C.compare([r])[0]["predicted_hit_rate"] == pytest.approx(P.hit_rate(25, 32))
