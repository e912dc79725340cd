"""The Anthropic Messages routes: create (through the one generation pipeline) and count_tokens.

Refusals on every /v1/messages path, those made before routing included (401, 413, 415), answer in
Anthropic's error shape with a `request-id` header: `ANTHROPIC_PATHS` is registered with the
request-context middleware for that.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ember.protocols.anthropic_errors import ANTHROPIC_ERRORS
from ember.protocols.anthropic_messages import MESSAGES, parse_count_tokens
from ember.server.pipeline import serve_generation, tokenize_only

ANTHROPIC_PATHS = {"/v1/messages": ANTHROPIC_ERRORS}

_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}}


def _docs(request_schema: str, responses: dict[int, str]) -> dict[str, Any]:
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request_schema}"}}}}},
        "responses": {status: {"description": text, **({} if status == 200 else _ERROR)}
                      for status, text in responses.items()},
    }


_REFUSALS = {
    400: "A malformed request (invalid_request_error), or a prompt beyond the context window "
         "(\"prompt is too long: N tokens > M maximum\").",
    401: "A missing or wrong API key (authentication_error).",
    413: "The body is larger than --max-request-mb (request_too_large).",
    529: "The model is still loading, or the queue is full (overloaded_error); see Retry-After.",
}


_TEXT_BLOCKS = {"oneOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}
_PROMPT_FIELDS: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1, "description": "Any label; echoed back. Omitted: the served id."},
    "system": {**_TEXT_BLOCKS, "description": "A first array block starting with 'x-anthropic-billing-header:' "
               "is dropped."},
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": ["user", "assistant", "system"]},
                       "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                           "type": "object", "properties": {"type": {
                               "enum": ["text", "image", "tool_use", "tool_result", "thinking"]}}}}]}}},
                 "description": "Turns in order; consecutive turns of one role are joined; a final assistant "
                                "turn of text is continued (prefill)."},
    "tools": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"}, "input_schema": {"type": "object"},
        "strict": {"type": "boolean", "description": "true holds the tool's calls to input_schema."}}}},
    "tool_choice": {"type": "object", "properties": {"type": {"enum": ["auto", "any", "tool", "none"]},
                                                     "name": {"type": "string"},
                                                     "disable_parallel_tool_use": {"type": "boolean"}}},
    "thinking": {"type": "object", "properties": {"type": {"enum": ["enabled", "adaptive", "disabled"]},
                                                  "budget_tokens": {"type": "integer", "minimum": 1024}}},
    "output_config": {"type": "object", "properties": {
        "effort": {"enum": ["low", "medium", "high", "xhigh", "max"]},
        "format": {"type": ["object", "null"], "required": ["type", "schema"], "description": "The answer is held "
                   "to this JSON schema. output_format, the field's earlier name, is also taken.",
                   "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}}}}},
    "context_management": {"type": "object", "description": "clear_thinking edits are applied."},
}
ANTHROPIC_SCHEMAS = {
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "request_id": {"type": "string"},
        "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}}},
    "MessagesRequest": {"type": "object", "required": ["messages"], "properties": {
        **_PROMPT_FIELDS,
        "max_tokens": {"type": "integer", "minimum": 1, "description": "Capped to the room the window leaves."},
        "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number"},
        "top_k": {"type": "integer", "minimum": 0},
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 64},
        "stream": {"type": "boolean"}, "metadata": {"type": "object"}, "service_tier": {"type": "string"}}},
    "CountTokensRequest": {"type": "object", "required": ["messages"], "properties": _PROMPT_FIELDS},
}


def add_anthropic_routes(app: FastAPI) -> None:
    @app.post("/v1/messages", summary="Create a message (Anthropic Messages)",
              **_docs("MessagesRequest", {200: "The message, or with stream: true its server-sent events.",
                                          **_REFUSALS, 500: "Generation failed (api_error).",
                                          504: "No slot freed within --pending-timeout (timeout_error)."}))
    async def create_message(request: Request) -> Response:
        return await serve_generation(request, MESSAGES)

    @app.post("/v1/messages/count_tokens", summary="The prompt tokens a Messages request would have",
              **_docs("CountTokensRequest", {200: "{\"input_tokens\": N}", **_REFUSALS}))
    async def count_tokens(request: Request) -> dict:
        return await tokenize_only(request, parse_count_tokens, lambda _, ids, __: {"input_tokens": len(ids)})
