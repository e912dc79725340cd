"""What a parsed reply is made of, and the declarations parsing needs: plain data, shared by
every chat dialect."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True, slots=True)
class ReasoningText:
    text: str


@dataclass(frozen=True, slots=True)
class ContentText:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    index: int  # among the reply's calls, from 0
    id: str  # stable for the whole stream
    name: str
    arguments: str  # a JSON object, as text


ReplyEvent = Union[ReasoningText, ContentText, ToolCall]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A declared function tool: its name and JSON schema of parameters."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)
    description: str | None = None
    strict: bool = False  # calls must match `parameters` (enforced by a grammar)

    def parameter_schema(self, name: str) -> dict[str, Any] | None:
        properties = self.parameters.get("properties")
        schema = properties.get(name) if isinstance(properties, dict) else None
        return schema if isinstance(schema, dict) else None


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    start: str = "<think>"
    end: str = "</think>"


@dataclass(slots=True)
class ParsedReply:
    """A whole reply split into its parts (the sum of every event)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    num_reasoning_tokens: int = 0
    num_dropped_calls: int = 0  # complete calls left out because parallel_tool_calls is false
    parts: list[ReplyEvent] = field(default_factory=list)  # every event in order, adjacent texts of a kind joined

    def add(self, event: ReplyEvent) -> None:
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
