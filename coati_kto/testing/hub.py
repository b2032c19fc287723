"""A stand-in Hugging Face Hub on the loopback, for tests that must never reach the network.

It serves what ``huggingface_hub`` 1.x and ``datasets`` 4.x call on the plain HTTP path (no Xet, no LFS: every
preupload answers ``regular``, so file contents travel base64-inline in the commit): repo info, file resolve
(HEAD and GET), tree and paths-info listings, repo creation, preupload, commit and branch creation. Repos are
git-like: a commit is a full snapshot (path -> bytes) under a sha, branches name commits.

Access: with ``token`` set, a private repo answers 401 ``RepoNotFound`` without it (as the Hub does: private and
missing look the same), a gated repo's files answer 401 ``GatedRepo``, and every write needs it.
``requests`` records (method, path) of every call, ``unhandled`` those it did not know (a test asserts it empty).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Repo:
    """One repository: commits (sha -> {path: bytes}) and branches (name -> sha)."""

    private: bool = False
    gated: bool = False
    cdn: bool = False  # files resolve through a 302 to /cdn/... (as the Hub's LFS files do)
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)

    def sha_of(self, revision: str) -> str | None:
        return self.branches.get(revision) or (revision if revision in self.commits else None)


def _sha(files: dict[str, bytes], parent: str | None, message: str) -> str:
    h = hashlib.sha1(f"{parent}\n{message}\n".encode())
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha1(files[path]).digest())
    return h.hexdigest()


class StandInHub:
    """``with StandInHub(token="hf_x") as hub:`` sets ``huggingface_hub`` and ``datasets`` to ``hub.url``."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.repos: dict[tuple[str, str], Repo] = {}  # (kind: model | dataset, repo id) -> repo
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.fail_commits = 0  # answer this many commits with 500 (a failed upload)
        self.fail_branches: set[str] = set()  # and every commit to these branches
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    # ---- test side
    def commit(
        self,
        kind: str,
        repo_id: str,
        files: dict[str, bytes],
        branch: str = "main",
        deleted: frozenset[str] = frozenset(),
        **flags: bool,
    ) -> str:
        """Add a commit on ``branch`` holding the branch's files but ``deleted``, updated by ``files``; returns its
        sha."""
        repo = self.repos.setdefault((kind, repo_id), Repo(**flags))
        parent = repo.branches.get(branch)
        kept = {path: data for path, data in repo.commits.get(parent, {}).items() if path not in deleted}
        tree = {**kept, **files}
        sha = _sha(tree, parent, f"{len(repo.commits)}")
        repo.commits[sha] = tree
        repo.branches[branch] = sha
        return sha

    def files(self, kind: str, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[(kind, repo_id)]
        return repo.commits[repo.sha_of(revision)]

    def __enter__(self) -> StandInHub:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- server side: (status, headers, body) per request
    def authorized(self, headers: Any) -> bool:
        return self.token is None or headers.get("authorization", "") == f"Bearer {self.token}"

    def find(self, kind: str, repo_id: str, headers: Any) -> Repo | None:
        repo = self.repos.get((kind, repo_id))
        return None if repo is None or (repo.private and not self.authorized(headers)) else repo


def hf_download(
    hub: StandInHub,
    repo_id: str,
    cache_dir: Path,
    revision: str | None = None,
    include: list[str] | None = None,
) -> Path:
    """What ``hf download --repo-type dataset REPO [--revision R] [--include P ...]`` writes into the hub cache
    ``cache_dir`` (HF_HOME/hub), from the stand-in: the CLI's own call (snapshot_download), at ``hub.url``.
    Returns the snapshot folder."""
    from huggingface_hub import snapshot_download

    folder = snapshot_download(
        repo_id,
        repo_type="dataset",
        revision=revision,
        allow_patterns=include,
        cache_dir=cache_dir,
        endpoint=hub.url,
        library_name="huggingface-cli",
    )
    return Path(folder)


def _error(status: int, code: str, message: str) -> tuple[int, dict, bytes]:
    return status, {"X-Error-Code": code, "X-Error-Message": message}, json.dumps({"error": message}).encode()


def _not_found(hub: StandInHub, headers: Any) -> tuple[int, dict, bytes]:
    """A missing (or unreadable private) repo: 401 to a request without a valid token, 404 with one (the Hub's)."""
    known = hub.token is not None and hub.authorized(headers)
    return _error(404 if known else 401, "RepoNotFound", "Repository not found")


def _ok(payload: Any) -> tuple[int, dict, bytes]:
    return 200, {"Content-Type": "application/json"}, json.dumps(payload).encode()


def _kind(segment: str) -> str:
    return {"models": "model", "datasets": "dataset"}.get(segment, segment)


def _entries(tree: dict[str, bytes], prefix: str, recursive: bool) -> list[dict]:
    """The tree API's entries under ``prefix``: files, and the directories on the way."""
    prefix = prefix.strip("/")
    out, dirs = [], set()
    for path in sorted(tree):
        if prefix and not path.startswith(prefix + "/"):
            continue
        rest = path[len(prefix) + 1 :] if prefix else path
        parts = rest.split("/")
        for depth in range(1, len(parts)):
            d = "/".join(([prefix] if prefix else []) + parts[:depth])
            if d not in dirs and (recursive or depth == 1):
                dirs.add(d)
                out.append(
                    {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                )
        if recursive or len(parts) == 1:
            data = tree[path]
            out.append(
                {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": path}
            )
    return out


def _info(hub: StandInHub, repo_id: str, repo: Repo, sha: str) -> dict:
    return {
        "id": repo_id,
        "_id": repo_id,
        "sha": sha,
        "private": repo.private,
        "gated": "auto" if repo.gated else False,
        "disabled": False,
        "siblings": [{"rfilename": p} for p in sorted(repo.commits[sha])],
        "lastModified": "2026-01-01T00:00:00.000Z",
        "tags": [],
    }


def _read(
    hub: StandInHub, method: str, parts: list[str], query: dict, headers: Any
) -> tuple[int, dict, bytes]:
    """GET / HEAD: /api/{kinds}/{org}/{name}[/revision/{rev} | /tree/{rev}/{path}], /api/whoami-v2,
    /[datasets/]{org}/{name}/resolve/{rev}/{path}, /cdn/... (a repo's files when ``cdn``)."""
    if parts == ["api", "agent-harnesses"]:  # huggingface_hub's user-agent detection: an empty registry
        return _ok({"standardEnvVars": [], "harnesses": {}})
    if parts[:1] == ["api"] and parts[1:2] == ["whoami-v2"]:
        return (
            _ok({"name": "stand-in", "type": "user"})
            if hub.authorized(headers)
            else _error(401, "", "Invalid token")
        )
    if parts[:1] == ["api"] and len(parts) >= 4:
        kind, repo_id, rest = _kind(parts[1]), "/".join(parts[2:4]), parts[4:]
        repo = hub.find(kind, repo_id, headers)
        if repo is None:
            return _not_found(hub, headers)
        revision = rest[1] if len(rest) >= 2 else "main"
        sha = repo.sha_of(revision)
        if sha is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if not rest or rest[0] == "revision":
            return _ok(_info(hub, repo_id, repo, sha))
        if rest[0] == "tree":
            entries = _entries(repo.commits[sha], "/".join(rest[2:]), query.get("recursive") in ("true", "1"))
            return _ok(entries)
    if "resolve" in parts:
        at = parts.index("resolve")
        kind = "dataset" if parts[0] == "datasets" else "model"
        repo_id = "/".join(parts[1:at] if kind == "dataset" else parts[:at])
        repo = hub.find(kind, repo_id, headers)
        if repo is None:
            return _not_found(hub, headers)
        sha = repo.sha_of(parts[at + 1])
        if sha is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {parts[at + 1]}")
        if repo.gated and not (hub.token is not None and hub.authorized(headers)):
            return _error(401, "GatedRepo", "Access to this repo is restricted: you must be authenticated")
        path = "/".join(parts[at + 2 :])
        data = repo.commits[sha].get(path)
        head = {"X-Repo-Commit": sha}
        if data is None:
            return 404, {**head, "X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"}, b""
        etag = f'"{hashlib.sha1(data).hexdigest()}"'
        if repo.cdn:  # the CDN serves the bytes; the 302 carries the file's metadata
            linked = {"X-Linked-Etag": etag, "X-Linked-Size": str(len(data))}
            return 302, {**head, **linked, "Location": f"/cdn/{kind}/{repo_id}/{sha}/{path}"}, b""
        return 200, {**head, "ETag": etag, "Content-Type": "application/octet-stream"}, data
    if parts[:1] == ["cdn"] and len(parts) >= 6:
        repo = hub.repos.get((parts[1], "/".join(parts[2:4])))
        data = repo.commits.get(parts[4], {}).get("/".join(parts[5:])) if repo else None
        if data is not None:
            return 200, {"ETag": f'"{hashlib.sha1(data).hexdigest()}"'}, data
    return 0, {}, b""


def _write(hub: StandInHub, parts: list[str], body: bytes, headers: Any) -> tuple[int, dict, bytes]:
    """POST: /api/repos/create, /api/validate-yaml, /api/{kinds}/{org}/{name}/(preupload|commit|branch|paths-info)/{rev}."""
    if parts == ["api", "repos", "create"]:
        if not hub.authorized(headers) or hub.token is None:
            return _error(401, "", "Invalid credentials")
        payload = json.loads(body)
        key = (payload.get("type") or "model", f"{payload['organization']}/{payload['name']}")
        if key in hub.repos:  # the Hub's 409 names the repo's url too (create_repo(exist_ok=True) reads it)
            status, headers, _ = _error(409, "", "You already created this model repo")
            return status, headers, json.dumps({"error": "exists", "url": f"{hub.url}/{key[1]}"}).encode()
        hub.repos[key] = Repo(private=payload.get("visibility") == "private")
        hub.commit(*key, {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"})
        return _ok({"url": f"{hub.url}/{key[1]}"})
    if parts == ["api", "validate-yaml"]:  # a README's front matter must be a YAML mapping
        return _validate_yaml(json.loads(body)["content"])
    if parts[:1] != ["api"] or len(parts) < 6:
        return 0, {}, b""
    kind, repo_id, action, revision = _kind(parts[1]), "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
    repo = hub.find(kind, repo_id, headers)
    if repo is None:
        return _not_found(hub, headers)
    if action == "paths-info":
        sha = repo.sha_of(revision)
        wanted = urllib.parse.parse_qs(body.decode()).get("paths", [])
        tree = repo.commits[sha] if sha else {}
        found = [e for e in _entries(tree, "", True) if e["path"] in wanted]
        return _ok(found)
    if not hub.authorized(headers) or hub.token is None:
        return _error(401, "", "Invalid credentials: a write token is needed")
    if action == "preupload":
        files = json.loads(body)["files"]
        return _ok(
            {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
        )
    if action == "branch":
        if revision in repo.branches:
            return _error(409, "", "Reference already exists")
        start = json.loads(body or b"{}").get("startingPoint") or "main"
        repo.branches[revision] = repo.sha_of(start)
        return _ok({})
    if action == "commit":
        return _commit(hub, kind, repo_id, repo, revision, body)
    return 0, {}, b""


def _validate_yaml(content: str) -> tuple[int, dict, bytes]:
    import yaml

    head = content.split("---\n")[1] if content.startswith("---\n") and content.count("---\n") >= 2 else ""
    try:
        meta = yaml.safe_load(head) if head else {}
    except yaml.YAMLError as err:
        return 400, {}, json.dumps({"errors": [{"message": str(err)}]}).encode()
    if not isinstance(meta, dict):
        return 400, {}, json.dumps({"errors": [{"message": "metadata is not a mapping"}]}).encode()
    return _ok({"errors": [], "warnings": []})


def _commit(
    hub: StandInHub, kind: str, repo_id: str, repo: Repo, branch: str, body: bytes
) -> tuple[int, dict, bytes]:
    if hub.fail_commits > 0 or branch in hub.fail_branches:
        hub.fail_commits = max(0, hub.fail_commits - 1)
        return _error(500, "", "Internal Error (stand-in: a failed commit)")
    if branch not in repo.branches:
        return _error(404, "RevisionNotFound", f"Invalid rev id: {branch}")
    files: dict[str, bytes] = {}
    deleted: set[str] = set()
    for line in body.splitlines():
        item = json.loads(line)
        if item["key"] == "file":
            files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
        elif (
            item["key"] == "deletedFile"
        ):  # upload_folder(delete_patterns=...): the files it does not replace
            deleted.add(item["value"]["path"])
        elif item["key"] != "header":  # lfsFile, deletedFolder...: not on the paths this stand-in serves
            return _error(400, "", f"stand-in hub: unsupported commit operation {item['key']}")
    sha = hub.commit(kind, repo_id, files, branch, deleted=frozenset(deleted))
    prefix = "datasets/" if kind == "dataset" else ""
    return _ok(
        {"commitUrl": f"{hub.url}/{prefix}{repo_id}/commit/{sha}", "commitOid": sha, "pullRequestUrl": None}
    )


def _handler(hub: StandInHub) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, method: str) -> None:
            url = urllib.parse.urlsplit(self.path)
            parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
            query = dict(urllib.parse.parse_qsl(url.query))
            hub.requests.append((method, url.path))
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else b""
            if method == "POST":
                status, headers, data = _write(hub, parts, body, self.headers)
            else:
                status, headers, data = _read(hub, method, parts, query, self.headers)
            if status == 0:
                hub.unhandled.append((method, url.path))
                status, headers, data = _error(404, "", f"stand-in hub: no route for {method} {url.path}")
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._answer("GET")

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer("HEAD")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, *args: object) -> None:
            pass

    return Handler
