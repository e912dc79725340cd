"""A request's token constraint as plain data: what crosses from the front end to the engine.

The front end decides how a reply is steered (a thinking budget, a forced tool call, a grammar) and
writes it down here; the engine compiles it into a live constraint (ember.grammar.realize) next to
the model, with its own grammar cache. Nothing in here is a live object, so a spec can be
serialized to an engine in another process or on another host. Both sides import this module
(and nothing of the other side): it imports no torch and no dialect.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The kinds of structured output a GrammarSpec holds (the dialects read them in ember.protocols.structured)
JSON_SCHEMA, JSON_OBJECT, REGEX, CHOICE, GRAMMAR = "json_schema", "json_object", "regex", "choice", "grammar"
LARK = "lark"  # a Lark grammar (a custom tool's input format, as Codex declares apply_patch)
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, CHOICE, GRAMMAR, LARK)
STRUCTURAL_TAG = "structural_tag"  # grammar_kind of an xgrammar structural tag (tool calls), as JSON text


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the reply must match. `text` is the schema as JSON text (json_schema), empty (json_object),
    the pattern (regex), a JSON array of the strings (choice), the EBNF grammar (grammar) or the
    Lark grammar (lark)."""

    kind: str
    text: str
    param: str  # the request field it came from, named when it cannot be compiled

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}")


@dataclass(frozen=True, slots=True)
class SteeringSpec:
    """Follow the reply's think block (closing it after `budget` tokens) and, with
    `forced_tool_format`, force a call's opener and one of `forced_names`."""

    think_start: str | None = None  # the think markers; None: the reply has no think block
    think_end: str | None = None
    in_block: bool = False  # the prompt leaves a think block open
    may_open: bool = False  # the reply may open one itself
    budget: int | None = None
    forced_tool_format: str | None = None  # a tool-call format's name (ember.parsers.TOOL_PARSERS)
    forced_names: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """A steering alone, a grammar alone, or a grammar whose answer starts after the steered
    reasoning. `grammar_kind` is a structured-output kind (a GrammarSpec's) or
    STRUCTURAL_TAG; `grammar_param` is the request field named if it cannot be compiled."""

    steering: SteeringSpec | None = None
    grammar_kind: str | None = None
    grammar_text: str = ""
    grammar_param: str = ""
    # structured-output specs (kind, text, param) to compile alone before the structural tag that
    # holds them, so that each one's error names its own field
    checks: list[tuple[str, str, str]] = field(default_factory=list)
