"""Tool calls stream as they are written, in every chat dialect, and a call cut short by max_tokens
is the same streamed and whole: through the openai and anthropic libraries against a real ember
serve on the default model (greedy, so both runs of a request are the same tokens)."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.e2e.conftest import wait_idle

ASK = "What is the weather in Paris?"
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "description": "Get the local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOLS = [{"type": "function", "function": tool} for tool in (WEATHER, TIME)]
RESPONSES_TOOLS = [{"type": "function", **tool} for tool in (WEATHER, TIME)]
ANTHROPIC_TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                   for t in (WEATHER, TIME)]
# 12 tokens end the forced call inside its name; 20 inside its arguments; 64 let it close.
CUT_NAME, CUT_ARGUMENTS, WHOLE = 12, 20, 64


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)


# ---- Chat Completions ---------------------------------------------------------------------------------

def chat(client, model_id, max_tokens, **fields):
    return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": ASK}],
                                          tools=CHAT_TOOLS, tool_choice="required", temperature=0,
                                          max_tokens=max_tokens, **fields)


def chat_stream(client, model_id, max_tokens) -> tuple[list[tuple[str, int]], dict]:
    """(what each chunk carried, in order: ("name", index) or ("arguments", index); the joined reply)."""
    order: list[tuple[str, int]] = []
    reply = {"content": "", "calls": {}, "finish": None}
    for chunk in chat(client, model_id, max_tokens, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reply["content"] += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = reply["calls"].setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            if delta.id:
                call["id"] = delta.id
            if delta.function and delta.function.name:
                call["name"] += delta.function.name
                order.append(("name", delta.index))
            if delta.function and delta.function.arguments:
                call["arguments"] += delta.function.arguments
                order.append(("arguments", delta.index))
        reply["finish"] = choice.finish_reason or reply["finish"]
    return order, reply


def chat_whole(client, model_id, max_tokens) -> dict:
    choice = chat(client, model_id, max_tokens).choices[0]
    calls = {i: {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for i, c in enumerate(choice.message.tool_calls or [])}
    return {"content": choice.message.content or "", "calls": calls, "finish": choice.finish_reason}


def without_ids(reply: dict) -> dict:
    return {**reply, "calls": {i: {k: v for k, v in call.items() if k != "id"} for i, call in reply["calls"].items()}}


def test_a_chat_call_streams_its_name_first_then_its_arguments_in_pieces(client, model_id, http):
    order, streamed = chat_stream(client, model_id, WHOLE)
    whole = chat_whole(client, model_id, WHOLE)
    assert whole["finish"] == streamed["finish"] == "tool_calls"
    assert without_ids(streamed) == without_ids(whole)
    assert order[0] == ("name", 0), "the name comes before any argument piece"
    assert order.count(("name", 0)) == 1
    assert order.count(("arguments", 0)) >= 2, "the arguments arrive as they are written, not at once"
    assert json.loads(streamed["calls"][0]["arguments"]) == json.loads(whole["calls"][0]["arguments"])
    wait_idle(http)


# ---- Responses ----------------------------------------------------------------------------------------

def respond(client, model_id, max_tokens, **fields):
    return client.responses.create(model=model_id, input=ASK, tools=RESPONSES_TOOLS, tool_choice="required",
                                   temperature=0, max_output_tokens=max_tokens, **fields)


def output_of(response) -> list[dict]:
    items = []
    for item in response.output:
        if item.type == "function_call":
            items.append({"type": item.type, "name": item.name, "arguments": item.arguments, "status": item.status})
        else:
            items.append({"type": item.type, "text": "".join(part.text for part in item.content)})
    return items


def responses_stream(client, model_id, max_tokens) -> tuple[list[str], object]:
    kinds, final = [], None
    for event in respond(client, model_id, max_tokens, stream=True):
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    return kinds, final


def test_a_responses_call_streams_its_item_first_then_argument_deltas(client, model_id, http):
    kinds, final = responses_stream(client, model_id, WHOLE)
    whole = respond(client, model_id, WHOLE)
    assert output_of(final) == output_of(whole)
    assert final.output[-1].type == "function_call" and final.status == "completed"
    # The first call: its item, then its argument deltas (more than one), then their end.
    added, done = kinds.index("response.output_item.added"), kinds.index("response.function_call_arguments.done")
    between = kinds[added + 1:done]
    assert set(between) == {"response.function_call_arguments.delta"} and len(between) >= 2
    wait_idle(http)


# ---- Anthropic Messages -------------------------------------------------------------------------------

def message_fields(max_tokens) -> dict:
    return {"model": "ember-local", "max_tokens": max_tokens, "messages": [{"role": "user", "content": ASK}],
            "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}, "extra_body": {"temperature": 0}}


def blocks_of(message) -> list[dict]:
    blocks = []
    for block in message.content:
        if block.type == "tool_use":
            blocks.append({"type": "tool_use", "name": block.name, "input": block.input})
        else:
            blocks.append({"type": block.type, "text": getattr(block, "text", None)})
    return blocks


def test_an_anthropic_tool_use_streams_its_block_first_then_input_pieces(claude, http):
    with claude.messages.stream(**message_fields(WHOLE)) as stream:
        kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None)) for event in stream
                 if event.type.startswith(("message_", "content_block_"))]  # the wire's events, not the SDK's
        final = stream.get_final_message()
    whole = claude.messages.create(**message_fields(WHOLE))
    assert blocks_of(final) == blocks_of(whole) and final.stop_reason == whole.stop_reason == "tool_use"
    # The first block: its start, then its input pieces (more than one), then its stop.
    start, stop = kinds.index(("content_block_start", None)), kinds.index(("content_block_stop", None))
    between = kinds[start + 1:stop]
    assert set(between) == {("content_block_delta", "input_json_delta")} and len(between) >= 2
    wait_idle(http)


# ---- a call cut short: one shape in every dialect -------------------------------------------------------

def chat_both(client, claude, model_id, max_tokens) -> tuple[dict, dict]:
    def parts(reply):
        calls = [("call", c["name"], c["arguments"]) for c in reply["calls"].values()]
        return {"parts": ([("text", reply["content"])] if reply["content"] else []) + calls, "end": reply["finish"]}
    return parts(chat_stream(client, model_id, max_tokens)[1]), parts(chat_whole(client, model_id, max_tokens))


def responses_both(client, claude, model_id, max_tokens) -> tuple[dict, dict]:
    def parts(response):
        return {"parts": [("call", i["name"], i["arguments"]) if i["type"] == "function_call" else ("text", i["text"])
                          for i in output_of(response)], "end": response.status}
    return parts(responses_stream(client, model_id, max_tokens)[1]), parts(respond(client, model_id, max_tokens))


def messages_both(client, claude, model_id, max_tokens) -> tuple[dict, dict]:
    def parts(message):
        return {"parts": [("call", b["name"], b["input"]) if b["type"] == "tool_use" else ("text", b["text"])
                          for b in blocks_of(message)], "end": message.stop_reason}
    with claude.messages.stream(**message_fields(max_tokens)) as stream:
        final = stream.get_final_message()
    return parts(final), parts(claude.messages.create(**message_fields(max_tokens)))


# (runs one request streamed and whole, the end a cut reply reports)
DIALECTS = {"chat": (chat_both, "length"), "responses": (responses_both, "incomplete"),
            "messages": (messages_both, "max_tokens")}


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_a_call_cut_short_is_the_same_streamed_and_whole(dialect, client, claude, model_id, http):
    both, cut_end = DIALECTS[dialect]
    # Cut inside its name, the call never started: its markup is the reply's text.
    streamed, whole = both(client, claude, model_id, CUT_NAME)
    assert streamed == whole
    [(kind, text)] = whole["parts"]
    assert kind == "text" and text.startswith("<tool_call>") and whole["end"] == cut_end
    # Cut inside its arguments, it is the named call with its arguments as far as they were written,
    # and the reply's end never says the calls can run.
    streamed, whole = both(client, claude, model_id, CUT_ARGUMENTS)
    assert streamed == whole
    [(kind, name, arguments)] = whole["parts"]
    assert (kind, name, whole["end"]) == ("call", "get_weather", cut_end)
    if dialect == "messages":
        assert arguments == {}  # an object: only the members written whole, none yet
    else:
        assert arguments and '{"city": "Paris"}'.startswith(arguments)
    wait_idle(http)
