"""Does the plan predict what `moeferry bench` measures? Compare, refit, tabulate.

For each `moeferry bench --json` report, the plan (engine/setup/plan.py `make_plan`) is asked for
the same model (the report's expert and resident byte counts), the same VRAM budget and
cache size, on the report's machine: its measured pinned host->device rate and its GPU's
memory bandwidth. Its prediction is set beside the measured decode speed of one mode
(default: full algorithm, fused kernels).

Two predictions per row: the plan as the app would make it (the routing assumption of
engine/setup/plan.py `hit_rate`: uniform, k/E, or the replayed trace's own LRU hit ratio when the
report replayed one), and the same cost model at the hit rate the run measured, which tests
the cost model alone; `refit` fits the coefficients with the measured hit rates. A report
whose copies were paced (`--h2d-gbps`) is planned at the paced rate.

    python -m benchmarks.plan_check REPORT.json [REPORT.json ...] [--refit] [--with-paper]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from moeferry.engine.errors import UserError
from moeferry.engine.setup import plan
from moeferry.engine.units import fmt_bytes

TOLERANCE = 0.30
# Peak memory bandwidth by GPU name (the benchmark report names the GPU but does not measure
# this); the H200 figure measured on the GPU machine, the others from the vendors' data sheets.
GPU_MEM_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 1.555e12, "L40S": 864e9,
                     "RTX 4090": 1.008e12, "RTX 3090": 936e9, "RTX 3060": 360e9, "T4": 320e9}
H200_VRAM_BYTES = 141 * 10**9


@dataclass
class CheckRow:
    device: str
    layers: int
    expert_bits: int
    mode: str
    kernels: str
    budget_bytes: int | None
    cache_experts: int
    measured_tokens_per_s: float
    predicted_tokens_per_s: float  # make_plan, as the app plans
    ratio: float  # predicted / measured
    within_30pct: bool
    measured_hit_rate: float
    predicted_hit_rate: float
    predicted_at_measured_hit_rate: float  # the cost model alone
    ratio_at_measured_hit_rate: float
    bound: str  # "pcie" or "compute": what the plan says limits the speed
    plan_fits: bool  # the plan's own VRAM accounting agrees this cache fits the budget

    def to_dict(self) -> dict:
        d = asdict(self)
        d["budget"] = d["budget_bytes"]
        return d


# ---------------------------------------------------------------------------------------------
# From a report to what the plan needs


def report_hardware(report: dict) -> dict:
    """The hardware dict make_plan takes, for the machine the report was measured on."""
    name = report.get("device") or ""
    mem = report.get("gpu_mem_bandwidth_bytes_per_s") or next(
        (bw for key, bw in GPU_MEM_BANDWIDTH.items() if key.lower() in name.lower()), None)
    budget = report.get("vram_budget_bytes")
    return {"gpu_name": name or "benchmark GPU", "torch_cuda_available": True,
            "h2d_bytes_per_s": ((report.get("link") or {}).get("paced_gb_per_s") or report["pinned_gb_per_s"]) * 1e9,
            "gpu_mem_bandwidth_bytes_per_s": mem,
            "vram_total_bytes": budget or H200_VRAM_BYTES, "ram_total_bytes": None}


def report_sizes(report: dict) -> plan.ModelSizes:
    """The report's model shape (engine/measure/bench_shapes.py MODEL_SHAPES; reports written before
    they named one are Mixtral-8x7B's) at its layer count, with the byte counts the run really had."""
    from moeferry.engine.measure.bench_shapes import MODEL_SHAPES

    shape = report.get("model") or "mixtral-8x7b"
    if shape not in MODEL_SHAPES:
        raise UserError(f"The report of {report.get('date', '?')} is of the model {shape!r}, which "
                        f"plan_check does not know; it knows {', '.join(MODEL_SHAPES)}.")
    config = dict(MODEL_SHAPES[shape], num_hidden_layers=report["layers"])
    sizes = plan.ModelSizes.from_config(config, report["expert_bits"], report.get("attn_bits", 4),
                                        name=f"bench {shape} {report['layers']} layers")
    sizes.expert_bytes = int(report["expert_bytes"])
    # experts cut into units (--expert-units): the cache holds units, so the plan counts units, each
    # expert's u of them routed together (their hit rate under uniform routing is still K/E)
    units = int(report.get("expert_units") or 1)
    sizes.num_experts, sizes.top_k = sizes.num_experts * units, sizes.top_k * units
    sizes.expert_params //= units
    sizes.ffn_matrix_params //= units
    # resident_bytes: the dense weights on the GPU; host_dense_bytes (in reports since the embedding
    # stays in host memory) the rest
    sizes.dense_bytes = int(report["resident_bytes"]) + int(report.get("host_dense_bytes", 0))
    return sizes


def pick_result(report: dict, mode: str, kernels: str) -> dict:
    for r in report.get("results", []):
        if r["mode"] == mode and r["kernels"] == kernels:
            return r
    have = ", ".join(f"{r['mode']}/{r['kernels']}" for r in report.get("results", [])) or "none"
    raise ValueError(f"the report of {report.get('date', '?')} has no {mode}/{kernels} result "
                     f"(it has {have})")


def observation(report: dict, result: dict) -> dict:
    """One measured run in the form plan.fit_coefficients / predict_observation take."""
    return {"hw": report_hardware(report), "model": report_sizes(report),
            "cache_experts_per_layer": result["cache_experts"],
            "prefetch_depth": result.get("prefetch", 0),
            "prompt_tokens": report.get("prompt_len", plan.DEFAULT_PROMPT_TOKENS),
            "measured_hit_rate": result["hit_rate"],
            "measured_tokens_per_s": result["decode_tokens_per_s"]}


# ---------------------------------------------------------------------------------------------
# Comparing and refitting


def compare(bench_reports: list[dict], mode: str = "full", kernels: str = "fused",
            coeffs: plan.Coefficients = plan.DEFAULT) -> list[dict]:
    """One row per report: the plan's prediction beside the measured decode speed."""
    rows = []
    for report in bench_reports:
        result = pick_result(report, mode, kernels)
        hw, sizes = report_hardware(report), report_sizes(report)
        # a budget the bench sized with extra slots in the first layers: the plan sizes it too
        sized = report.get("extra_slot_layers") and report.get("vram_budget_bytes")
        p = plan.make_plan(hw, sizes, report.get("vram_budget_bytes"), coeffs=coeffs,
                           context_tokens=report.get("prompt_len", 128) + report.get("new_tokens", 64),
                           prefetch_depth=result.get("prefetch", 0),
                           prompt_tokens=report.get("prompt_len", plan.DEFAULT_PROMPT_TOKENS),
                           cache_experts_per_layer=None if sized else result["cache_experts"],
                           trace_hit_ratio=((report.get("routing") or {}).get("trace") or {}).get("lru_hit_ratio"))
        at_measured = plan.predict_observation(observation(report, result), coeffs)
        measured = result["decode_tokens_per_s"]
        ratio = p.predicted_tokens_per_s / measured
        rows.append(CheckRow(
            device=report.get("device", ""), layers=report["layers"], expert_bits=report["expert_bits"],
            mode=mode, kernels=kernels, budget_bytes=report.get("vram_budget_bytes"),
            cache_experts=result["cache_experts"], measured_tokens_per_s=measured,
            predicted_tokens_per_s=p.predicted_tokens_per_s, ratio=ratio,
            within_30pct=abs(ratio - 1) <= TOLERANCE, measured_hit_rate=result["hit_rate"],
            predicted_hit_rate=p.hit_rate, predicted_at_measured_hit_rate=at_measured,
            ratio_at_measured_hit_rate=at_measured / measured, bound=p.bound,
            plan_fits=p.fits).to_dict())
    return rows


def rms_log_error(observations: list[dict], coeffs: plan.Coefficients) -> float:
    return plan.rms(plan.log_errors(observations, coeffs))


def refit(bench_reports: list[dict], modes=("lru", "full"), kernels: str = "fused",
          with_paper: bool = False, names: tuple[str, ...] = plan.FIT_NAMES) -> dict:
    """Refit the plan's coefficients to the reports' runs and say how wrong they are.

    Returns the fitted coefficients, the RMS log error (about the relative error) of the
    defaults and of the fit, and with 3 or more runs the leave-one-out error: the error on
    each run of a fit made without it, which is what to expect on a run not measured yet.
    `with_paper` adds the runs the defaults were fitted to (plan.paper_calibration), so
    that a handful of H200 rows does not pull the model away from the consumer GPUs.
    """
    obs = [observation(r, res) for r in bench_reports for res in r.get("results", [])
           if res["mode"] in modes and res["kernels"] == kernels]
    if not obs:
        raise ValueError(f"no {'/'.join(modes)} runs with {kernels} kernels in the reports")
    fit_on = obs + (plan.paper_calibration() if with_paper else [])
    fitted, err = plan.fit_coefficients(fit_on, names)
    out = {"runs": len(obs), "fitted_on": len(fit_on), "names": list(names),
           "coefficients": asdict(fitted),
           "rms_log_error_default": rms_log_error(obs, plan.DEFAULT),
           "rms_log_error_fit": rms_log_error(obs, fitted), "rms_log_error_fit_all": err,
           "leave_one_out_rms_log_error": None}
    if len(obs) >= 3:
        errs = []
        for i, held_out in enumerate(obs):
            others = obs[:i] + obs[i + 1:] + (plan.paper_calibration() if with_paper else [])
            c, _ = plan.fit_coefficients(others, names)
            errs += plan.log_errors([held_out], c)
        out["leave_one_out_rms_log_error"] = plan.rms(errs)
    return out


# ---------------------------------------------------------------------------------------------
# Output


def _gib(n: int | None) -> str:
    return "none" if n is None else fmt_bytes(n)


def markdown(rows: list[dict]) -> str:
    """The comparison as a table for docs/BENCHMARKS.md."""
    lines = ["| GPU | layers | expert bits | VRAM budget | cached experts/layer | mode | measured tok/s "
             "| plan tok/s | plan/measured | within 30 % | hit rate measured/plan "
             "| model at measured hit rate tok/s | (its ratio) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['device']} | {r['layers']} | {r['expert_bits']} | {_gib(r['budget'])} | "
            f"{r['cache_experts']} | {r['mode']}/{r['kernels']} | {r['measured_tokens_per_s']:.2f} | "
            f"{r['predicted_tokens_per_s']:.2f} | {r['ratio']:.2f} | "
            f"{'yes' if r['within_30pct'] else 'no'} | "
            f"{r['measured_hit_rate']:.2f}/{r['predicted_hit_rate']:.2f} | "
            f"{r['predicted_at_measured_hit_rate']:.2f} | {r['ratio_at_measured_hit_rate']:.2f} |")
    return "\n".join(lines)


def markdown_refit(fit: dict) -> str:
    pct = lambda e: "n/a" if e is None else f"{(math.exp(e) - 1) * 100:.0f} %"  # noqa: E731
    c = fit["coefficients"]
    values = ", ".join(f"{n} = {c[n]:.3g}" for n in fit["names"])
    loo = fit["leave_one_out_rms_log_error"]
    return "\n".join([
        f"Refit on {fit['runs']} benchmark runs" + (f" (+ {fit['fitted_on'] - fit['runs']} published runs)"
                                                     if fit["fitted_on"] > fit["runs"] else "") + ":",
        f"- RMS error with the default coefficients: {pct(fit['rms_log_error_default'])}",
        f"- RMS error after the refit: {pct(fit['rms_log_error_fit'])}"
        + (f"; leave-one-out: {pct(loo)}" if loo is not None else " (too few runs for leave-one-out)"),
        f"- fitted: {values}"])


def load_reports(paths: list[str]) -> list[dict]:
    reports = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise UserError(f"Cannot read {path} ({e.strerror or e}); give the file that "
                            f"`moeferry bench --json` wrote.") from None
        except ValueError:
            raise UserError(f"{path} is not JSON; give the output of `moeferry bench --json` "
                            f"(its progress lines go to stderr).") from None
        items = data if isinstance(data, list) else [data]
        if not all(isinstance(d, dict) and "results" in d and "pinned_gb_per_s" in d for d in items):
            raise UserError(f"{path} is not a `moeferry bench --json` report (no results or "
                            f"pinned_gb_per_s).")
        reports += items
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_check",
                                description="The plan's predictions against `moeferry bench --json` reports.")
    p.add_argument("reports", nargs="+", metavar="REPORT.json")
    p.add_argument("--mode", default="full", choices=("naive", "lru", "full"))
    p.add_argument("--kernels", default="fused", choices=("reference", "fused"))
    p.add_argument("--refit", action="store_true", help="also refit the coefficients and say the error")
    p.add_argument("--with-paper", action="store_true", help="refit with the published runs too")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        reports = load_reports(a.reports)
        rows = compare(reports, a.mode, a.kernels)
        fit = refit(reports, kernels=a.kernels, with_paper=a.with_paper) if a.refit else None
    except UserError as e:
        print(f"plan_check: {e}", file=sys.stderr)
        return e.exit_code
    except (ValueError, KeyError) as e:
        print(f"plan_check: a report lacks what is needed ({e}); use reports of the current "
              f"`moeferry bench --json`.", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"rows": rows, "refit": fit}, indent=1))
        return 0
    print(markdown(rows))
    if fit:
        print()
        print(markdown_refit(fit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
