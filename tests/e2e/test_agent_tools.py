"""Agents' tool history through the openai and anthropic client libraries, on the shared servers:
tool results put back in call order or refused by name, hosted tools and unenforceable grammars
listed as ignored, input_examples in the prompt, defer_loading refused, a custom tool's grammar
holding the model's call, and a later system message rendered where the template drops it."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from ember.protocols.sampling_fields import PRIORITIES

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLAUDE_WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
                  "input_schema": WEATHER["parameters"]}
SHELL = {"type": "custom", "name": "shell", "description": "Run a read-only shell command.",
         "format": {"type": "grammar", "syntax": "regex", "definition": r"(ls|pwd|whoami)( -l)?"}}
IGNORED = "x-ember-ignored-fields"


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def claude_calls(*results: dict) -> list[dict]:
    return [{"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_paris", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_rome", "name": "get_weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": list(results)}]


def result(call_id: str, text: str) -> dict:
    return {"type": "tool_result", "tool_use_id": call_id, "content": text}


def test_anthropic_results_in_any_order_give_the_same_prompt(claude):
    in_order = claude_calls(result("toolu_paris", "sunny"), result("toolu_rome", "rainy"))
    reversed_ = claude_calls(result("toolu_rome", "rainy"), result("toolu_paris", "sunny"))
    counts = [claude.messages.count_tokens(model="m", tools=[CLAUDE_WEATHER], messages=m).input_tokens
              for m in (in_order, reversed_)]
    assert counts[0] == counts[1]
    reply = claude.messages.create(model="m", max_tokens=4, tools=[CLAUDE_WEATHER], messages=reversed_,
                                   extra_body={"temperature": 0})
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("results, named", [
    ([result("toolu_paris", "sunny"), result("toolu_london", "foggy")], "messages[2].content[1].tool_use_id"),
    ([result("toolu_paris", "sunny")], "'toolu_rome'"),
])
def test_anthropic_an_unknown_or_missing_result_is_a_400_naming_it(claude, results, named):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="m", max_tokens=4, tools=[CLAUDE_WEATHER], messages=claude_calls(*results))
    assert named in caught.value.body["error"]["message"]


def responses_calls(*outputs: dict) -> list[dict]:
    return [{"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "function_call", "call_id": "call_paris", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_rome", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            *outputs]


def output(call_id: str, text: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


def test_responses_results_in_any_order_give_the_same_prompt(client, model_id):
    in_order = responses_calls(output("call_paris", "sunny"), output("call_rome", "rainy"))
    reversed_ = responses_calls(output("call_rome", "rainy"), output("call_paris", "sunny"))
    counts = [client.responses.input_tokens.count(model=model_id, tools=[WEATHER], input=items).input_tokens
              for items in (in_order, reversed_)]
    assert counts[0] == counts[1]


def test_responses_a_partial_set_of_results_is_a_400_naming_the_call(client, model_id):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model_id, max_output_tokens=4, tools=[WEATHER],
                                input=responses_calls(output("call_rome", "rainy")))
    error = caught.value.body
    assert (error["param"], error["code"]) == ("input[1].call_id", "invalid_tool_history")
    assert "'call_paris'" in error["message"]


def test_hosted_tools_are_listed_as_ignored_in_the_header_and_the_request_log(client, model_id, http):
    tools = [{"type": "web_search"}, WEATHER, {"type": "file_search", "vector_store_ids": ["vs"]}]
    raw = client.responses.with_raw_response.create(model=model_id, input="Hello.", max_output_tokens=4, tools=tools)
    assert raw.headers[IGNORED] == "tools[0], tools[2]"
    assert [tool.type for tool in raw.parse().tools] == ["web_search", "function", "file_search"]
    entries = http.get("/debug/requests").json()["data"]
    [entry] = [e for e in entries if e["request_id"] == raw.headers["x-request-id"]]
    assert entry["ignored_fields"] == ["tools[0]", "tools[2]"]


def test_a_custom_tools_grammar_holds_a_hermes_json_call(client, model_id):
    # The main server's model writes hermes JSON calls: the grammar holds the input's JSON string.
    raw = client.responses.with_raw_response.create(model=model_id, input="List the files.", tools=[SHELL],
                                                    tool_choice={"type": "custom", "name": "shell"},
                                                    max_output_tokens=48, temperature=0)
    assert IGNORED not in raw.headers
    [call] = [item for item in raw.parse().output if item.type == "custom_tool_call"]
    assert call.name == "shell" and re.fullmatch(r"(ls|pwd|whoami)( -l)?", call.input), call.input


def test_anthropic_input_examples_reach_the_prompt_and_defer_loading_is_refused(claude):
    ask = [{"role": "user", "content": "Weather?"}]
    plain = claude.messages.count_tokens(model="m", tools=[CLAUDE_WEATHER], messages=ask).input_tokens
    examples = {**CLAUDE_WEATHER, "input_examples": [{"city": "Paris"}, {"city": "Lagos"}]}
    shown = claude.messages.count_tokens(model="m", tools=[examples], messages=ask).input_tokens
    assert shown > plain
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="m", max_tokens=4, messages=ask,
                               tools=[{**CLAUDE_WEATHER, "defer_loading": True}])
    assert "defer_loading" in caught.value.body["error"]["message"]


@pytest.fixture(scope="module")
def xml_client(thinking_xml_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=thinking_xml_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_custom_tools_grammar_holds_the_call_the_model_writes(xml_client, model_id):
    reply = xml_client.responses.create(model=model_id, input="Show me the files here.", tools=[SHELL],
                                        tool_choice={"type": "custom", "name": "shell"}, max_output_tokens=64,
                                        temperature=0)
    [call] = [item for item in reply.output if item.type == "custom_tool_call"]
    assert call.name == "shell" and re.fullmatch(r"(ls|pwd|whoami)( -l)?\n?", call.input), call.input


def test_a_custom_tools_grammar_xgrammar_cannot_compile_is_a_400_naming_it(xml_client, model_id):
    broken = {**SHELL, "format": {"type": "grammar", "syntax": "lark", "definition": "start: ???"}}
    with pytest.raises(openai.BadRequestError) as caught:
        xml_client.responses.create(model=model_id, input="Hi", tools=[broken], max_output_tokens=4)
    assert caught.value.body["param"] == "tools[0].format.definition"


def test_a_later_system_message_the_template_drops_reaches_the_prompt(thinking_server):
    # think_hermes.jinja renders a system message at the start only: a later one becomes a user turn.
    claude_thinking = anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0, timeout=120)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    ask = {"role": "user", "content": "Weather?"}
    note = {"role": "system", "content": "The user reads on a small phone screen; keep answers short."}
    without = claude_thinking.messages.count_tokens(model="m", messages=[*history, ask]).input_tokens
    with_note = claude_thinking.messages.count_tokens(model="m", messages=[*history, note, ask]).input_tokens
    assert with_note > without
    with httpx.Client(base_url=thinking_server.url, timeout=120) as http:
        reply = http.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [*history, note, ask]})
    assert reply.status_code == 200


def test_claude_code_s_session_title_requests_run_as_background_work(claude, http):
    title_system = ("Analyze if this message indicates a new conversation topic. If it does, extract a 2-3 word "
                    "title that captures the new topic.")
    asked = {}
    for kind, system in (("title", title_system), ("turn", "You are a helpful assistant.")):
        raw = claude.messages.with_raw_response.create(model="m", max_tokens=4, system=system,
                                                       messages=[{"role": "user", "content": "Fix the login bug."}])
        asked[kind] = raw.headers["x-request-id"]
    entries = {e["request_id"]: e for e in http.get("/debug/requests").json()["data"]}
    assert entries[asked["title"]]["sampling"]["priority"] == PRIORITIES["background"]
    assert entries[asked["turn"]]["sampling"]["priority"] == PRIORITIES["foreground"]
