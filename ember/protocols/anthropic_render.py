"""Anthropic Messages: the message object, and its SSE lifecycle.

    message_start (content empty; usage with the prompt's uncached / cached split)
    ping
    per block: content_block_start, deltas, content_block_stop (indices from 0)
        thinking: thinking_delta ..., then one signature_delta just before the stop
        text: text_delta ...
        tool_use: input_json_delta pieces as the call is written (the joined pieces are its input)
    message_delta (stop_reason, stop_sequence, cumulative usage)
    message_stop
    or, once the stream has begun, an `error` event.

One `BlockAssembler` turns the parser's events into blocks for both the stream and the whole
message, so a streamed reply and a whole one hold the same blocks. A block opens with its first
non-whitespace character: whitespace alone between blocks is dropped.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Any

from ember.errors import EmberError
from ember.parsers.events import (
    ContentText, ReasoningText, ReplyEvent, ToolCall, ToolCallDelta, ToolCallStart, streamed_call,
)
from ember.protocols.anthropic_errors import anthropic_error_body
from ember.protocols.neutral import ChoiceResult, GenerationRequest, ResponseMeta, RunResult, reply_token_fields
from ember.protocols.partial_json import members_so_far
from ember.protocols.sse import ServerEvent
from ember.types import FinishReason, GenerationOutput

# Signs thinking text so a client can tell ember's blocks; new at each start. A thinking block sent
# back is read for its text whatever its signature (one from an earlier run is as good).
_SIGNING_KEY = secrets.token_bytes(32)


def thinking_signature(text: str) -> str:
    return base64.b64encode(hmac.new(_SIGNING_KEY, text.encode(), hashlib.sha256).digest()).decode()


def tool_use_id(call: ToolCall) -> str:
    """Anthropic-style ids: the parser's random call id under the toolu_ prefix."""
    return "toolu_" + call.id.removeprefix("call_")


def event(kind: str, **fields: Any) -> ServerEvent:
    return ServerEvent({"type": kind, **fields}, event=kind)


class BlockAssembler:
    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # "thinking" or "text": the kind of the last block, still open
        self._held = ""  # whitespace not yet in a block
        self._held_kind: str | None = None
        self._json = ""  # the open tool_use block's input, as streamed

    def feed(self, item: ReplyEvent) -> list[ServerEvent]:
        if isinstance(item, ToolCallStart):
            events = self.close()
            self._held = ""
            index = len(self.blocks)
            self.blocks.append({"type": "tool_use", "id": tool_use_id(item), "name": item.name, "input": {}})
            self._json = ""
            return events + [event("content_block_start", index=index, content_block=dict(self.blocks[-1]))]
        if isinstance(item, ToolCallDelta):
            self._json += item.arguments
            return [event("content_block_delta", index=len(self.blocks) - 1,
                          delta={"type": "input_json_delta", "partial_json": item.arguments})]
        if isinstance(item, ToolCall):
            # `input` must be an object: a call cut short keeps the members written whole so far.
            self.blocks[-1]["input"] = members_so_far(self._json)
            return [event("content_block_stop", index=len(self.blocks) - 1)]
        kind = "thinking" if isinstance(item, ReasoningText) else "text"
        if self._open == kind:
            self._held = ""
            return [self._delta(item.text)]
        text = (self._held if self._held_kind == kind else "") + item.text
        if not text.strip():
            self._held, self._held_kind = text, kind
            return []
        self._held = ""
        events = self.close()
        index = len(self.blocks)
        empty = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                 else {"type": "text", "text": ""})
        self.blocks.append(dict(empty))
        self._open = kind
        return events + [event("content_block_start", index=index, content_block=empty), self._delta(text)]

    def _delta(self, text: str) -> ServerEvent:
        block = self.blocks[-1]
        index = len(self.blocks) - 1
        if self._open == "thinking":
            block["thinking"] += text
            return event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": text})
        block["text"] += text
        return event("content_block_delta", index=index, delta={"type": "text_delta", "text": text})

    def close(self) -> list[ServerEvent]:
        """Close the open block, if any (a thinking block gets its signature first)."""
        if self._open is None:
            return []
        index = len(self.blocks) - 1
        events = []
        if self._open == "thinking":
            block = self.blocks[-1]
            block["signature"] = thinking_signature(block["thinking"])
            events.append(event("content_block_delta", index=index,
                                delta={"type": "signature_delta", "signature": block["signature"]}))
        self._open = None
        return events + [event("content_block_stop", index=index)]


def reply_parts(choice: ChoiceResult) -> list[ReplyEvent]:
    """The whole reply's events in order (content only when nothing was parsed)."""
    if choice.parser is None:
        return [ContentText(choice.text)] if choice.text else []
    parts: list[ReplyEvent] = []
    for part in choice.reply.parts:
        parts += streamed_call(part) if isinstance(part, ToolCall) else [part]
    return parts


class MessagesRenderer:
    """Renders the one choice of a Messages request; `request` is a MessagesRequest."""

    def __init__(self, request: GenerationRequest, result: RunResult, meta: ResponseMeta) -> None:
        self.request = request
        self.result = result
        self.meta = meta
        self.blocks = BlockAssembler()
        self.started = False

    # ---- pieces both forms share ----------------------------------------------------------------

    @property
    def model(self) -> str:
        return getattr(self.request, "model_label", "") or self.meta.model

    def usage(self, output_tokens: int) -> dict[str, Any]:
        """cache_read_input_tokens: the prompt's part found in the prefix cache; cache_creation_input_tokens:
        the part after it that the request's cache_control breakpoints wrote and pinned; input_tokens:
        the rest. The three add up to the prompt."""
        cached = self.result.num_cached_tokens
        created = max(self.result.num_pinned_tokens - cached, 0)
        usage: dict[str, Any] = {"input_tokens": self.result.num_prompt_tokens - cached - created,
                                 "cache_creation_input_tokens": created, "cache_read_input_tokens": cached,
                                 "output_tokens": output_tokens}
        thinking = self.result.num_reasoning_tokens
        if thinking is not None and output_tokens:
            usage["output_tokens_details"] = {"thinking_tokens": thinking}
        usage.update(self.result.speculative_usage())
        return usage

    def stop(self, choice: ChoiceResult) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if choice.reply.calls_complete and choice.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            return "tool_use", None
        if choice.finish_reason == FinishReason.LENGTH:
            return ("model_context_window_exceeded" if self.result.fit and self.result.fit.reaches_window
                    else "max_tokens"), None
        if isinstance(choice.stop_reason, str):
            return "stop_sequence", choice.stop_reason
        return "end_turn", None

    def envelope(self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
                 usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.meta.response_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    # ---- whole ----------------------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        choice = self.result.choices[0]
        blocks = BlockAssembler()
        for part in reply_parts(choice):
            blocks.feed(part)
        blocks.close()
        stop_reason, stop_sequence = self.stop(choice)
        return {**self.envelope(blocks.blocks, stop_reason, stop_sequence, self.usage(len(choice.token_ids))),
                **reply_token_fields(self.request, self.result)}

    # ---- stream ---------------------------------------------------------------------------------

    def stream_start(self) -> list[ServerEvent]:
        return []  # message_start waits for the first output, which carries the prefix-cache hit

    def _message_start(self) -> list[ServerEvent]:
        self.started = True
        message = self.envelope([], None, None, self.usage(0))
        return [event("message_start", message=message), event("ping")]

    def stream_output(self, choice: ChoiceResult, output: GenerationOutput) -> list[ServerEvent]:
        events = [] if self.started else self._message_start()
        for item in choice.events:
            events += self.blocks.feed(item)
        return events

    def stream_end(self) -> list[ServerEvent]:
        events = [] if self.started else self._message_start()
        events += self.blocks.close()
        choice = self.result.choices[0]
        stop_reason, stop_sequence = self.stop(choice)
        events.append(event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            usage=self.usage(len(choice.token_ids)), **reply_token_fields(self.request, self.result)))
        events.append(event("message_stop"))
        return events

    def stream_error(self, error: EmberError) -> list[ServerEvent]:
        body = anthropic_error_body(error, getattr(self.meta, "request_id", None))
        return [ServerEvent(body, event="error")]
