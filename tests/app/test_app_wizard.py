"""The set-up wizard, page by page, against fake set-up backends (the real engine: test_real_engine.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from PySide6.QtWidgets import QWizard

from moeferry.app.settings import Key
from moeferry.app.wizard.wizard import Page
from moeferry.engine.setup.download import FetchProgress
from tests.app.fakes import NO_GPU, fake_setup_backend
from tests.app.wizard_steps import next_page, open_install_page


def test_whole_wizard_then_chat(launch, qtbot, data_dir, engine_backend):
    parts = launch()
    wizard = parts.window.wizard
    assert wizard is not None and wizard.currentId() == Page.WELCOME
    next_page(wizard, qtbot, Page.HARDWARE)
    hw = wizard.pages[Page.HARDWARE]
    qtbot.waitUntil(hw.isComplete, timeout=5000)
    assert "RTX 3060, 12 GB, PCIe 4 x16: good; expect about 2.3 tokens/s with 2-bit experts" in hw.headline.text()
    assert "24.8 GB/s" in hw.details.text()
    next_page(wizard, qtbot, Page.MODEL)
    model = wizard.pages[Page.MODEL]
    assert [o.key for o in model.options] == ["mixtral-2bit", "mixtral-src", "demo", "folder"]
    assert "download 17.5 GB" in model.options[0].facts and "2.3 tokens/s" in model.options[0].facts
    model.select("mixtral-src")  # download, then convert to 3-bit
    assert model.delete_download.isVisibleTo(model) and model.delete_download.isChecked()
    assert "convert other bit-widths later" in model.delete_hint.text() and "93.0 GB" in model.delete_hint.text()
    model.delete_download.setChecked(False)  # keep the original weights for the other bit-widths
    seen = []
    next_page(wizard, qtbot, Page.INSTALL)
    install = wizard.pages[Page.INSTALL]
    install.task.progress.connect(lambda p: seen.append(install.detail.text()))
    qtbot.waitUntil(install.isComplete, timeout=5000)
    assert any("MB of 4.0 MB" in s and "MB/s" in s and "left" in s for s in seen), seen
    assert wizard.store_path == data_dir / "models" / "tiny--mixtral-3bit"
    assert (data_dir / "models" / "downloads" / "tiny--mixtral" / "config.json").is_file(), "unticked: kept"
    next_page(wizard, qtbot, Page.CACHE)
    cache = wizard.pages[Page.CACHE]
    assert cache.form_widget.isVisibleTo(cache)
    assert cache.budget_label.text() == "10.5 GB"  # the default keeps 1.5 GB of the 12 GB card free
    cache.slider.setValue(cache.slider.maximum())
    assert cache.budget_label.text() == "11.0 GB"  # at most, room for the GPU's runtime
    assert cache.cache.value() == 2  # fake plan: 11 GB / 4
    assert wizard.cache_experts == 0  # not edited: the engine sizes the cache from the budget, as the plan
    cache.cache.setValue(4)  # editable
    next_page(wizard, qtbot, Page.DONE)
    assert "4" in wizard.pages[Page.DONE].summary.text()
    with qtbot.waitSignal(parts.controller.model_ready, timeout=3000, check_params_cb=lambda ok: ok):
        wizard.button(QWizard.WizardButton.FinishButton).click()
    s = parts.settings
    assert s.get(Key.WIZARD_DONE) and s.get(Key.STORE_PATH) == str(wizard.store_path)
    assert s.get(Key.CACHE_EXPERTS) == 4 and s.get(Key.PENDING_INSTALL) is None
    assert s.get(Key.INSTALLED)[0]["expert_bits"] == 3
    assert s.get(Key.INSTALLED)[0]["source_path"].endswith("downloads/tiny--mixtral")
    assert engine_backend.loads[-1].store == str(wizard.store_path)
    assert engine_backend.loads[-1].cache_experts == 4
    # the settings panel now offers the other bit-widths from the kept source
    panel = parts.window.settings_panel
    assert panel.convert_button.isVisibleTo(panel)
    assert [panel.convert_bits.itemData(i) for i in range(panel.convert_bits.count())] == [2, 4]
    parts.controller.send("hi")
    qtbot.waitUntil(lambda: not parts.controller.busy, timeout=3000)


def test_no_gpu_is_said_plainly_and_offers_the_demo(launch, qtbot, tmp_path):
    parts = launch(setup=fake_setup_backend(tmp_path, hw=dict(NO_GPU)))
    wizard = parts.window.wizard
    next_page(wizard, qtbot, Page.HARDWARE)
    hw = wizard.pages[Page.HARDWARE]
    qtbot.waitUntil(hw.isComplete, timeout=5000)
    assert hw.headline.text().count("No NVIDIA GPU found")
    assert "demo model" in hw.advice.text()
    next_page(wizard, qtbot, Page.MODEL)
    model = wizard.pages[Page.MODEL]
    assert model.current().key == "demo" and model.options[0].key == "demo"
    assert "speed here: unknown" in model.options[1].details
    next_page(wizard, qtbot, Page.INSTALL)
    qtbot.waitUntil(wizard.pages[Page.INSTALL].isComplete, timeout=3000)
    next_page(wizard, qtbot, Page.CACHE)
    assert not wizard.pages[Page.CACHE].form_widget.isVisibleTo(wizard.pages[Page.CACHE])
    assert "No NVIDIA GPU" in wizard.pages[Page.CACHE].intro.text()


def test_local_folder_store_is_used_as_is(launch, qtbot, tmp_path):
    from tests.app.fakes import make_store

    folder = make_store(tmp_path / "mine", expert_bits=4)
    parts = launch()
    wizard = parts.window.wizard
    next_page(wizard, qtbot, Page.HARDWARE)
    next_page(wizard, qtbot, Page.MODEL)
    model = wizard.pages[Page.MODEL]
    model.select("folder")
    assert not model.isComplete()
    model.set_folder(folder)
    assert "ready to use" in model.folder_label.text()
    next_page(wizard, qtbot, Page.INSTALL)
    qtbot.waitUntil(wizard.pages[Page.INSTALL].isComplete, timeout=3000)
    assert wizard.store_path == folder


def slow_fetch_backend(tmp_path, gate: threading.Event):
    """A fetch that stops at half way until `gate` is set, keeping its bytes on disk like the real one."""
    def fetch(repo_id, dest, revision=None, endpoint=None, progress=None, cancel=None, **_):
        dest = Path(dest)
        partial = dest.with_name(dest.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        part = partial / "model.safetensors.incomplete"
        start = part.stat().st_size if part.exists() else 0
        total = 1000
        for done in range(start, total + 1, 100):
            part.write_bytes(b"x" * done)
            progress(FetchProgress("model.safetensors", done, total, done, total, 1000.0, (total - done) / 1000,
                                   0, 1))
            while done >= 500 and not gate.is_set() and not cancel.is_set():
                time.sleep(0.01)
            if cancel.is_set():
                raise RuntimeError("cancelled")
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(part.read_bytes())
        fetch.resumed_from.append(start)
        return dest

    fetch.resumed_from = []
    return fake_setup_backend(tmp_path, fetch=fetch), fetch


def test_cancel_then_resume_after_restart(launch, qtbot, tmp_path, data_dir):
    gate = threading.Event()
    backend, fetch = slow_fetch_backend(tmp_path, gate)
    parts = launch(setup=backend)
    wizard = parts.window.wizard
    install = open_install_page(wizard, qtbot, "mixtral-src")
    qtbot.waitUntil(lambda: "500 B of 1.0 KB" in install.detail.text(), timeout=3000)
    with qtbot.waitSignal(install.task.cancelled, timeout=3000):
        install.cancel_button.click()
    assert install.resume_button.isVisibleTo(install) and "Resume" in install.resume_button.text()
    assert not install.isComplete()
    assert parts.settings.get(Key.PENDING_INSTALL)["repo_id"] == "tiny/mixtral"
    parts.window.close()  # quitting the app keeps the stopped install (Cancel would forget it)

    gate.set()
    again = launch(setup=backend)  # "after a restart"
    wizard = again.window.wizard
    assert wizard is not None and wizard.currentId() == Page.INSTALL
    install = wizard.pages[Page.INSTALL]
    assert install.what.text().startswith("Resuming")
    qtbot.waitUntil(install.isComplete, timeout=5000)
    # the steps listed are the ones that ran, also once the new store exists
    assert install.steps.text() == "Downloading → Converting"
    assert fetch.resumed_from == [500], "continued from the bytes kept on disk"
    assert again.settings.get(Key.PENDING_INSTALL) is None
    next_page(wizard, qtbot, Page.CACHE)
    next_page(wizard, qtbot, Page.DONE)
    wizard.button(QWizard.WizardButton.FinishButton).click()
    assert again.settings.get(Key.STORE_PATH).endswith("tiny--mixtral-3bit")


def test_install_failure_is_one_sentence_with_retry(launch, qtbot, tmp_path):
    from moeferry.engine.errors import UserError

    def fetch(*a, **k):
        raise UserError("The hub refused the download (404); check the repository name.", 2)

    parts = launch(setup=fake_setup_backend(tmp_path, fetch=fetch))
    wizard = parts.window.wizard
    next_page(wizard, qtbot, Page.HARDWARE)
    next_page(wizard, qtbot, Page.MODEL)
    next_page(wizard, qtbot, Page.INSTALL)
    install = wizard.pages[Page.INSTALL]
    qtbot.waitUntil(lambda: "404" in install.message.text(), timeout=3000)
    assert install.resume_button.text() == "Try again" and not install.isComplete()


def test_wizard_reopens_from_the_menu(ready, qtbot):
    menu = next(a.menu() for a in ready.window.menuBar().actions() if a.text() == "&Model")
    action = next(a for a in menu.actions() if a.text().startswith("Set up a model"))
    action.trigger()
    assert ready.window.wizard is not None and ready.window.wizard.isVisible()
    assert ready.window.wizard.currentId() == Page.WELCOME
