"""Refusals of the HTTP layer, how a dialect shapes them (ErrorShape), and OpenAI's shape.

All of them are `EmberError`s (status, type, code, param, message); a dialect only chooses the
status and the JSON body. `retry_after` (seconds) becomes a Retry-After header where it is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ember.errors import EmberError, InvalidRequest


class ModelNotFound(EmberError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"The model '{model}' does not exist on this server; it serves '{served}'.",
                         param="model", code="model_not_found")


class RouteNotFound(EmberError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, method: str, path: str) -> None:
        super().__init__(f"There is no route {method} {path} on this server.", code="not_found")


class MethodNotAllowed(EmberError):
    status = 405
    type = "invalid_request_error"

    def __init__(self, method: str, path: str) -> None:
        super().__init__(f"{path} does not answer {method}.", code="method_not_allowed")


class Unauthorized(EmberError):
    status = 401
    type = "authentication_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


class Forbidden(EmberError):
    status = 403
    type = "permission_error"

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message, code=code)


class RequestTooLarge(EmberError):
    status = 413
    type = "invalid_request_error"

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"The request body is larger than this server accepts "
                         f"({_format_size(limit_bytes)}, set by --max-request-mb).", code="request_too_large")


class UnsupportedMediaType(EmberError):
    status = 415
    type = "invalid_request_error"

    def __init__(self, content_type: str) -> None:
        super().__init__(f"The request body must be JSON (Content-Type: application/json), "
                         f"not {content_type}.", code="unsupported_media_type")


class ServerOverloaded(EmberError):
    status = 429
    type = "rate_limit_error"

    def __init__(self, num_waiting: int, retry_after: int, tenant: str | None = None) -> None:
        if tenant is None:
            message = (f"The server is busy: {num_waiting} requests are already waiting for a slot "
                       f"(--max-pending). Retry in a few seconds.")
        else:
            message = (f"Your tenant '{tenant}' already has {num_waiting} requests waiting for a slot, its share "
                       f"(--max-pending-per-tenant). Retry in a few seconds.")
        super().__init__(message, code="server_overloaded" if tenant is None else "tenant_overloaded")
        self.retry_after = retry_after


class ImagesBusy(EmberError):
    status = 429
    type = "rate_limit_error"

    def __init__(self, encoding: int, limit: int, retry_after: int = 2) -> None:
        super().__init__(f"The server is busy encoding images: {encoding} are under way and this request would pass "
                         f"the limit of {limit} (--max-images-encoding). Retry in a few seconds.",
                         code="server_overloaded")
        self.retry_after = retry_after


class QueueTimeout(EmberError):
    status = 503
    type = "server_error"

    def __init__(self, waited: float, retry_after: int) -> None:
        super().__init__(f"The request waited {waited:.1f} s for a free slot without getting one "
                         f"(--pending-timeout). Retry later.", code="request_queue_timeout")
        self.retry_after = retry_after


class ModelLoading(EmberError):
    status = 503
    type = "server_error"

    def __init__(self, retry_after: int = 5) -> None:
        super().__init__("The model is still loading; retry in a few seconds.", code="model_loading")
        self.retry_after = retry_after


class ServerUnavailable(EmberError):
    status = 503
    type = "server_error"

    def __init__(self, reason: str) -> None:
        super().__init__(f"The server cannot take requests: {reason}", code="unavailable")


class GenerationFailed(EmberError):
    status = 500
    type = "server_error"

    def __init__(self, reason: str) -> None:
        super().__init__(f"Generation failed: {reason}", code="generation_failed")


def unsupported(param: str, message: str) -> InvalidRequest:
    """A field ember understands but cannot honour: refused, never silently ignored."""
    return InvalidRequest(message, param=param, code="unsupported_parameter")


def openai_error_body(error: EmberError, request_id: str | None = None) -> dict:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """How a dialect answers a refusal: the status each error gets, the JSON body (which may carry
    the request id), and a header that repeats the request id on every response of its routes."""

    body: Callable[[EmberError, str | None], dict[str, Any]]
    status: Callable[[EmberError], int]
    id_header: str | None = None


OPENAI_ERRORS = ErrorShape(body=openai_error_body, status=lambda error: error.status)


def error_headers(error: EmberError) -> dict[str, str]:
    retry_after = getattr(error, "retry_after", None)
    # x-should-retry: the OpenAI and Anthropic SDKs retry on it whatever the status says
    headers = {"Retry-After": str(retry_after), "x-should-retry": "true"} if retry_after is not None else {}
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def _format_size(num_bytes: int) -> str:
    if num_bytes >= 1 << 20:
        return f"{num_bytes / (1 << 20):g} MiB"
    if num_bytes >= 1 << 10:
        return f"{num_bytes / (1 << 10):g} KiB"
    return f"{num_bytes} bytes"
