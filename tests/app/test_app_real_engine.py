"""The app with the real engine: wizard -> download from a local fake hub -> convert -> verify -> chat.

A tiny random Mixtral checkpoint is served by tests/hub_server.py on 127.0.0.1; nothing else is mocked
but the hardware probe (so the test does not spend time measuring) and the catalog.
"""

from __future__ import annotations

import json

import pytest
from PySide6.QtWidgets import QWizard

pytest.importorskip("moeferry.engine.runtime.generate")

from moeferry.app.catalog import CatalogEntry  # noqa: E402
from moeferry.app.engine_backend import real_engine_backend  # noqa: E402
from moeferry.app.settings import Key  # noqa: E402
from moeferry.app.setup_backend import real_setup_backend  # noqa: E402
from moeferry.app.wizard.wizard import Page  # noqa: E402
from tests.app.fakes import NO_GPU  # noqa: E402
from tests.conftest import make_checkpoint  # noqa: E402
from tests.hub_server import FakeRepo, HubServer  # noqa: E402

REPO = "tiny/mixtral"


@pytest.fixture
def hub(hub_online):
    tmp_path = hub_online
    ck = tmp_path / "ck"
    make_checkpoint(ck, shard="60KB")
    files = {p.relative_to(ck).as_posix(): p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    server = HubServer(repos={REPO: FakeRepo(files)}).start()
    server.config = json.loads((ck / "config.json").read_text())
    server.download_bytes = sum(len(b) for b in files.values())
    yield server
    server.stop()


@pytest.mark.slow
def test_wizard_downloads_converts_and_the_chat_streams_from_the_real_engine(launch, qtbot, hub, data_dir):
    raw = {"id": "tiny", "name": "Tiny Mixtral", "repo_id": REPO, "needs_convert": True, "expert_bits": 2,
           "attn_bits": 4, "config": hub.config, "download_bytes": hub.download_bytes}
    entry = CatalogEntry(id="tiny", name="Tiny Mixtral (2-bit experts)", repo_id=REPO, needs_convert=True,
                         expert_bits=2, attn_bits=4, download_bytes=hub.download_bytes,
                         disk_bytes=2 * hub.download_bytes, quality="random weights", raw=raw)
    setup = real_setup_backend()
    setup.probe = lambda: dict(NO_GPU)
    setup.catalog = lambda: [entry]
    setup.demo_path = lambda: None
    setup.endpoint = hub.url
    parts = launch(engine=real_engine_backend(), setup=setup)
    parts.settings.set(Key.MAX_NEW_TOKENS, 6)
    parts.settings.set(Key.TEMPERATURE, 0.0)
    wizard = parts.window.wizard
    for expect in (Page.HARDWARE, Page.MODEL):
        qtbot.waitUntil(wizard.currentPage().isComplete, timeout=10000)
        wizard.next()
        assert wizard.currentId() == expect
    model = wizard.pages[Page.MODEL]
    model.select("tiny")
    assert "CPU" in wizard.pages[Page.HARDWARE].headline.text()
    wizard.next()
    install = wizard.pages[Page.INSTALL]
    steps = []
    install.task.progress.connect(lambda p: steps.append(p.step))
    qtbot.waitUntil(install.isComplete, timeout=60000)
    assert {"download", "convert"} <= set(steps) and "verify" not in steps  # converting verifies
    store = data_dir / "models" / "tiny--mixtral-2bit"
    assert wizard.store_path == store and (store / "manifest.json").is_file()
    wizard.next()
    wizard.next()
    assert wizard.currentId() == Page.DONE
    with qtbot.waitSignal(parts.controller.model_ready, timeout=60000, check_params_cb=lambda ok: ok):
        wizard.button(QWizard.WizardButton.FinishButton).click()

    with qtbot.waitSignal(parts.controller.reply_finished, timeout=60000) as done:
        parts.controller.send("Hello")
    msg = done.args[0]
    assert msg.complete and msg.stats["new_tokens"] >= 1
    summary = parts.window.expert_map.summary
    assert summary is not None and summary.num_layers == 2 and summary.num_experts == 4
    assert "tok/s" in parts.window.status.labels["tps"].text()


def test_real_store_verification_finds_a_damaged_file(ready, qtbot, tmp_path, tiny_store):
    import shutil

    from moeferry.app.errors import Action

    store = tmp_path / "copy"
    shutil.copytree(tiny_store, store)
    with open(store / "experts.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\0" * 8)
    ready.window.setup_backend = real_setup_backend()
    ready.settings.set(Key.STORE_PATH, str(store))
    ready.window.reverify()
    qtbot.waitUntil(lambda: ready.window.error_dialog is not None, timeout=30000)
    assert ready.window.error_dialog.info.action == Action.REDOWNLOAD
    assert "experts.safetensors" in ready.window.error_dialog.informativeText()


def test_real_probe_reads_as_plain_words():
    from moeferry.app.hardware_words import describe_hardware
    from moeferry.engine.setup.hardware import probe

    verdict = describe_hardware(probe(measure_bandwidth=False))
    assert verdict.headline.endswith(".") and verdict.details
