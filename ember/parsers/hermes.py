"""The hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, JSON inside."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ember.parsers.events import ToolSpec
from ember.parsers.tool_format import CLOSER, OPENER, strict_json


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


class Hermes:
    name = "hermes"
    call_prefix = OPENER + '\n{"name": "'
    name_suffix = '"'
    after_name = ', "arguments": {'

    def scanner(self) -> JsonAwareScanner:
        return JsonAwareScanner()

    def parse(self, body: str, tools: Mapping[str, ToolSpec]) -> tuple[str, str] | None:
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

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{OPENER}\n{payload}\n{CLOSER}"


HERMES = Hermes()
