"""Strict, typed reads of JSON request fields; every refusal names the field's full path.

`null` reads as absent. A boolean is never a number, a number is never a string, and
NaN or Infinity (which Python's json module accepts) is refused wherever a number is read.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from ember.errors import InvalidRequest

def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def join_path(base: str, name: str | int) -> str:
    if isinstance(name, int):
        return f"{base}[{name}]"
    return f"{base}.{name}" if base else name


def as_integer(value: Any, path: str, *, low: int | None = None, high: int | None = None) -> int:
    """An integer; a number with no fractional part (10.0) counts as one."""
    if isinstance(value, float) and not isinstance(value, bool) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{path} must be an integer, not {json_type(value)}", param=path)
    if low is not None and value < low:
        raise InvalidRequest(f"{path} must be at least {low}, got {value}", param=path)
    if high is not None and value > high:
        raise InvalidRequest(f"{path} must be at most {high}, got {value}", param=path)
    return value


def as_number(value: Any, path: str, *, low: float | None = None, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{path} must be a number, not {json_type(value)}", param=path)
    if not math.isfinite(value):
        raise InvalidRequest(f"{path} must be a finite number, got {value}", param=path)
    if low is not None and value < low:
        raise InvalidRequest(f"{path} must be at least {low:g}, got {value:g}", param=path)
    if high is not None and value > high:
        raise InvalidRequest(f"{path} must be at most {high:g}, got {value:g}", param=path)
    return float(value)


def as_string(value: Any, path: str, *, non_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{path} must be a string, not {json_type(value)}", param=path)
    if non_empty and not value:
        raise InvalidRequest(f"{path} must not be empty", param=path)
    return value


class Fields:
    """A JSON object with its path, read one field at a time."""

    def __init__(self, obj: Any, path: str = "") -> None:
        if not isinstance(obj, Mapping):
            where = path or "the request body"
            raise InvalidRequest(f"{where} must be a JSON object, not {json_type(obj)}", param=path or None)
        self.obj = obj
        self.path = path

    def path_of(self, name: str | int) -> str:
        """The full path of this object's field `name`, as refusals name it (`param`)."""
        return join_path(self.path, name)

    def has(self, name: str) -> bool:
        return self.obj.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        value = self.obj.get(name)
        return default if value is None else value

    def integer(self, name: str, default: Any = None, *, low: int | None = None, high: int | None = None) -> Any:
        value = self.obj.get(name)
        return default if value is None else as_integer(value, self.path_of(name), low=low, high=high)

    def number(self, name: str, default: Any = None, *, low: float | None = None,
               high: float | None = None) -> Any:
        value = self.obj.get(name)
        return default if value is None else as_number(value, self.path_of(name), low=low, high=high)

    def boolean(self, name: str, default: Any = None) -> Any:
        value = self.obj.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidRequest(f"{self.path_of(name)} must be true or false, not {json_type(value)}",
                                 param=self.path_of(name))
        return value

    def string(self, name: str, default: Any = None, *, non_empty: bool = False,
               choices: Iterable[str] | None = None) -> Any:
        value = self.obj.get(name)
        if value is None:
            return default
        value = as_string(value, self.path_of(name), non_empty=non_empty)
        if choices is not None:
            allowed = list(choices)
            if value not in allowed:
                raise InvalidRequest(f"{self.path_of(name)} must be one of {', '.join(allowed)}; got '{value}'",
                                     param=self.path_of(name))
        return value

    def object(self, name: str) -> "Fields | None":
        value = self.obj.get(name)
        return None if value is None else Fields(value, self.path_of(name))

    def array(self, name: str, *, non_empty: bool = False) -> list | None:
        value = self.obj.get(name)
        if value is None:
            return None
        if not isinstance(value, list):
            raise InvalidRequest(f"{self.path_of(name)} must be an array, not {json_type(value)}",
                                 param=self.path_of(name))
        if non_empty and not value:
            raise InvalidRequest(f"{self.path_of(name)} must not be empty", param=self.path_of(name))
        return value
