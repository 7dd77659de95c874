"""Deleting the downloaded checkpoint once its store verifies (issues 4 and 7)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from pathlib import Path

import pytest
from PySide6.QtWidgets import QWizard

from moeferry.app.catalog import CatalogEntry
from moeferry.app.install import InstallRequest, deletable_download, delete_download, run_install
from moeferry.app.settings import Key
from moeferry.app.wizard.wizard import Page
from tests.app.fakes import fake_setup_backend, make_store
from tests.app.test_app_wizard import next_page


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def catalog_request(root: Path, delete: bool = True, **kw) -> InstallRequest:
    values = dict(source="catalog", name="Mixtral", repo_id="tiny/mixtral", src_path=str(root / "downloads" / "m"),
                  needs_convert=True, expert_bits=3, dest=str(root / "m-3bit"), delete_download=delete)
    return InstallRequest(**(values | kw))


def install(req, backend, root):
    seen = []
    path = run_install(req, backend, seen.append, threading.Event(), downloads_root=root / "downloads")
    return path, seen


def test_download_deleted_after_verified_install_when_ticked(tmp_path):
    root = tmp_path / "models"
    req = catalog_request(root)
    path, seen = install(req, fake_setup_backend(tmp_path), root)
    assert (path / "manifest.json").is_file(), "the store stays"
    assert not Path(req.src_path).exists()
    done = seen[-1]
    assert done.step == "done" and done.download_deleted and done.freed_bytes == 3  # config.json + 1-byte weights
    assert done.message.startswith("Ready · Freed 3 B")


def test_download_kept_when_unticked(tmp_path):
    root = tmp_path / "models"
    req = catalog_request(root, delete=False)
    _, seen = install(req, fake_setup_backend(tmp_path), root)
    assert (Path(req.src_path) / "config.json").is_file()
    assert seen[-1].message == "Ready" and not seen[-1].download_deleted and seen[-1].freed_bytes is None


def test_download_kept_when_verification_fails(tmp_path):
    from moeferry.engine.errors import UserError

    def convert(*_, **__):  # as moeferry.engine.storage.convert does when the new store's hashes do not match
        raise UserError("The converted store failed verification (experts.safetensors: wrong sha256); "
                        "check the disk and run again.")

    root = tmp_path / "models"
    req = catalog_request(root)
    with pytest.raises(UserError, match="failed verification"):
        install(req, fake_setup_backend(tmp_path, convert=convert), root)
    assert (Path(req.src_path) / "model.safetensors").is_file()
    # a finished store that fails its check after a restart keeps the download too
    make_store(Path(req.dest))
    backend = dataclasses.replace(fake_setup_backend(tmp_path), verify=lambda p: ["experts/0.bin: wrong sha256"])
    with pytest.raises(UserError, match="failed verification"):
        install(req, backend, root)
    assert (Path(req.src_path) / "model.safetensors").is_file()


def test_guard_never_deletes_outside_the_downloads_folder(tmp_path):
    root = tmp_path / "models"
    downloads = root / "downloads"
    outside = tmp_path / "my-checkpoint"
    outside.mkdir(parents=True)
    (outside / "config.json").write_text("{}")
    inside = downloads / "m"
    inside.mkdir(parents=True)
    link = downloads / "link"
    link.symlink_to(outside, target_is_directory=True)
    store = make_store(downloads / "store")
    assert "not inside" in deletable_download(outside, downloads, [])
    assert "not inside" in deletable_download(downloads, downloads, []), "never the downloads folder itself"
    assert "not inside" in deletable_download(downloads / ".." / ".." / "my-checkpoint", downloads, [])
    assert "link" in deletable_download(link, downloads, [])
    assert "holds or is part of the model" in deletable_download(store, downloads, [store])
    assert "holds or is part of the model" in deletable_download(downloads / "store", downloads, [store / "x"])
    assert deletable_download(inside, downloads, [root / "m-3bit"]) is None

    # run_install refuses too: the model is ready, the folder stays, a notice says why
    req = catalog_request(root, src_path=str(outside))
    backend = fake_setup_backend(tmp_path, fetch=lambda repo_id, dest, **_: Path(dest))
    path, seen = install(req, backend, root)
    assert (path / "manifest.json").is_file() and (outside / "config.json").is_file()
    assert not seen[-1].download_deleted and "was kept" in seen[-1].message and "not inside" in seen[-1].message
    # and a folder request (a checkpoint the user chose) is never deleted, ticked or not
    folder = InstallRequest(source="folder", name="mine", src_path=str(inside), needs_convert=True,
                            dest=str(root / "mine-2bit"), delete_download=True)
    install(folder, fake_setup_backend(tmp_path), root)
    assert inside.is_dir()


def test_hf_cache_is_never_deleted(tmp_path, hf_cache):
    root = tmp_path / "models"
    snapshot = hf_cache / "models--tiny--mixtral" / "snapshots" / ("a" * 40)
    blobs = hf_cache / "models--tiny--mixtral" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir(parents=True)
    (blobs / "w").write_bytes(b"w" * 100)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").symlink_to(blobs / "w")
    backend = fake_setup_backend(tmp_path)
    # the wizard's "in your Hugging Face cache" route: the snapshot is converted in place, never deleted
    req = InstallRequest(source="hf_cache", name="m", src_path=str(snapshot), needs_convert=True,
                         dest=str(root / "m-3bit"), delete_download=True)
    install(req, backend, root)
    assert (snapshot / "model.safetensors").is_file() and (blobs / "w").is_file()
    # a catalog download that landed in the cache (here: the downloads folder is inside it) is refused
    cached_root = hf_cache / "moeferry"
    req = catalog_request(cached_root, src_path=str(snapshot))
    assert "Hugging Face cache" in deletable_download(snapshot, hf_cache, [])
    assert delete_download(req, cached_root / "m-3bit", hf_cache).deleted is False
    assert snapshot.is_dir()
    # files the downloader hard-linked from the cache: the links go, the cache's blobs stay, nothing is freed
    download = root / "downloads" / "m"
    download.mkdir(parents=True)
    os.link(blobs / "w", download / "model.safetensors")
    (download / "config.json").write_text("{}")
    cleanup = delete_download(catalog_request(root), root / "m-3bit", root / "downloads")
    assert cleanup.deleted and not download.exists()
    assert (blobs / "w").read_bytes() == b"w" * 100 and cleanup.freed_bytes == 2  # only config.json was ours


def test_deletion_failure_is_a_notice_and_the_model_is_ready(tmp_path, monkeypatch):
    root = tmp_path / "models"

    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    req = catalog_request(root)
    path, seen = install(req, fake_setup_backend(tmp_path), root)
    assert (path / "manifest.json").is_file() and Path(req.src_path).is_dir()
    assert seen[-1].step == "done" and not seen[-1].download_deleted
    assert "could not be deleted (Permission denied)" in seen[-1].message


def test_tokenizer_fetched_beside_the_download_goes_too(tmp_path):
    root = tmp_path / "models"
    req = catalog_request(root, tokenizer_repo_id="tiny/tokenizer")
    install(req, fake_setup_backend(tmp_path), root)
    assert not Path(req.src_path).exists() and not Path(req.src_path + "-tokenizer").exists()
    assert list((root / "downloads").iterdir()) == []


def test_resume_after_deletion_does_not_download_again(tmp_path):
    root = tmp_path / "models"
    req = catalog_request(root)
    install(req, fake_setup_backend(tmp_path), root)

    def no_fetch(*a, **k):
        raise AssertionError("the store is converted already")

    path, seen = install(req, fake_setup_backend(tmp_path, fetch=no_fetch), root)
    assert (path / "manifest.json").is_file() and seen[-1].download_deleted
    assert "already gone" in seen[-1].message


def test_choice_is_persisted_with_the_resumable_request(tmp_path):
    req = catalog_request(tmp_path)
    assert InstallRequest.from_dict(req.to_dict()).delete_download is True
    old = {k: v for k, v in req.to_dict().items() if k != "delete_download"}  # saved by an older version
    assert InstallRequest.from_dict(old).delete_download is False


def test_wizard_deletes_the_download_and_settings_say_the_source_is_gone(launch, qtbot, data_dir):
    parts = launch()
    wizard = parts.window.wizard
    next_page(wizard, qtbot, Page.HARDWARE)
    next_page(wizard, qtbot, Page.MODEL)
    model = wizard.pages[Page.MODEL]
    model.select("mixtral-2bit")  # a ready store, downloaded as is: nothing to delete
    assert not model.delete_download.isVisibleTo(model)
    model.select("mixtral-src")
    assert model.delete_download.isVisibleTo(model) and model.delete_download.isChecked()
    next_page(wizard, qtbot, Page.INSTALL)
    install_page = wizard.pages[Page.INSTALL]
    assert parts.settings.get(Key.PENDING_INSTALL)["delete_download"] is True
    qtbot.waitUntil(install_page.isComplete, timeout=5000)
    assert not (data_dir / "models" / "downloads" / "tiny--mixtral").exists()
    assert "Freed 3 B" in install_page.message.text()
    next_page(wizard, qtbot, Page.CACHE)
    next_page(wizard, qtbot, Page.DONE)
    wizard.button(QWizard.WizardButton.FinishButton).click()
    entry = parts.settings.get(Key.INSTALLED)[0]
    assert entry["source_path"] == "" and entry["source_deleted"] is True
    panel = parts.window.settings_panel
    assert not panel.convert_button.isVisibleTo(panel)
    assert panel.source_gone.isVisibleTo(panel) and "deleted" in panel.source_gone.text()


def test_paper_checkpoint_is_deleted_by_default_with_its_reason(launch, qtbot, tmp_path, data_dir):
    backend = fake_setup_backend(tmp_path)
    paper = CatalogEntry(id="paper", name="Paper checkpoint", repo_id="tiny/paper", needs_convert=True,
                         download_bytes=17_500_000_000, imports="paper-checkpoint")
    backend = dataclasses.replace(backend, catalog=lambda: [paper])
    parts = launch(setup=backend)
    wizard = parts.window.wizard
    next_page(wizard, qtbot, Page.HARDWARE)
    next_page(wizard, qtbot, Page.MODEL)
    model = wizard.pages[Page.MODEL]
    model.select("paper")
    assert model.delete_download.isChecked() and "nothing else can be made from it" in model.delete_hint.text()
    assert "17.5 GB" in model.delete_hint.text()
    req = model.build_request()
    assert req.delete_download and req.importing
    assert Path(req.src_path).parent == data_dir / "models" / "downloads"
    model.delete_download.setChecked(False)
    assert model.build_request().delete_download is False
