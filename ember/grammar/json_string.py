"""A grammar's language as the inside of a JSON string, for tool calls written as JSON.

A model that writes its calls as JSON (hermes) writes a custom tool's raw input as a JSON string:
the text the grammar must hold appears escaped (a newline as `\\n`, a quote as `\\"`). xgrammar
holds a grammar on the text as written, so the grammar is rewritten: xgrammar first turns the
Lark or regex grammar into its own EBNF, then every terminal of that EBNF (string literals and
character classes) is replaced by what it looks like inside a JSON string. The rewritten grammar
accepts exactly the JSON string bodies whose decoded text the original accepts, written the way
`json.dumps(..., ensure_ascii=False)` writes them (no optional escapes such as `\\/` or `\\u00e9`).
"""

from __future__ import annotations

import functools
import json

from ember.constraint_spec import LARK, REGEX

_MAX_CODE_POINT = 0x10FFFF
# characters a JSON string must escape: the control characters, the quote and the backslash
_SPECIAL = [*range(0x20), ord('"'), ord("\\")]
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "b": "\b", "a": "\a", "e": "\x1b", "0": "\0"}
_HEX_LENGTHS = {"x": 2, "u": 4, "U": 8}


@functools.lru_cache(maxsize=64)
def json_string_ebnf(kind: str, text: str) -> str:
    """xgrammar EBNF for the JSON string bodies (without the quotes) of the texts a Lark or regex
    grammar accepts."""
    import xgrammar

    if kind == LARK:
        grammar = xgrammar.Grammar.from_lark(text)
    elif kind == REGEX:
        grammar = xgrammar.Grammar.from_regex(text)
    else:
        raise ValueError(kind)
    return escape_terminals(str(grammar))


def escape_terminals(ebnf: str) -> str:
    """Rewrite every string literal and character class of xgrammar's printed EBNF as its JSON
    string form; rule names, operators and repetitions pass through."""
    out: list[str] = []
    pos = 0
    while pos < len(ebnf):
        char = ebnf[pos]
        if char == '"':
            literal, pos = _read_string(ebnf, pos + 1)
            out.append(_literal(json.dumps(literal, ensure_ascii=False)[1:-1]))
        elif char == "[":
            ranges, negated, pos = _read_class(ebnf, pos + 1)
            out.append(_escaped_class(_complement(ranges) if negated else ranges))
        else:
            out.append(char)
            pos += 1
    return "".join(out)


def _read_char(text: str, pos: int) -> tuple[str, int]:
    """One character of a literal or class, escapes decoded; returns it and the position after it."""
    if text[pos] != "\\":
        return text[pos], pos + 1
    code = text[pos + 1]
    if code in _HEX_LENGTHS:
        end = pos + 2 + _HEX_LENGTHS[code]
        return chr(int(text[pos + 2:end], 16)), end
    return _ESCAPES.get(code, code), pos + 2


def _read_string(text: str, pos: int) -> tuple[str, int]:
    chars = []
    while text[pos] != '"':
        char, pos = _read_char(text, pos)
        chars.append(char)
    return "".join(chars), pos + 1


def _read_class(text: str, pos: int) -> tuple[list[tuple[int, int]], bool, int]:
    negated = text[pos] == "^"
    pos += negated
    ranges = []
    while text[pos] != "]":
        low, pos = _read_char(text, pos)
        high = low
        if text[pos] == "-" and text[pos + 1] != "]":
            high, pos = _read_char(text, pos + 1)
        ranges.append((ord(low), ord(high)))
    return ranges, negated, pos + 1


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    result, start = [], 0
    for low, high in sorted(ranges):
        if low > start:
            result.append((start, low - 1))
        start = max(start, high + 1)
    if start <= _MAX_CODE_POINT:
        result.append((start, _MAX_CODE_POINT))
    return result


def _escaped_class(ranges: list[tuple[int, int]]) -> str:
    """A class's JSON form: its characters a JSON string writes as they are, as one class, or'ed
    with the escape sequence of each character it holds that JSON must escape."""
    plain = _complement([(c, c) for c in _SPECIAL] + _complement(ranges))
    specials = [c for c in _SPECIAL if any(low <= c <= high for low, high in ranges)]
    options = ["[" + "".join(_class_item(low, high) for low, high in plain) + "]"] if plain else []
    options += [_literal(json.dumps(chr(c))[1:-1]) for c in specials]
    return "(" + " | ".join(options) + ")"


def _class_item(low: int, high: int) -> str:
    return _code(low) if low == high else f"{_code(low)}-{_code(high)}"


def _code(point: int) -> str:
    char = chr(point)
    if char.isascii() and char.isalnum():
        return char
    return f"\\u{point:04x}" if point <= 0xFFFF else f"\\U{point:08x}"


def _literal(text: str) -> str:
    return '"' + "".join(_code(ord(c)) if c in '"\\' or not c.isprintable() else c for c in text) + '"'

