"""Where the app keeps its files: one data folder (engine/paths.py defines the locations),
overridable for tests with MOEFERRY_DATA_DIR."""

from __future__ import annotations

import os
import time
from pathlib import Path

from moeferry.engine import paths as engine_paths
from moeferry.engine.paths import DATA_DIR_ENV, models_dir, resources_dir  # noqa: F401 - the app's names for them


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


DEMO_STORE = "demo"  # the engine's name for the embedded demo store, wherever the app lives


def portable_store_path(path: str) -> str:
    """A store path as the settings keep it: the embedded demo store as "demo".

    The demo lives inside the app folder, so an absolute path to it breaks when the app is
    reinstalled elsewhere. Older versions stored one: a path to this app's demo, or one ending
    in resources/demo that is no longer there (an earlier install's), becomes "demo".
    """
    if not path or path == DEMO_STORE:
        return path
    p = Path(path)
    try:
        if p.resolve() == (resources_dir() / DEMO_STORE).resolve():
            return DEMO_STORE
    except OSError:
        return path
    return DEMO_STORE if p.parts[-2:] == ("resources", DEMO_STORE) and not p.exists() else path
