"""Ollama's replies, whole or as NDJSON lines: a line per piece of text (reasoning goes in
`thinking`), a line per finished tool call (its arguments an object), then a closing line with
`done: true`, `done_reason` and the durations; a failure after the first line is an `error` line.

Chat puts the pieces in `message` (ChatRenderer), generate at the top level (GenerateRenderer).
A tool call whose arguments are not a whole JSON object (cut short by num_predict, or malformed)
is left out: an Ollama client could not run it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ember.errors import EmberError
from ember.parsers.events import ContentText, ReasoningText, ToolCall
from ember.protocols.neutral import ChoiceResult, GenerationRequest, ResponseMeta, RunResult
from ember.protocols.ollama_common import done_reason, durations, error_line, line, timestamp
from ember.protocols.sse import ServerEvent
from ember.types import GenerationOutput


@dataclass(frozen=True, slots=True)
class OllamaReply:
    """What only Ollama's rendering reads of a request (GenerationRequest.dialect_options)."""

    model_label: str  # the request's `model`, echoed


def call_body(call: ToolCall) -> dict[str, Any]:
    return {"function": {"name": call.name, "arguments": json.loads(call.arguments or "{}")}}


def whole_calls(choice: ChoiceResult) -> list[dict[str, Any]]:
    return [call_body(call) for call in choice.reply.tool_calls if call.complete]


class OllamaRenderer:
    def __init__(self, request: GenerationRequest, result: RunResult, meta: ResponseMeta) -> None:
        self.request = request
        self.result = result
        self.meta = meta
        self.label = request.dialect_options.model_label

    def head(self) -> dict[str, Any]:
        return {"model": self.label, "created_at": timestamp()}

    def pieces(self, content: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError

    def stream_start(self) -> list[ServerEvent]:
        return []

    def stream_output(self, choice: ChoiceResult, output: GenerationOutput) -> list[ServerEvent]:
        lines = []
        for event in choice.events:
            if isinstance(event, ContentText) and event.text:
                body = self.pieces(event.text, "", [])
            elif isinstance(event, ReasoningText) and event.text:
                body = self.pieces("", event.text, [])
            elif isinstance(event, ToolCall) and event.complete:
                body = self.pieces("", "", [call_body(event)])
            else:
                continue
            lines.append(line({**self.head(), **body, "done": False}))
        return lines

    def closing(self) -> dict[str, Any]:
        choice = self.result.choices[0]
        return {"done": True, "done_reason": done_reason(choice.finish_reason), **durations(self.result)}

    def stream_end(self) -> list[ServerEvent]:
        return [line({**self.head(), **self.pieces("", "", []), **self.closing()})]

    def stream_error(self, error: EmberError) -> list[ServerEvent]:
        return error_line(error)

    def response(self) -> dict[str, Any]:
        choice = self.result.choices[0]
        reply = choice.reply
        return {**self.head(), **self.pieces(reply.content, reply.reasoning, whole_calls(choice)), **self.closing()}


class ChatRenderer(OllamaRenderer):
    def pieces(self, content: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}


class GenerateRenderer(OllamaRenderer):
    def pieces(self, content: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"response": content}
        if thinking:
            body["thinking"] = thinking
        return body
