"""Reply parsers: reasoning markers and tool-call formats, chosen by name or found in the chat template."""

from __future__ import annotations

from ember.errors import EmberError
from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.parsers.qwen3_xml import QWEN3_XML
from ember.parsers.tool_format import ToolFormat

REASONING_PARSERS: dict[str, ThinkMarkers] = {"think": ThinkMarkers("<think>", "</think>")}
TOOL_PARSERS: dict[str, ToolFormat] = {HERMES.name: HERMES, QWEN3_XML.name: QWEN3_XML}
AUTO, NONE = "auto", "none"


def resolve_reasoning(choice: str, template: str | None) -> ThinkMarkers | None:
    """`auto`: the think markers when the template writes them; `none`: no reasoning parser."""
    if choice == NONE:
        return None
    if choice == AUTO:
        markers = REASONING_PARSERS["think"]
        return markers if template and (markers.start in template or markers.end in template) else None
    if choice not in REASONING_PARSERS:
        raise EmberError(f"unknown reasoning parser {choice!r}; choose from {AUTO}, {NONE}, "
                         f"{', '.join(REASONING_PARSERS)}", param="reasoning_parser")
    return REASONING_PARSERS[choice]


def resolve_tool_format(choice: str, template: str | None) -> ToolFormat | None:
    """`auto`: the XML format when the template writes `<function=`, else hermes (which ember also
    teaches a template that cannot list tools); `none`: tool calls are refused."""
    if choice == NONE:
        return None
    if choice == AUTO:
        return QWEN3_XML if template and "<function=" in template else HERMES
    if choice not in TOOL_PARSERS:
        raise EmberError(f"unknown tool-call parser {choice!r}; choose from {AUTO}, {NONE}, "
                         f"{', '.join(TOOL_PARSERS)}", param="tool_call_parser")
    return TOOL_PARSERS[choice]
