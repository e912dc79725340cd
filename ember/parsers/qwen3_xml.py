"""The Qwen3 XML format:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are raw text; the tool's JSON schema types them. A string value may hold balanced
`<parameter=...>...</parameter>` text and tool-call markers: the format has no escapes, so only an
unbalanced nested tag makes a block unreadable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ember.parsers.events import ToolSpec
from ember.parsers.tool_format import CLOSER, OPENER, framing_only, strict_json

_FUNCTION_OPEN = re.compile(r"\s*<function=([^>\n]+)>")
_FUNCTION_CLOSE = re.compile(r"</function>\s*$")
_PARAM_OPEN = "<parameter="
_PARAM_CLOSE = "</parameter>"
_FUNCTION_TAG = "<function="
_FUNCTION_END = "</function>"
_MISSING = object()


class ParameterAwareScanner:
    """Finds the closing tag outside parameter values."""

    def __init__(self) -> None:
        self.body = ""
        self._pos = 0
        self._depth = 0

    def feed(self, text: str) -> int | None:
        self.body += text
        body = self.body
        while True:
            found = body.find("<", self._pos)
            if found < 0:
                self._pos = len(body)
                return None
            rest = body[found:]
            for tag in (_PARAM_OPEN, _PARAM_CLOSE, CLOSER):
                if tag.startswith(rest) and len(rest) < len(tag):
                    self._pos = found
                    return None  # a tag may be arriving: wait for more text
            if rest.startswith(_PARAM_OPEN):
                self._depth += 1
            elif rest.startswith(_PARAM_CLOSE):
                self._depth = max(self._depth - 1, 0)
            elif rest.startswith(CLOSER) and self._depth == 0:
                return found
            self._pos = found + 1


class XmlCallReader:
    """Streams a call one parameter at a time: `{` once the function is named, then each parameter
    as a JSON member once its value closes, then `}` at `</function>`. The joined text is the JSON
    of the typed values, as a whole parse gives it. Markup that cannot be a parameter stops the
    reading: the call ends there (incomplete) and the rest of its block is content."""

    def __init__(self, tools: Mapping[str, ToolSpec]) -> None:
        self.tools = tools
        self.tool: ToolSpec | None = None
        self._text = ""  # the arguments so far
        self._seen: set[str] = set()
        self._pos = 0  # the body is read up to here
        self._state = "open"  # open | done (`</function>` read) | broken

    def head(self, body: str) -> str | None | bool:
        found = _FUNCTION_OPEN.match(body)
        if found is None:
            rest = body.lstrip()
            opening = rest.startswith(_FUNCTION_TAG) and ">" not in rest and "\n" not in rest
            return None if opening or _FUNCTION_TAG.startswith(rest) else False
        name = found.group(1).strip()
        if name not in self.tools:
            return False
        self.tool = self.tools[name]
        self._pos = found.end()
        self._text = "{"
        return name

    def arguments(self, body: str) -> str:
        while self._state == "open" and self._read_one(body):
            pass
        return self._text

    def _read_one(self, body: str) -> bool:
        """Read the next parameter or the function's end; False when more text is needed (or reading stopped)."""
        start = self._pos
        while start < len(body) and body[start].isspace():
            start += 1
        rest = body[start:]
        if rest.startswith(_FUNCTION_END):
            self._text += "}"
            self._pos, self._state = start + len(_FUNCTION_END), "done"
            return False
        if not rest.startswith(_PARAM_OPEN):
            if rest and not _PARAM_OPEN.startswith(rest) and not _FUNCTION_END.startswith(rest):
                self._state = "broken"
            return False
        name_end = body.find(">", start)
        if name_end < 0:
            return False
        value_end = _matching_close(body, name_end + 1)
        if value_end is None:
            return False
        name = body[start + len(_PARAM_OPEN):name_end].strip()
        if not name or name in self._seen:
            self._state = "broken"
            return False
        self._seen.add(name)
        value = typed_value(_strip_framing(body[name_end + 1:value_end]), self.tool.parameter_schema(name))
        if value is not _MISSING:
            self._text += ("" if self._text == "{" else ", ") + _member(name, value)
        self._pos = value_end + len(_PARAM_CLOSE)
        return True

    def finish(self, body: str, closed: bool) -> tuple[str, str, bool]:
        self.arguments(body)
        rest = body[self._pos:]
        if self._state == "done":
            return self._text, "" if framing_only(rest) else rest, True
        if self._state == "open" and closed and not rest.strip():
            self._text += "}"  # the block closed with `</function>` left out: nothing is missing
            return self._text, "", True
        if self._state == "open" and not closed:
            return self._text + self._cut_parameter(rest), "", False
        return self._text, rest, False

    def _cut_parameter(self, rest: str) -> str:
        """A parameter the end of the reply cut short, as far as it was written."""
        head = rest.lstrip()
        if not head.startswith(_PARAM_OPEN) or ">" not in head:
            return ""
        name, value = head[len(_PARAM_OPEN):].split(">", 1)
        name = name.strip()
        if not name or name in self._seen:
            return ""
        value = value.removeprefix("\n")
        types = schema_types(self.tool.parameter_schema(name))
        written = json.dumps(value, ensure_ascii=False)[:-1] if types is None or "string" in types else value
        return ("" if self._text == "{" else ", ") + json.dumps(name, ensure_ascii=False) + ": " + written


def _member(name: str, value: Any) -> str:
    return json.dumps({name: value}, ensure_ascii=False)[1:-1]


class Qwen3Xml:
    name = "qwen3_xml"
    call_prefix = OPENER + "\n<function="
    name_suffix = ">"
    after_name = "\n"

    def scanner(self) -> ParameterAwareScanner:
        return ParameterAwareScanner()

    def reader(self, tools: Mapping[str, ToolSpec]) -> XmlCallReader:
        return XmlCallReader(tools)

    def parse(self, body: str, tools: Mapping[str, ToolSpec]) -> tuple[str, str] | None:
        head = _FUNCTION_OPEN.match(body)
        if head is None or head.group(1).strip() not in tools:
            return None
        tool = tools[head.group(1).strip()]
        tail = _FUNCTION_CLOSE.search(body, head.end())
        if tail is None:
            return None
        values = _read_parameters(body[head.end():tail.start()])
        if values is None:
            return None
        arguments: dict[str, Any] = {}
        for name, text in values:
            if name in arguments:
                return None  # a parameter given twice cannot be one JSON object
            value = typed_value(text, tool.parameter_schema(name))
            if value is not _MISSING:
                arguments[name] = value
        return tool.name, json.dumps(arguments, ensure_ascii=False)

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        lines = [OPENER, f"<function={name}>"]
        for key, value in (arguments.items() if isinstance(arguments, Mapping) else ()):
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            lines += [f"<parameter={key}>", text, _PARAM_CLOSE]
        lines += ["</function>", CLOSER]
        return "\n".join(lines)


def _read_parameters(text: str) -> list[tuple[str, str]] | None:
    """[(name, raw value)] of a function body; None if anything but whitespace lies between them
    or a parameter never closes."""
    values = []
    pos = 0
    while True:
        start = text.find(_PARAM_OPEN, pos)
        if start < 0:
            return values if not text[pos:].strip() else None
        if text[pos:start].strip():
            return None
        name_end = text.find(">", start)
        if name_end < 0:
            return None
        name = text[start + len(_PARAM_OPEN):name_end].strip()
        value_start = name_end + 1
        value_end = _matching_close(text, value_start)
        if value_end is None or not name:
            return None
        values.append((name, _strip_framing(text[value_start:value_end])))
        pos = value_end + len(_PARAM_CLOSE)


def _matching_close(text: str, pos: int) -> int | None:
    depth = 1
    while True:
        open_at = text.find(_PARAM_OPEN, pos)
        close_at = text.find(_PARAM_CLOSE, pos)
        if close_at < 0:
            return None
        if 0 <= open_at < close_at:
            depth += 1
            pos = open_at + len(_PARAM_OPEN)
            continue
        depth -= 1
        if depth == 0:
            return close_at
        pos = close_at + len(_PARAM_CLOSE)


def _strip_framing(value: str) -> str:
    """The newline after `<parameter=P>` and the one before `</parameter>` belong to the format."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def schema_types(schema: Mapping[str, Any] | None) -> set[str] | None:
    """The explicit JSON types a parameter's schema admits; None when it names none."""
    if not schema:
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            kinds = [o.get("type") if isinstance(o, dict) else None for o in options]
            if all(isinstance(k, str) for k in kinds):
                return set(kinds)
    return None


def typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A raw value as its schema's type. Strings stay as written; a value that does not fit its
    type is kept as a string for the client to judge; an empty non-string value is left out."""
    types = schema_types(schema)
    if types is None:
        try:
            return strict_json(text)
        except ValueError:
            return text
    if "string" in types:
        return text
    stripped = text.strip()
    if not stripped:
        return _MISSING
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if "null" in types and stripped == "null":
        return None
    try:
        value = strict_json(stripped)
    except ValueError:
        return text
    if isinstance(value, bool):
        return value if "boolean" in types else text
    if isinstance(value, int) and ({"integer", "number"} & types):
        return value
    if isinstance(value, float) and ("number" in types or ("integer" in types and value.is_integer())):
        return int(value) if "number" not in types else value
    if isinstance(value, dict) and "object" in types:
        return value
    if isinstance(value, list) and "array" in types:
        return value
    if value is None and "null" in types:
        return None
    return text


QWEN3_XML = Qwen3Xml()
