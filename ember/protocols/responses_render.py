"""OpenAI Responses: the reply's events as output items, whole or as the Responses SSE lifecycle.

    response.created, response.in_progress (the response object, status in_progress, no output)
    per output item (reasoning, message, function_call, custom_tool_call), in order:
        response.output_item.added
        reasoning and message: content_part.added, reasoning_text / output_text deltas, their done,
            content_part.done
        function_call: function_call_arguments deltas as the call is written, then their done
        custom_tool_call: its whole input once the call ends (custom_tool_call_input delta and done)
        response.output_item.done
    response.completed or response.incomplete (the final object, stored when the request asked)
    or, once the stream has begun, an `error` event and response.failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ember.errors import EmberError
from ember.parsers.events import (
    TEXT_EVENTS, ContentText, ReasoningText, ReplyEvent, ToolCall, ToolCallDelta, ToolCallStart, streamed_call,
)
from ember.protocols.neutral import ChoiceResult, ResponseMeta, RunResult, reply_token_fields
from ember.protocols.responses_items import new_item_id
from ember.protocols.responses_request import ResponsesContext, ResponsesRequest
from ember.protocols.responses_tools import ToolRef, unwrap_call
from ember.protocols.sse import ServerEvent
from ember.types import FinishReason, GenerationOutput


@dataclass(slots=True)
class OutputItem:
    """One output item as it grows: its kind, stable id and index, and its text."""

    kind: str  # reasoning | message | function_call | custom_tool_call
    id: str
    index: int
    text: str = ""  # reasoning or answer text; a call's arguments or input
    call_id: str = ""
    ref: ToolRef | None = None
    sealed: str | None = None  # encrypted_content, once done
    status: str = "in_progress"

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def body(self, status: str, include_encrypted: bool = False) -> dict[str, Any]:
        """The item as it stands: `in_progress` when added (empty text), else completed or incomplete."""
        done = status != "in_progress"
        if self.kind == "reasoning":
            item = {"id": self.id, "type": "reasoning", "summary": [],
                    "content": [self.part(self.text)] if done else []}
            if include_encrypted:
                item["encrypted_content"] = self.sealed if done else None
            return item
        if self.kind == "message":
            return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                    "content": [self.part(self.text)] if done else []}
        text = self.text if done else ""
        item = {"id": self.id, "type": self.kind, "call_id": self.call_id, "name": self.ref.name}
        if self.kind == "function_call":
            item.update(arguments=text, status=status)
        else:
            item["input"] = text
        if self.ref.namespace is not None:
            item["namespace"] = self.ref.namespace
        return item


class ResponsesRenderer:
    """Builds the output items from the reply's events; as a stream, every event carries `event:`
    and a `sequence_number` that rises by one from 0."""

    def __init__(self, request: ResponsesRequest, result: RunResult, meta: ResponseMeta,
                 context: ResponsesContext) -> None:
        self.request = request
        self.spec = request.spec
        self.result = result
        self.meta = meta
        self.context = context
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.sequence = 0

    # ---- events -----------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> ServerEvent:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return ServerEvent(data, event=kind)

    def on_reply(self, reply_event: ReplyEvent) -> list[ServerEvent]:
        if isinstance(reply_event, ToolCallStart):
            return self.close_open("completed") + self.start_call(reply_event)
        if isinstance(reply_event, ToolCallDelta):
            item = self.items[-1]
            if item.kind == "custom_tool_call":
                return []  # its input is the string inside the arguments: given once the call ends
            item.text += reply_event.arguments
            return [self.event("response.function_call_arguments.delta", item_id=item.id, output_index=item.index,
                               delta=reply_event.arguments)]
        if isinstance(reply_event, ToolCall):
            return self.end_call(reply_event)
        kind = "reasoning" if isinstance(reply_event, ReasoningText) else "message"
        events = []
        if self.open is None or self.open.kind != kind:
            events += self.close_open("completed")
            self.open = OutputItem(kind, new_item_id(kind), len(self.items))
            self.items.append(self.open)
            events.append(self.event("response.output_item.added", output_index=self.open.index,
                                     item=self.open.body("in_progress", self.spec.include_encrypted)))
            events.append(self.event("response.content_part.added", item_id=self.open.id,
                                     output_index=self.open.index, content_index=0, part=self.open.part("")))
        item = self.open
        item.text += reply_event.text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(delta, item_id=item.id, output_index=item.index, content_index=0,
                                 delta=reply_event.text, **extra))
        return events

    def start_call(self, call: ToolCallStart) -> list[ServerEvent]:
        ref = self.spec.refs.get(call.name) or ToolRef("function", call.name)
        kind = "custom_tool_call" if ref.kind == "custom" else "function_call"
        item = OutputItem(kind, new_item_id(kind), len(self.items), call_id=call.id, ref=ref)
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=item.index, item=item.body("in_progress"))]

    def end_call(self, call: ToolCall) -> list[ServerEvent]:
        """A call cut short or malformed ends `incomplete`, its arguments as far as they were written."""
        item = self.items[-1]
        item.status = "completed" if call.complete else "incomplete"
        events = []
        if item.kind == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item.id,
                                     output_index=item.index, name=item.ref.name, arguments=item.text))
        else:
            item.text = unwrap_call(item.ref, call.arguments)
            events.append(self.event("response.custom_tool_call_input.delta", item_id=item.id,
                                     output_index=item.index, delta=item.text))
            events.append(self.event("response.custom_tool_call_input.done", item_id=item.id,
                                     output_index=item.index, input=item.text))
        events.append(self.event("response.output_item.done", output_index=item.index,
                                 item=item.body(item.status)))
        return events

    def close_open(self, status: str) -> list[ServerEvent]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        if item.kind == "reasoning" and self.spec.include_encrypted:
            item.sealed = self.context.seal.seal(item.text)
        if item.kind == "reasoning":
            done = self.event("response.reasoning_text.done", item_id=item.id, output_index=item.index,
                              content_index=0, text=item.text)
        else:
            done = self.event("response.output_text.done", item_id=item.id, output_index=item.index,
                              content_index=0, text=item.text, logprobs=[])
        return [done,
                self.event("response.content_part.done", item_id=item.id, output_index=item.index,
                           content_index=0, part=item.part(item.text)),
                self.event("response.output_item.done", output_index=item.index,
                           item=item.body(status, self.spec.include_encrypted))]

    # ---- the response object ----------------------------------------------------------------------

    def status(self) -> str:
        choice = self.result.choices[0]
        if choice.finish_reason == FinishReason.LENGTH and not choice.reply.calls_complete:
            return "incomplete"  # whole calls count even when text after them ran out of tokens
        return "completed"

    def response_object(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        final = status != "in_progress"
        body: dict[str, Any] = {
            "id": self.meta.response_id, "object": "response", "created_at": self.meta.created,
            "status": status, "background": False, "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.meta.model,
            "output": [item.body(item.status, self.spec.include_encrypted) for item in self.items] if final else [],
            **self.spec.echo,
            "usage": self.usage() if final else None,
        }
        if final:
            body.update(reply_token_fields(self.request, self.result))
        return body

    @staticmethod
    def item_status(status: str) -> str:
        return "incomplete" if status in ("incomplete", "failed") else "completed"

    def usage(self) -> dict[str, Any]:
        result = self.result
        prompt, completion = result.num_prompt_tokens, result.num_completion_tokens
        cached = result.num_cached_tokens
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": max(prompt - cached, 0)},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": result.num_reasoning_tokens or 0},
                "total_tokens": prompt + completion, **result.speculative_usage()}

    def finish(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The final object; stored (before the client sees it) when the request asked for it."""
        body = self.response_object(status, error)
        if self.spec.store:
            history = self.spec.history + tuple(self.spec.input_items) + tuple(
                item.body(item.status) for item in self.items)
            self.context.save(body, self.spec, history)
        return body

    # ---- Renderer ---------------------------------------------------------------------------------

    def stream_start(self) -> list[ServerEvent]:
        return [self.event("response.created", response=self.response_object("in_progress")),
                self.event("response.in_progress", response=self.response_object("in_progress"))]

    def stream_output(self, choice: ChoiceResult, output: GenerationOutput) -> list[ServerEvent]:
        events: list[ServerEvent] = []
        for reply_event in choice.events:
            events += self.on_reply(reply_event)
        return events

    def stream_end(self) -> list[ServerEvent]:
        status = self.status()
        events = self.close_open(self.item_status(status))
        try:
            body = self.finish(status)
        except EmberError as exc:
            return events + self.failed(exc)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self.event(kind, response=body)]

    def stream_error(self, error: EmberError) -> list[ServerEvent]:
        for item in self.items:
            if item.status == "in_progress":
                item.status = "incomplete"  # a call the failure cut short
        return self.close_open("incomplete") + self.failed(error)

    def failed(self, error: EmberError) -> list[ServerEvent]:
        """An `error` event, then `response.failed` with the final object."""
        detail = {"code": "server_error", "message": error.message}
        notice = self.event("error", code=error.code or error.type, message=error.message, param=error.param)
        try:
            body = self.finish("failed", detail)
        except EmberError:
            body = self.response_object("failed", detail)
        return [notice, self.event("response.failed", response=body)]

    def response(self) -> dict[str, Any]:
        reply = self.result.choices[0].reply
        events: list[ReplyEvent] = [ReasoningText(reply.reasoning), ContentText(reply.content)]
        for call in reply.tool_calls:
            events += streamed_call(call)
        for reply_event in events:
            if isinstance(reply_event, TEXT_EVENTS) and not reply_event.text:
                continue
            self.on_reply(reply_event)
        status = self.status()
        self.close_open(self.item_status(status))
        return self.finish(status)
