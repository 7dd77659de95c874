"""engine/setup/download.py against a local fake hub (tests/hub_server.py); nothing leaves 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moeferry.engine.errors import UserError
from moeferry.engine.setup import download
from moeferry.engine.setup.download import FetchCancelled, cli_fetch, fetch_repo
from moeferry.engine.setup.hf_cache import find_in_hf_cache

try:
    from tests.hub_server import FakeRepo, HubServer, git_blob_sha1
except ModuleNotFoundError:  # plain `pytest` puts tests/ itself on sys.path
    from hub_server import FakeRepo, HubServer, git_blob_sha1

ROOT = Path(__file__).resolve().parents[3]
REPO = "org/tiny"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def safetensors_bytes(n_floats: int, seed: int) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, 4 * n_floats]}})
    header += " " * (-len(header) % 8)
    data = hashlib.shake_256(seed.to_bytes(4, "little")).digest(4 * n_floats)
    return len(header).to_bytes(8, "little") + header.encode() + data


def tiny_files() -> dict[str, bytes]:
    index = {"metadata": {}, "weight_map": {"a": SHARD1, "b": SHARD2}}
    return {
        "config.json": b'{"model_type": "mixtral"}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        SHARD1: safetensors_bytes(100_000, 1),
        SHARD2: safetensors_bytes(60_000, 2),
        "tokenizer/tokenizer.json": b'{"version": "1.0"}' * 10,
    }


@pytest.fixture
def clean_env(hub_online, monkeypatch):
    monkeypatch.setattr(download, "_stored_token", lambda: os.environ.get("HF_TOKEN"))
    return hub_online


@pytest.fixture
def hub(clean_env):
    server = HubServer(repos={REPO: FakeRepo(tiny_files())}).start()
    yield server
    server.stop()


def fetch(hub, dest, **kw):
    kw.setdefault("backoff_s", 0.01)
    return fetch_repo(REPO if "repo_id" not in kw else kw.pop("repo_id"), dest,
                      endpoint=hub.url, **kw)


def assert_same_files(dest: Path, files: dict[str, bytes]):
    for name, data in files.items():
        assert (dest / name).read_bytes() == data, name


def test_fetch_verifies_and_installs_atomically(hub, tmp_path):
    dest = tmp_path / "out"
    events = []
    path = fetch(hub, dest, progress=events.append)
    assert path == dest.absolute()
    assert_same_files(dest, tiny_files())
    manifest = json.loads((dest / download.STATE_NAME).read_text())
    assert manifest["complete"] and manifest["commit"] == hub.repos[REPO].sha
    assert {f["path"] for f in manifest["files"]} == set(tiny_files())
    assert not (tmp_path / "out.partial").exists() and not (tmp_path / "out.partial.lock").exists()
    last = events[-1]
    assert last.phase == "done" and last.done == last.total == sum(map(len, tiny_files().values()))
    assert last.files_done == last.files_total == 5
    # the tree request uses the hub's real path and the file URLs the resolve path
    assert any(r.path.startswith(f"/api/models/{REPO}/tree/main") for r in hub.requests)
    sha = FakeRepo(tiny_files()).sha  # files come from the commit the listing named
    assert any(r.path == f"/{REPO}/resolve/{sha}/{SHARD1}" for r in hub.requests)
    before = len(hub.requests)
    assert fetch(hub, dest) == dest.absolute()  # already complete: no hub traffic at all
    assert len(hub.requests) == before


def test_dropped_connection_resumes_with_range(hub, tmp_path):
    hub.drop_after[SHARD1] = 150_000
    hub.drop_times[SHARD1] = 2
    dest = tmp_path / "out"
    fetch(hub, dest)
    assert_same_files(dest, tiny_files())
    ranges = [r.headers.get("Range") for r in hub.resolves(SHARD1)]
    assert ranges == [None, "bytes=150000-", "bytes=150000-"]


def test_retries_are_logged_and_bounded(hub, tmp_path):
    hub.drop_after[SHARD1] = 0
    hub.drop_times[SHARD1] = 99
    logs = []
    with pytest.raises(UserError, match=f"Downloading {SHARD1} failed 3 times in a row"):
        fetch(hub, tmp_path / "out", max_retries=3, log=logs.append)
    assert sum("connection dropped; resuming" in m for m in logs) == 3


def test_server_ignoring_range_restarts_the_file(hub, tmp_path):
    hub.drop_after[SHARD1] = 100_000
    hub.ignore_range = True
    fetch(hub, tmp_path / "out")
    assert_same_files(tmp_path / "out", tiny_files())


def test_hub_without_tree_api_falls_back_to_model_info(hub, tmp_path):
    hub.tree_supported = False
    hub.corrupt.add(SHARD1)
    with pytest.raises(UserError, match=SHARD1):  # sizes and sha256 came from the siblings
        fetch(hub, tmp_path / "out")
    assert any("blobs=" in r.path for r in hub.requests)


def test_redirected_lfs_files_resume_at_the_cdn(hub, tmp_path):
    hub.redirect_lfs = True
    hub.drop_after[SHARD2] = 70_000
    fetch(hub, tmp_path / "out")
    assert_same_files(tmp_path / "out", tiny_files())
    cdn = [r for r in hub.resolves(SHARD2) if r.path.startswith("/cdn/")]
    assert [r.headers.get("Range") for r in cdn] == [None, "bytes=70000-"]


def _run_fetch_process(hub, dest, env) -> subprocess.Popen:
    code = ("import sys; from moeferry.engine.setup.download import cli_fetch; "
            "sys.exit(cli_fetch(sys.argv[1], sys.argv[2], None, sys.argv[3]))")
    return subprocess.Popen([sys.executable, "-c", code, REPO, str(dest), hub.url], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_kill_9_then_a_new_process_resumes_with_range(hub, tmp_path):
    hub.throttle_bps[SHARD1] = 400_000
    dest = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    incomplete = tmp_path / "out.partial" / (SHARD1 + ".incomplete")
    proc = _run_fetch_process(hub, dest, env)
    deadline = time.monotonic() + 10
    while download._size(incomplete) < 50_000:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.02)
    proc.kill()  # SIGKILL: no cleanup of any kind
    proc.wait()
    assert not dest.exists()
    have = download._size(incomplete)
    assert 0 < have < len(tiny_files()[SHARD1])

    hub.throttle_bps.clear()
    proc = _run_fetch_process(hub, dest, env)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    assert_same_files(dest, tiny_files())
    ranges = [r.headers.get("Range") for r in hub.resolves(SHARD1)]
    assert ranges[0] is None and len(ranges) == 2
    start = int(re.fullmatch(r"bytes=(\d+)-", ranges[1]).group(1))
    assert 0 < start <= have  # the killed process may have lost its last buffered bytes
    assert b"every file verified" in out


def test_corrupted_bytes_refused_named_and_kept_aside(hub, tmp_path):
    hub.corrupt.add(SHARD2)
    dest = tmp_path / "out"
    with pytest.raises(UserError) as e:
        fetch(hub, dest)
    assert e.value.exit_code == 1 and SHARD2 in str(e.value) and ".corrupt" in str(e.value)
    assert not dest.exists()
    partial = tmp_path / "out.partial"
    assert (partial / (SHARD2 + ".corrupt")).exists() and (partial / SHARD1).exists()

    # not fetched again unless asked
    n = len(hub.resolves(SHARD2))
    with pytest.raises(UserError):
        fetch(hub, dest)
    assert len(hub.resolves(SHARD2)) == n and len(hub.resolves(SHARD1)) == 1

    hub.corrupt.clear()
    fetch(hub, dest, retry_corrupt=True)
    assert_same_files(dest, tiny_files())
    assert len(hub.resolves(SHARD1)) == 1  # the good shard was kept


def test_corrupted_small_file_caught_by_git_hash(hub, tmp_path):
    hub.corrupt.add("config.json")
    with pytest.raises(UserError, match="config.json"):
        fetch(hub, tmp_path / "out")


@pytest.mark.parametrize("gated_api", [False, True])
def test_gated_repo_explained(hub, tmp_path, monkeypatch, gated_api):
    hub.repos["org/gated"] = FakeRepo(tiny_files(), gated=True, gated_api=gated_api)
    with pytest.raises(UserError) as e:
        fetch(hub, tmp_path / "out", repo_id="org/gated")
    msg = str(e.value)
    assert e.value.exit_code == 2
    # the licence page is on the hub actually used (--endpoint), not always huggingface.co
    assert f"{hub.url}/org/gated" in msg and "huggingface.co" not in msg
    assert "hf auth login" in msg and "HF_TOKEN" in msg
    assert "licence" in msg and "\n" not in msg
    assert not (tmp_path / "out").exists()

    with pytest.raises(UserError, match="no access"):
        fetch(hub, tmp_path / "out", repo_id="org/gated", token="hf_other")

    monkeypatch.setenv("HF_TOKEN", "hf_good")  # the token comes from the environment
    fetch(hub, tmp_path / "out", repo_id="org/gated")
    assert_same_files(tmp_path / "out", tiny_files())


def test_not_found_and_bad_revision(hub, tmp_path):
    with pytest.raises(UserError, match="Repository org/missing was not found") as e:
        fetch(hub, tmp_path / "a", repo_id="org/missing")
    assert e.value.exit_code == 2
    with pytest.raises(UserError, match="Revision v9 was not found"):
        fetch(hub, tmp_path / "b", revision="v9")
    with pytest.raises(UserError, match="not a valid repository id"):
        fetch(hub, tmp_path / "c", repo_id="no slash/../x")


def test_no_network_is_one_clear_sentence(clean_env, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nothing listens there
    with pytest.raises(UserError, match="Cannot reach the hub at") as e:
        fetch_repo(REPO, tmp_path / "out", endpoint=f"http://127.0.0.1:{port}")
    assert e.value.exit_code == 1


def test_not_enough_disk_refused_before_downloading(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 50_000))
    with pytest.raises(UserError, match="Not enough free disk space") as e:
        fetch(hub, tmp_path / "out")
    assert e.value.exit_code == 1
    assert not any("/resolve/" in r.path for r in hub.requests)
    assert not (tmp_path / "out").exists()


def test_disk_check_counts_bytes_already_there(hub, tmp_path, monkeypatch):
    hub.corrupt.add(SHARD2)
    with pytest.raises(UserError):
        fetch(hub, tmp_path / "out")
    hub.corrupt.clear()
    need = len(tiny_files()[SHARD2]) + download.DISK_MARGIN_BYTES
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 0, need))
    fetch(hub, tmp_path / "out", retry_corrupt=True)  # only SHARD2 is still missing: fits


def test_cancel_keeps_progress_for_the_next_run(hub, tmp_path):
    hub.throttle_bps[SHARD1] = 2_000_000
    cancel = threading.Event()

    def on_progress(p):
        if p.file == SHARD1 and p.file_done > 100_000:
            cancel.set()

    with pytest.raises(FetchCancelled):
        fetch(hub, tmp_path / "out", progress=on_progress, cancel=cancel)
    assert not (tmp_path / "out").exists()
    assert download._size(tmp_path / "out.partial" / (SHARD1 + ".incomplete")) > 100_000
    hub.throttle_bps.clear()
    fetch(hub, tmp_path / "out")
    assert_same_files(tmp_path / "out", tiny_files())
    assert hub.resolves(SHARD1)[-1].headers.get("Range", "").startswith("bytes=")


def test_dest_with_other_content_refused(hub, tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists"):
        fetch(hub, dest)
    assert (dest / "notes.txt").read_text() == "mine"


def test_allow_patterns_and_pickle_duplicates(hub, tmp_path):
    hub.repos[REPO].files["pytorch_model.bin"] = b"x" * 2000
    logs = []
    fetch(hub, tmp_path / "a", log=logs.append)
    assert not (tmp_path / "a" / "pytorch_model.bin").exists()
    assert any("pickled" in m for m in logs)
    fetch(hub, tmp_path / "b", allow_patterns=["*.json"])  # fnmatch: * also matches "/"
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.name[0] != ".") == \
        ["config.json", "model.safetensors.index.json", "tokenizer"]
    assert not (tmp_path / "b" / SHARD1).exists()


def test_cli_fetch_prints_progress_and_result(hub, tmp_path, capsys):
    assert cli_fetch(REPO, str(tmp_path / "out"), None, hub.url) == 0
    out, err = capsys.readouterr()
    assert "100.0%" in err and "every file verified" in out
    with pytest.raises(UserError):
        cli_fetch("org/missing", str(tmp_path / "x"), None, hub.url)


# ---------------------------------------------------------------------------------------------
# Hugging Face cache


def make_hf_cache(root: Path, repo_id: str, files: dict[str, bytes], commit: str,
                  lfs_min_size: int = 1024) -> Path:
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for name, data in files.items():
        oid = hashlib.sha256(data).hexdigest() if len(data) >= lfs_min_size else git_blob_sha1(data)
        (repo / "blobs" / oid).write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / oid, link.parent))
    return snap


def test_find_in_hf_cache_honours_env_and_checks_completeness(clean_env, monkeypatch):
    commit = "a" * 40
    snap = make_hf_cache(clean_env / "hf_cache", REPO, tiny_files(), commit)
    assert find_in_hf_cache(REPO) == snap
    assert find_in_hf_cache(REPO, commit) == snap
    assert find_in_hf_cache(REPO, "v2") is None
    assert find_in_hf_cache("org/other") is None

    monkeypatch.delenv("HF_HUB_CACHE")  # then HF_HOME/hub is the cache
    assert find_in_hf_cache(REPO) is None
    shutil.move(clean_env / "hf_cache", clean_env / "hf_home" / "hub")
    snap = clean_env / "hf_home" / "hub" / f"models--org--tiny/snapshots/{commit}"
    assert find_in_hf_cache(REPO) == snap

    (snap / SHARD2).unlink()  # a shard named by the index is missing
    assert find_in_hf_cache(REPO) is None


def test_truncated_snapshot_is_not_complete(clean_env):
    files = tiny_files()
    files[SHARD1] = files[SHARD1][:-10]
    make_hf_cache(clean_env / "hf_cache", REPO, files, "b" * 40)
    assert find_in_hf_cache(REPO) is None


def test_fetch_reuses_files_found_in_hf_cache(hub, clean_env, tmp_path):
    make_hf_cache(clean_env / "hf_cache", REPO, tiny_files(), hub.repos[REPO].sha)
    events = []
    fetch(hub, tmp_path / "out", progress=events.append)
    assert_same_files(tmp_path / "out", tiny_files())
    assert not any("/resolve/" in r.path for r in hub.requests)  # every byte came from the cache
    assert any(e.phase == "reuse" for e in events) or events[-1].phase == "done"
    sha = hashlib.sha256(tiny_files()[SHARD1]).hexdigest()
    blob = clean_env / "hf_cache" / "models--org--tiny" / "blobs" / sha
    assert os.path.samefile(blob, tmp_path / "out" / SHARD1)  # linked, not copied


def test_unreachable_hub_points_at_the_cache(clean_env, tmp_path):
    snap = make_hf_cache(clean_env / "hf_cache", REPO, tiny_files(), "c" * 40)
    with pytest.raises(UserError, match=re.escape(str(snap))):
        fetch_repo(REPO, tmp_path / "out", endpoint="http://127.0.0.1:9")


def test_a_second_fetch_into_the_same_dest_is_refused_while_one_runs(hub, tmp_path):
    dest = tmp_path / "out"
    with download._Lock(tmp_path / "out.partial.lock", dest):
        with pytest.raises(UserError, match="Another download into"):
            fetch(hub, dest)
    fetch(hub, dest)  # the lock is gone with its holder
    assert_same_files(dest, tiny_files())


def test_damaged_finished_download_is_not_taken_as_complete(hub, tmp_path):
    dest = tmp_path / "out"
    fetch(hub, dest)
    (dest / SHARD1).write_bytes(b"short")
    with pytest.raises(UserError, match="damaged"):
        fetch(hub, dest)
