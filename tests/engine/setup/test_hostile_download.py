"""Hostile and damaged input on the download side (issue 12, cases 5, 7 and 8), on the local hub.

A damaged blob in the Hugging Face cache, a listing that moves between runs, rate limits with
Retry-After, a server that trickles bytes, unsafe file names, and the Windows path rules that
`safe_relpath` applies on every platform.
"""

from __future__ import annotations

import json
import time
from pathlib import PureWindowsPath

import pytest

from moeferry.engine.errors import UserError
from moeferry.engine.setup import download, hf_cache
from moeferry.engine.setup.hf_cache import safe_relpath
from tests.engine.setup import test_download
from tests.engine.setup.test_download import REPO, SHARD1, assert_same_files, fetch, make_hf_cache, tiny_files

clean_env, hub = test_download.clean_env, test_download.hub  # the local hub's fixtures


def test_a_damaged_cache_blob_is_downloaded_not_linked_again(hub, clean_env, tmp_path):
    files = tiny_files()
    snap = make_hf_cache(clean_env / "hf_cache", REPO, files, hub.repos[REPO].sha)
    blob = (snap / SHARD1).resolve()
    damaged = bytearray(blob.read_bytes())
    damaged[-5] ^= 0xFF  # right size, wrong bytes
    blob.write_bytes(bytes(damaged))
    messages = []
    fetch(hub, tmp_path / "out", log=messages.append)
    assert_same_files(tmp_path / "out", files)
    assert len(hub.resolves(SHARD1)) == 1, "the hub was asked for the file the cache had damaged"
    assert [m for m in messages if "damaged" in m and SHARD1 in m and "cache" in m]
    assert blob.read_bytes() == bytes(damaged), "the cache's blob is never written through a link"
    assert (tmp_path / "out" / SHARD1).stat().st_ino != blob.stat().st_ino


def test_files_are_fetched_from_the_listed_commit_not_the_branch(hub, tmp_path):
    hub.drop_after[SHARD1] = 50_000  # a resumed file: every attempt must name the same commit
    fetch(hub, tmp_path / "out")
    sha = hub.repos[REPO].sha
    resolves = [r.path for r in hub.requests if "/resolve/" in r.path]
    assert len(hub.resolves(SHARD1)) == 2
    assert resolves and all(p.startswith(f"/{REPO}/resolve/{sha}/") for p in resolves), resolves


def test_retry_after_is_honoured(hub, tmp_path):
    hub.rate_limited[SHARD1] = 1
    hub.retry_after = "1"
    fetch(hub, tmp_path / "out", backoff_s=0.01)
    first, second = hub.resolves(SHARD1)
    assert second.at - first.at >= 0.9, "waited the server's Retry-After, not the 10 ms backoff"
    assert_same_files(tmp_path / "out", tiny_files())


def test_retry_after_is_bounded(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(download, "RETRY_AFTER_MAX_S", 0.2)
    hub.rate_limited[SHARD1] = 1
    hub.retry_after = "86400"  # a day: never waited in full
    t0 = time.monotonic()
    fetch(hub, tmp_path / "out", backoff_s=0.01)
    assert time.monotonic() - t0 < 10
    first, second = hub.resolves(SHARD1)
    assert second.at - first.at >= 0.15


def test_endless_rate_limit_says_wait_not_network(hub, tmp_path):
    hub.rate_limited[SHARD1] = 10_000
    hub.retry_after = "0"
    with pytest.raises(UserError) as e:
        fetch(hub, tmp_path / "out", max_retries=2)
    msg = str(e.value)
    assert "429" in msg and "wait" in msg and "network" not in msg and e.value.exit_code == 1


def test_a_trickling_server_times_out_with_a_sentence(hub, tmp_path):
    hub.throttle_bps[SHARD1] = 64_000  # 400 kB at 64 kB/s would take 6 s per attempt
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        fetch(hub, tmp_path / "out", max_retries=2, stall_s=0.5, min_rate_bps=1e6)
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert SHARD1 in msg and "slower than" in msg and "\n" not in msg and e.value.exit_code == 1
    assert len(hub.resolves(SHARD1)) == 3  # the first try and two retries, each cut short


def test_a_fast_server_is_not_taken_for_a_stalled_one(hub, tmp_path):
    fetch(hub, tmp_path / "out", stall_s=0.05, min_rate_bps=1e3)
    assert_same_files(tmp_path / "out", tiny_files())


UNSAFE = ["D:evil", "C:/Windows/win.ini", "aux", "NUL", "nul.txt", "con.json", "com1", "LPT9.bin",
          "weights.bin:hidden", "a/aux/b", "a\\b", "../x", "a/../../x", "/etc/passwd", "name.",
          "name ", "a//b", "", "tab\tname"]


@pytest.mark.parametrize("name", UNSAFE)
def test_safe_relpath_applies_windows_rules_everywhere(name):
    with pytest.raises(UserError, match="unsafe file name"):
        safe_relpath(name)
    assert hf_cache.path_problem(name)


def test_the_refused_names_are_the_ones_windows_misreads():
    """Each refused name would, joined to a download folder on Windows, escape it, open a
    device or a stream, or silently become another name (checked with PureWindowsPath)."""
    base = PureWindowsPath("C:/Users/u/models/out")
    for name in ("D:evil", "C:/Windows/win.ini", "/etc/passwd"):
        joined = base / name
        assert base not in joined.parents, name  # leaves the folder (drive or root)
    for name in ("aux", "NUL", "nul.txt", "con.json", "com1", "LPT9.bin"):
        assert (base / name).is_reserved(), name  # a device, not a file
    assert PureWindowsPath("a\\b").parts == ("a", "b")  # a backslash is a separator there
    # names that are safe on Windows too are accepted, and stay inside the folder
    for name in ("config.json", "tokenizer/tokenizer.json", "model-00001-of-00002.safetensors",
                 "auxiliary.json", "console/x.txt", "com10.bin", "a b.txt"):
        assert hf_cache.path_problem(name) is None, name
        assert base in (base / name).parents and not (base / name).is_reserved(), name
        assert safe_relpath(name).as_posix() == name


def test_a_listing_with_a_windows_unsafe_name_writes_nothing(hub, tmp_path):
    files = tiny_files()
    files["D:evil.json"] = b"{}"
    hub.repos["org/bad"] = hub.repos[REPO].__class__(files)
    with pytest.raises(UserError, match="unsafe file name 'D:evil.json'") as e:
        fetch(hub, tmp_path / "out", repo_id="org/bad")
    assert e.value.exit_code == 1
    assert not any("/resolve/" in r.path for r in hub.requests)
    assert not list(tmp_path.glob("out*"))


def test_gated_sentence_names_the_endpoint_used(hub, tmp_path):
    hub.repos["org/gated"] = hub.repos[REPO].__class__(tiny_files(), gated=True, gated_api=True)
    with pytest.raises(UserError) as e:
        fetch(hub, tmp_path / "out", repo_id="org/gated")
    assert f"{hub.url}/org/gated" in str(e.value) and "huggingface.co" not in str(e.value)


@pytest.mark.parametrize("state", ['[1, 2]', '{"repo_id": "org/tiny", "files": [{"size": 3}, 7], "verified": [1]}',
                                   '{"repo_id": "org/tiny", "files": [{"path": "../../x", "size": 1}], '
                                   '"verified": {"../../x": "00"}}'])
def test_a_damaged_or_hostile_fetch_state_is_ignored(hub, tmp_path, state):
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / download.STATE_NAME).write_text(state)
    (tmp_path / "x").write_text("keep")  # what a '../../x' entry would reach
    fetch(hub, tmp_path / "out")
    assert_same_files(tmp_path / "out", tiny_files())
    assert (tmp_path / "x").read_text() == "keep"


def test_a_finished_download_with_a_damaged_manifest_is_not_taken_as_complete(hub, tmp_path):
    fetch(hub, tmp_path / "out")
    state = tmp_path / "out" / download.STATE_NAME
    data = json.loads(state.read_text())
    data["files"].append({"path": "C:/x", "size": 1})
    state.write_text(json.dumps(data))
    with pytest.raises(UserError, match="damaged or of another repository"):
        fetch(hub, tmp_path / "out")
