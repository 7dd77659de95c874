"""Where the app keeps its files: one data folder (engine/paths.py defines the locations),
overridable for tests with MOEFERRY_DATA_DIR."""

from __future__ import annotations

import os
import time
from pathlib import Path

from engine import paths as engine_paths
from engine.paths import DATA_DIR_ENV, models_dir, resources_dir  # noqa: F401 - the app's names for them


def data_dir() -> Path:
    """The folder holding the database, the settings and installed models (created if needed)."""
    path = engine_paths.data_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


def downloads_dir(root: Path | None = None) -> Path:
    """Where the wizard downloads checkpoints before converting or importing them."""
    return models_dir(root) / "downloads"


def move_aside(path: Path) -> Path:
    """Rename a damaged file to `<name>.corrupt-<timestamp>` so nothing is lost; returns the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    os.replace(path, target)
    return target
