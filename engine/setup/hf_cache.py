"""What Hugging Face knows about a repository: the hub's file listing and the local hub cache.

The listing (files, sizes, LFS sha256, git hashes) comes through huggingface_hub's session
and error types, every failure turned into one UserError sentence. The cache is the folder
huggingface_hub downloads into (`models--ORG--NAME/{blobs,snapshots,refs}`); engine/setup/download.py
reuses its blobs instead of downloading them again, and a complete snapshot there can be
converted directly.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from moeferry.engine.errors import UserError


@dataclass
class RemoteFile:
    path: str
    size: int
    sha256: str | None = None  # LFS files: the content's sha256
    git_oid: str | None = None  # git blob sha1 (for non-LFS files, of the content)


@dataclass
class RepoListing:
    repo_id: str
    revision: str
    commit: str | None
    files: list[RemoteFile]


def list_repo_files(repo_id: str, revision: str, endpoint: str, token: str | None) -> RepoListing:
    """Ask the hub for the repo's commit and its files with sizes and hashes.

    The requests are the ones huggingface_hub's model_info / list_repo_tree make, through its
    session and error mapping; the JSON is read here so that a hub answer without optional
    fields (pointerSize, id, ...) is still understood.
    """
    from huggingface_hub import errors as hf_errors
    from huggingface_hub.utils import validate_repo_id

    rev = urllib.parse.quote(revision, safe="")
    try:
        validate_repo_id(repo_id)
        info = _get_json(f"{endpoint}/api/models/{repo_id}/revision/{rev}", token)
        commit = info.get("sha") if isinstance(info, dict) else None
        try:
            files = []
            url, params = f"{endpoint}/api/models/{repo_id}/tree/{rev}", {"recursive": "true",
                                                                          "expand": "false"}
            while url:
                page, url = _get_json(url, token, params, with_next=True)
                params = None  # the next link carries them
                files += [_from_tree(e) for e in page if e.get("type", "file") == "file"]
        except hf_errors.HfHubHTTPError as e:
            if _status(e) != 404 or isinstance(e, hf_errors.RepositoryNotFoundError):
                raise
            info = _get_json(f"{endpoint}/api/models/{repo_id}/revision/{rev}", token,
                             {"blobs": "true"})
            files = [_from_sibling(s, repo_id) for s in info.get("siblings") or []]
    except Exception as e:  # noqa: BLE001 - every failure becomes one sentence below
        raise _api_error(e, repo_id, revision, endpoint, token) from None
    for rf in files:
        safe_relpath(rf.path)
    return RepoListing(repo_id, revision, commit, files)


WINDOWS_DEVICES = {"con", "prn", "aux", "nul", "conin$", "conout$",
                   *(f"{d}{i}" for d in ("com", "lpt") for i in (*"0123456789", "¹", "²", "³"))}
WINDOWS_FORBIDDEN = set('<>:"|?*\\') | {chr(c) for c in range(32)}


def path_problem(path: str) -> str | None:
    """Why `path` (a '/'-separated relative name) could leave its folder on some platform, or None.

    The rules are Windows' as well as POSIX's, on every platform, so that a folder made on Linux
    is safe when copied to Windows: no absolute or drive-qualified names (`/x`, `C:x`), no
    `..`, `.` or empty parts, no backslashes, no `name:stream`, no reserved device names
    (`nul`, `aux.txt`, `COM1`), no part ending in a dot or a space, no control characters.
    """
    if not isinstance(path, str) or not path:
        return "is empty or not text"
    if path.startswith("/"):
        return "is an absolute path"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return "leaves its folder (an empty, '.' or '..' part)"
        bad = sorted(set(part) & WINDOWS_FORBIDDEN)
        if bad:
            return f"holds the character {bad[0]!r}, which names a drive, a stream or nothing on Windows"
        if part[-1] in ". ":
            return "has a part ending in a dot or a space, which Windows drops"
        if part.split(".")[0].rstrip(" ").lower() in WINDOWS_DEVICES:
            return "is a reserved device name on Windows"
    return None


def safe_relpath(path: str) -> Path:
    """A hub-listed file name as a relative path that cannot leave the download folder."""
    problem = path_problem(path)
    if problem:
        raise UserError(f"The hub listed an unsafe file name {path!r} (it {problem}): check --endpoint.", 1)
    return Path(*path.split("/"))


# ---------------------------------------------------------------------------------------------
# Hub requests and their errors


def _get_json(url: str, token: str | None, params: dict | None = None, with_next: bool = False):
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    headers = build_hf_headers(token=token or False, library_name="moeferry")
    r = get_session().get(url, headers=headers, params=params, timeout=30)
    hf_raise_for_status(r)
    data = r.json()
    if with_next:
        return data, r.links.get("next", {}).get("url")
    return data


def _sha256(lfs: dict | None) -> str | None:
    if not lfs:
        return None
    oid = lfs.get("oid") or lfs.get("sha256")
    return oid.split(":", 1)[-1].lower() if oid else None


def _from_tree(e: dict) -> RemoteFile:
    lfs = e.get("lfs")
    size = e.get("size") if e.get("size") is not None else (lfs or {}).get("size")
    return RemoteFile(e["path"], int(size), _sha256(lfs), e.get("oid"))


def _from_sibling(s: dict, repo_id: str) -> RemoteFile:
    lfs = s.get("lfs")
    size = s.get("size") if s.get("size") is not None else (lfs or {}).get("size")
    if size is None:
        raise UserError(f"The hub did not report file sizes for {repo_id}: check --endpoint "
                        "points at a Hugging Face hub.", 1)
    return RemoteFile(s["rfilename"], int(size), _sha256(lfs), s.get("blobId"))


def _status(e: Exception) -> int | None:
    resp = getattr(e, "response", None)
    return getattr(resp, "status_code", None)


def _transport_errors() -> tuple[type, ...]:
    errors: list[type] = [OSError]
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def gated_message(repo_id: str, token: str | None, endpoint: str) -> str:
    page = f"{endpoint.rstrip('/')}/{repo_id}"
    if token:
        return (f"{repo_id} is gated and your token has no access to it: accept its licence on "
                f"{page} with the account the token belongs to, then run again.")
    return (f"{repo_id} is gated: accept its licence on {page}, then log in with "
            f"`hf auth login` (or set HF_TOKEN) and run again.")


def _api_error(e: Exception, repo_id: str, revision: str, endpoint: str,
               token: str | None) -> Exception:
    from huggingface_hub import errors as hf_errors

    if isinstance(e, UserError):
        return e
    status = _status(e)
    if isinstance(e, hf_errors.GatedRepoError) or status == 403:
        return UserError(gated_message(repo_id, token, endpoint), 2)
    if isinstance(e, hf_errors.RevisionNotFoundError):
        return UserError(f"Revision {revision} was not found in {repo_id}: check --revision.", 2)
    if isinstance(e, hf_errors.RepositoryNotFoundError) and status == 401:
        return UserError(
            f"The hub refused access to {repo_id} (HTTP 401): if it is gated, accept its licence "
            f"on {endpoint.rstrip('/')}/{repo_id} and log in with `hf auth login` (or set "
            f"HF_TOKEN); otherwise check the repository name.", 2)
    if isinstance(e, hf_errors.RepositoryNotFoundError) or status == 404:
        return UserError(f"Repository {repo_id} was not found on {endpoint}: check its name "
                         f"(ORG/NAME) and --endpoint.", 2)
    if isinstance(e, hf_errors.HFValidationError):
        return UserError(f"{repo_id!r} is not a valid repository id: use the form ORG/NAME.", 2)
    if isinstance(e, hf_errors.OfflineModeIsEnabled):
        return UserError("HF_HUB_OFFLINE is set, so nothing can be downloaded: unset it and run "
                         "again.", 1)
    if isinstance(e, hf_errors.HfHubHTTPError):
        return UserError(f"The hub at {endpoint} answered HTTP {status} for {repo_id}: try again "
                         "later or check --endpoint.", 1)
    if isinstance(e, (KeyError, TypeError, ValueError, AttributeError)):
        return UserError(f"The hub at {endpoint} answered in a form this version does not "
                         f"understand ({type(e).__name__}: {e}): check --endpoint.", 1)
    if isinstance(e, _transport_errors()):
        cached = find_in_hf_cache(repo_id, None if revision == "main" else revision)
        hint = (f"; a complete copy is already in your Hugging Face cache at {cached}, which can be "
                "used directly" if cached else "")
        return UserError(f"Cannot reach the hub at {endpoint} ({type(e).__name__}): check your "
                         f"network connection or --endpoint{hint}.", 1)
    return e


# ---------------------------------------------------------------------------------------------
# The local cache


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (not at import)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


def find_in_hf_cache(repo_id: str, revision: str | None = None) -> Path | None:
    """An already-complete snapshot of `repo_id` in the user's HF cache, or None.

    Complete means: config.json is there, and every weight file (those named by the
    safetensors index, else every *.safetensors) exists and is as long as its header says.
    Without a revision, refs/main is tried first, then the newest complete snapshot.
    """
    root = cache_repo_dir(repo_id)
    snapshots = root / "snapshots"
    if not snapshots.is_dir():
        return None
    candidates = []
    rev = revision or "main"
    if re.fullmatch(r"[0-9a-f]{40}", rev):
        candidates.append(snapshots / rev)
    elif (root / "refs" / rev).is_file():
        candidates.append(snapshots / (root / "refs" / rev).read_text().strip())
    if revision is None:
        others = sorted((p for p in snapshots.iterdir() if p.is_dir() and p not in candidates),
                        key=lambda p: p.stat().st_mtime, reverse=True)
        candidates += others
    for snap in candidates:
        if snap.is_dir() and _snapshot_complete(snap):
            return snap
    return None


def cache_repo_dir(repo_id: str) -> Path:
    """Where the cache keeps repo_id (it may not exist)."""
    return hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def cache_blob(cache_repo: Path | None, rf: RemoteFile) -> Path | None:
    """The cache stores LFS files as blobs/<sha256> and others as blobs/<git sha1>."""
    if cache_repo is None:
        return None
    oid = rf.sha256 or rf.git_oid
    if not oid or not re.fullmatch(r"[0-9a-fA-F]{40,64}", oid):
        return None
    blob = cache_repo / "blobs" / oid
    return blob if blob.is_file() and blob.stat().st_size == rf.size else None


def _safetensors_whole(path: Path) -> bool:
    """True when the file is as long as its (valid) header says (catches truncated copies)."""
    from moeferry.engine.storage.safetensors_io import FormatError, read_header

    try:
        header, start = read_header(path)
    except (OSError, FormatError):
        return False
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    return path.stat().st_size == start + end


def _snapshot_complete(snap: Path) -> bool:
    if not (snap / "config.json").is_file():
        return False
    index = snap / "model.safetensors.index.json"
    if index.exists():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if not isinstance(data, dict) or "weight_map" not in data:
            return False
        names = sorted(set(data["weight_map"].values()))
    else:
        names = sorted(p.name for p in snap.glob("*.safetensors"))
    return bool(names) and all(_safetensors_whole(snap / n) for n in names)
