"""The hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, JSON inside."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ember.parsers.events import ToolSpec
from ember.parsers.tool_format import (
    CLOSER, OPENER, expect, framing_only, is_json_object, strict_json, string_end,
)


class JsonQuotes:
    """Follows JSON text one character at a time: is it inside a string?"""

    def __init__(self) -> None:
        self.in_string = False
        self._escaped = False

    def structural(self, char: str) -> bool:
        """Take one character; True when it is outside every string (quotes count as inside)."""
        if self.in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self.in_string = False
            return False
        if char == '"':
            self.in_string = True
            return False
        return True


class JsonAwareScanner:
    """Finds the closing tag outside JSON strings, so a string value may contain the tag's text."""

    def __init__(self) -> None:
        self.body = ""
        self._pos = 0
        self._quotes = JsonQuotes()

    def feed(self, text: str) -> int | None:
        self.body += text
        body = self.body
        while self._pos < len(body):
            if body[self._pos] == "<" and not self._quotes.in_string:
                if body.startswith(CLOSER, self._pos):
                    return self._pos
                if CLOSER.startswith(body[self._pos:]):
                    return None  # maybe the tag, cut short: look again with more text
            self._quotes.structural(body[self._pos])
            self._pos += 1
        return None


class HermesCallReader:
    """Streams a call written `{"name": "NAME", ...}`: the call starts once NAME is whole. With
    `"arguments": {...}` (or `"parameters"`) next, the arguments are the model's own text of that
    object, as written, piece by piece; any other layout (no arguments, a string of JSON) is read
    whole when the block closes."""

    def __init__(self, tools: Mapping[str, ToolSpec]) -> None:
        self.tools = tools
        self._after_name = 0  # just past the name's closing quote
        self._start: int | None = None  # where the arguments object starts
        self._no_object = False  # the name is followed by something else than an arguments object
        self._end: int | None = None  # just past its closing brace, once seen
        self._pos = 0  # scanned up to here
        self._depth = 0
        self._quotes = JsonQuotes()

    def head(self, body: str) -> str | None | bool:
        pos = expect(body, 0, "{")
        pos = pos and expect(body, pos, '"name"')
        pos = pos and expect(body, pos, ":")
        pos = pos and expect(body, pos, '"')
        if not pos:
            return pos
        name_end = string_end(body, pos)
        if name_end is None:
            return None
        try:
            name = json.loads(body[pos - 1:name_end + 1])
        except ValueError:
            return False
        if name not in self.tools:
            return False
        self._after_name = name_end + 1
        return name

    def _find_arguments(self, body: str) -> None:
        pos = expect(body, self._after_name, ",")
        if pos:
            key = expect(body, pos, '"arguments"')
            pos = key if key is not False else expect(body, pos, '"parameters"')
        pos = pos and expect(body, pos, ":")
        pos = pos and expect(body, pos, "{")
        if pos is False:
            self._no_object = True
        elif pos is not None:
            self._start = self._pos = pos - 1

    def arguments(self, body: str) -> str:
        if self._start is None and not self._no_object:
            self._find_arguments(body)
        if self._start is None:
            return ""
        while self._end is None and self._pos < len(body):
            char = body[self._pos]
            self._pos += 1
            if self._quotes.structural(char):
                self._depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(char, 0)
                if self._depth == 0:
                    self._end = self._pos
        return body[self._start:self._end if self._end is not None else len(body)]

    def finish(self, body: str, closed: bool) -> tuple[str, str, bool]:
        arguments = self.arguments(body)
        if self._start is None:
            parsed = parse_call(body, self.tools)
            if parsed is not None:
                return parsed[1], "", True
            # Cut while the arguments might still have come: what is there is only their lead-in.
            cut_in_lead_in = not closed and not self._no_object
            return "", "" if cut_in_lead_in else body[self._after_name:], False
        if self._end is None:
            return arguments, "", False
        rest = body[self._end:]
        return arguments, "" if framing_only(rest, "}") else rest, is_json_object(arguments)


def parse_call(body: str, tools: Mapping[str, ToolSpec]) -> tuple[str, str] | None:
    """(name, JSON arguments) of a whole block's body, in any layout hermes models write."""
    try:
        call = strict_json(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in tools:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = strict_json(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


class Hermes:
    name = "hermes"
    call_prefix = OPENER + '\n{"name": "'
    name_suffix = '"'
    after_name = ', "arguments": {'

    def scanner(self) -> JsonAwareScanner:
        return JsonAwareScanner()

    def reader(self, tools: Mapping[str, ToolSpec]) -> HermesCallReader:
        return HermesCallReader(tools)

    def parse(self, body: str, tools: Mapping[str, ToolSpec]) -> tuple[str, str] | None:
        return parse_call(body, tools)

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{OPENER}\n{payload}\n{CLOSER}"


HERMES = Hermes()
