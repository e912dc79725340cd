"""The contract every tool-call format follows, and the scan that finds where a call block ends.

Both formats ember reads wrap each call in `<tool_call>` ... `</tool_call>`; they differ in the
body. A format knows how to find the block's real end (a closing tag inside a string value does not
end it), how to read a body into a call, what text opens a call up to the function name (for
forced calls), and how to write a past call as the model would have (for a template that cannot
take tools; ember.parsers.tool_prompt writes the rest).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from ember.parsers.events import ToolSpec

OPENER = "<tool_call>"
CLOSER = "</tool_call>"


def strict_json(text: str) -> Any:
    """json.loads that refuses what JSON has not: NaN, Infinity, and numbers too large for a float."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} does not fit a float")
    return value


class BlockScanner(Protocol):
    def feed(self, text: str) -> int | None:
        """Add body text; return the offset (in the whole body so far) where the closing tag
        starts, once it is seen outside any value."""
        ...


class CallReader(Protocol):
    """Reads one call block while it is written, so the call can stream: its name as soon as it is
    known, then its arguments. `body` is always the block's whole text so far (after `<tool_call>`)."""

    def head(self, body: str) -> str | None | bool:
        """The declared tool's name once the body shows it; None: more text is needed; False: this
        block cannot be read as it streams (it is read whole once it closes)."""
        ...

    def arguments(self, body: str) -> str:
        """The arguments text readable so far; it only ever grows (each result starts with the last)."""
        ...

    def finish(self, body: str, closed: bool) -> tuple[str, str, bool]:
        """The block ended (`closed`: by its closing tag, else by the end of the reply):
        (the whole arguments text, which starts with every earlier result; the rest of the block that
        is no part of the call, given out as content; whether the arguments are a whole JSON object)."""
        ...


class ToolFormat(Protocol):
    name: str
    call_prefix: str  # what a call's text is up to its function name
    name_suffix: str  # what follows the name
    after_name: str  # text ember writes after the name when it forces a call

    def scanner(self) -> BlockScanner: ...

    def reader(self, tools: Mapping[str, ToolSpec]) -> CallReader: ...

    def parse(self, body: str, tools: Mapping[str, ToolSpec]) -> tuple[str, str] | None:
        """(name, JSON arguments) for a well-formed call to a declared tool, else None."""
        ...

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """A past call as the model would have written it (for templates without tool support)."""
        ...


def is_json_object(text: str) -> bool:
    try:
        return isinstance(strict_json(text), dict)
    except ValueError:
        return False


def string_end(text: str, pos: int) -> int | None:
    """The offset of the quote that closes the JSON string whose text starts at `pos`; None when
    the text ends first."""
    escaped = False
    for offset in range(pos, len(text)):
        char = text[offset]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            return offset
    return None


def expect(text: str, pos: int, literal: str) -> int | None | bool:
    """After optional whitespace at `pos`, `literal`: the offset past it; None when the text ends
    before it could be told; False when something else stands there."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    rest = text[pos:pos + len(literal)]
    if rest == literal:
        return pos + len(literal)
    return None if literal.startswith(rest) else False


def framing_only(text: str, closer: str = "") -> bool:
    """Nothing but whitespace, the format's `closer` once, and the start of `</tool_call>` (a block
    cut short by the end of the reply)."""
    rest = text.strip()
    if closer and rest.startswith(closer):
        rest = rest[len(closer):].strip()
    return not rest or CLOSER.startswith(rest)
