"""What a parsed reply is made of, and the declarations parsing needs: plain data, shared by
every chat dialect."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Union

from ember.constraint_spec import GrammarSpec

CUSTOM_INPUT = "input"  # the one string parameter a custom (free-form) tool is shown to the model with


@dataclass(frozen=True, slots=True)
class ReasoningText:
    text: str


@dataclass(frozen=True, slots=True)
class ContentText:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A call's name is known: the call is given out from here on, its arguments follow."""

    index: int  # among the reply's calls, from 0
    id: str  # stable for the whole stream
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """The next piece of a started call's arguments text."""

    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call that has ended: every piece of it was given out before, by a start and its deltas."""

    index: int  # among the reply's calls, from 0
    id: str  # stable for the whole stream
    name: str
    arguments: str  # the joined deltas: a JSON object as text, or as far as the model wrote it
    complete: bool = True  # False: the arguments are not a whole JSON object (cut short or malformed)


ReplyEvent = Union[ReasoningText, ContentText, ToolCallStart, ToolCallDelta, ToolCall]
TEXT_EVENTS = (ReasoningText, ContentText)


def streamed_call(call: ToolCall) -> list[ReplyEvent]:
    """An ended call as the events that gave it out (for renderers building a whole reply)."""
    pieces: list[ReplyEvent] = [ToolCallDelta(call.index, call.arguments)] if call.arguments else []
    return [ToolCallStart(call.index, call.id, call.name), *pieces, call]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A declared function tool: its name and JSON schema of parameters."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)
    description: str | None = None
    strict: bool = False  # calls must match `parameters` (enforced by a grammar)
    # a custom tool's grammar: the text of its one string parameter CUSTOM_INPUT must match it
    input_grammar: GrammarSpec | None = None

    def parameter_schema(self, name: str) -> dict[str, Any] | None:
        properties = self.parameters.get("properties")
        schema = properties.get(name) if isinstance(properties, dict) else None
        return schema if isinstance(schema, dict) else None


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    start: str = "<think>"
    end: str = "</think>"


# Why a call block went out as text: it is no call to a declared tool (malformed, or another
# name), or the reply ended inside it before it could be read as one.
TEXT_FALLBACK_REASONS = ("not_a_declared_call", "unclosed_block")


@dataclass(slots=True)
class ParsedReply:
    """A whole reply split into its parts (the sum of every event)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    num_reasoning_tokens: int = 0
    num_dropped_calls: int = 0  # complete calls left out because parallel_tool_calls is false
    # how the call markup was read: blocks opened, calls read whole only once their block closed
    # (the streaming reader could not follow them) or found in a think block the reply never
    # closed, and blocks given back as text, each with its reason (TEXT_FALLBACK_REASONS)
    num_call_blocks: int = 0
    num_recovered_calls: int = 0
    text_fallbacks: list[str] = field(default_factory=list)
    parts: list[ReplyEvent] = field(default_factory=list)  # every event in order, adjacent texts of a kind joined

    @property
    def calls_complete(self) -> bool:
        """The reply holds calls and every one of them is whole: a client can run them."""
        return bool(self.tool_calls) and all(call.complete for call in self.tool_calls)

    def add(self, event: ReplyEvent) -> None:
        if isinstance(event, (ToolCallStart, ToolCallDelta)):
            return  # a call counts once it ends
        if isinstance(event, ReasoningText):
            self.reasoning += event.text
        elif isinstance(event, ContentText):
            self.content += event.text
        else:
            self.tool_calls.append(event)
        if self.parts and not isinstance(event, ToolCall) and type(self.parts[-1]) is type(event):
            self.parts[-1] = type(event)(self.parts[-1].text + event.text)
        else:
            self.parts.append(event)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)
