"""Where MoE Ferry's files are, for the engine and the app alike. Imports nothing heavy.

    data_dir()         the user's data folder: platformdirs' user data dir "moeferry", or
                       $MOEFERRY_DATA_DIR; the app's database, settings and log live here
    models_dir()       data_dir()/models: installed stores (the wizard's, `moeferry probe`'s disk)
    resources_dir()    the shipped resources/ (catalog, icons, styles, the demo store)
    demo_store_path()  resources/demo: the embedded demo store, what a STORE argument `demo` names
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "MOEFERRY_DATA_DIR"


def data_dir() -> Path:
    """The data folder (not created here)."""
    override = os.environ.get(DATA_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_data_dir("moeferry", appauthor=False))


def models_dir(root: Path | None = None) -> Path:
    return (root or data_dir()) / "models"


def resources_dir() -> Path:
    """resources/ inside the installed package (or the source tree)."""
    from moeferry import resources

    return Path(resources.__file__).resolve().parent


def demo_store_path() -> Path:
    return resources_dir() / "demo"
