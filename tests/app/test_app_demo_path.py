"""The embedded demo model is kept in settings.json as "demo", not as a path into the app folder.

The demo lives inside the installed app, so an absolute path to it breaks when the app is
reinstalled under another prefix ("Cannot continue" at every start before this fix).
"""

from __future__ import annotations

import dataclasses
import json

from PySide6.QtWidgets import QWizard

from moeferry.app.paths import resources_dir
from moeferry.app.settings import Key, load_settings
from moeferry.app.setup_backend import real_demo_path
from moeferry.app.wizard.wizard import Page
from tests.app.fakes import NO_GPU, fake_setup_backend, write_settings
from tests.app.test_app_wizard import next_page

DEMO = resources_dir() / "demo"


def test_the_demo_is_saved_as_demo(tmp_path):
    s = load_settings(tmp_path)
    s.set(Key.STORE_PATH, str(DEMO))
    s.set(Key.INSTALLED, [{"path": str(DEMO), "name": "Demo"}])
    s.save()
    saved = json.loads((tmp_path / "settings.json").read_text())
    assert saved["store_path"] == "demo" and saved["installed"] == [{"path": "demo", "name": "Demo"}]


def test_an_older_absolute_demo_path_loads_as_demo(tmp_path):
    gone = "/opt/moeferry-0.0.9/lib/moeferry/_internal/resources/demo"  # an earlier install's
    write_settings(tmp_path, store_path=gone,
                   installed=[{"path": "demo", "name": "Demo"}, {"path": gone, "name": "Demo (old)"},
                              {"path": str(tmp_path / "mixtral-2bit"), "name": "Mixtral"}])
    s = load_settings(tmp_path)
    assert s.get(Key.STORE_PATH) == "demo"
    assert [e["path"] for e in s.get(Key.INSTALLED)] == ["demo", str(tmp_path / "mixtral-2bit")]
    assert s.get(Key.INSTALLED)[0]["name"] == "Demo (old)"  # the later entry wins


def test_a_users_own_store_keeps_its_path(tmp_path):
    own = tmp_path / "resources" / "demo"  # named like the demo, but a real folder of the user's
    own.mkdir(parents=True)
    s = load_settings(tmp_path)
    s.set(Key.STORE_PATH, str(own))
    assert s.get(Key.STORE_PATH) == str(own)
    s.set(Key.STORE_PATH, str(tmp_path / "models" / "mixtral"))
    assert s.get(Key.STORE_PATH) == str(tmp_path / "models" / "mixtral")


def test_choosing_the_demo_in_the_wizard_stores_demo_and_loads_it(launch, qtbot, tmp_path, data_dir,
                                                                   engine_backend):
    assert real_demo_path() == DEMO
    backend = dataclasses.replace(fake_setup_backend(tmp_path, hw=dict(NO_GPU)), demo_path=real_demo_path)
    parts = launch(setup=backend)
    wizard = parts.window.wizard
    next_page(wizard, qtbot, Page.HARDWARE)
    next_page(wizard, qtbot, Page.MODEL)
    assert wizard.pages[Page.MODEL].current().key == "demo"
    next_page(wizard, qtbot, Page.INSTALL)
    next_page(wizard, qtbot, Page.CACHE)
    next_page(wizard, qtbot, Page.DONE)
    with qtbot.waitSignal(parts.controller.model_ready, timeout=5000, check_params_cb=lambda ok: ok):
        wizard.button(QWizard.WizardButton.FinishButton).click()
    qtbot.waitUntil(lambda: (data_dir / "settings.json").is_file(), timeout=3000)
    qtbot.waitUntil(lambda: json.loads((data_dir / "settings.json").read_text()).get("store_path") == "demo",
                    timeout=3000)
    assert [e["path"] for e in json.loads((data_dir / "settings.json").read_text())["installed"]] == ["demo"]
    assert engine_backend.loads[-1].store == "demo"
