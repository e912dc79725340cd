"""Tool declarations ember takes without running them: Responses' hosted tools are accepted and
listed as ignored; Anthropic's input_examples reach the prompt and defer_loading is refused. Pure logic."""

from __future__ import annotations

import pytest

from ember.errors import InvalidRequest
from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.protocols.anthropic_messages import parse_messages
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.neutral import ModelInfo
from ember.protocols.openai_responses import parse_responses
from ember.protocols.reasoning_seal import ReasoningSeal
from ember.protocols.unknown_fields import watch_fields
from ember.server.response_store import MemoryResponseStore
from ember.server.responses_routes import make_context

MODEL = ModelInfo(name="served", max_model_len=2048, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), HERMES))
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}


def responses(**fields):
    return parse_responses({"input": "Hi", **fields}, MODEL, make_context(MemoryResponseStore(), ReasoningSeal(b"k" * 32)))


@pytest.mark.parametrize("strict", [False, True])
def test_hosted_tools_are_accepted_and_listed_as_ignored(strict):
    tools = [{"type": "web_search"}, WEATHER, {"type": "mcp", "server_label": "x", "server_url": "https://x"},
             {"type": "file_search", "vector_store_ids": ["vs_1"]}]
    with watch_fields(strict) as report:
        request = responses(tools=tools, unknown_extra=None)
    assert [tool["function"]["name"] for tool in request.prompt.tools] == ["get_weather"]
    assert report.ignored == ["tools[0]", "tools[2]", "tools[3]"]
    assert report.header_value() == "tools[0], tools[2], tools[3]"


def test_a_hosted_tool_named_in_allowed_tools_is_listed_too():
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_weather"},
                                                                 {"type": "web_search"}]}
    with watch_fields(False) as report:
        request = responses(tools=[WEATHER, {"type": "web_search"}], tool_choice=choice)
    assert [tool.name for tool in request.chat.tools] == ["get_weather"]
    assert report.ignored == ["tools[1]", "tool_choice.tools[1]"]


def anthropic(**fields):
    body = {"model": "claude", "max_tokens": 32, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse_messages(body, MODEL)


def anthropic_refusal(**fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        anthropic(**fields)
    return caught.value


def test_input_examples_reach_the_prompt_with_the_description():
    tool = {"name": "get_weather", "description": "Weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            "input_examples": [{"city": "Paris"}, {"city": "Zürich"}]}
    bare = {"name": "ping", "input_examples": [{}]}
    tools = anthropic(tools=[tool, bare]).prompt.tools
    described = {t["function"]["name"]: t["function"]["description"] for t in tools}
    assert described == {"get_weather": 'Weather in a city.\n\nInput examples:\n{"city": "Paris"}\n{"city": "Zürich"}',
                         "ping": "Input examples:\n{}"}


@pytest.mark.parametrize("tool, param", [
    ({"name": "f", "input_examples": [{"a": 1}, "a"]}, "tools[0].input_examples[1]"),
    ({"name": "f", "input_examples": {"a": 1}}, "tools[0].input_examples"),
    ({"name": "f", "input_examples": [{}] * 33}, "tools[0].input_examples"),
])
def test_malformed_input_examples_are_refused_by_name(tool, param):
    assert anthropic_refusal(tools=[tool]).param == param


def test_defer_loading_is_refused_by_name_unless_false():
    error = anthropic_refusal(tools=[{"name": "f"}, {"name": "g", "defer_loading": True}])
    assert (error.param, error.code) == ("tools[1].defer_loading", "unsupported_parameter")
    assert [t.name for t in anthropic(tools=[{"name": "g", "defer_loading": False}]).chat.tools] == ["g"]
