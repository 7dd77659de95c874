"""`moeferry probe` and the wizard recommend the same model (moeferry.engine.setup.hardware.recommend_model)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moeferry.app.setup_backend import real_setup_backend
from moeferry.app.wizard.hardware_page import survey
from moeferry.app.wizard.model_page import catalog_option
from moeferry.engine.setup import hardware
from moeferry.engine.units import GiB


def machine(vram_gib: float | None, disk_gib: float = 500, ram_gib: float = 64) -> dict:
    hw = {"gpu_name": None, "torch_cuda_available": False, "ram_total_bytes": int(ram_gib * GiB),
          "disk_free_bytes": int(disk_gib * GiB), "cpu_cores_physical": 4, "cpu_matvec_params_per_s": 2e9,
          "cpu_matmul_flops": 5e10}
    if vram_gib:
        hw.update(gpu_name="Fake GPU", torch_cuda_available=True, vram_total_bytes=int(vram_gib * GiB),
                  vram_free_bytes=int((vram_gib - 0.4) * GiB), h2d_bytes_per_s=24e9,
                  gpu_mem_bandwidth_bytes_per_s=900e9)
    return hw


@pytest.mark.parametrize("hw", [machine(None), machine(6), machine(12), machine(16), machine(24), machine(80),
                                machine(24, disk_gib=30), machine(12, ram_gib=8)],
                         ids=["cpu", "6GB", "12GB", "16GB", "24GB", "80GB", "24GB-small-disk", "12GB-8GB-RAM"])
def test_the_wizard_recommends_what_the_cli_recommends(hw):
    cli = next((r["id"] for r in hardware.catalog_plans(hw) if r["recommended"]), None)
    backend = replace(real_setup_backend(), probe=lambda: dict(hw), find_in_hf_cache=lambda repo: None)
    found = survey(backend)
    assert found["recommended"] == cli
    marked = [e.id for e in found["catalog"] if not e.embedded
              and catalog_option(e, found["plans"][e.id], None, hw["disk_free_bytes"],
                                 e.id == found["recommended"]).recommended]
    assert marked == ([cli] if cli not in (None, "demo") else [])


def test_a_model_that_does_not_fit_the_disk_is_not_recommended():
    roomy = next(r for r in hardware.catalog_plans(machine(24)) if r["recommended"])
    cramped = machine(24, disk_gib=roomy["disk_bytes"] / GiB - 1)
    assert next((r["id"] for r in hardware.catalog_plans(cramped) if r["recommended"]), None) != roomy["id"]
