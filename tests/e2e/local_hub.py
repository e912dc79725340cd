"""A local stand-in for the Hugging Face hub: the few routes huggingface_hub calls to list a repo and
download its files, served from memory on 127.0.0.1 (point the client at it with HF_ENDPOINT).

Routes: GET /api/models/{repo}[/revision/{rev}] (repo info with files), GET /api/models/{repo}/tree/{rev}
(the file listing), HEAD and GET /{repo}/resolve/{rev}/{path} (metadata, then bytes; Range honoured).
Every request is recorded as (method, path, Range header) so tests can see what was fetched."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import urllib.parse

_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/.*)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class LocalHub:
    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        self.repos = repos
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "LocalHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloaded(self, repo: str) -> set[str]:
        """The files whose bytes were fetched (GET on the resolve route)."""
        prefix = f"/{repo}/resolve/"
        return {path[len(prefix):].split("/", 1)[1] for method, path, _ in self.requests
                if method == "GET" and path.startswith(prefix)}

    # ---- routes ------------------------------------------------------------------------------

    def _answer(self, handler: http.server.BaseHTTPRequestHandler, body: bool) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(handler.path).path)
        self.requests.append((handler.command, path, handler.headers.get("Range")))
        for pattern, route in ((_TREE, self._tree), (_INFO, self._info), (_RESOLVE, self._resolve)):
            found = pattern.match(path)
            if found:
                repo = found["repo"]
                if repo not in self.repos:
                    return _send(handler, 404, b'{"error": "Repository not found"}', body,
                                 {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"})
                return route(handler, found, body)
        _send(handler, 404, b"{}", body, {"Content-Type": "application/json"})

    def _info(self, handler, found, body: bool) -> None:
        repo = found["repo"]
        siblings = [{"rfilename": name, "size": len(data), "blobId": _git_oid(data)}
                    for name, data in sorted(self.repos[repo].items())]
        info = {"id": repo, "modelId": repo, "sha": self.commits[repo], "private": False, "siblings": siblings}
        _send(handler, 200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})

    def _tree(self, handler, found, body: bool) -> None:
        entries = [{"type": "file", "oid": _git_oid(data), "size": len(data), "path": name}
                   for name, data in sorted(self.repos[found["repo"]].items())]
        _send(handler, 200, json.dumps(entries).encode(), body, {"Content-Type": "application/json"})

    def _resolve(self, handler, found, body: bool) -> None:
        files = self.repos[found["repo"]]
        data = files.get(found["path"])
        if data is None:
            return _send(handler, 404, b"{}", body, {"X-Error-Code": "EntryNotFound"})
        headers = {"X-Repo-Commit": self.commits[found["repo"]], "ETag": f'"{_git_oid(data)}"',
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        wanted = re.fullmatch(r"bytes=(\d+)-", handler.headers.get("Range") or "")
        if wanted and int(wanted[1]) <= len(data):
            start = int(wanted[1])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return _send(handler, 206, data[start:], body, headers)
        _send(handler, 200, data, body, headers)


def _git_oid(data: bytes) -> str:
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _send(handler, status: int, data: bytes, body: bool, headers: dict[str, str]) -> None:
    handler.send_response(status)
    for key, value in headers.items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if body:
        handler.wfile.write(data)
