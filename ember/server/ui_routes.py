"""GET /: the chat page (with --ui) or health; GET /ui/...: the page's own files.

The files ship inside the package (ember/server/ui/) and are read once, at start: no build step,
nothing fetched from elsewhere. They answer without the API key (the page asks for it), and
with a Content-Security-Policy that lets the page run only its own scripts and styles and reach
only this server, as a second wall behind the page's rule of never turning model text into HTML.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ember.protocols.errors import RouteNotFound

UI_DIR = Path(__file__).with_name("ui")
UI_PREFIX = "/ui/"
_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
                  ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated by ETag, so a new ember's page is seen at once
}


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: str
    etag: str

    def response(self, request: Request) -> Response:
        headers = {**_HEADERS, "ETag": self.etag}
        if request.headers.get("if-none-match") == self.etag:
            return Response(status_code=304, headers=headers)
        return Response(self.body, media_type=self.content_type, headers=headers)


def load_assets(folder: Path = UI_DIR) -> dict[str, Asset]:
    """Every shippable file under `folder`, by its path below it ("index.html", "js/main.js")."""
    assets = {}
    for path in sorted(folder.rglob("*")):
        content_type = _CONTENT_TYPES.get(path.suffix)
        if path.is_file() and content_type:
            body = path.read_bytes()
            assets[path.relative_to(folder).as_posix()] = Asset(
                body, content_type, f'"{hashlib.sha256(body).hexdigest()[:16]}"')
    return assets


def add_ui_routes(app: FastAPI, enabled: bool, health: Callable[[], Awaitable[Response]]) -> None:
    """`/` is the page when `enabled`, else the same answer as /health."""
    if not enabled:
        app.add_api_route("/", health, methods=["GET"], summary="Health (the chat page with --ui)")
        return
    assets = load_assets()
    if "index.html" not in assets:
        raise RuntimeError(f"the chat page's files are missing from {UI_DIR}")

    @app.get("/", summary="The chat page (ember serve --ui)", response_class=Response)
    async def page(request: Request) -> Response:
        return assets["index.html"].response(request)

    @app.get(UI_PREFIX + "{name:path}", include_in_schema=False)
    async def asset(name: str, request: Request) -> Response:
        if name not in assets:
            raise RouteNotFound(request.method, request.url.path)
        return assets[name].response(request)
