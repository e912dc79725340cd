"""The OpenAPI document at /openapi.json: the routes FastAPI knows, plus request and error schemas.

Requests are validated by ember's own code (protocols/), so these schemas document the fields;
they are not what enforces them.
"""

from __future__ import annotations

from typing import Any

from fastapi.openapi.utils import get_openapi

import ember
from ember.server.native_schemas import NATIVE_SCHEMAS

DESCRIPTION = (
    "ember serves one model or several in the OpenAI Chat Completions, Completions and Responses dialects and "
    "as Anthropic Messages. With --api-key, "
    "every route except /health needs 'Authorization: Bearer KEY' or 'x-api-key: KEY'. POST bodies are "
    "JSON (415 otherwise) and at most --max-request-mb (413). An unknown top-level field is ignored and "
    "named in the x-ember-ignored-fields header (with --strict-fields: 400 unknown_parameter); a field ember "
    "cannot honour is refused with a 400 naming it in error.param. Every response carries x-request-id. "
    "The Anthropic Messages routes (/v1/messages, /v1/messages/count_tokens) answer errors in Anthropic's "
    "shape, with a request-id header and 529 overloaded_error when the queue is full or the model loads."
)

_NUMBER = {"type": "number"}
_INTEGER = {"type": "integer"}
_BOOLEAN = {"type": "boolean"}
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 16}],
         "description": "Text that ends the output (not included in it)."}

SAMPLING_FIELDS: dict[str, Any] = {
    "model": {"type": "string", "description": "The model's id or an alias; omit it for the server's first model."},
    "max_tokens": {**_INTEGER, "minimum": 1, "description": "Most tokens to generate; capped to the room the "
                   "context window leaves. Omitted: to the end of the window (or --default-max-tokens)."},
    "max_completion_tokens": {**_INTEGER, "minimum": 1, "description": "Same as max_tokens; wins when both are set."},
    "temperature": {**_NUMBER, "minimum": 0, "description": "0 is greedy."},
    "top_p": {**_NUMBER, "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {**_INTEGER, "minimum": -1, "description": "0 or -1: off."},
    "min_p": {**_NUMBER, "minimum": 0, "maximum": 1},
    "presence_penalty": {**_NUMBER, "minimum": -2, "maximum": 2},
    "frequency_penalty": {**_NUMBER, "minimum": -2, "maximum": 2},
    "repetition_penalty": {**_NUMBER, "exclusiveMinimum": 0, "description": "1 is off."},
    "logit_bias": {"type": "object", "additionalProperties": {**_NUMBER, "minimum": -100, "maximum": 100},
                   "description": "Token id (as a string) -> bias added to its logit."},
    "seed": {**_INTEGER, "description": "Makes sampling reproducible."},
    "stop": _STOP,
    "stop_token_ids": {"type": "array", "items": _INTEGER},
    "ignore_eos": {**_BOOLEAN, "description": "Keep generating past the end-of-sequence token."},
    "min_tokens": {**_INTEGER, "minimum": 0, "description": "End tokens are held back until this many tokens."},
    "n": {**_INTEGER, "minimum": 1, "maximum": 8, "description": "Choices, sharing the prompt's KV cache."},
    "stream": _BOOLEAN,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOLEAN}},
    "return_token_ids": {**_BOOLEAN, "description": "Add the prompt's and each choice's token ids."},
    "return_progress": {**_BOOLEAN, "description": "Streams: prompt_progress chunks {total, cache, processed, "
                        "time_ms} while the prompt is computed, the last (processed == total) before the first text."},
    "timings_per_token": {**_BOOLEAN, "description": "Streams: the running timings object on every text chunk."},
    "user": {"type": "string", "description": "Accepted; not used."},
    "metadata": {"type": "object", "description": "Accepted; not used."},
    "priority": {"oneOf": [{"enum": ["foreground", "background"]}, {**_INTEGER, "minimum": 0}],
                 "description": "background yields its slot, KV blocks and step budget to foreground requests, "
                 "within a bound of waiting steps; an integer is the engine's rank (0 foreground)."},
}

# OpenAI prompt caching, shared by chat and Responses (breakpoints sit on content parts).
CACHE_FIELDS = {
    "prompt_cache_options": {"type": "object", "description": "mode (implicit: the latest 3 breakpoints are "
                             "pinned, explicit: the latest 4) and ttl (30m by default, 1m to 24h).",
                             "properties": {"mode": {"enum": ["implicit", "explicit"]}, "ttl": {"type": "string"}}},
    "prompt_cache_retention": {"enum": ["in_memory", "24h"], "description": "Checked; not used."},
    "prompt_cache_key": {"type": "string", "description": "The request's session: tags it in the request log "
                         "and metrics (as X-Session-Id does) and keeps a session on one data-parallel worker."},
}
_BREAKPOINT = {"type": "object", "properties": {"mode": {"const": "explicit"}},
               "description": "Pin the prompt up to the end of this part in the prefix cache."}

# Structured outputs (at most one per request), shared by chat and completions.
STRUCTURED_FIELDS = {
    "response_format": {"type": "object", "description": "{\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\", \"strict\"}}."},
    "guided_json": {"oneOf": [{"type": "object"}, {"type": "string"}], "description": "A JSON schema the reply matches."},
    "guided_regex": {"type": "string", "description": "A regular expression the reply matches."},
    "guided_choice": {"type": "array", "items": {"type": "string"}, "description": "The reply is one of these."},
    "guided_grammar": {"type": "string", "description": "An EBNF grammar (root first) the reply matches."},
    "structured_outputs": {"type": "object", "description": "One of json, json_object, regex, choice, grammar."},
    "json_schema": {"type": "object", "description": "As guided_json (llama.cpp's name)."},
    "grammar": {"type": "string", "description": "As guided_grammar (llama.cpp's name)."},
}

CHAT_REQUEST = {
    "type": "object", "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role"],
            "properties": {
                "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                    "type": "object", "properties": {
                        "type": {"enum": ["text", "image_url"]}, "text": {"type": "string"},
                        "image_url": {"oneOf": [{"type": "string"}, {"type": "object"}]},
                        "prompt_cache_breakpoint": _BREAKPOINT}}}],
                    "description": "Text, or text and image_url parts in order (images in user and tool messages, "
                                   "for a vision model)."},
                "name": {"type": "string"}, "tool_calls": {"type": "array"}, "tool_call_id": {"type": "string"},
            }}},
        **SAMPLING_FIELDS,
        "logprobs": _BOOLEAN,
        "top_logprobs": {**_INTEGER, "minimum": 0, "maximum": 20},
        "chat_template_kwargs": {"type": "object", "description": "Extra variables for the chat template."},
        **STRUCTURED_FIELDS,
        **CACHE_FIELDS,
    },
}

COMPLETION_REQUEST = {
    "type": "object", "required": ["prompt"],
    "properties": {
        "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 1},
                             {"type": "array", "items": _INTEGER}],
                   "description": "A string, an array of one string, or token ids."},
        **SAMPLING_FIELDS,
        "logprobs": {**_INTEGER, "minimum": 0, "maximum": 20},
        "echo": {**_BOOLEAN, "description": "Put the prompt before the output."},
        **STRUCTURED_FIELDS,
    },
}

_ITEMS = {"type": "array", "items": {"type": "object"}}
RESPONSES_REQUEST = {
    "type": "object",
    "properties": {
        "model": SAMPLING_FIELDS["model"],
        "input": {"oneOf": [{"type": "string"}, _ITEMS], "description": "A user message, or items: message "
                  "(user, assistant, system, developer), reasoning, function_call, function_call_output, "
                  "custom_tool_call, custom_tool_call_output."},
        "instructions": {"type": "string", "description": "A system turn placed first, for this request only."},
        "previous_response_id": {"type": "string", "description": "Continue a stored response's conversation."},
        "store": {**_BOOLEAN, "description": "Keep the response for retrieval and continuation (default true)."},
        "metadata": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 512},
                     "maxProperties": 16},
        "max_output_tokens": {**_INTEGER, "minimum": 1},
        "temperature": SAMPLING_FIELDS["temperature"], "top_p": SAMPLING_FIELDS["top_p"],
        "top_k": SAMPLING_FIELDS["top_k"], "min_p": SAMPLING_FIELDS["min_p"], "seed": SAMPLING_FIELDS["seed"],
        "stop": _STOP, "stream": _BOOLEAN,
        "reasoning": {"type": "object", "properties": {
            "effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]},
            "summary": {"enum": ["auto", "concise", "detailed"], "description": "Accepted; summaries stay empty."}}},
        "text": {"type": "object", "properties": {"format": {
            "type": "object", "description": "text, json_object, or json_schema (name, schema, description, "
            "strict): the answer is held to it.", "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]}, "name": {"type": "string"},
                "schema": {"type": "object"}, "description": {"type": "string"}, "strict": _BOOLEAN}}}},
        "tools": {**_ITEMS, "description": "function, namespace and custom tools; hosted tools are accepted, "
                  "not offered to the model, and listed in x-ember-ignored-fields."},
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": _BOOLEAN,
        "include": {"type": "array", "items": {"const": "reasoning.encrypted_content"}},
        **CACHE_FIELDS, "priority": SAMPLING_FIELDS["priority"],
        "user": {"type": "string"}, "safety_identifier": {"type": "string"}, "service_tier": {"type": "string"},
        "return_token_ids": {**_BOOLEAN, "description": "Add the prompt's and the reply's token ids to the final "
                             "response object."},
    },
}

ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"], "description": "The request field at fault."},
        "code": {"type": ["string", "null"]}}}},
}

_TOTAL = {**_NUMBER, "description": "Only grows: two samples make a rate."}
HEALTH = {
    "type": "object", "required": ["status"],
    "properties": {"status": {"enum": ["ok", "loading", "unavailable"]}, "model": {"type": "string"},
                   "max_model_len": _INTEGER,
                   "kv_cache_tokens": {**_INTEGER, "description": "The most tokens the KV cache pool holds, all "
                                       "requests together (each worker's under data parallelism)."},
                   "cache_bytes": {**_INTEGER, "description": "Bytes of prompt cache in host memory (the host "
                                   "tier's; the same as host_cache_bytes)."},
                   "host_cache_bytes": {**_INTEGER, "description": "Bytes of KV blocks the host tier holds."},
                   "host_cache_cap_bytes": {**_INTEGER, "description": "The most the host tier holds (--cache-ram; "
                                            "0: off)."},
                   "host_cache_evictions": {**_INTEGER, "description": "Blocks the host tier dropped to stay under "
                                            "its cap. Only grows."},
                   "disk_cache_bytes": {**_INTEGER, "description": "Bytes of KV blocks the disk tier holds."},
                   "disk_cache_cap_bytes": {**_INTEGER, "description": "The most the disk tier holds "
                                            "(--cache-disk-mib; 0: no --cache-dir)."},
                   "disk_cache_enabled": {"type": "boolean", "description": "The disk tier is on and writable "
                                          "(false without --cache-dir, or after a write failed)."},
                   "cache_tiers": {"type": "object", "description": "Each tier that is on (host, disk): bytes, "
                                   "blocks, capacity_bytes, evictions, hits, misses (blocks), read_seconds, "
                                   "write_seconds; the disk's also enabled, corrupt and dropped_writes."},
                   "tensor_parallel_size": {**_INTEGER, "description": "Ranks the model is split over (1: none)."},
                   "data_parallel_size": {**_INTEGER, "description": "Engine workers, each with the whole model "
                                          "(1: one)."},
                   "requests_running": _INTEGER, "requests_waiting": _INTEGER,
                   "requests_finished": _TOTAL, "prompt_tokens_total": _TOTAL, "cached_tokens_total": _TOTAL,
                   "completion_tokens_total": _TOTAL, "prefill_seconds_total": _TOTAL,
                   "decode_seconds_total": _TOTAL,
                   "busy": {"type": "boolean", "description": "A request is running or waiting."},
                   "live_rows": _INTEGER, "waiting": _INTEGER, "requests_total": _TOTAL, "rounds_total": _TOTAL,
                   "context_length": _INTEGER,
                   "worker_pid": {"type": ["integer", "null"], "description": "The engine worker's process id; "
                                  "null while it starts again."},
                   "worker_restarts": {**_INTEGER, "description": "Times the engine worker was started again "
                                       "(summed over the workers under data parallelism)."},
                   "last_worker_exit": {"type": ["object", "null"], "description": "Why the last engine worker "
                                        "stopped: cause (crashed, fault, stalled, load) and reason; null before "
                                        "any did."},
                   "worker_exits": {"type": "object", "description": "Engine workers that stopped, by cause."},
                   "workers": {"type": "array", "items": {"type": "object"}, "description": "Data parallelism only: "
                               "each worker's status, process, restarts, routing counts and engine numbers."},
                   "streams": {"type": "object", "description": "Engine sequences decoding and prefilling, and the "
                               "most that run at once."},
                   "batch_invariant": {"type": "boolean", "description": "Whether a greedy or seeded request gets the "
                                       "same bits alone as in any batch, as checked on this processor at startup."},
                   "batch_invariant_reason": {"type": "string", "description": "How the check decided, or why "
                                              "the promise is not made."},
                   "engine": {"type": "object", "description": "The engine's counters (KV blocks, sequences, tokens)."}},
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def generation_route_docs(request_schema: str) -> dict[str, Any]:
    """Keyword arguments for a generation route's decorator."""
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request_schema}"}}}}},
        "responses": {
            200: {"description": "The result, or with stream: true server-sent events ending with data: [DONE].",
                  "content": {"application/json": {}, "text/event-stream": {}}},
            400: _error("A malformed request, with error.param naming the field; a prompt beyond the context "
                        "window has code context_length_exceeded."),
            401: _error("A missing or wrong API key."),
            404: _error("Another model id than the served one (code model_not_found)."),
            413: _error("The body is larger than --max-request-mb."),
            415: _error("The body is not JSON."),
            429: _error("Too many requests are waiting (--max-pending); see Retry-After."),
            503: _error("Loading, shutting down, an engine fault, or a wait beyond --pending-timeout."),
        },
    }


def build_document(app) -> dict[str, Any]:
    document = get_openapi(title="ember", version=ember.__version__, description=DESCRIPTION, routes=app.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update({"Error": ERROR, "Health": HEALTH, "ChatCompletionRequest": CHAT_REQUEST,
                    "CompletionRequest": COMPLETION_REQUEST, "ResponsesRequest": RESPONSES_REQUEST})
    from ember.server.anthropic_routes import ANTHROPIC_SCHEMAS
    schemas.update(ANTHROPIC_SCHEMAS)
    schemas.update(NATIVE_SCHEMAS)
    return document
