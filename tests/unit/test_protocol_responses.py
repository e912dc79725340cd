"""OpenAI Responses validation, rendering, the reasoning seal and the response store: pure logic, no model."""

from __future__ import annotations

import json

import pytest

from ember.errors import InvalidRequest
from ember.media.sources import DATA, URL, ImageRef
from ember.parsers.events import ContentText, ReasoningText, ThinkMarkers, ToolCall, ToolCallDelta, streamed_call
from ember.parsers.hermes import HERMES
from ember.protocols.chat_reply import FUNCTION, NONE, REQUIRED, ChatFeatures
from ember.protocols.neutral import ModelInfo, ResponseMeta, RunResult
from ember.protocols.openai_responses import parse_responses, responses_dialect
from ember.protocols.reasoning_seal import ReasoningSeal, SealError
from ember.server.keys import DEFAULT_TENANT
from ember.server.response_store import MemoryResponseStore, StoredResponse, record_size
from ember.server.responses_routes import list_page, make_context
from ember.types import FinishReason
from tests.e2e.responses_stream import check_stream

MODEL = ModelInfo(name="served", max_model_len=512, vocab_size=1000, chat=ChatFeatures(ThinkMarkers(), HERMES))
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}


def context(store: MemoryResponseStore | None = None):
    return make_context(store if store is not None else MemoryResponseStore(), ReasoningSeal(b"k" * 32))


def parse(ctx=None, **fields):
    return parse_responses({"input": "Hi", **fields}, MODEL, ctx or context())


def refused(ctx=None, **fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(ctx, **fields)
    return caught.value


def test_a_string_input_is_one_user_message_after_the_instructions():
    request = parse(instructions="Be brief.", max_output_tokens=20, temperature=0.5, top_k=4, seed=7,
                    stop=["\n\n"])
    assert request.prompt.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert request.prompt.tools is None and request.prompt_param == "input"
    params = request.params
    assert (params.max_tokens, params.temperature, params.top_k, params.seed, params.stop) == (20, 0.5, 4, 7,
                                                                                              ["\n\n"])
    [item] = request.spec.input_items
    assert item["type"] == "message" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "Hi"}]
    assert request.spec.store is True and request.spec.echo["instructions"] == "Be brief."


def test_assistant_items_in_a_row_form_one_turn_and_results_follow():
    items = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call", "call_id": "call_2", "name": "get", "namespace": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_2", "output": "Rain"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "Sun"}]},
        {"type": "message", "role": "assistant", "content": "It is sunny."},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Later."}]},
    ]
    messages = parse(input=items).prompt.messages
    assert messages[0] == {"role": "system", "content": "Use tools."}
    assert messages[2] == {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.",
                           "tool_calls": [
                               {"id": "call_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                               {"id": "call_2", "type": "function",
                                "function": {"name": "weather__get", "arguments": {}}}]}
    # The results come back in call order, whatever order they were sent in.
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "Sun"}
    assert messages[4] == {"role": "tool", "tool_call_id": "call_2", "content": "Rain"}
    # Reasoning after text cannot join that turn: it starts the next one.
    assert messages[5] == {"role": "assistant", "content": "It is sunny."}
    assert messages[6] == {"role": "assistant", "content": "", "reasoning_content": "Later."}


@pytest.mark.parametrize("items, param", [
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "input[0].call_id"),
    ([{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
      {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"}], "input[1].call_id"),
    ([{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "a", "output": "x"},
      {"type": "function_call_output", "call_id": "a", "output": "x"}], "input[2].call_id"),
    ([{"role": "user", "content": "x", "id": "same"}, {"role": "user", "content": "y", "id": "same"}], "input[1].id"),
    ([{"role": "robot", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_video", "video_url": "data:,"}]}], "input[0].content[0]"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[0].content[0]"),
    ([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}], "input[0].content"),
    ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
    ([{"type": "function_call", "call_id": "a", "name": "f"}], "input[0].arguments"),
])
def test_malformed_items_name_the_field(items, param):
    assert refused(input=items).param == param


@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include[1]"),
    ({"include": ["file_search_call.results", 3]}, "include[1]"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": {"id": "c"}}, "conversation"),
    ({"prompt": {"id": "p"}}, "prompt"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": []}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}}},
     "text.format.strict"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER], "tool_choice": "required"}, "text.format"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER],
      "tool_choice": {"type": "function", "name": "get_weather"}}, "text.format"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"metadata": {"k": None}}, "metadata.k"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [{"type": "file_search"}], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tools": [{**WEATHER, "strict": "yes"}]}, "tools[0].strict"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]}, "tools[0].tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"input": None}, "input"),
    ({"input": 5}, "input"),
])
def test_refusals_name_the_field(fields, param):
    assert refused(**fields).param == param


def test_text_format_becomes_the_grammar_and_is_echoed_as_sent():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}
    fmt = {"type": "json_schema", "name": "digit", "description": "One digit", "schema": schema, "strict": True}
    request = parse(text={"format": fmt, "verbosity": "low"})
    assert (request.grammar.kind, request.grammar.param) == ("json_schema", "text.format.schema")
    assert json.loads(request.grammar.text) == schema
    assert request.spec.echo["text"] == {"format": fmt, "verbosity": "low"}
    request = parse(text={"format": {"type": "json_object"}}, tools=[WEATHER], tool_choice="auto")
    assert (request.grammar.kind, request.grammar.param) == ("json_object", "text.format")
    assert request.spec.echo["text"] == {"format": {"type": "json_object"}}
    request = parse(text={"format": {"type": "text"}})
    assert request.grammar is None and request.spec.echo["text"] == {"format": {"type": "text"}}
    assert parse().grammar is None and parse().spec.echo["text"] == {"format": {"type": "text"}}


def test_strict_function_tools_are_held_to_their_schema():
    request = parse(tools=[{**WEATHER, "strict": True}, {**WEATHER, "name": "loose"}], tool_choice="required")
    assert [(t.name, t.strict) for t in request.chat.tools] == [("get_weather", True), ("loose", False)]
    assert request.chat.tools[0].parameters == WEATHER["parameters"]
    assert request.spec.echo["tools"][0]["strict"] is True and request.spec.echo["tools"][1]["strict"] is None


def test_tools_namespaces_custom_and_hosted():
    request = parse(tools=[
        {"type": "web_search"}, WEATHER,
        {"type": "namespace", "name": "mcp__files", "description": "Files", "tools": [
            {"type": "function", "name": "read", "parameters": {"type": "object", "properties": {}}}]},
        {"type": "custom", "name": "apply_patch", "description": "Patch files",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    ])
    options = request.chat
    assert [t.name for t in options.tools] == ["get_weather", "mcp__files__read", "apply_patch"]
    assert [t["function"]["name"] for t in request.prompt.tools] == ["get_weather", "mcp__files__read",
                                                                     "apply_patch"]
    refs = request.spec.refs
    assert (refs["mcp__files__read"].name, refs["mcp__files__read"].namespace) == ("read", "mcp__files")
    assert refs["apply_patch"].kind == "custom"
    patch = options.tools[2]
    assert patch.parameters["required"] == ["input"] and "start: /.+/" in patch.description
    assert [t["type"] for t in request.spec.echo["tools"]] == ["web_search", "function", "namespace", "custom"]
    assert options.tool_choice == "auto"


def test_tool_choice_narrows_and_forces():
    tools = [WEATHER, {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "get_weather"}]}]
    named = parse(tools=tools, tool_choice={"type": "function", "name": "get_weather", "namespace": "ns"}).chat
    assert named.tool_choice == FUNCTION and [t.name for t in named.tools] == ["ns__get_weather"]
    plain = parse(tools=tools, tool_choice={"type": "function", "name": "get_weather"}).chat
    assert [t.name for t in plain.tools] == ["get_weather"]
    allowed = parse(tools=tools, tool_choice={"type": "allowed_tools", "mode": "required", "tools": [
        {"type": "function", "name": "get_weather", "namespace": "ns"}]}).chat
    assert allowed.tool_choice == REQUIRED and [t.name for t in allowed.tools] == ["ns__get_weather"]
    none = parse(tools=tools, tool_choice="none")
    assert none.chat.tool_choice == NONE and none.prompt.tools is None
    hosted_only = parse(tools=[{"type": "web_search"}])
    assert hosted_only.chat.tool_choice == NONE and hosted_only.prompt.tools is None


def test_reasoning_effort_reaches_the_template():
    on = parse(reasoning={"effort": "high", "summary": "auto"})
    assert on.prompt.template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}
    assert on.chat.thinking is True and on.spec.echo["reasoning"] == {"effort": "high", "summary": "auto"}
    off = parse(reasoning={"effort": "none"})
    assert off.prompt.template_kwargs == {"enable_thinking": False} and off.chat.thinking is False
    assert parse().prompt.template_kwargs == {}


def test_encrypted_reasoning_is_read_back_and_cannot_be_forged():
    ctx = context()
    sealed = ctx.seal.seal("I should look it up.")
    assert "look it up" not in sealed
    items = [{"role": "user", "content": "Q"},
             {"type": "reasoning", "summary": [], "encrypted_content": sealed},
             {"role": "assistant", "content": "A"}, {"role": "user", "content": "Again"}]
    messages = parse(ctx, input=items).prompt.messages
    assert messages[1]["reasoning_content"] == "I should look it up."
    # The sealed text wins over a content the client changed.
    items[1] = {**items[1], "content": [{"type": "reasoning_text", "text": "Something else."}]}
    assert parse(ctx, input=items).prompt.messages[1]["reasoning_content"] == "I should look it up."
    for forged in (sealed[:-2] + "xx", "ember2.AAAA", ReasoningSeal(b"z" * 32).seal("mine"), "plain",
                   "ember1." + sealed[len("ember2."):]):
        items[1] = {"type": "reasoning", "summary": [], "encrypted_content": forged}
        error = refused(ctx, input=items)
        assert error.param == "input[1].encrypted_content" and error.code == "invalid_encrypted_content"


def test_seal_round_trips_any_text():
    seal = ReasoningSeal()
    for text in ("", "é" * 100, "x" * 10000):
        assert seal.open(seal.seal(text)) == text
    assert seal.seal("same") != seal.seal("same")  # a fresh nonce per item
    with pytest.raises(SealError):
        ReasoningSeal().open(seal.seal("another process"))


def test_a_key_file_lets_another_process_open_the_seal(tmp_path):
    key_file = tmp_path / "reasoning.key"
    key_file.write_text(bytes(range(32)).hex() + "\n")
    token = ReasoningSeal.from_key_file(str(key_file)).seal("kept across restarts")
    assert ReasoningSeal.from_key_file(str(key_file)).open(token) == "kept across restarts"
    for text, words in (("abc", "64 hexadecimal"), ("zz" * 32, "hexadecimal"), ("00" * 16, "64 hexadecimal")):
        key_file.write_text(text)
        with pytest.raises(ValueError, match=words):
            ReasoningSeal.from_key_file(str(key_file))
    with pytest.raises(ValueError, match="cannot read"):
        ReasoningSeal.from_key_file(str(tmp_path / "missing"))


def test_previous_response_id_rebuilds_the_stored_chain_without_its_instructions():
    store = MemoryResponseStore()
    ctx = context(store)
    history = ({"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
               {"id": "msg_2", "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]})
    store.put(StoredResponse({"id": "resp_1"}, history[:1], history, 10), DEFAULT_TENANT)
    request = parse(ctx, input="More", previous_response_id="resp_1", instructions="New rules.")
    assert request.prompt.messages == [{"role": "system", "content": "New rules."}, {"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "Hello!"},
                                       {"role": "user", "content": "More"}]
    assert request.spec.history == history
    # With the chain stored, input may be empty.
    assert parse(ctx, input=[], previous_response_id="resp_1").prompt.messages[-1]["role"] == "assistant"


# ---- images -------------------------------------------------------------------------------------------

PNG_URL = "data:image/png;base64,iVBORw0KGgo="


def input_image(url=PNG_URL, **extra):
    return {"type": "input_image", "image_url": url, **extra}


def test_input_images_become_image_refs_and_stay_as_sent_in_the_items():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "What is "}, input_image(detail="auto"),
                                          {"type": "input_text", "text": "?"}, input_image("https://x.org/a.png")]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1",
              "output": [{"type": "input_text", "text": "map:"}, input_image()]}]
    request = parse(input=items)
    user, _, tool = request.prompt.messages
    assert user["content"] == [
        {"type": "text", "text": "What is "},
        {"type": "image", "image": ImageRef(DATA, PNG_URL, "input[0].content[1].image_url")},
        {"type": "text", "text": "?"},
        {"type": "image", "image": ImageRef(URL, "https://x.org/a.png", "input[0].content[3].image_url")}]
    assert tool["content"] == [{"type": "text", "text": "map:"},
                               {"type": "image", "image": ImageRef(DATA, PNG_URL, "input[2].output[1].image_url")}]
    assert request.spec.input_items[0]["content"][1] == {"type": "input_image", "image_url": PNG_URL, "detail": "auto"}
    assert request.spec.input_items[0]["content"][3]["detail"] == "auto"  # as a stored item lists it
    json.dumps(request.spec.input_items)  # listed and sized as JSON


def test_a_stored_conversation_replays_its_images():
    store = MemoryResponseStore()
    ctx = context(store)
    first = parse(ctx, input=[{"role": "user", "content": [input_image(), {"type": "input_text", "text": "Hi"}]}])
    reply = {"id": "msg_2", "type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "A dot.", "annotations": []}]}
    history = (*first.spec.input_items, reply)
    store.put(StoredResponse({"id": "resp_1"}, tuple(first.spec.input_items), history,
                             record_size({"id": "resp_1"}, history)), DEFAULT_TENANT)
    again = parse(ctx, input=[{"role": "user", "content": [input_image("https://x.org/b.png")]}],
                  previous_response_id="resp_1")
    assert again.prompt.messages == [
        {"role": "user", "content": [{"type": "image", "image": ImageRef(DATA, PNG_URL, "previous_response_id")},
                                     {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "A dot."},
        {"role": "user", "content": [{"type": "image", "image": ImageRef(URL, "https://x.org/b.png",
                                                                         "input[0].content[0].image_url")}]}]


@pytest.mark.parametrize("part, param, code", [
    (input_image(detail="low"), "input[0].content[0].detail", "unsupported_parameter"),
    (input_image(detail="high"), "input[0].content[0].detail", "unsupported_parameter"),
    (input_image(detail="tiny"), "input[0].content[0].detail", None),
    ({"type": "input_image", "file_id": "file_1"}, "input[0].content[0].file_id", "unsupported_content"),
    ({"type": "input_image"}, "input[0].content[0].image_url", None),
    (input_image("s3://bucket/a.png"), "input[0].content[0].image_url", "invalid_media"),
    (input_image({"url": PNG_URL}), "input[0].content[0].image_url", None),
])
def test_malformed_input_images_are_refused_by_name(part, param, code):
    error = refused(input=[{"role": "user", "content": [part]}])
    assert (error.param, error.code) == (param, code)


@pytest.mark.parametrize("role", ["assistant", "system", "developer"])
def test_an_image_outside_user_messages_and_results_is_refused(role):
    error = refused(input=[{"role": role, "content": [input_image()]}, {"role": "user", "content": "Hi"}])
    assert (error.param, error.code) == ("input[0].content[0]", "unsupported_content")


def test_an_image_in_a_result_is_named_by_its_output_part():
    items = [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": [input_image(detail="high")]}]
    assert refused(input=items).param == "input[1].output[0].detail"


# ---- rendering ----------------------------------------------------------------------------------------

def render_stream(events, finish=FinishReason.STOP, **fields):
    ctx = context()
    request = parse(ctx, include=["reasoning.encrypted_content"], stream=True,
                    tools=[WEATHER, {"type": "custom", "name": "apply_patch"},
                           {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "get"}]}],
                    **fields)
    result = RunResult(1, [1, 2, 3])
    renderer = responses_dialect(ctx).renderer(request, result, ResponseMeta("resp_x", 100, "served", "fp", str))
    frames = renderer.stream_start()
    for event in events:
        frames += renderer.on_reply(event)
    result.choices[0].finish_reason = finish
    frames += renderer.stream_end()
    return [(frame.event, frame.data) for frame in frames], ctx


def test_a_stream_of_every_item_kind_passes_the_validator():
    events = [ReasoningText("Let me "), ReasoningText("think."), ContentText("Calling."),
              *streamed_call(ToolCall(0, "call_a", "get_weather", '{"city": "Paris"}')),
              *streamed_call(ToolCall(1, "call_b", "apply_patch", '{"input": "*** Begin Patch"}')),
              *streamed_call(ToolCall(2, "call_c", "ns__get", "{}")), ContentText("Done.")]
    frames, ctx = render_stream(events)
    final = check_stream(frames)
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call",
                                                          "custom_tool_call", "function_call", "message"]
    reasoning, _, call, custom, namespaced, _ = final["output"]
    assert ctx.seal.open(reasoning["encrypted_content"]) == "Let me think."
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert (call["call_id"], call["arguments"]) == ("call_a", '{"city": "Paris"}')
    assert custom["input"] == "*** Begin Patch" and custom["name"] == "apply_patch"
    assert (namespaced["name"], namespaced["namespace"]) == ("get", "ns")
    assert final["status"] == "completed" and final["completed_at"] is not None


def test_a_call_cut_short_streams_as_written_and_ends_incomplete():
    pieces = ['{"city": ', '"Par']
    events = [*streamed_call(ToolCall(0, "call_a", "get_weather", "".join(pieces), complete=False))]
    events[1:2] = [ToolCallDelta(0, piece) for piece in pieces]
    frames, _ = render_stream(events, finish=FinishReason.LENGTH)
    final = check_stream(frames)
    types = [kind for kind, _ in frames]
    added = types.index("response.output_item.added")
    assert types[added + 1:added + 3] == ["response.function_call_arguments.delta"] * 2
    assert final["status"] == "incomplete"
    [call] = final["output"]
    assert (call["status"], call["arguments"]) == ("incomplete", '{"city": "Par')


def test_a_reply_cut_by_the_token_limit_is_incomplete_and_invents_no_message():
    frames, _ = render_stream([ReasoningText("Still thinking")], finish=FinishReason.LENGTH)
    final = check_stream(frames)
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in final["output"]] == ["reasoning"]
    assert final["completed_at"] is None


def test_list_pages():
    items = [{"id": f"i{n}"} for n in range(5)]
    page = list_page(items, {"limit": "2"})
    assert [i["id"] for i in page["data"]] == ["i4", "i3"] and page["has_more"]
    assert (page["first_id"], page["last_id"]) == ("i4", "i3")
    rest = list_page(items, {"order": "asc", "after": "i2"})
    assert [i["id"] for i in rest["data"]] == ["i3", "i4"] and not rest["has_more"]
    assert list_page([], {})["first_id"] is None


def test_an_error_after_the_stream_opened_ends_it_with_response_failed():
    ctx = context()
    request = parse(ctx, stream=True)
    result = RunResult(1, [1, 2, 3])
    renderer = responses_dialect(ctx).renderer(request, result, ResponseMeta("resp_y", 100, "served", "fp", str))
    frames = renderer.stream_start() + renderer.on_reply(ContentText("Half an ans"))
    frames += renderer.stream_error(InvalidRequest("the engine stopped"))
    final = check_stream([(frame.event, frame.data) for frame in frames])
    assert [frame.data["type"] for frame in frames[-2:]] == ["error", "response.failed"]
    assert frames[-2].data["message"] == "the engine stopped"
    assert final["status"] == "failed" and final["error"] == {"code": "server_error", "message": "the engine stopped"}
    assert final["output"][0]["status"] == "incomplete"
    assert ctx.history_of("resp_y") is not None  # a failed response is stored like any other
