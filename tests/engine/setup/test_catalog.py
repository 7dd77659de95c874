"""engine/setup/catalog.py: resources/catalog.json read by its own field names."""

from __future__ import annotations

import json

from moeferry.engine.setup.catalog import entry_from_dict, load_catalog


def test_the_real_catalog_reads():
    entries = load_catalog()
    assert entries, "resources/catalog.json"
    paper = next(e for e in entries if "paper" in e.id)
    assert paper.needs_convert and paper.imports == "paper-checkpoint", "imported after download"
    assert paper.quality.startswith("WikiText2") and paper.download_bytes > 1e10
    three = next(e for e in entries if e.id == "mixtral-8x7b-instruct-3bit")
    assert three.needs_convert and not three.imports and three.expert_bits == 3 and three.gated
    assert any(e.embedded for e in entries)
    assert all(e.raw["id"] == e.id for e in entries)


def test_an_unreadable_catalog_is_empty(tmp_path):
    bad = tmp_path / "catalog.json"
    bad.write_text("{not json")
    assert load_catalog(bad) == []
    bad.write_text(json.dumps({"models": [{"name": "no id"}]}))
    assert load_catalog(bad) == []
    assert load_catalog(tmp_path / "absent.json") == []


def test_an_entry_takes_the_defaults_of_what_it_leaves_out():
    e = entry_from_dict({"id": "x", "quality": {"note": "good"}})
    assert (e.name, e.repo_id, e.expert_bits, e.attn_bits, e.quality) == ("x", "", 2, 4, "good")
    assert not e.needs_convert and not e.imports and not e.embedded and not e.gated
