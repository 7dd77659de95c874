"""A local stand-in for the Hugging Face hub, for download tests (127.0.0.1, ephemeral port).

It speaks the parts of the hub API that engine/setup/download.py uses, with the real paths and
JSON field names:

    GET /api/models/{repo}[/revision/{rev}]           model info: sha, siblings (with sizes
                                                      and lfs {sha256, size} when blobs=true)
    GET /api/models/{repo}/tree/{rev}[/{path}]        ?recursive=...: entries with oid, size,
                                                      lfs {oid (sha256), size, pointerSize}
    GET|HEAD /{repo}/resolve/{rev}/{file}             bytes, with Range; LFS files optionally
                                                      via a 302 to /cdn/{sha256} like the hub

Errors carry the hub's X-Error-Code header (RepoNotFound, RevisionNotFound, EntryNotFound,
GatedRepo). Knobs for tests: gated repos (401 without the right token, 403 with another),
dropping the connection after N bytes of a file, serving corrupted bytes, throttling,
answering HTTP 429 (with a Retry-After) for the first N requests of a file.
Every request is recorded with its headers in `HubServer.requests`.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    lfs_min_size: int = 1024  # files this big or bigger are "LFS" files
    gated: bool = False
    gated_api: bool = False  # also refuse the API (most gated repos only refuse resolve)
    token: str = "hf_good"
    revisions: tuple[str, ...] = ("main",)

    def is_lfs(self, path: str) -> bool:
        return len(self.files[path]) >= self.lfs_min_size


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    at: float = field(default_factory=time.monotonic)  # when it arrived


@dataclass
class HubServer:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    drop_after: dict[str, int] = field(default_factory=dict)  # file -> bytes, then close
    drop_times: dict[str, int] = field(default_factory=dict)  # how many times (default 1)
    corrupt: set[str] = field(default_factory=set)
    throttle_bps: dict[str, int] = field(default_factory=dict)
    redirect_lfs: bool = False
    tree_supported: bool = True  # False: /tree answers a bare 404, like a minimal mirror
    ignore_range: bool = False  # True: always 200 with the whole file, like some proxies
    rate_limited: dict[str, int] = field(default_factory=dict)  # file -> how many 429s first
    retry_after: str = ""  # the Retry-After header sent with a 429 ("" = none)
    requests: list[Request] = field(default_factory=list)
    url: str = ""
    _server: ThreadingHTTPServer | None = None

    def start(self) -> "HubServer":
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()

    def resolves(self, file: str) -> list[Request]:
        """Requests that fetched bytes of `file` (resolve or CDN)."""
        repo_sha = {hashlib.sha256(d).hexdigest(): p for r in self.repos.values()
                    for p, d in r.files.items()}
        out = []
        for r in self.requests:
            path = urllib.parse.unquote(r.path.split("?")[0])
            if "/resolve/" in path and path.endswith("/" + file):
                out.append(r)
            elif path.startswith("/cdn/") and repo_sha.get(path[5:]) == file:
                out.append(r)
        return out


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _entry(repo: FakeRepo, path: str) -> dict:
    data = repo.files[path]
    if repo.is_lfs(path):
        sha = hashlib.sha256(data).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n"
        return {"type": "file", "oid": git_blob_sha1(pointer.encode()), "size": len(data),
                "path": path, "lfs": {"oid": sha, "size": len(data), "pointerSize": len(pointer)}}
    return {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}


class _Handler(BaseHTTPRequestHandler):
    server_hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_HEAD(self):
        self._route(head=True)

    def do_GET(self):
        self._route(head=False)

    # -- routing -------------------------------------------------------------------------------

    def _route(self, head: bool):
        hub = self.server_hub
        hub.requests.append(Request(self.command, self.path, dict(self.headers.items())))
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        query = urllib.parse.parse_qs(url.query)
        if path.startswith("/cdn/"):
            return self._cdn(path[5:], head)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            return self._info(m.group(1), m.group(2) or "main", query)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
        if m and not hub.tree_supported:
            return self._error(404, "", "Not Found")
        if m:
            return self._tree(m.group(1), m.group(2), m.group(3) or "", query)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(m.group(1), m.group(2), m.group(3), head)
        self._error(404, "EntryNotFound", "Not found")

    def _repo(self, repo_id: str, rev: str, api: bool) -> FakeRepo | None:
        repo = self.server_hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if rev not in repo.revisions and rev != repo.sha:
            self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            return None
        if repo.gated and (repo.gated_api or not api):
            auth = self.headers.get("Authorization", "")
            if auth != f"Bearer {repo.token}":
                status = 403 if auth else 401
                self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted.")
                return None
        return repo

    def _info(self, repo_id: str, rev: str, query: dict):
        repo = self._repo(repo_id, rev, api=True)
        if repo is None:
            return
        blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
        siblings = []
        for p in sorted(repo.files):
            s = {"rfilename": p}
            if blobs:
                e = _entry(repo, p)
                s.update(size=e["size"], blobId=e["oid"])
                if "lfs" in e:
                    s["lfs"] = {"sha256": e["lfs"]["oid"], "size": e["size"],
                                "pointerSize": e["lfs"]["pointerSize"]}
            siblings.append(s)
        self._json({"_id": "fake", "id": repo_id, "modelId": repo_id, "sha": repo.sha,
                    "private": False, "disabled": False, "gated": "manual" if repo.gated else False,
                    "downloads": 0, "likes": 0, "tags": [], "siblings": siblings,
                    "lastModified": "2024-01-01T00:00:00.000Z"})

    def _tree(self, repo_id: str, rev: str, sub: str, query: dict):
        repo = self._repo(repo_id, rev, api=True)
        if repo is None:
            return
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = sub.strip("/") + "/" if sub.strip("/") else ""
        entries, dirs = [], set()
        for p in sorted(repo.files):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/")[0])
                continue
            parts = rest.split("/")[:-1]
            for i in range(len(parts)):
                dirs.add(prefix + "/".join(parts[: i + 1]))
            entries.append(_entry(repo, p))
        folders = [{"type": "directory", "oid": "f" * 40, "size": 0, "path": d} for d in sorted(dirs)]
        self._json(folders + entries)

    def _resolve(self, repo_id: str, rev: str, file: str, head: bool):
        repo = self._repo(repo_id, rev, api=False)
        if repo is None:
            return
        if file not in repo.files:
            return self._error(404, "EntryNotFound", f"{file} does not exist")
        if self.server_hub.rate_limited.get(file, 0) > 0:
            self.server_hub.rate_limited[file] -= 1
            return self._error(429, "", "Too many requests")
        if self.server_hub.redirect_lfs and repo.is_lfs(file):
            self.send_response(302)
            self.send_header("Location", "/cdn/" + hashlib.sha256(repo.files[file]).hexdigest())
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._send_file(file, repo.files[file], head)

    def _cdn(self, sha: str, head: bool):
        for repo in self.server_hub.repos.values():
            for p, d in repo.files.items():
                if hashlib.sha256(d).hexdigest() == sha:
                    return self._send_file(p, d, head)
        self._error(404, "EntryNotFound", "no such blob")

    # -- bytes ---------------------------------------------------------------------------------

    def _send_file(self, name: str, data: bytes, head: bool):
        hub = self.server_hub
        if name in hub.corrupt:
            data = bytes(b ^ 0x5A for b in data[:64]) + data[64:]
        size = len(data)
        start, end = 0, size - 1
        rng = None if hub.ignore_range else self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m or int(m.group(1)) >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.end_headers()
        if head:
            return
        body = data[start: end + 1]
        drop = hub.drop_after.get(name)
        if drop is not None and hub.drop_times.get(name, 1) > 0:
            hub.drop_times[name] = hub.drop_times.get(name, 1) - 1
            cut = max(drop - start, 0)
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        bps = hub.throttle_bps.get(name)
        step = 16384 if bps else len(body) or 1
        for i in range(0, len(body), step):
            try:
                self.wfile.write(body[i: i + step])
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return
            if bps:
                time.sleep(step / bps)

    def _json(self, obj) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)

    def _error(self, status: int, code: str, message: str) -> None:
        raw = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if status == 429 and self.server_hub.retry_after:
            self.send_header("Retry-After", self.server_hub.retry_after)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)
