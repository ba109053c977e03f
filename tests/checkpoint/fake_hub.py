"""A Hugging Face Hub in a thread: the routes huggingface_hub's ``model_info`` and
``hf_hub_download`` call (the repository listing, then HEAD and GET of each file), with the Hub's
error headers, so the download path runs for real against files the test chooses."""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    revisions: dict[str, str] = field(default_factory=lambda: {"main": "a" * 40})
    gated: bool = False
    token: str | None = None  # a gated repository's files are served to this token


class FakeHub:
    def __init__(self, repos: dict[str, FakeRepo]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []  # (method, path)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._handle(self, "GET")

            def do_HEAD(self) -> None:
                hub._handle(self, "HEAD")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def file_gets(self) -> list[str]:
        """The file paths fetched with GET (bodies downloaded)."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests
                if m == "GET" and "/resolve/" in p]

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append((method, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id = "/".join(parts[2:4])
            revision = parts[5] if len(parts) >= 6 and parts[4] == "revision" else "main"
            self._listing(handler, repo_id, revision)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._file(handler, method, "/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        else:
            _error(handler, 404, "EntryNotFound", "no such route")

    def _repo(self, handler: BaseHTTPRequestHandler, repo_id: str, revision: str) -> tuple[FakeRepo, str] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            _error(handler, 401, "RepoNotFound", "Repository not found")
            return None
        sha = repo.revisions.get(revision) or (revision if revision in repo.revisions.values() else None)
        if sha is None:
            _error(handler, 404, "RevisionNotFound", "Invalid rev id")
            return None
        return repo, sha

    def _listing(self, handler: BaseHTTPRequestHandler, repo_id: str, revision: str) -> None:
        found = self._repo(handler, repo_id, revision)
        if found is None:
            return
        repo, sha = found
        body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                           "gated": "auto" if repo.gated else False,
                           "siblings": [{"rfilename": n} for n in sorted(repo.files)]}).encode()
        _send(handler, 200, body, {"Content-Type": "application/json"})

    def _file(self, handler: BaseHTTPRequestHandler, method: str, repo_id: str, revision: str, name: str) -> None:
        found = self._repo(handler, repo_id, revision)
        if found is None:
            return
        repo, sha = found
        if repo.gated and handler.headers.get("Authorization") != f"Bearer {repo.token}":
            _error(handler, 401, "GatedRepo", "Access to this model is restricted")
            return
        if name not in repo.files:
            _error(handler, 404, "EntryNotFound", "Entry not found")
            return
        data = repo.files[name]
        headers = {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Type": "application/octet-stream"}
        _send(handler, 200, data if method == "GET" else b"", headers, len(data))


def _error(handler: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    _send(handler, status, body, {"X-Error-Code": code, "X-Error-Message": message,
                                  "Content-Type": "application/json"})


def _send(handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str],
          length: int | None = None) -> None:
    handler.send_response(status)
    for key, value in headers.items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(body) if length is None else length))
    handler.end_headers()
    if body:
        handler.wfile.write(body)
