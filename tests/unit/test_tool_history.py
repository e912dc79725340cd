"""Tool results against the calls they answer, in Anthropic Messages and Responses: matched by id,
put back in call order, and refused by name where the history does not hold together. Pure logic."""

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
from ember.server.response_store import MemoryResponseStore
from ember.server.responses_routes import make_context

MODEL = ModelInfo(name="served", max_model_len=2048, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), HERMES))


# ---- Anthropic Messages ---------------------------------------------------------------------------

def tool_use(call_id: str) -> dict:
    return {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {}}


def tool_result(call_id: str, text: str = "ok") -> dict:
    return {"type": "tool_result", "tool_use_id": call_id, "content": text}


def messages_with(results: list[dict], calls=("toolu_a", "toolu_b")) -> list[dict]:
    return [{"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [tool_use(c) for c in calls]},
            {"role": "user", "content": results}]


def anthropic(messages: list[dict]):
    return parse_messages({"model": "claude", "max_tokens": 32, "messages": messages}, MODEL).prompt.messages


def anthropic_refusal(messages: list[dict]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        anthropic(messages)
    return caught.value


def test_anthropic_results_sent_out_of_order_render_in_call_order():
    got = anthropic(messages_with([{"type": "text", "text": "Thanks."}, tool_result("toolu_b", "rain"),
                                   tool_result("toolu_a", "sun")]))
    assert [(m["role"], m.get("tool_call_id"), m["content"]) for m in got[2:]] == [
        ("tool", "toolu_a", "sun"), ("tool", "toolu_b", "rain"), ("user", None, "Thanks.")]


@pytest.mark.parametrize("results, param, named", [
    ([tool_result("toolu_a"), tool_result("toolu_zzz")], "messages[2].content[1].tool_use_id", "toolu_zzz"),
    ([tool_result("toolu_a"), tool_result("toolu_a"), tool_result("toolu_b")], "messages[2].content[1].tool_use_id",
     "toolu_a"),
    ([tool_result("toolu_b")], "messages[2].content", "toolu_a"),
    ([{"type": "text", "text": "never mind"}], "messages[2].content", "toolu_a"),
])
def test_anthropic_unknown_repeated_and_missing_results_are_refused_by_name(results, param, named):
    error = anthropic_refusal(messages_with(results))
    assert (error.param, error.code) == (param, "invalid_tool_history")
    assert f"'{named}'" in error.message


def test_anthropic_results_must_answer_the_turn_right_before_them():
    messages = [*messages_with([tool_result("toolu_a"), tool_result("toolu_b")]),
                {"role": "assistant", "content": "Sunny and rainy."},
                {"role": "user", "content": [tool_result("toolu_a")]}]
    assert anthropic_refusal(messages).param == "messages[4].content[0].tool_use_id"


def test_anthropic_a_history_that_opens_with_results_is_kept_as_truncated():
    got = anthropic([{"role": "user", "content": [tool_result("toolu_old", "42"), {"type": "text", "text": "So?"}]}])
    assert got == [{"role": "tool", "tool_call_id": "toolu_old", "content": "42"}, {"role": "user", "content": "So?"}]


def test_anthropic_a_system_turn_between_calls_and_results_is_passed_over():
    messages = messages_with([tool_result("toolu_b"), tool_result("toolu_a")])
    messages.insert(2, {"role": "system", "content": "Be brief."})
    got = anthropic(messages)
    assert [m.get("tool_call_id") for m in got[3:]] == ["toolu_a", "toolu_b"]


# ---- Responses --------------------------------------------------------------------------------------

def call(call_id: str, kind: str = "function_call") -> dict:
    if kind == "custom_tool_call":
        return {"type": kind, "call_id": call_id, "name": "apply_patch", "input": "*** Begin Patch"}
    return {"type": kind, "call_id": call_id, "name": "get_weather", "arguments": "{}"}


def output(call_id: str, text: str = "ok", kind: str = "function_call_output") -> dict:
    return {"type": kind, "call_id": call_id, "output": text}


def responses(items: list[dict], ctx=None):
    ctx = ctx or make_context(MemoryResponseStore(), ReasoningSeal(b"k" * 32))
    return parse_responses({"input": [{"role": "user", "content": "Weather?"}, *items]}, MODEL, ctx)


def responses_refusal(items: list[dict]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        responses(items)
    return caught.value


def test_responses_results_render_in_call_order_for_every_kind_of_call():
    items = [call("c1"), call("c2", "custom_tool_call"), output("c2", "patched", "custom_tool_call_output"),
             output("c1", "sun")]
    got = responses(items).prompt.messages
    assert [(m["role"], m.get("tool_call_id"), m["content"]) for m in got[2:]] == [
        ("tool", "c1", "sun"), ("tool", "c2", "patched")]


def test_responses_a_partial_set_of_results_is_refused_by_name():
    error = responses_refusal([call("c1"), call("c2"), output("c2"), {"role": "user", "content": "and?"}])
    assert (error.param, error.code) == ("input[1].call_id", "invalid_tool_history")
    assert "'c1'" in error.message
    # At the end of the input too: the turn's results are all the client sent.
    assert responses_refusal([call("c1"), call("c2"), output("c1")]).param == "input[2].call_id"


def test_responses_a_turn_whose_calls_have_no_results_at_all_is_kept():
    got = responses([call("c1"), {"role": "user", "content": "Skip that."}]).prompt.messages
    assert got[1]["tool_calls"][0]["id"] == "c1" and got[2] == {"role": "user", "content": "Skip that."}


@pytest.mark.parametrize("items, param", [
    ([call("c1"), output("c9")], "input[2].call_id"),
    ([call("c1"), output("c1"), {"role": "user", "content": "more"}, call("c2"), output("c1")], "input[5].call_id"),
])
def test_responses_a_result_answers_only_the_turn_before_it(items, param):
    error = responses_refusal(items)
    assert (error.param, error.code) == (param, "invalid_tool_history")


def test_responses_results_for_a_stored_turn_answer_its_calls():
    ctx = make_context(MemoryResponseStore(), ReasoningSeal(b"k" * 32))
    stored = [{"id": "fc_1", "type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}",
               "status": "completed"},
              {"id": "fc_2", "type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}",
               "status": "completed"}]
    ctx.history_of = lambda response_id: tuple(stored) if response_id == "resp_1" else None
    request = parse_responses({"previous_response_id": "resp_1", "input": [output("c2", "rain"), output("c1", "sun")]},
                              MODEL, ctx)
    assert [m["tool_call_id"] for m in request.prompt.messages[1:]] == ["c1", "c2"]
    with pytest.raises(InvalidRequest) as caught:
        parse_responses({"previous_response_id": "resp_1", "input": [output("c2")]}, MODEL, ctx)
    assert (caught.value.param, caught.value.code) == ("input[0].call_id", "invalid_tool_history")
    assert "'c1'" in caught.value.message
