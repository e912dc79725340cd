"""The members of a JSON object whose text was cut short: what a client can read of a tool call
that the end of the reply interrupted (Anthropic's `input` must be an object, never text)."""

from __future__ import annotations

import json
from typing import Any

from ember.parsers.tool_format import string_end

_VALUE_ENDS = ',}] \t\r\n'


def members_so_far(text: str) -> dict[str, Any]:
    """The object as far as its values are whole: an unfinished key, string, number or literal is
    left out, open containers are closed. {} when nothing whole was written."""
    cuts: list[tuple[int, str]] = []  # (offset just past a whole value, the closers it then needs)
    closers: list[str] = []
    expect_key = False  # inside an object, the next string is a key
    pos, size = 0, len(text)
    while pos < size:
        char = text[pos]
        if char == '"':
            end = string_end(text, pos + 1)
            if end is None:
                break
            pos = end + 1
            if expect_key and closers and closers[-1] == "}":
                expect_key = False
            else:
                cuts.append((pos, "".join(reversed(closers))))
        elif char in "{[":
            closers.append("}" if char == "{" else "]")
            expect_key = char == "{"
            pos += 1
            cuts.append((pos, "".join(reversed(closers))))
        elif char in "}]":
            if not closers:
                break
            closers.pop()
            expect_key = False
            pos += 1
            cuts.append((pos, "".join(reversed(closers))))
        elif char == ",":
            expect_key = bool(closers) and closers[-1] == "}"
            pos += 1
        elif char == ":" or char.isspace():
            pos += 1
        else:  # a number or a literal: whole only once something follows it
            end = pos
            while end < size and text[end] not in _VALUE_ENDS:
                end += 1
            if end == size:
                break
            pos = end
            cuts.append((pos, "".join(reversed(closers))))
    for offset, closing in reversed(cuts):
        try:
            value = json.loads(text[:offset] + closing)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}

