"""A local HTTP server speaking the part of the Hugging Face Hub API that huggingface_hub's
snapshot_download uses (repo info by revision, the recursive file tree, HEAD/GET of a file by
commit), serving repos from local folders. Tests point HF_ENDPOINT at it in a child process
(huggingface_hub reads the endpoint at import) and watch which files are requested."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    """repos: repo id -> {revision name or commit -> (commit, folder)}."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, tuple[str, Path]]] = {}
        self.downloads: list[str] = []  # "repo/file" of every GET of a file
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo: str, commit: str, folder: Path, refs: list[str]) -> None:
        revs = self.repos.setdefault(repo, {})
        for name in [commit, *refs]:
            revs[name] = (commit, folder)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _error(self, code: int, error_code: str) -> None:
                self.send_response(code)
                self.send_header("X-Error-Code", error_code)
                self.send_header("X-Error-Message", error_code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _json(self, value, body: bool) -> None:
                data = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _lookup(self, repo: str, rev: str):
                if repo not in hub.repos:
                    self._error(404, "RepoNotFound")
                    return None
                found = hub.repos[repo].get(unquote(rev))
                if found is None:
                    self._error(404, "RevisionNotFound")
                return found

            def _serve(self, body: bool) -> None:
                path = urlparse(self.path).path
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path)
                if m:
                    found = self._lookup(m[1], m[2])
                    if found:
                        commit, folder = found
                        self._json({"id": m[1], "sha": commit, "siblings": [
                            {"rfilename": f} for f in _files(folder)]}, body)
                    return
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
                if m:
                    found = self._lookup(m[1], m[2])
                    if found:
                        folder = found[1]
                        self._json([{"type": "file", "path": f,
                                     "size": (folder / f).stat().st_size,
                                     "oid": hashlib.sha1((folder / f).read_bytes()).hexdigest()}
                                    for f in _files(folder)], body)
                    return
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if m:
                    found = self._lookup(m[1], m[2])
                    if not found:
                        return
                    commit, folder = found
                    file = folder / unquote(m[3])
                    if not file.is_file():
                        self._error(404, "EntryNotFound")
                        return
                    data = file.read_bytes()
                    self.send_response(200)
                    self.send_header("X-Repo-Commit", commit)
                    self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if body:
                        hub.downloads.append(f"{m[1]}/{m[3]}")
                        self.wfile.write(data)
                    return
                self._error(404, "EntryNotFound")

        return Handler


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
