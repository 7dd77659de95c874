"""App tests: offscreen Qt, a throwaway data folder, a fake engine and a fake set-up backend."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` puts only the test folders on sys.path
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
from PySide6.QtWidgets import QMessageBox  # noqa: E402

from tests.app.fakes import FakeEngineBackend, fake_setup_backend, make_store, write_settings  # noqa: E402


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    monkeypatch.setenv("MOEFERRY_DATA_DIR", str(folder))
    return folder


@pytest.fixture(autouse=True)
def _answer_yes(monkeypatch):
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)


@pytest.fixture
def engine_backend():
    return FakeEngineBackend()


@pytest.fixture
def setup_backend(tmp_path):
    return fake_setup_backend(tmp_path)


@pytest.fixture
def store(tmp_path):
    return make_store(tmp_path / "store")


@pytest.fixture
def launch(qapp, qtbot, data_dir, engine_backend, setup_backend):
    """Start the app on `data_dir` (call again after closing to 'restart'); windows close at teardown."""
    from moeferry.app.main import start

    started = []

    def _launch(engine=None, setup=None):
        engine = engine or engine_backend
        engine = engine.as_backend() if hasattr(engine, "as_backend") else engine
        parts = start(qapp, data_dir, engine, setup or setup_backend)
        started.append(parts)
        return parts

    yield _launch
    for parts in started:
        if parts.window.isVisible():
            parts.window.close()
        if parts.window.wizard is not None:
            parts.window.wizard.stop_tasks()
            parts.window.wizard.close()


@pytest.fixture
def ready(launch, data_dir, store, qtbot):
    """The app after set-up, with the fake model loaded."""
    write_settings(data_dir, wizard_done=True, store_path=str(store),
                   installed=[{"path": str(store), "name": "tiny", "expert_bits": 2}])
    parts = launch()
    qtbot.waitUntil(lambda: parts.controller.loaded is not None, timeout=3000)
    return parts
