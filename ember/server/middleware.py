"""ASGI middleware, outermost first:

- RequestContext: a request id on every response (x-request-id), HEAD answered with the health
  status, a last-resort 500 in the route's error shape, one log line per request, and the
  observer told once when the request has ended (metrics, request log, /debug/requests).
- (Starlette's CORSMiddleware, for the listed origins only, when --cors-origins is given.)
- Guard: the API key (constant-time; not for health and the chat page's files), then POST bodies: JSON only (415), at most the size limit (413).
"""

from __future__ import annotations

import logging
from typing import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response

from ember.errors import EmberError
from ember.protocols.errors import (
    OPENAI_ERRORS, ErrorShape, GenerationFailed, RequestTooLarge, Unauthorized, UnsupportedMediaType, error_headers,
)
from ember.protocols.unknown_fields import HEADER as IGNORED_FIELDS_HEADER, watch_fields
from ember.server.keys import KeyRing
from ember.server.request_events import log_request
from ember.server.request_record import RequestRecord
from ember.server.ui_routes import UI_PREFIX

logger = logging.getLogger("ember.server")

OPEN_PATHS = ("/", "/health", "/v1/health", "/healthz")  # answer without an API key ("/" is health or the chat page)
OPEN_PREFIXES = (UI_PREFIX,)  # the chat page's own files: the page asks for the key itself


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def error_response(error: EmberError, record: RequestRecord | None) -> Response:
    """The refusal in the shape of the request's route (OpenAI's where there is no record)."""
    if record is None:
        return JSONResponse(OPENAI_ERRORS.body(error, None), status_code=OPENAI_ERRORS.status(error),
                            headers=error_headers(error))
    record.note_error(error)
    shape = record.errors
    return JSONResponse(shape.body(error, record.request_id), status_code=shape.status(error),
                        headers=error_headers(error))


class RequestContextMiddleware:
    """`error_shapes` maps a path prefix to its dialect's ErrorShape (OpenAI's elsewhere), so even
    refusals made before routing (401, 413, 415) answer in the shape the client expects."""

    def __init__(self, app, server, observer=None, error_shapes: dict[str, ErrorShape] | None = None) -> None:
        self.app = app
        self.server = server  # has config (strict_fields) and health() (HEAD answers with its status)
        self.observer = observer  # has request_ended(record)
        self.error_shapes = error_shapes or {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord.from_scope(scope)
        for prefix, shape in self.error_shapes.items():
            if record.path == prefix or record.path.startswith(prefix.rstrip("/") + "/"):
                record.errors = shape
        scope["ember.record"] = record
        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                record.status = message["status"]
                MutableHeaders(scope=message).append("x-request-id", record.request_id)
                if record.errors.id_header:
                    MutableHeaders(scope=message).append(record.errors.id_header, record.request_id)
                record.ignored_fields = list(fields.ignored)
                ignored = fields.header_value()
                if ignored:
                    MutableHeaders(scope=message).append(IGNORED_FIELDS_HEADER, ignored)
            await send(message)

        try:
            with watch_fields(self.server.config.strict_fields) as fields:
                if scope["method"] == "HEAD":
                    status, _ = self.server.health()
                    await Response(status_code=status)(scope, receive, send_with_id)
                else:
                    await self.app(scope, receive, send_with_id)
        except Exception as exc:  # a bug; the client still gets a JSON error with its request id
            logger.exception("request %s failed", record.request_id)
            if not started:
                error = GenerationFailed(f"internal error ({type(exc).__name__})")
                error.code = "internal_error"
                await error_response(error, record)(scope, receive, send_with_id)
        finally:
            log_request(record)
            if self.observer is not None:
                try:
                    self.observer.request_ended(record)
                except Exception:  # the response is out; a fault in the records must not mask it
                    logger.exception("recording request %s failed", record.request_id)


class GuardMiddleware:
    def __init__(self, app, keys: KeyRing, max_body_bytes: int) -> None:
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        record = scope.get("ember.record")
        headers = Headers(scope=scope)
        try:
            if self.keys.required and not is_open_path(scope["path"]):
                tenant = self._check_key(headers)
                if record is not None:
                    record.tenant = tenant
            if scope["method"] == "POST":
                body = await self._read_body(headers, receive)
                receive = _replay(body, receive)
        except EmberError as error:
            await error_response(error, record)(scope, receive, send)
            return
        except ClientGone:
            if record is not None:
                record.client_gone = True
            return
        await self.app(scope, receive, send)

    def _check_key(self, headers: Headers) -> str:
        """The tenant of the key the request offers; Unauthorized if it offers none that is accepted."""
        offered = []
        authorization = headers.get("authorization", "")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            offered.append(token.strip())
        if headers.get("x-api-key"):
            offered.append(headers["x-api-key"].strip())
        if not offered:
            raise Unauthorized("This server needs an API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'.")
        tenant = self.keys.tenant_of(offered)
        if tenant is None:
            raise Unauthorized("The API key is not valid for this server.")
        return tenant

    async def _read_body(self, headers: Headers, receive: Callable) -> bytes:
        content_type = headers.get("content-type")
        if content_type is not None and not _is_json(content_type):
            raise UnsupportedMediaType(content_type.split(";")[0].strip() or "an empty content type")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise RequestTooLarge(self.max_body_bytes)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise RequestTooLarge(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _replay(body: bytes, receive: Callable) -> Callable:
    """A receive that hands the app the body already read, then passes through (disconnects)."""
    delivered = False

    async def replay():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
