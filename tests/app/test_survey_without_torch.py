"""The wizard's survey (plans, recommendation, Hugging Face cache, demo) loads no torch: the app
starts fast and the hardware page answers quickly. Only the probe's own measurements need torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SURVEY = r"""
import json, struct, sys
from dataclasses import replace
from pathlib import Path

snap = Path(sys.argv[1]) / "models--org--m" / "snapshots" / ("a" * 40)
snap.mkdir(parents=True)
(snap / "config.json").write_text("{}")
header = json.dumps({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
(snap / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))

from moeferry.app.setup_backend import real_setup_backend
from moeferry.app.wizard.hardware_page import survey

hw = {"gpu_name": "Fake GPU", "torch_cuda_available": True, "vram_total_bytes": 16 << 30,
      "vram_free_bytes": 15 << 30, "h2d_bytes_per_s": 24e9, "ram_total_bytes": 64 << 30,
      "disk_free_bytes": 500 << 30}
backend = replace(real_setup_backend(), probe=lambda: dict(hw))
found = survey(backend)
assert found["recommended"] and found["demo"] is not None
assert any(p is not None for p in found["plans"].values())
from moeferry.engine.setup.hf_cache import find_in_hf_cache
assert find_in_hf_cache("org/m") == snap
assert backend.plan(hw, found["demo"], None) is not None  # an installed store's plan
assert "torch" not in sys.modules, "the survey imported torch"
print("ok")
"""


def test_the_survey_imports_no_torch(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path), "QT_QPA_PLATFORM": "offscreen", "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path), "MOEFERRY_DATA_DIR": str(tmp_path / "data")}
    r = subprocess.run([sys.executable, "-c", SURVEY, str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
