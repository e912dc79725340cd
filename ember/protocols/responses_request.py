"""The Responses request as its two halves share it (openai_responses.py reads it,
responses_render.py renders its reply), and what the dialect needs from the server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ember.protocols.neutral import GenerationRequest
from ember.protocols.reasoning_seal import ReasoningSeal
from ember.protocols.responses_tools import ToolRef


@dataclass(slots=True)
class ResponsesContext:
    """What the dialect needs from the server: stored conversations and the reasoning seal."""

    seal: ReasoningSeal
    history_of: Callable[[str], tuple[dict[str, Any], ...] | None]  # a stored response's conversation
    save: Callable[[dict[str, Any], "ResponseSpec", tuple[dict[str, Any], ...]], None]  # may raise a 400
    check_size: Callable[[tuple[dict[str, Any], ...]], None] = lambda items: None  # refuses what cannot be stored
    preserve_thinking_of: Callable[[str], bool | None] = lambda response_id: None  # a stored response's setting


@dataclass(slots=True)
class ResponseSpec:
    """The Responses-only parts of a create request."""

    input_items: list[dict[str, Any]]  # normalized
    history: tuple[dict[str, Any], ...] = ()  # the previous response's conversation
    store: bool = True
    include_encrypted: bool = False
    refs: dict[str, ToolRef] = field(default_factory=dict)  # the model's tool names -> the client's tools
    echo: dict[str, Any] = field(default_factory=dict)  # settings the response object repeats


@dataclass(slots=True)
class ResponsesRequest(GenerationRequest):
    spec: ResponseSpec | None = None
