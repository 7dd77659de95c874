"""pyproject.toml and packaging/moeferry.spec: what ships. The wheel is built from a copy of
the repository (so no build/ or .egg-info lands in the checkout) and its file list checked;
the PyInstaller spec's exclude list is read from its source (building it takes PyInstaller).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEV_ONLY = ("benchmarks", "tests", "training")  # top-level folders that must not ship
TOOLS = ("kernel_bench", "kernel_sass", "profile_decode", "convert_bench", "plan_check", "conftest",
         "fakes", "hub_server", "routing_suite")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("engine", "app", "resources", *DEV_ONLY):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-cache-dir", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (built,) = out.glob("moeferry-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_files(wheel) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


@pytest.mark.slow
def test_the_wheel_holds_the_engine_the_app_and_resources_and_no_developer_tool(wheel_files):
    tops = {name.split("/")[0] for name in wheel_files}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"moeferry"}  # one import name
    assert not [n for n in wheel_files if any(Path(n).stem == t for t in TOOLS)]
    # every source folder is a listed package (pyproject.toml's packages), so nothing is left out
    sources = {f"moeferry/{p.relative_to(ROOT).as_posix()}" for folder in ("engine", "app", "resources")
               for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert sources <= set(wheel_files), sorted(sources - set(wheel_files))[:10]
    assert {"moeferry/engine/runtime/model.py", "moeferry/engine/cli.py", "moeferry/app/cli.py",
            "moeferry/resources/catalog.json"} <= set(wheel_files)
    assert any(n.startswith("moeferry/resources/demo/") and n.endswith(".safetensors") for n in wheel_files)


@pytest.mark.slow
def test_the_wheels_console_script_is_the_apps(wheel, wheel_files):
    (name,) = [n for n in wheel_files if n.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(wheel) as z:
        text = z.read(name).decode()
    assert "[console_scripts]\nmoeferry = moeferry.app.cli:main" in text, text


def spec_excludes() -> list[str]:
    tree = ast.parse((ROOT / "packaging" / "moeferry.spec").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["excludes"]:
            return ast.literal_eval(node.value)
    raise AssertionError("packaging/moeferry.spec has no `excludes = [...]`")


def test_the_installer_bundle_excludes_benchmarks_and_tests():
    assert {"benchmarks", "tests", "training"} <= set(spec_excludes())
