"""The hardware check in plain words. No Qt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.setup_backend import PlanSummary
from app.stats_format import fmt_bytes, speed_words

GiB = 1024**3
# Mixtral's 2-bit experts with 8-bit metadata are about 17 GB; they sit in host RAM.
EXPERTS_RAM_BYTES = 18 * 10**9


@dataclass(frozen=True)
class HardwareVerdict:
    level: str            # good | workable | poor | none
    headline: str         # one sentence, the first thing the user reads
    details: list[str]    # one line per fact: GPU, link, bandwidth, RAM, disk, CPU
    has_gpu: bool


def pick(hw: dict, *names: str) -> Any:
    for name in names:
        if hw.get(name) not in (None, ""):
            return hw[name]
    return None


def _gb(n: float) -> str:
    gb = n / GiB
    return f"{gb:.0f} GB" if gb >= 10 or abs(gb - round(gb)) < 0.05 else f"{gb:.1f} GB"


def describe_hardware(hw: dict, plan: PlanSummary | None = None, expert_bits: int = 2) -> HardwareVerdict:
    name = pick(hw, "gpu_name", "gpu")
    vram = pick(hw, "vram_bytes", "vram_total_bytes", "gpu_memory_bytes")
    gen, width = pick(hw, "pcie_gen", "pcie_generation"), pick(hw, "pcie_width", "pcie_lanes")
    bandwidth = pick(hw, "h2d_gb_per_s", "bandwidth_gb_per_s", "pinned_h2d_gb_per_s", "bandwidth")
    ram, disk = pick(hw, "ram_bytes", "ram_total_bytes"), pick(hw, "disk_free_bytes", "disk_free")
    details: list[str] = []

    if not name:
        details.append("No NVIDIA GPU was found.")
        level = "none"
        speed = plan.predicted_tokens_per_s if plan else None
        pace = speed_words(speed) if speed else "well under one token per second"
        headline = (f"No NVIDIA GPU found: Mixtral would run on the CPU at {pace}, "
                    "so start with the demo model, or choose a model and accept CPU speed.")
    else:
        link = f", PCIe {gen} x{width}" if gen and width else ""
        card = f"{name}, {_gb(vram)}{link}" if vram else f"{name}{link}"
        if vram is None or vram >= 12 * GiB:
            level = "good"
        elif vram >= 8 * GiB:
            level = "workable"
        else:
            level = "poor"
        words = {"good": "good", "workable": "workable with a small expert cache",
                 "poor": "too little GPU memory for Mixtral"}[level]
        headline = f"{card}: {words}"
        speed = plan.predicted_tokens_per_s if plan else None
        if speed and level != "poor":
            headline += f"; expect {speed_words(speed)} with {expert_bits}-bit experts."
        elif level == "poor":
            headline += "; the demo model still works."
        else:
            headline += "."
        details.append(f"GPU: {name}" + (f" with {_gb(vram)} of memory" if vram else ""))
        driver = pick(hw, "driver", "driver_version")
        if driver:
            details.append(f"Driver: {driver}")
        if gen and width:
            slow = " (slow link: expert copies will take longer)" if int(gen) < 3 or int(width) < 8 else ""
            details.append(f"PCIe link: generation {gen}, x{width}{slow}")
    if bandwidth:
        details.append(f"Measured host-to-GPU copy speed: {float(bandwidth):.1f} GB/s")
    if ram:
        short = " (less than the ~18 GB Mixtral's experts need in RAM)" if ram < EXPERTS_RAM_BYTES else ""
        details.append(f"RAM: {_gb(ram)}{short}")
    if disk:
        details.append(f"Free disk space: {fmt_bytes(disk)}")  # as the model page says it
    cpu = pick(hw, "cpu", "cpu_name")
    if cpu:
        details.append(f"CPU: {cpu}")
    if plan and plan.verdict:
        details.append(plan.verdict)
    return HardwareVerdict(level, headline, details, bool(name))
