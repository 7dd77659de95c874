"""Download a Hugging Face repo: resumable, sha256-verified, installed atomically.

The file list, sizes and LFS sha256 come from the hub API (engine/setup/hf_cache.py, through
huggingface_hub), as do blobs already in the local Hugging Face cache; the bytes are
fetched here with HTTP Range requests so that a download resumes after a dropped connection
and after the process was killed (huggingface_hub restarts from zero across processes).

On disk, while fetching into DEST:

    DEST.partial/                  files land here; DEST appears only when all verified
        .moeferry-fetch.json       repo, revision, expected files, which are verified
        <file>.incomplete          bytes so far; the next run continues with a Range request
        <file>.corrupt             failed its hash; kept aside, fetched again only if asked
    DEST.partial.lock              held while a process is fetching into DEST

The finished DEST keeps `.moeferry-fetch.json` (with "complete": true) as its manifest.
"""

from __future__ import annotations

import fnmatch
import hashlib
import http.client
import json
import os
import re
import shutil
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from moeferry.engine.errors import UserError

# FetchProgress is imported from here by the app
from moeferry.engine.setup.download_progress import FetchProgress, _ProgressBar, _Tracker  # noqa: F401
from moeferry.engine.setup.hf_cache import (
    RemoteFile,
    RepoListing,
    cache_blob,
    cache_repo_dir,
    gated_message,
    list_repo_files,
    path_problem,
    safe_relpath,
)
from moeferry.engine.units import fmt_bytes

STATE_NAME = ".moeferry-fetch.json"
CHUNK = 1 << 20
READ_TIMEOUT_S = 60
MAX_RETRIES = 8
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 60.0
RETRY_AFTER_MAX_S = 300.0  # a server's Retry-After is honoured up to this
STALL_S = 120.0  # a download slower than MIN_RATE_BPS over this long counts as stalled
MIN_RATE_BPS = 1024.0
DISK_MARGIN_BYTES = 64 << 20
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
RETRY_STATUS = {408, 429, 500, 502, 503, 504}
USER_AGENT = "moeferry-fetch/0.1"


class FetchCancelled(Exception):
    """The cancel event was set; what was fetched so far is kept for the next run."""


class _Dropped(Exception):
    """The server closed the connection before sending the whole body."""


class _Stalled(Exception):
    """The server sent less than the minimum rate over a whole stall window."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long a download waits and how often it tries again."""
    max_retries: int = MAX_RETRIES
    backoff_s: float = BACKOFF_BASE_S
    stall_s: float = STALL_S
    min_rate_bps: float = MIN_RATE_BPS


# ---------------------------------------------------------------------------------------------
# Public entry points


def fetch_repo(repo_id: str, dest, revision: str | None = None, endpoint: str | None = None,
               token: str | None = None, progress: Callable[[FetchProgress], None] | None = None,
               cancel: threading.Event | None = None, allow_patterns: list[str] | None = None,
               *, retry_corrupt: bool = False, use_hf_cache: bool = True,
               skip_pickle_duplicates: bool = True, max_retries: int = MAX_RETRIES,
               backoff_s: float = BACKOFF_BASE_S, log: Callable[[str], None] | None = None,
               stall_s: float = STALL_S, min_rate_bps: float = MIN_RATE_BPS) -> Path:
    """Download `repo_id` at `revision` into the folder `dest` and return its path.

    Every LFS file is checked against the hub's sha256, other files against their size and
    git hash. Files are fetched from the commit the listing names, so a resumed file cannot
    mix two revisions. A download slower than `min_rate_bps` for `stall_s` seconds is retried
    like a dropped one; a Retry-After from the server is honoured (up to RETRY_AFTER_MAX_S).
    A file that fails is renamed `<file>.corrupt` inside DEST.partial and, unless
    `retry_corrupt`, is not fetched again. Files already in the Hugging Face cache with the
    same hash are linked (or copied) instead of downloaded; a cache copy that fails its hash
    is downloaded instead (and the log says the cache copy was damaged). Raises UserError with one
    sentence (exit code 2: wrong repo/revision/access/DEST; 1: network, disk, bad bytes) and
    FetchCancelled when `cancel` is set.
    """
    dest = Path(dest).expanduser().absolute()
    revision = revision or "main"
    base = (endpoint or _default_endpoint()).rstrip("/")
    token = token if token is not None else _stored_token()
    log = log or (lambda msg: None)
    cancel = cancel or threading.Event()
    policy = RetryPolicy(max_retries, backoff_s, stall_s, min_rate_bps)

    done_already = _complete_download(dest, repo_id)
    if done_already is not None and done_already.get("revision") == revision:
        log(f"{dest} already holds {repo_id} ({revision}), verified when it was downloaded.")
        return dest
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        if (dest / STATE_NAME).exists():
            raise UserError(f"{dest} holds a download that is damaged or of another repository "
                            f"or revision: delete it (or choose another DEST) and run again.", 2)
        raise UserError(f"{dest} already exists and is not empty: choose another DEST or delete "
                        "it.", 2)

    listing = list_repo_files(repo_id, revision, base, token)
    files = _select(listing.files, allow_patterns, skip_pickle_duplicates, log)
    partial = dest.with_name(dest.name + ".partial")
    with _Lock(dest.with_name(dest.name + ".partial.lock"), dest):
        partial.mkdir(parents=True, exist_ok=True)
        state = _load_state(partial, listing, files)
        _check_disk(partial, files, state, cache_repo_dir(repo_id) if use_hf_cache else None)
        tracker = _Tracker(files, state, progress, log)
        failed = []
        for rf in files:
            if rf.path in state["verified"]:
                continue
            ok = _fetch_one(rf, partial, state, listing, base, token, tracker, cancel,
                            retry_corrupt, use_hf_cache, policy)
            if not ok:
                failed.append(rf.path)
        if failed:
            raise UserError(_corrupt_message(failed, partial), 1)
        state["complete"] = True
        _save_state(partial, state)
        if dest.exists():
            dest.rmdir()
        os.replace(partial, dest)
        tracker.emit("", 0, 0, phase="done", force=True)
    return dest


def cli_fetch(repo_id: str, dest: str, revision: str | None, endpoint: str | None) -> int:
    """`moeferry fetch`: download with a progress bar on stderr; returns the exit code."""
    bar = _ProgressBar(sys.stderr)
    try:
        path = fetch_repo(repo_id, dest, revision=revision, endpoint=endpoint,
                          progress=bar, log=bar.message)
    except KeyboardInterrupt:
        bar.finish()
        print("Download stopped; run the same command again to resume where it left off.",
              file=sys.stderr)
        return 130
    finally:
        bar.finish()  # end the redrawn line before any message
    manifest = _read_json(path / STATE_NAME) or {}
    n = len(manifest.get("files", []))
    total = sum(f["size"] for f in manifest.get("files", []))
    print(f"{repo_id} is in {path}: {n} files, {fmt_bytes(total)}, every file verified.")
    return 0


# ---------------------------------------------------------------------------------------------
# Hub settings and the file selection


def _default_endpoint() -> str:
    from huggingface_hub import constants
    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def _stored_token() -> str | None:
    try:
        from huggingface_hub import get_token
        return get_token()
    except Exception:  # noqa: BLE001 - a broken token file means "not logged in"
        return None


def _select(files: list[RemoteFile], allow_patterns, skip_pickles: bool, log) -> list[RemoteFile]:
    if allow_patterns:
        files = [f for f in files if any(fnmatch.fnmatch(f.path, p) for p in allow_patterns)]
    if skip_pickles and any(f.path.endswith(".safetensors") for f in files):
        skipped = [f for f in files if f.path.endswith(PICKLE_SUFFIXES)]
        if skipped:
            log(f"Skipping {len(skipped)} pickled weight file(s) "
                f"({fmt_bytes(sum(f.size for f in skipped))}) that duplicate the safetensors weights.")
            files = [f for f in files if not f.path.endswith(PICKLE_SUFFIXES)]
    if not files:
        raise UserError("The repository has no files to download (after filtering): check the "
                        "repository name and revision.", 2)
    return files


# ---------------------------------------------------------------------------------------------
# State, locking, disk


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _complete_download(dest: Path, repo_id: str) -> dict | None:
    """The manifest of a finished download of repo_id in dest whose files are all there."""
    state = _read_json(dest / STATE_NAME)
    if not isinstance(state, dict) or not state.get("complete") or state.get("repo_id") != repo_id:
        return None
    files = _state_files(state)
    if not files or len(files) != len(state["files"]):
        return None
    for path, f in files.items():
        p = dest / safe_relpath(path)
        if not p.is_file() or p.stat().st_size != f.get("size"):
            return None
    return state


def _save_state(partial: Path, state: dict) -> None:
    tmp = partial / (STATE_NAME + ".tmp")
    tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
    os.replace(tmp, partial / STATE_NAME)


def _load_state(partial: Path, listing: RepoListing, files: list[RemoteFile]) -> dict:
    """Carry over what an earlier run fetched, dropping anything the hub now lists differently."""
    old = _read_json(partial / STATE_NAME)
    old = old if isinstance(old, dict) else {}  # a damaged state counts as none
    if old.get("repo_id") not in (None, listing.repo_id):
        raise UserError(f"{partial} holds a download of another repository "
                        f"({str(old.get('repo_id'))[:80]}): delete it or choose another DEST.", 2)
    before = _state_files(old)
    now = {f.path: f for f in files}
    for path, f in before.items():
        rf = now.get(path)
        if rf is None or (rf.size, rf.sha256, rf.git_oid) != (f.get("size"), f.get("sha256"), f.get("git_oid")):
            local = partial / safe_relpath(path)
            for p in (local, _sibling(local, ".incomplete"), _sibling(local, ".corrupt")):
                p.unlink(missing_ok=True)
    verified = {}
    old_verified = old.get("verified") if isinstance(old.get("verified"), dict) else {}
    for path, sha in old_verified.items():
        if path in now and path in before and isinstance(sha, str):
            local = partial / safe_relpath(path)
            if local.is_file() and local.stat().st_size == now[path].size:
                verified[path] = sha
    state = {"format": "moeferry-fetch", "version": 1, "repo_id": listing.repo_id,
             "revision": listing.revision, "commit": listing.commit, "complete": False,
             "files": [{"path": f.path, "size": f.size, "sha256": f.sha256, "git_oid": f.git_oid}
                       for f in files],
             "verified": verified}
    _save_state(partial, state)
    return state


def _state_files(state: dict) -> dict[str, dict]:
    """The state's file entries that are well formed and have safe names, by path."""
    files = state.get("files")
    return {f["path"]: f for f in (files if isinstance(files, list) else [])
            if isinstance(f, dict) and isinstance(f.get("path"), str) and not path_problem(f["path"])}


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


class _Lock:
    """An OS file lock, released by the OS if the process dies (so kill -9 leaves none)."""

    def __init__(self, path: Path, dest: Path):
        self.path, self.dest, self.fd = path, dest, None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.name == "nt":
                import msvcrt
                msvcrt.locking(self.fd, msvcrt.LK_NBLCK, 1)
            else:
                import fcntl
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise UserError(f"Another download into {self.dest} is running: wait for it to "
                            "finish or stop it first.", 2) from None
        return self

    def __exit__(self, *exc):
        os.close(self.fd)
        try:
            self.path.unlink()
        except OSError:
            pass


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _check_disk(partial: Path, files: list[RemoteFile], state: dict, cache_repo: Path | None):
    """Refuse before downloading when the bytes still to come do not fit."""
    where = _existing_parent(partial)
    dev = where.stat().st_dev
    needed = 0
    for rf in files:
        if rf.path in state["verified"]:
            continue
        local = partial / safe_relpath(rf.path)
        have = _size(_sibling(local, ".incomplete"))
        blob = cache_blob(cache_repo, rf)
        if blob is not None and blob.stat().st_dev == dev:
            continue  # will be hard-linked, costs no space
        needed += max(rf.size - have, 0)
    free = shutil.disk_usage(where).free
    if needed + DISK_MARGIN_BYTES > free:
        raise UserError(f"Not enough free disk space in {where}: the download needs "
                        f"{fmt_bytes(needed)} more but only {fmt_bytes(free)} is free; free "
                        f"some space or choose another DEST.", 1)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# ---------------------------------------------------------------------------------------------
# One file


def _fetch_one(rf: RemoteFile, partial: Path, state: dict, listing: RepoListing, base: str,
               token: str | None, tracker: "_Tracker", cancel: threading.Event,
               retry_corrupt: bool, use_hf_cache: bool, policy: RetryPolicy) -> bool:
    """Bring one file into `partial` and verify it; False if it failed its hash."""
    local = partial / safe_relpath(rf.path)
    incomplete, corrupt = _sibling(local, ".incomplete"), _sibling(local, ".corrupt")
    if corrupt.exists():
        if not retry_corrupt:
            return False
        corrupt.unlink()
    local.parent.mkdir(parents=True, exist_ok=True)
    blob = cache_blob(cache_repo_dir(listing.repo_id), rf) if use_hf_cache else None
    if blob is not None and incomplete.exists() and os.path.samefile(blob, incomplete):
        incomplete.unlink()  # linked by a run that stopped before checking it: check it again
    sha = None
    if blob is not None and _size(incomplete) == 0:
        _link_or_copy(blob, incomplete)
        tracker.start_file(rf, 0)
        sha = _hash_prefix(incomplete, rf.size, tracker, rf, "reuse", cancel).hexdigest()
        if not _verified(incomplete, rf, sha):
            # Unlink (never truncate: it may be a hard link to the cache's blob) and download.
            incomplete.unlink()
            tracker.advance(rf, -rf.size, transferred=False)
            tracker.log(f"The Hugging Face cache's copy of {rf.path} ({blob}) is damaged (it fails "
                        f"its checksum), so it is downloaded again instead.")
            sha = None
    if sha is None:
        sha = _download(_resolve_url(base, listing, rf), token, incomplete, rf, tracker, cancel,
                        policy, listing.repo_id, base)
    if not _verified(incomplete, rf, sha):
        os.replace(incomplete, corrupt)
        tracker.file_failed(rf)
        return False
    os.replace(incomplete, local)
    state["verified"][rf.path] = sha
    _save_state(partial, state)
    tracker.file_done(rf)
    return True


def _resolve_url(base: str, listing: RepoListing, rf: RemoteFile) -> str:
    """The file at the listing's commit (the branch only when the hub named no commit)."""
    rev = listing.commit if listing.commit and re.fullmatch(r"[0-9a-f]{40}", listing.commit) \
        else listing.revision
    return f"{base}/{listing.repo_id}/resolve/{urllib.parse.quote(rev, safe='')}/{urllib.parse.quote(rf.path)}"


def _verified(path: Path, rf: RemoteFile, sha256: str) -> bool:
    if _size(path) != rf.size:
        return False
    if rf.sha256:
        return sha256 == rf.sha256.lower()
    if rf.git_oid and re.fullmatch(r"[0-9a-f]{40}", rf.git_oid):
        data = path.read_bytes()
        git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        # Some hub mirrors report the plain sha1 of the content for small files.
        return rf.git_oid in (git, hashlib.sha1(data).hexdigest())
    return True


def _hash_prefix(path: Path, limit: int, tracker, rf, phase: str, cancel) -> "hashlib._Hash":
    """sha256 of the bytes already on disk (after a restart, or a reused cache blob)."""
    h = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        while done < limit:
            if cancel.is_set():
                raise FetchCancelled()
            block = f.read(min(CHUNK * 8, limit - done))
            if not block:
                break
            h.update(block)
            done += len(block)
            tracker.advance(rf, len(block), transferred=False, phase=phase)
    return h


@dataclass
class _Transfer:
    """One file's bytes so far: `have` on disk (hashed), `got` in the current attempt, and the
    bytes received since `window_start` (across attempts, so time-outs count as slowness)."""
    have: int
    hasher: "hashlib._Hash"
    got: int = 0
    window_start: float = field(default_factory=time.monotonic)
    window_bytes: int = 0

    def check_rate(self, policy: RetryPolicy) -> None:
        """Raise _Stalled when a whole stall window passed below the minimum rate."""
        now = time.monotonic()
        if now - self.window_start >= policy.stall_s:
            slow = self.window_bytes < policy.min_rate_bps * (now - self.window_start)
            self.window_start, self.window_bytes = now, 0
            if slow:
                raise _Stalled()


def _download(url: str, token: str | None, incomplete: Path, rf: RemoteFile, tracker,
              cancel: threading.Event, policy: RetryPolicy, repo_id: str, base: str) -> str:
    """Fetch url into `incomplete`, resuming from its length; returns the sha256 of the bytes."""
    have = _size(incomplete)
    if have > rf.size:
        incomplete.unlink()
        have = 0
    tracker.start_file(rf, 0)
    t = _Transfer(have, _hash_prefix(incomplete, have, tracker, rf, "verify", cancel) if have
                  else hashlib.sha256())
    failures = 0
    while t.have < rf.size:
        if cancel.is_set():
            raise FetchCancelled()
        t.got = 0
        try:
            with _open(url, token, t.have, policy) as resp:
                start = _range_start(resp, t.have)
                if start not in (t.have, 0):
                    raise _Dropped()  # a range we did not ask for: ask again
                if start != t.have:  # the server ignored Range: start again from zero
                    tracker.advance(rf, -t.have, transferred=False)
                    t.have, t.hasher = 0, hashlib.sha256()
                _receive(resp, incomplete, rf, t, tracker, cancel, policy)
        except urllib.error.HTTPError as e:
            if e.code == 416 and t.have:
                incomplete.unlink(missing_ok=True)
                tracker.advance(rf, -t.have, transferred=False)
                t.have, t.hasher = 0, hashlib.sha256()
                continue
            if e.code not in RETRY_STATUS:
                raise _http_error(e, rf, repo_id, token, base) from None
            failures = _backoff(failures, t.got, policy, cancel, rf, f"HTTP {e.code}", tracker.log,
                                e.code, _retry_after(e))
        except _Stalled:
            why = f"slower than {fmt_bytes(policy.min_rate_bps)}/s for {policy.stall_s:.0f} s"
            failures = _backoff(failures, 0, policy, cancel, rf, why, tracker.log)
        except (_Dropped, OSError, http.client.HTTPException) as e:
            why = "connection dropped" if isinstance(e, _Dropped) else type(e).__name__
            try:
                t.check_rate(policy)
            except _Stalled:
                why, t.got = f"{why}, slower than {fmt_bytes(policy.min_rate_bps)}/s", 0
            failures = _backoff(failures, t.got, policy, cancel, rf, why, tracker.log)
    return t.hasher.hexdigest()


def _receive(resp, incomplete: Path, rf: RemoteFile, t: _Transfer, tracker, cancel, policy) -> None:
    """Append the response body to `incomplete` until the file is whole; _Stalled when too slow."""
    with open(incomplete, "r+b" if t.have else "wb") as out:
        out.seek(t.have)
        out.truncate()
        while t.have < rf.size:
            if cancel.is_set():
                raise FetchCancelled()
            block = _read_block(resp, min(CHUNK, rf.size - t.have))
            if not block:
                raise _Dropped()
            _write(out, block, rf)
            t.hasher.update(block)
            t.have += len(block)
            t.got += len(block)
            tracker.advance(rf, len(block))
            t.window_bytes += len(block)
            t.check_rate(policy)
        out.flush()
        os.fsync(out.fileno())


def _read_block(resp, n: int) -> bytes:
    reader = getattr(resp, "read1", None) or resp.read
    return reader(n)


def _write(out, block: bytes, rf: RemoteFile) -> None:
    try:
        out.write(block)
    except OSError as e:
        raise UserError(f"Could not write {rf.path} ({e.strerror or e}): free some disk space "
                        "and run again to resume.", 1) from None


def _retry_after(e: urllib.error.HTTPError) -> float | None:
    """The server's Retry-After in seconds (a number or an HTTP date), or None."""
    value = (e.headers.get("Retry-After") if e.headers else None) or ""
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        from email.utils import parsedate_to_datetime
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _backoff(failures: int, got: int, policy: RetryPolicy, cancel, rf, why, log,
             status: int | None = None, retry_after: float | None = None) -> int:
    """Wait before the next attempt (raise UserError once attempts run out); the new count."""
    failures = 1 if got else failures + 1  # progress resets the count
    if failures > policy.max_retries:
        if status == 429:
            raise UserError(f"The hub kept refusing {rf.path} with HTTP 429 (too many requests) "
                            f"{policy.max_retries} times in a row: wait a few minutes, then run the "
                            "same command again to resume.", 1)
        raise UserError(f"Downloading {rf.path} failed {policy.max_retries} times in a row ({why}): "
                        "check your network connection and run the same command again to resume.", 1)
    wait = min(policy.backoff_s * 2 ** (failures - 1), BACKOFF_MAX_S)
    if retry_after is not None:
        wait = min(max(retry_after, wait), RETRY_AFTER_MAX_S)
    log(f"{rf.path}: {why}; resuming in {wait:.0f} s (attempt {failures} of {policy.max_retries}).")
    if cancel.wait(wait):
        raise FetchCancelled()
    return failures


def _range_start(resp, asked: int) -> int:
    """Where the body starts: 0 for a 200, else what Content-Range says (assume as asked)."""
    if resp.status != 206:
        return 0
    m = re.match(r"bytes (\d+)-", resp.headers.get("Content-Range", ""))
    return int(m.group(1)) if m else asked


def _http_error(e: urllib.error.HTTPError, rf: RemoteFile, repo_id: str, token,
                base: str) -> UserError:
    code = e.headers.get("X-Error-Code", "") if e.headers else ""
    if code == "GatedRepo" or e.code in (401, 403):
        return UserError(gated_message(repo_id, token, base), 2)
    if e.code == 404:
        return UserError(f"{rf.path} was not found in {repo_id} on the hub although it was "
                         "listed: run again, or check the revision.", 1)
    return UserError(f"The hub answered HTTP {e.code} for {rf.path}: try again later.", 1)


class _AuthRedirect(urllib.request.HTTPRedirectHandler):
    """Keep the token on same-host redirects; never send it to another host (the CDN)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        auth = req.unredirected_hdrs.get("Authorization")
        if new is not None and auth and urllib.parse.urlsplit(newurl).netloc == \
                urllib.parse.urlsplit(req.full_url).netloc:
            new.add_unredirected_header("Authorization", auth)
        return new


_opener = urllib.request.build_opener(_AuthRedirect)


def _open(url: str, token: str | None, start: int, policy: RetryPolicy):
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT,
                                               "Accept-Encoding": "identity"})
    if start:
        req.add_header("Range", f"bytes={start}-")
    if token:
        req.add_unredirected_header("Authorization", f"Bearer {token}")
    return _opener.open(req, timeout=min(READ_TIMEOUT_S, policy.stall_s))


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _corrupt_message(failed: list[str], partial: Path) -> str:
    names = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
    verb = "was" if len(failed) == 1 else "were"
    return (f"{names} did not match the hub's checksum and {verb} kept aside as .corrupt in "
            f"{partial}: delete the .corrupt file(s) and run the same command again to download "
            f"them again.")
