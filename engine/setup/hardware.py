"""Hardware probe: GPU (NVML), torch CUDA, measured host->device bandwidth, RAM, CPU, disk.

`probe()` returns one flat JSON-able dict. Every field is null when it cannot be learned: no
nvidia-ml-py, no driver, no GPU, a CPU-only torch, a query the driver does not support.
Nothing here raises for missing hardware.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from moeferry.engine.paths import models_dir
from moeferry.engine.setup.catalog import load_catalog
from moeferry.engine.units import fmt_bytes

H2D_TEST_BYTES = 64 << 20
H2D_TEST_SECONDS = 1.0  # the copy loop; with allocation and warm-up well under 2 s
CPU_TEST_SECONDS = 0.3


def probe(measure_bandwidth: bool = True) -> dict:
    """Everything the planner and the wizard need to know about this machine.

    measure_bandwidth=False skips every timing test (host->device copies, CPU speed),
    leaving those fields null; useful for a quick look and for tests.
    """
    hw: dict = {"schema": 1, "os": platform.platform(), "python": sys.version.split()[0],
                "notes": []}
    hw.update(_nvml_info(hw["notes"]))
    hw.update(_torch_info(hw, measure_bandwidth))
    hw.update(_ram_info())
    hw.update(_cpu_info())
    hw.update(_disk_info(models_dir()))
    if measure_bandwidth:
        hw.update(_measure_cpu())
    else:
        hw.update(cpu_matvec_params_per_s=None, cpu_matmul_flops=None, cpu_small_matvec_params_per_s=None)
    hw["h2d_gb_per_s"] = round(hw["h2d_bytes_per_s"] / 1e9, 2) if hw.get("h2d_bytes_per_s") else None
    return hw


# ---------------------------------------------------------------------------------------------
# GPU through NVML


_GPU_FIELDS = ("gpu_name", "gpu_index", "gpu_count", "vram_total_bytes", "vram_free_bytes",
               "driver_version", "cuda_driver_version", "compute_capability", "pcie_gen",
               "pcie_width", "pcie_gen_current", "pcie_width_current", "pcie_gen_max",
               "pcie_width_max", "pcie_gen_gpu_max", "gpu_mem_bandwidth_bytes_per_s")


def _nvml_info(notes: list[str]) -> dict:
    out: dict = {k: None for k in _GPU_FIELDS}
    out.update(gpus=[], nvml_status=None)
    try:
        import pynvml
    except ImportError:
        out["nvml_status"] = "nvidia-ml-py is not installed"
        return out
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - library missing, driver not loaded, ...
        out["nvml_status"] = _nvml_reason(e)
        return out
    try:
        out["driver_version"] = _call(pynvml.nvmlSystemGetDriverVersion)
        cuda = _call(pynvml.nvmlSystemGetCudaDriverVersion)
        if isinstance(cuda, int):
            out["cuda_driver_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        count = _call(pynvml.nvmlDeviceGetCount) or 0
        gpus = [g for g in (_nvml_gpu(pynvml, i) for i in range(count)) if g]
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    out["gpus"], out["gpu_count"] = gpus, len(gpus)
    if not gpus:
        out["nvml_status"] = "no NVIDIA GPU found"
        return out
    out["nvml_status"] = "ok"
    best = max(gpus, key=lambda g: g.get("vram_total_bytes") or 0)
    if len(gpus) > 1:
        notes.append(f"{len(gpus)} GPUs found; planning for GPU {best['gpu_index']} "
                     f"({best['gpu_name']}), the one with the most memory.")
    out.update(best)
    if out["pcie_gen_current"] and out["pcie_gen_max"] and out["pcie_gen_current"] < out["pcie_gen_max"]:
        notes.append("The PCIe link runs below its maximum generation right now; GPUs slow the "
                     "link down when idle, so the maximum is what copies will use.")
    return out


def _nvml_reason(e: Exception) -> str:
    name = type(e).__name__
    if "LibraryNotFound" in name:
        return "NVIDIA driver library (NVML) not found"
    if "DriverNotLoaded" in name:
        return "NVIDIA driver not loaded"
    return f"NVML unavailable ({e})"


def _call(fn, *args):
    """One NVML query; None when unsupported (old driver, WSL, MIG, laptop quirks)."""
    try:
        value = fn(*args)
    except Exception:  # noqa: BLE001
        return None
    return value.decode() if isinstance(value, bytes) else value


def _nvml_gpu(pynvml, index: int) -> dict | None:
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        return None
    mem = _call(pynvml.nvmlDeviceGetMemoryInfo, handle)
    cc = _call(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    g = {
        "gpu_index": index,
        "gpu_name": _call(pynvml.nvmlDeviceGetName, handle),
        "vram_total_bytes": getattr(mem, "total", None),
        "vram_free_bytes": getattr(mem, "free", None),
        "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
        "pcie_gen_current": _call(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        "pcie_width_current": _call(pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        "pcie_gen_max": _call(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        "pcie_width_max": _call(pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        "pcie_gen_gpu_max": _call(pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration, handle),
    }
    # The link trains down when idle, so "the link" is the best this GPU and slot allow.
    g["pcie_gen"] = g["pcie_gen_max"] or g["pcie_gen_current"]
    g["pcie_width"] = g["pcie_width_max"] or g["pcie_width_current"]
    bus = _call(pynvml.nvmlDeviceGetMemoryBusWidth, handle)
    clock = _call(pynvml.nvmlDeviceGetMaxClockInfo, handle, getattr(pynvml, "NVML_CLOCK_MEM", 2))
    # NVML's memory clock is half the data rate for GDDR6/6X and HBM alike
    # (RTX 3060: 7501 MHz x 192 bit -> 360 GB/s; A100: 1215 MHz x 5120 bit -> 1555 GB/s).
    g["gpu_mem_bandwidth_bytes_per_s"] = 2 * clock * 1e6 * bus / 8 if bus and clock else None
    return g


# ---------------------------------------------------------------------------------------------
# torch: CUDA and the bandwidth test


def _torch_info(hw: dict, measure: bool) -> dict:
    out = {"torch_version": None, "torch_cuda_available": False, "torch_cuda_version": None,
           "h2d_bytes_per_s": None, "h2d_pinned": None, "h2d_pageable_bytes_per_s": None}
    try:
        import torch
    except ImportError:
        hw["notes"].append("PyTorch is not installed.")
        return out
    out["torch_version"] = torch.__version__
    out["torch_cuda_version"] = torch.version.cuda
    try:
        out["torch_cuda_available"] = bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver can raise here
        out["torch_cuda_available"] = False
    if not out["torch_cuda_available"]:
        if hw.get("gpu_name"):
            hw["notes"].append("An NVIDIA GPU is present but this PyTorch build has no CUDA "
                               "support: install a CUDA build of torch to use the GPU.")
        return out
    index = hw.get("gpu_index") or 0
    if not hw.get("gpu_name"):  # NVML missing but CUDA works: learn what torch can tell
        try:
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            hw.update(gpu_name=props.name, gpu_index=index, gpu_count=torch.cuda.device_count(),
                      vram_total_bytes=total, vram_free_bytes=free,
                      compute_capability=f"{props.major}.{props.minor}")
        except Exception:  # noqa: BLE001
            pass
    if measure:
        try:
            out.update(measure_h2d(torch, index))
        except Exception as e:  # noqa: BLE001 - out of memory, driver trouble: report, go on
            hw["notes"].append(f"The host->GPU bandwidth test failed ({type(e).__name__}: {e}).")
    return out


def measure_h2d(torch, index: int = 0, nbytes: int = H2D_TEST_BYTES,
                seconds: float = H2D_TEST_SECONDS) -> dict:
    """Median host->device copy rate from pinned memory (pageable if pinning fails)."""
    device = torch.device("cuda", index)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        src, pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory(), True
    except RuntimeError:
        src, pinned = torch.empty(nbytes, dtype=torch.uint8), False
    rates = _copy_rates(torch, dst, src, seconds)
    pageable = _copy_rates(torch, dst, torch.empty(nbytes, dtype=torch.uint8), 0.2) if pinned else rates
    del dst
    torch.cuda.empty_cache()
    return {"h2d_bytes_per_s": _median(rates), "h2d_pinned": pinned,
            "h2d_pageable_bytes_per_s": _median(pageable)}


def _copy_rates(torch, dst, src, seconds: float) -> list[float]:
    dst.copy_(src, non_blocking=True)  # warm-up: first touch, page-locking, lazy init
    torch.cuda.synchronize(dst.device)
    rates, end = [], time.perf_counter() + seconds
    while len(rates) < 3 or (time.perf_counter() < end and len(rates) < 50):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        stop.record()
        stop.synchronize()
        rates.append(src.numel() / (start.elapsed_time(stop) / 1e3))
    return rates


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2]


# ---------------------------------------------------------------------------------------------
# RAM, CPU, disk


def _ram_info() -> dict:
    try:
        import psutil
        vm = psutil.virtual_memory()
        return {"ram_total_bytes": vm.total, "ram_available_bytes": vm.available}
    except Exception:  # noqa: BLE001 - psutil missing: read what the OS offers
        pass
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kb = lambda k: int(info[k].split()[0]) * 1024  # noqa: E731
        return {"ram_total_bytes": kb("MemTotal"), "ram_available_bytes": kb("MemAvailable")}
    except (OSError, KeyError, ValueError):
        pass
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return {"ram_total_bytes": total, "ram_available_bytes": None}
    except (ValueError, OSError, AttributeError):
        return {"ram_total_bytes": None, "ram_available_bytes": None}


def _cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            import subprocess
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=2).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or None


def _cpu_info() -> dict:
    physical = None
    try:
        import psutil
        physical = psutil.cpu_count(logical=False)
    except Exception:  # noqa: BLE001
        pass
    return {"cpu_name": _cpu_name(), "cpu_cores_physical": physical,
            "cpu_cores_logical": os.cpu_count(), "cpu_arch": platform.machine() or None}


def _disk_info(path: Path) -> dict:
    where = path
    while not where.exists() and where.parent != where:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError:
        return {"disk_path": str(path), "disk_free_bytes": None, "disk_total_bytes": None}
    return {"disk_path": str(path), "disk_free_bytes": usage.free, "disk_total_bytes": usage.total}


def _measure_cpu() -> dict:
    """fp32 matrix-vector rate (weights/s, memory-bound like decode) and matmul FLOP/s."""
    try:
        import torch
    except ImportError:
        return {"cpu_matvec_params_per_s": None, "cpu_matmul_flops": None, "cpu_small_matvec_params_per_s": None}
    w = torch.randn(4096, 4096)
    x = torch.randn(4096)
    a = torch.randn(512, 512)
    torch.mv(w, x)
    mv, mm = [], []
    end = time.perf_counter() + CPU_TEST_SECONDS
    while len(mv) < 3 or (time.perf_counter() < end and len(mv) < 30):
        t = time.perf_counter()
        torch.mv(w, x)
        mv.append(w.numel() / (time.perf_counter() - t))
        t = time.perf_counter()
        a @ a
        mm.append(2 * 512**3 / (time.perf_counter() - t))
    return {"cpu_matvec_params_per_s": _median(mv), "cpu_matmul_flops": max(mm),
            "cpu_small_matvec_params_per_s": _small_matvec_rate(torch)}


def _small_matvec_rate(torch) -> float:
    """fp32 weights/s of one thread over many small matrices read from RAM (64 MB of 384x256, the
    demo's expert size), as the engine runs a small model: below the big matvec's rate, as each
    short matrix restarts the memory prefetch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ws = [torch.full((384, 256), 0.01) for _ in range(170)]  # the values do not matter, only the reads
        x = torch.randn(1, 256)
        rates = []
        for _ in range(4):
            t = time.perf_counter()
            for w in ws:
                torch.nn.functional.linear(x, w)
            rates.append(len(ws) * ws[0].numel() / (time.perf_counter() - t))
        return _median(rates[1:])
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# moeferry probe


def cli_probe(as_json: bool) -> int:
    """`moeferry probe [--json]`: the report and the plan for each catalog model."""
    hw = probe(measure_bandwidth=True)
    rows = catalog_plans(hw)
    recommended = next((r for r in rows if r["recommended"]), None)
    if as_json:
        report = dict(hw, plans=rows, recommended=recommended)
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(format_report(hw, rows, recommended))
    return 0


def catalog_plans(hw: dict, vram_budget_bytes: int | None = None, entries: list[dict] | None = None) -> list[dict]:
    """A plan for every catalog model this machine could use (`entries`: the catalog's raw
    entries, by default resources/catalog.json's), the recommended one marked."""
    from moeferry.engine.setup import plan as planner

    rows = []
    for entry in entries if entries is not None else (e.raw for e in load_catalog()):  # the catalog's own keys
        sizes = entry_sizes(entry)
        if sizes is None:
            continue
        p = planner.make_plan(hw, sizes, vram_budget_bytes)
        rows.append({"id": entry["id"], "name": entry.get("name", entry["id"]),
                     "expert_bits": sizes.expert_bits, "recommended": False, "best_bits": False,
                     "needs_convert": bool(entry.get("needs_convert")),
                     "model_type": entry.get("model_type", "mixtral"),
                     "download_bytes": entry.get("download_bytes"),
                     "disk_bytes": entry.get("disk_bytes"), "plan": p.to_dict()})
    best, chosen = recommend_model(hw, rows)
    for row, key in ((best, "best_bits"), (chosen, "recommended")):
        if row is not None:
            row[key] = True
    return rows


def recommend_model(hw: dict, rows: list[dict]) -> tuple[dict | None, dict | None]:
    """(the best bit-width among Mixtral's variants, the recommended model) among catalog_plans'
    rows: `moeferry probe`'s and the wizard's recommendation. Without a GPU that holds the dense
    weights the demo model; models that do not fit the free disk are never recommended."""
    from moeferry.engine.setup import plan as planner

    def pick(rows: list[dict]) -> dict:
        return rows[planner.recommend([planner.Plan(**r["plan"]) for r in rows],
                                      [r["download_bytes"] or 0 for r in rows])]

    disk = hw.get("disk_free_bytes")
    demo = next((r for r in rows if r["id"] == "demo"), None)
    # the bit-width choice and the route are among Mixtral's variants; other families are offered beside them
    mixtral = [r for r in rows if r["id"] != "demo" and r["model_type"] == "mixtral"]
    if not any(r["plan"]["fits"] and r["plan"]["device"] == "cuda" for r in mixtral):  # the demo model first
        return None, demo
    best = pick(mixtral)
    roomy = [r for r in mixtral if disk is None or not r["disk_bytes"] or r["disk_bytes"] <= disk]
    # The route: the ready-made checkpoint (no 93 GB download, no conversion) when it fits.
    ready = [r for r in roomy if not r["needs_convert"] and r["plan"]["fits"] and r["plan"]["device"] == "cuda"]
    return best, ready[0] if ready else pick(roomy) if roomy else demo


def entry_sizes(entry: dict):
    """ModelSizes for a catalog entry, None when unknown (the demo model not built)."""
    from moeferry.engine.setup.plan import ModelSizes

    try:
        return ModelSizes.from_catalog(entry)
    except (ValueError, KeyError, OSError):
        return None


def _tok_s(x: float) -> str:
    """Two significant digits, never in exponent form: 240, 13, 2.3, 0.021."""
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _duration(s: float) -> str:
    return f"{s:.1f} s" if s < 100 else f"{s / 60:.0f} min"


def format_report(hw: dict, rows: list[dict], recommended: dict | None) -> str:
    lines = ["MoE Ferry hardware probe", ""]
    if hw.get("gpu_name"):
        cc = f", compute capability {hw['compute_capability']}" if hw.get("compute_capability") else ""
        lines.append(f"GPU        {hw['gpu_name']}{cc}")
        lines.append(f"VRAM       {fmt_bytes(hw.get('vram_total_bytes'))} total, "
                     f"{fmt_bytes(hw.get('vram_free_bytes'))} free")
        lines.append(f"Driver     {hw.get('driver_version') or 'unknown'}"
                     + (f" (CUDA {hw['cuda_driver_version']})" if hw.get("cuda_driver_version") else ""))
        link = lambda g, w: f"gen {g} x{w}" if g and w else "unknown"  # noqa: E731
        lines.append(f"PCIe       {link(hw.get('pcie_gen_current'), hw.get('pcie_width_current'))} now, "
                     f"{link(hw.get('pcie_gen_max'), hw.get('pcie_width_max'))} max")
    else:
        lines.append(f"GPU        none usable ({hw.get('nvml_status') or 'not found'})")
    cuda = "with CUDA " + str(hw.get("torch_cuda_version")) if hw.get("torch_cuda_available") else "no CUDA"
    lines.append(f"torch      {hw.get('torch_version') or 'not installed'} ({cuda})")
    if hw.get("h2d_bytes_per_s"):
        kind = "pinned" if hw.get("h2d_pinned") else "pageable (pinning failed)"
        lines.append(f"Host->GPU  {hw['h2d_bytes_per_s'] / 1e9:.1f} GB/s measured, {kind}")
    cores = hw.get("cpu_cores_physical") or "?"
    lines.append(f"CPU        {hw.get('cpu_name') or 'unknown'}, {cores} cores / "
                 f"{hw.get('cpu_cores_logical') or '?'} threads")
    if hw.get("cpu_matvec_params_per_s"):
        lines.append(f"CPU speed  {hw['cpu_matvec_params_per_s'] / 1e9:.2f} G weights/s fp32 "
                     f"matvec, {hw['cpu_matmul_flops'] / 1e9:.0f} GFLOP/s matmul")
    lines.append(f"RAM        {fmt_bytes(hw.get('ram_total_bytes'))} total, "
                 f"{fmt_bytes(hw.get('ram_available_bytes'))} available")
    lines.append(f"Disk       {fmt_bytes(hw.get('disk_free_bytes'))} free at {hw.get('disk_path')}")
    lines += [f"Note       {n}" for n in hw.get("notes", [])]
    lines += ["", "Plans (batch 1 decode; predictions, not measurements):"]
    for r in rows:
        p = r["plan"]
        mark = "*" if r["recommended"] else " "
        more = f" (+1 in {p['extra_slot_layers']} layers)" if p.get("extra_slot_layers") else ""
        where = (f"{p['cache_experts_per_layer']} experts/layer cached{more}" if p["device"] == "cuda"
                 else "CPU")
        fits = "" if p["fits"] else "  DOES NOT FIT"
        lines.append(f" {mark} {r['name']}")
        lines.append(f"     {where}, ~{_tok_s(p['predicted_tokens_per_s'])} tok/s, first token after "
                     f"~{_duration(p['predicted_first_token_s'])}, bound by {p['bound']}{fits}")
        if p.get("predicted_hybrid_tokens_per_s"):
            lines.append(f"     with --cpu-experts auto: ~{p['predicted_hybrid_tokens_per_s']:.2g} tok/s")
    if not rows:
        lines.append("   (no catalog found)")
    if recommended:
        lines += ["", f"Recommended: {recommended['name']}.", recommended["plan"]["verdict"]]
    elif rows:  # CPU only and the demo model is not built into this install
        lines += ["", "Recommended: the demo model (not built into this install).",
                  rows[0]["plan"]["verdict"]]
    best = next((r for r in rows if r.get("best_bits")), None)
    if best and not best["recommended"]:
        lines.append(f"Best quality at nearly the same speed: {best['name']} "
                     f"(~{best['plan']['predicted_tokens_per_s']:.2g} tok/s), after a "
                     f"{fmt_bytes(best['download_bytes'])} download and a local conversion.")
    return "\n".join(lines)
