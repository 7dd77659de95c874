"""The test fakes write what the engine writes: a fake store's manifest uses convert's keys."""

from __future__ import annotations

import json

from moeferry.app.catalog import read_store_info
from moeferry.engine.storage.convert import source_info
from tests.app.fakes import make_store


def test_a_fake_store_names_its_source_as_convert_does(tmp_path):
    snapshot = tmp_path / "models--org--m" / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    real = source_info(snapshot)  # what `moeferry convert` writes as the manifest's "source"
    fake = json.loads((make_store(tmp_path / "store", source="org/m") / "manifest.json").read_text())["source"]
    assert set(fake) <= set(real) and real["repo"] == fake["repo"] == "org/m"
    assert read_store_info(tmp_path / "store").source == "org/m"
