"""The hardware check in plain words. No Qt."""

from __future__ import annotations

from dataclasses import dataclass

from moeferry.app.setup_backend import PlanSummary
from moeferry.app.stats_format import fmt_bytes, speed_words
from moeferry.engine.units import GB, GiB, fmt_memory

# Mixtral's 2-bit experts with 8-bit metadata are about 17 GB; they sit in host RAM.
EXPERTS_RAM_BYTES = 18 * GB


@dataclass(frozen=True)
class HardwareVerdict:
    level: str            # good | workable | poor | none
    headline: str         # one sentence, the first thing the user reads
    details: list[str]    # one line per fact: GPU, link, bandwidth, RAM, disk, CPU
    has_gpu: bool


def describe_hardware(hw: dict, plan: PlanSummary | None = None, expert_bits: int = 2) -> HardwareVerdict:
    """`hw` is moeferry.engine.setup.hardware.probe()'s report (its keys; a key may be missing or None)."""
    name = hw.get("gpu_name")
    vram = hw.get("vram_total_bytes")
    gen, width = hw.get("pcie_gen"), hw.get("pcie_width")
    bandwidth = hw.get("h2d_gb_per_s")
    ram, disk = hw.get("ram_total_bytes"), hw.get("disk_free_bytes")
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
        card = f"{name}, {fmt_memory(vram)}{link}" if vram else f"{name}{link}"
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
        details.append(f"GPU: {name}" + (f" with {fmt_memory(vram)} of memory" if vram else ""))
        driver = hw.get("driver_version")
        if driver:
            details.append(f"Driver: {driver}")
        if gen and width:
            slow = " (slow link: expert copies will take longer)" if int(gen) < 3 or int(width) < 8 else ""
            details.append(f"PCIe link: generation {gen}, x{width}{slow}")
    if bandwidth:
        details.append(f"Measured host-to-GPU copy speed: {float(bandwidth):.1f} GB/s")
    if ram:
        short = " (less than the ~18 GB Mixtral's experts need in RAM)" if ram < EXPERTS_RAM_BYTES else ""
        details.append(f"RAM: {fmt_memory(ram)}{short}")
    if disk:
        details.append(f"Free disk space: {fmt_bytes(disk)}")  # as the model page says it
    cpu = hw.get("cpu_name")
    if cpu:
        details.append(f"CPU: {cpu}")
    if plan and plan.verdict:
        details.append(plan.verdict)
    return HardwareVerdict(level, headline, details, bool(name))
