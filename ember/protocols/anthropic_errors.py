"""Anthropic's error shape: `{"type": "error", "error": {"type", "message"}, "request_id"}`, with
Anthropic's status codes and error types, and a `request-id` header on every response.

ember's refusals are `EmberError`s with OpenAI-style statuses; this module maps them:
a full admission queue (429) and a model still loading answer 529 `overloaded_error`, since an
Anthropic client reads 429 as its own rate limit; a wait for a slot beyond --pending-timeout
answers 504 `timeout_error`; a prompt beyond the context window reads
"prompt is too long: N tokens > M maximum", the sentence Anthropic clients look for.
"""

from __future__ import annotations

from typing import Any

from ember.errors import ContextLengthExceeded, EmberError
from ember.protocols.errors import ErrorShape, ModelLoading, QueueTimeout, ServerOverloaded

REQUEST_ID_HEADER = "request-id"

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_status(error: EmberError) -> int:
    if isinstance(error, (ServerOverloaded, ModelLoading)):
        return 529
    if isinstance(error, QueueTimeout):
        return 504
    return error.status


def anthropic_error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def anthropic_message(error: EmberError) -> str:
    if isinstance(error, ContextLengthExceeded):
        # The most prompt tokens that leave room for one output token.
        return f"prompt is too long: {error.num_prompt_tokens} tokens > {error.max_model_len - 1} maximum"
    return error.message


def anthropic_error_body(error: EmberError, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": anthropic_error_type(anthropic_status(error)),
                                                       "message": anthropic_message(error)}}
    if request_id:
        body["request_id"] = request_id
    return body


ANTHROPIC_ERRORS = ErrorShape(body=anthropic_error_body, status=anthropic_status, id_header=REQUEST_ID_HEADER)
