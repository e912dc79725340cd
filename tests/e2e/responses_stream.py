"""Reading and checking Responses event streams: the raw SSE frames, and every rule a client relies on."""

from __future__ import annotations

import json

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
TEXT_DELTAS = {"response.output_text.delta": "response.output_text.done",
               "response.reasoning_text.delta": "response.reasoning_text.done"}
CALL_DELTAS = {"response.function_call_arguments.delta": ("response.function_call_arguments.done", "arguments"),
               "response.custom_tool_call_input.delta": ("response.custom_tool_call_input.done", "input")}


def raw_events(http, body: dict) -> list[tuple[str | None, dict]]:
    """(the `event:` name, the JSON data) of every frame of a streamed create."""
    events: list[tuple[str | None, dict]] = []
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = line[len("data: "):]
                assert data != "[DONE]", "a Responses stream has no [DONE] sentinel"
                events.append((name, json.loads(data)))
                name = None
    return events


def check_stream(events: list[tuple[str | None, dict]]) -> dict:
    """Assert the Responses streaming rules; return the terminal event's response object."""
    assert events, "the stream sent no event"
    for name, data in events:
        assert name == data["type"], f"event line {name!r} differs from the data's type {data['type']!r}"
        STREAM_EVENT.validate_python(data)  # every field the SDK declares, with its type
    datas = [data for _, data in events]
    types = [data["type"] for data in datas]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in TERMINAL and sum(t in TERMINAL for t in types) == 1, types
    response_id = datas[0]["response"]["id"]
    for data in (datas[0], datas[1], datas[-1]):
        assert data["response"]["id"] == response_id and data["response"]["model"]
        assert isinstance(data["response"]["created_at"], int)
    assert datas[0]["response"]["status"] == "in_progress"

    items: list[dict] = []
    current: dict | None = None
    body = datas[2:-1]
    if types[-1] == "response.failed":
        assert types[-2] == "error", "a failed stream sends an error event just before response.failed"
        assert datas[-2]["message"]
        body = datas[2:-2]
    for data in body:
        kind = data["type"]
        if kind == "response.output_item.added":
            assert current is None, "items do not interleave"
            assert data["output_index"] == len(items)
            current = {"id": data["item"]["id"], "index": data["output_index"], "parts": [], "calls": "",
                       "call_done": None, "done": None, "type": data["item"]["type"]}
            items.append(current)
            continue
        assert current is not None, f"{kind} outside an item"
        assert data["output_index"] == current["index"]
        if kind == "response.output_item.done":
            assert data["item"]["id"] == current["id"] and data["item"]["type"] == current["type"]
            assert all(part["done"] for part in current["parts"]), "every content part is closed first"
            current["done"] = data["item"]
            current = None
            continue
        assert data["item_id"] == current["id"]
        if kind == "response.content_part.added":
            assert data["content_index"] == len(current["parts"])
            assert data["part"]["text"] == ""
            current["parts"].append({"text": "", "text_done": None, "done": None})
        elif kind in TEXT_DELTAS:
            part = current["parts"][data["content_index"]]
            assert part["text_done"] is None
            part["text"] += data["delta"]
        elif kind in TEXT_DELTAS.values():
            part = current["parts"][data["content_index"]]
            assert data["text"] == part["text"], "joined deltas equal the done text"
            part["text_done"] = data["text"]
        elif kind == "response.content_part.done":
            part = current["parts"][data["content_index"]]
            assert part["text_done"] is not None and data["part"]["text"] == part["text"]
            part["done"] = data["part"]
        elif kind in CALL_DELTAS:
            assert current["call_done"] is None
            current["calls"] += data["delta"]
        elif kind in (done for done, _ in CALL_DELTAS.values()):
            field = "arguments" if kind.startswith("response.function_call") else "input"
            assert data[field] == current["calls"], "joined deltas equal the call's text"
            current["call_done"] = data[field]
        else:
            raise AssertionError(f"unexpected event {kind}")
    assert current is None, "every item is closed before the terminal event"

    final = datas[-1]["response"]
    Response.model_validate(final)
    assert final["output"] == [item["done"] for item in items], "the final output is the items as streamed"
    for item in items:
        done = item["done"]
        if done["type"] in ("message", "reasoning"):
            assert [p["text"] for p in done["content"]] == [p["text"] for p in item["parts"]]
        elif done["type"] == "function_call":
            assert done["arguments"] == item["calls"]
        elif done["type"] == "custom_tool_call":
            assert done["input"] == item["calls"]
    status = {"response.completed": "completed", "response.incomplete": "incomplete",
              "response.failed": "failed"}[types[-1]]
    assert final["status"] == status
    return final
