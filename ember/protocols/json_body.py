"""A request body read as JSON with limits, so that no shape of input can crash or stall the server.

Refused with a 400 naming where it happened (`param`, a path such as `messages[2].content`):
bytes that are not UTF-8; text that is not JSON; nesting deeper than MAX_DEPTH; an array or
object of more than MAX_ITEMS entries; a string (or key) holding a NUL character or half of a
surrogate pair (a lone `\\ud800` escape: not text, and it cannot be encoded again); a number
beyond the float range (`1e999`) and the NaN and Infinity literals JSON does not have.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from ember.errors import InvalidRequest

MAX_DEPTH = 64  # objects and arrays inside one another
MAX_ITEMS = 100_000  # entries of one array or object


def parse_body(body: bytes, *, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
               parse_float: Callable[[str], Any] | None = None) -> Any:
    """The body's JSON value. A route that reads numbers or objects its own way passes json.loads'
    hooks; `parse_float` then also decides what a number beyond the float range becomes."""
    if not body.strip():
        raise InvalidRequest("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"The request body is not UTF-8: byte {exc.start} cannot be decoded.",
                             code="invalid_json") from None
    try:
        value = json.loads(text, parse_float=parse_float or _float, parse_constant=_NotANumber,
                           object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise InvalidRequest(f"The request body nests deeper than {MAX_DEPTH} levels.", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, and integers of more digits than Python converts
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    check_value(value)
    return value


def check_value(value: Any) -> None:
    """Walk the parsed body without recursion and refuse what the module docstring lists."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, path or "body")
        elif isinstance(item, _NotANumber):
            reason = "beyond the range of a 64-bit float" if item.overflow else "not a JSON number"
            raise InvalidRequest(f"{path or 'body'} is {item.text}: {reason}", param=path or None, code="invalid_json")
        elif isinstance(item, (dict, list)):
            where = path or "body"
            if depth > MAX_DEPTH:
                raise InvalidRequest(f"{where} nests deeper than {MAX_DEPTH} levels of objects and arrays",
                                     param=path or None, code="invalid_json")
            if len(item) > MAX_ITEMS:
                raise InvalidRequest(f"{where} holds {len(item)} entries; at most {MAX_ITEMS} are allowed",
                                     param=path or None, code="invalid_json")
            if isinstance(item, dict):
                for key, child in item.items():
                    child_path = f"{path}.{key}" if path else key
                    _check_text(key, child_path)
                    stack.append((child, child_path, depth + 1))
            else:
                stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_text(text: str, path: str) -> None:
    if "\x00" in text:
        raise InvalidRequest(f"{path} holds a NUL character", param=path, code="invalid_json")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{path} holds half of a UTF-16 surrogate pair (an unpaired \\ud800-\\udfff escape)",
                             param=path, code="invalid_json") from None


class _NotANumber:
    """What the parser leaves where a number cannot be a float: found, with its path, by the walk."""

    def __init__(self, text: str, overflow: bool = False) -> None:
        self.text, self.overflow = text[:40], overflow


def _float(text: str) -> float | _NotANumber:
    value = float(text)
    return _NotANumber(text, overflow=True) if value in (float("inf"), float("-inf")) else value
