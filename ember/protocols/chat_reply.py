"""What every chat dialect shares about replies: the request's tool and thinking options, and the
plan that turns them (with the served model's markers and the rendered prompt) into a parser for
each choice and, where the reply must be steered, a token constraint."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.errors import InvalidRequest
from ember.protocols.errors import unsupported
from ember.protocols.fields import Fields, json_type
from ember.constraint_spec import ConstraintSpec, SteeringSpec
from ember.parsers.constraint import ForcedCall
from ember.parsers.events import ThinkMarkers, ToolSpec
from ember.parsers.reply import ReplyFormat, ReplyParser
from ember.parsers.tool_format import ToolFormat

AUTO, NONE, REQUIRED, FUNCTION = "auto", "none", "required", "function"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
MAX_TOOLS = 128
BUDGET_ROOM_INSUFFICIENT = "thinking_budget_capacity_insufficient"
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")  # what every dialect accepts as a tool's name
# Template arguments a request may not override: they belong to the server.
RESERVED_TEMPLATE_KWARGS = ("messages", "conversation", "tools", "documents", "tokenize", "chat_template",
                            "return_dict", "return_tensors", "tokenizer_kwargs")


def read_template_kwargs(f: Fields, reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """chat_template_kwargs, passed to the chat template as they are; the server's own arguments
    (and `reserved`, a dialect's) may not be set."""
    kwargs: dict[str, Any] = {}
    options = f.object("chat_template_kwargs")
    if options is not None:
        for key, value in options.obj.items():
            if key in RESERVED_TEMPLATE_KWARGS or key in reserved:
                raise InvalidRequest(f"chat_template_kwargs may not set '{key}'", param=options.path_of(key))
            kwargs[key] = value
    return kwargs


def read_thinking_budget(f: Fields) -> int | None:
    """thinking_budget: reasoning tokens before ember closes the think block (0 or absent: None,
    the server's default)."""
    return f.integer("thinking_budget", low=0) or None


def tool_items(f: Fields) -> list:
    """The raw entries of a request's `tools` array (empty when absent), at most MAX_TOOLS."""
    items = f.array("tools")
    if not items:
        return []
    if len(items) > MAX_TOOLS:
        raise InvalidRequest(f"tools holds {len(items)} tools; at most {MAX_TOOLS} are allowed", param="tools")
    return items


def function_tool(tool: Fields) -> Fields:
    """A `{type: "function", function: {...}}` tools entry's `function` (OpenAI's and Ollama's shape)."""
    kind = tool.string("type", "function")
    if kind != "function":
        raise unsupported(tool.path_of("type"), f"{tool.path_of('type')} is '{kind}'; only function tools can be "
                                                "called on this server")
    function = tool.object("function")
    if function is None:
        raise InvalidRequest(f"{tool.path_of('function')} is required", param=tool.path_of("function"))
    return function


def called_function(call: Fields) -> tuple[Fields, str]:
    """A history tool call's `function` and its name (`{function: {name, arguments}}`, OpenAI's and Ollama's shape)."""
    function = call.object("function")
    if function is None:
        raise InvalidRequest(f"{call.path_of('function')} is required", param=call.path_of("function"))
    name = function.string("name", non_empty=True)
    if name is None:
        raise InvalidRequest(f"{function.path_of('name')} is required", param=function.path_of("name"))
    return function, name


# One reader of a tool declaration's name and schema for every dialect; `tool` is the object that
# holds `name` (OpenAI's `function`, an Anthropic or Responses tool).

def tool_name(tool: Fields) -> str:
    name = tool.string("name")
    if name is None or not TOOL_NAME.fullmatch(name):
        raise InvalidRequest(f"{tool.path_of('name')} must be 1 to 128 letters, digits, '_', '-', '.' or ':'",
                             param=tool.path_of("name"))
    return name


def tool_schema(tool: Fields, key: str, default: dict[str, Any]) -> dict[str, Any]:
    schema = tool.raw(key, default)
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{tool.path_of(key)} must be a JSON schema object, not {json_type(schema)}",
                             param=tool.path_of(key))
    return schema


def declare_tool(specs: list[ToolSpec], spec: ToolSpec, tool: Fields) -> None:
    """Add `spec` (named as the model sees it) to the request's tools; a name declared twice is refused."""
    if any(s.name == spec.name for s in specs):
        raise InvalidRequest(f"{tool.path_of('name')}: the tool '{spec.name}' is declared twice",
                             param=tool.path_of("name"))
    specs.append(spec)


@dataclass(frozen=True, slots=True)
class ChatFeatures:
    """The served model's reply markers, fixed at load (flags or the template)."""

    think: ThinkMarkers | None = None
    tool_format: ToolFormat | None = None
    default_thinking_budget: int | None = None
    efforts: tuple[str, ...] | None = None  # the reasoning efforts the template tells apart; None: it ignores them
    default_thinking: bool | None = None  # False with --no-thinking; None: the template's own default
    default_reasoning_effort: str | None = None  # --reasoning-effort
    preserve_thinking: bool = False  # --preserve-thinking: closed turns keep their reasoning by default


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """A chat request's tool and thinking choices, validated by its dialect."""

    tools: tuple[ToolSpec, ...] = ()  # the tools the reply may call (a named choice leaves one)
    tool_choice: str = AUTO  # auto | none | required | function
    parallel_tool_calls: bool = True
    thinking: bool | None = None  # None: the template's own default
    thinking_budget: int | None = None  # None: the server's default
    reasoning_effort: str | None = None
    thinking_budget_param: str = "thinking_budget"  # the dialect's name of the budget's field
    requested_effort: str | None = None  # as the request named it (reasoning_effort: as settled, defaults included)

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != NONE


def template_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Tools in the shape Hugging Face chat templates read."""
    result = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
        result.append({"type": "function", "function": function})
    return result


@dataclass(slots=True)
class ReplyPlan:
    """How each choice of one request is read and steered."""

    fmt: ReplyFormat
    token_bytes: Any
    budget: int | None = None
    forced_call: ForcedCall | None = None
    counts_reasoning: bool = field(default=False)
    budget_param: str | None = None  # the request's field that set the budget; None: the server's default
    budget_close_tokens: int = 0  # the tokens the budget's close takes (the server's tokenizer counts them)

    def check_budget_room(self, max_tokens: int) -> None:
        """A reply that can run past its thinking budget must have room for the close and one token
        after it; between the two, the close would be cut short, so the request is refused."""
        budget = self.budget
        if budget is None or not budget < max_tokens <= budget + self.budget_close_tokens:
            return
        need = budget + self.budget_close_tokens + 1
        source = f"{self.budget_param} ({budget})" if self.budget_param else f"the server's thinking budget ({budget})"
        raise InvalidRequest(f"{source} leaves no room to close the thinking and answer: the reply may take "
                             f"{max_tokens} tokens, and closing after {budget} needs {need} (the close takes "
                             f"{self.budget_close_tokens}, then one answer token); raise max_tokens to {need} or "
                             f"more, or lower the budget below {max_tokens - self.budget_close_tokens}",
                             param=self.budget_param or "max_tokens", code=BUDGET_ROOM_INSUFFICIENT)

    def parser(self) -> ReplyParser:
        return ReplyParser(self.fmt, self.token_bytes)

    def steering(self, reasoning_only: bool = False) -> SteeringSpec | None:
        """How each choice's tokens are steered, as data the engine turns into a live constraint of
        that choice's own; None when nothing is. `reasoning_only`: the think block alone (a
        grammar shapes the rest)."""
        think, forced = self.fmt.think, None if reasoning_only else self.forced_call
        if think is None if reasoning_only else (self.budget is None and forced is None):
            return None
        return SteeringSpec(think.start if think else None, think.end if think else None,
                            self.fmt.starts_in_reasoning, self.fmt.may_open_reasoning, self.budget,
                            forced.tool_format.name if forced else None, list(forced.names) if forced else [])

    def constraint(self) -> ConstraintSpec | None:
        steering = self.steering()
        return ConstraintSpec(steering) if steering is not None else None


def plan_reply(options: ChatOptions, features: ChatFeatures, prompt_tail: str, token_bytes) -> ReplyPlan | None:
    """None when the reply is plain content with nothing to parse or steer."""
    think = features.think
    calls = options.calls_tools and features.tool_format is not None
    if think is None and not calls:
        return None
    starts_in, may_open = _think_state(think, prompt_tail) if think else (False, False)
    fmt = ReplyFormat(think=think, starts_in_reasoning=starts_in, may_open_reasoning=may_open,
                      tool_format=features.tool_format if calls else None,
                      tools={t.name: t for t in options.tools} if calls else {},
                      parallel_tool_calls=options.parallel_tool_calls)
    budget = budget_param = None
    if think is not None and options.thinking is not False and (starts_in or may_open):
        budget = options.thinking_budget or features.default_thinking_budget
        budget_param = options.thinking_budget_param if options.thinking_budget else None
    forced = None
    if calls and options.tool_choice in (REQUIRED, FUNCTION):
        forced = ForcedCall(features.tool_format, tuple(t.name for t in options.tools))
    return ReplyPlan(fmt, token_bytes, budget, forced, counts_reasoning=think is not None, budget_param=budget_param)


def _think_state(think: ThinkMarkers, prompt_tail: str) -> tuple[bool, bool]:
    """(the prompt leaves a think block open, the reply may open one itself)."""
    opened, closed = prompt_tail.rfind(think.start), prompt_tail.rfind(think.end)
    if opened > closed and not prompt_tail[opened + len(think.start):].strip():
        return True, False
    if closed >= 0 and not prompt_tail[closed + len(think.end):].strip():
        return False, False
    return False, True
