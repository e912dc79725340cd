"""Responses input items: validated into one normalized form, and turned into chat messages.

The normalized form is what `GET /v1/responses/{id}/input_items` lists and what a stored response
keeps as its conversation; output items (reasoning, message, function_call, custom_tool_call) are
already in it, so a stored chain is rebuilt by reading its items back through the same code.

Chat messages: system and developer items become system turns; assistant-owned items in a row
(reasoning, assistant messages, calls) become one assistant turn in the order reasoning -> text ->
calls, and an item that would go back in that order starts a new assistant turn; results become
`tool` turns, matched to their calls by `call_id` and put in call order (tool_history).

Images (input_image parts of user messages and of results) stay in the normalized form as sent, so
they are listed and stored as JSON; each time a conversation is built, its chat message gets an
ImageRef made from the part, so a stored conversation replays its images (an http(s) URL is
fetched again: a data URL keeps the image's bytes themselves).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from ember.errors import InvalidRequest
from ember.media.sources import image_ref
from ember.protocols.cache_hints import mark, read_openai_breakpoint
from ember.protocols.fields import Fields, as_string, json_type
from ember.protocols.image_parts import misplaced_image, read_responses_image
from ember.protocols.reasoning_seal import ReasoningSeal, SealError
from ember.protocols.tool_history import INVALID_TOOL_HISTORY, Answer, Call, in_call_order
from ember.tokenization.message_content import build_content, content_length, image_part

ROLES = ("user", "assistant", "system", "developer")
MEDIA_PARTS = ("input_file", "input_audio", "input_video", "image_url")  # parts ember cannot read
ID_PREFIXES = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_", "function_call_output": "fco_",
               "custom_tool_call": "ctc_", "custom_tool_call_output": "ctco_", "local_shell_call": "lsh_",
               "local_shell_call_output": "lsho_"}
CALLS = ("function_call", "custom_tool_call", "local_shell_call")
RESULTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
LOCAL_SHELL = "local_shell"  # the name a past local_shell_call has in the prompt (Codex's history)
NAMESPACE_JOIN = "__"


def new_item_id(kind: str) -> str:
    return ID_PREFIXES[kind] + secrets.token_hex(12)


def visible_name(name: str, namespace: str | None) -> str:
    """The name the model sees for a function in a namespace: `NAMESPACE__name` (no doubled separator)."""
    if not namespace:
        return name
    return (namespace if namespace.endswith(NAMESPACE_JOIN) else namespace + NAMESPACE_JOIN) + name


# ---- validation -----------------------------------------------------------------------------------

def read_input(raw: Any, seal: ReasoningSeal) -> list[dict[str, Any]]:
    """`input`: a string (one user message) or an array of items, normalized; ids kept or made."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"id": new_item_id("message"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list):
        raise InvalidRequest(f"input must be a string or an array of items, not {json_type(raw)}", param="input")
    items = [read_item(Fields(entry, f"input[{i}]"), seal) for i, entry in enumerate(raw)]
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        if item["id"] in seen:
            raise InvalidRequest(f"input[{i}].id '{item['id']}' is also the id of input[{seen[item['id']]}]; "
                                 "item ids must be unique", param=f"input[{i}].id")
        seen[item["id"]] = i
    return items


def read_item(f: Fields, seal: ReasoningSeal) -> dict[str, Any]:
    kind = f.string("type")
    if kind is None:
        if f.has("role"):
            kind = "message"
        else:
            raise InvalidRequest(f"{f.path_of('type')} is required", param=f.path_of("type"))
    reader = _READERS.get(kind)
    if reader is None:
        if kind == "item_reference":
            raise InvalidRequest(f"{f.path_of('type')}: item_reference items are not supported; send the item itself, "
                                 "or continue with previous_response_id", param=f.path_of("type"),
                                 code="unsupported_parameter")
        raise InvalidRequest(f"{f.path_of('type')} is '{kind}'; this server takes message, reasoning, function_call, "
                             "function_call_output, custom_tool_call, custom_tool_call_output, local_shell_call "
                             "and local_shell_call_output items", param=f.path_of("type"))
    item = reader(f, seal)
    given = f.string("id", non_empty=True)
    return {"id": given or new_item_id(kind), "type": kind, **item}


def _read_message(f: Fields, seal: ReasoningSeal) -> dict[str, Any]:
    role = f.string("role")
    if role is None:
        raise InvalidRequest(f"{f.path_of('role')} is required", param=f.path_of("role"))
    if role not in ROLES:
        raise InvalidRequest(f"{f.path_of('role')} must be one of {', '.join(ROLES)}; got '{role}'",
                             param=f.path_of("role"))
    content = f.raw("content")
    path = f.path_of("content")
    text_part = "output_text" if role == "assistant" else "input_text"
    if content is None:
        raise InvalidRequest(f"{path} is required", param=path)
    if isinstance(content, str):
        parts = [_text_part(text_part, content)]
    elif isinstance(content, list):
        parts = [_read_part(Fields(part, f"{path}[{j}]"), role) for j, part in enumerate(content)]
    else:
        raise InvalidRequest(f"{path} must be a string or an array of content parts, not {json_type(content)}",
                             param=path)
    return {"role": role, "status": "completed", "content": parts}


def _text_part(kind: str, text: str) -> dict[str, Any]:
    return {"type": kind, "text": text, "annotations": []} if kind == "output_text" else {"type": kind, "text": text}


def _read_part(part: Fields, role: str) -> dict[str, Any]:
    kind = part.string("type")
    if kind == "input_image":
        if role != "user":
            raise misplaced_image(part.path, role)
        url, detail = read_responses_image(part)
        read = {"type": kind, "image_url": url, "detail": detail}
    elif kind in MEDIA_PARTS:
        raise InvalidRequest(f"{part.path}: {kind} parts cannot be read; ember reads input_text and input_image "
                             "parts", param=part.path, code="unsupported_content")
    elif kind in ("input_text", "output_text"):
        read = _text_part(kind, as_string(part.raw("text"), part.path_of("text")))
    elif kind == "refusal" and role == "assistant":
        return {"type": "refusal", "refusal": as_string(part.raw("refusal"), part.path_of("refusal"))}
    else:
        allowed = "input_text, output_text or refusal" if role == "assistant" else "input_text or input_image"
        raise InvalidRequest(f"{part.path_of('type')} is {kind!r}; a {role} message takes {allowed} parts",
                             param=part.path_of("type"))
    if read_openai_breakpoint(part):
        read["prompt_cache_breakpoint"] = {"mode": "explicit"}
    return read


def _read_reasoning(f: Fields, seal: ReasoningSeal) -> dict[str, Any]:
    item: dict[str, Any] = {"summary": [], "content": []}
    for j, raw in enumerate(f.array("summary") or []):
        part = Fields(raw, f"{f.path_of('summary')}[{j}]")
        item["summary"].append({"type": "summary_text", "text": as_string(part.raw("text"), part.path_of("text"))})
    texts = []
    for j, raw in enumerate(f.array("content") or []):
        part = Fields(raw, f"{f.path_of('content')}[{j}]")
        kind = part.string("type")
        if kind != "reasoning_text":
            raise InvalidRequest(f"{part.path_of('type')} must be reasoning_text, not {kind!r}",
                                 param=part.path_of("type"))
        texts.append(as_string(part.raw("text"), part.path_of("text")))
    sealed = f.string("encrypted_content")
    if sealed is not None:
        try:
            texts = [seal.open(sealed)]  # the sealed text is authoritative: the client cannot alter it
        except SealError as exc:
            raise InvalidRequest(f"{f.path_of('encrypted_content')} cannot be read by this server: {exc}",
                                 param=f.path_of("encrypted_content"), code="invalid_encrypted_content") from None
        item["encrypted_content"] = sealed
    elif not texts:
        raise InvalidRequest(f"{f.path}: a reasoning item needs its reasoning_text content, or the "
                             "encrypted_content this server gave it", param=f.path_of("content"))
    item["content"] = [{"type": "reasoning_text", "text": text} for text in texts]
    return item


def _read_call(f: Fields, seal: ReasoningSeal) -> dict[str, Any]:
    call_id = f.string("call_id", non_empty=True)
    if call_id is None:
        raise InvalidRequest(f"{f.path_of('call_id')} is required", param=f.path_of("call_id"))
    name = f.string("name", non_empty=True)
    if name is None:
        raise InvalidRequest(f"{f.path_of('name')} is required", param=f.path_of("name"))
    item: dict[str, Any] = {"call_id": call_id, "name": name}
    if f.string("type") == "function_call":
        arguments = f.raw("arguments")
        if arguments is None:
            raise InvalidRequest(f"{f.path_of('arguments')} is required", param=f.path_of("arguments"))
        item["arguments"] = as_string(arguments, f.path_of("arguments"))
    else:
        item["input"] = as_string(f.raw("input", ""), f.path_of("input"))
    namespace = f.string("namespace", non_empty=True)
    if namespace is not None:
        item["namespace"] = namespace
    item["status"] = "completed"
    return item


def _read_shell_call(f: Fields, seal: ReasoningSeal) -> dict[str, Any]:
    """Codex's record of a command it ran for the model: `action` {type: exec, command: [...], ...}."""
    call_id = f.string("call_id", non_empty=True)
    if call_id is None:
        raise InvalidRequest(f"{f.path_of('call_id')} is required", param=f.path_of("call_id"))
    action = f.object("action")
    if action is None:
        raise InvalidRequest(f"{f.path_of('action')} is required", param=f.path_of("action"))
    action.string("type", choices=("exec",))
    command = action.array("command", non_empty=True)
    if command is None:
        raise InvalidRequest(f"{action.path_of('command')} is required", param=action.path_of("command"))
    for j, part in enumerate(command):
        as_string(part, f"{action.path_of('command')}[{j}]")
    return {"call_id": call_id, "action": dict(action.obj), "status": "completed"}


def _read_result(f: Fields, seal: ReasoningSeal) -> dict[str, Any]:
    call_id = f.string("call_id", non_empty=True)
    if call_id is None:
        raise InvalidRequest(f"{f.path_of('call_id')} is required", param=f.path_of("call_id"))
    output = f.raw("output")
    path = f.path_of("output")
    if output is None:
        raise InvalidRequest(f"{path} is required", param=path)
    if isinstance(output, list):
        output = [_read_part(Fields(part, f"{path}[{j}]"), "user") for j, part in enumerate(output)]
    elif not isinstance(output, str):
        raise InvalidRequest(f"{path} must be a string or an array of input_text and input_image parts, not "
                             f"{json_type(output)}",
                             param=path)
    item = {"call_id": call_id, "output": output}
    if f.string("type") != "custom_tool_call_output":
        item["status"] = "completed"
    return item


_READERS: dict[str, Callable[[Fields, ReasoningSeal], dict[str, Any]]] = {
    "message": _read_message, "reasoning": _read_reasoning, "function_call": _read_call,
    "custom_tool_call": _read_call, "function_call_output": _read_result, "custom_tool_call_output": _read_result,
    "local_shell_call": _read_shell_call, "local_shell_call_output": _read_result,
}


# ---- chat messages ----------------------------------------------------------------------------------

def parts_content(parts: Any, path: str | None) -> Any:
    """A message's content parts, or a result's output, as a chat message's content (see
    tokenization.message_content); `path` names the parts in the request (None: stored history,
    whose images are named by previous_response_id)."""
    if isinstance(parts, str):
        return parts
    pieces = []
    for j, part in enumerate(parts):
        if part["type"] == "input_image":
            pieces.append(image_part(image_ref(part["image_url"], f"{path}[{j}].image_url" if path
                                               else "previous_response_id")))
        else:
            pieces.append(part.get("text", part.get("refusal", "")))
    return build_content(pieces)


def call_arguments(item: dict[str, Any]) -> Any:
    """A past call's arguments for the template: a JSON object becomes a dict (what templates expect);
    a custom tool's free-form input becomes {"input": ...}, the shape the model was shown."""
    if item["type"] == "custom_tool_call":
        return {"input": item["input"]}
    if item["type"] == "local_shell_call":
        return item["action"]
    try:
        decoded = json.loads(item["arguments"])
    except ValueError:
        return item["arguments"]
    return decoded if isinstance(decoded, dict) else item["arguments"]


def to_messages(items: Sequence[dict[str, Any]], paths: Sequence[str | None], instructions: str | None = None,
                cache_ttl_s: float = 0.0) -> list[dict[str, Any]]:
    """Chat messages for the template. `paths[i]` names items[i] in the request (None: stored history),
    for the 400s of a tool history that does not hold together (tool_history: results answer the
    calls of the assistant turn before them, all or none of them, and are put in call order). Parts
    of this request's items (not the stored history's) that carry a prompt_cache_breakpoint mark
    their message (cache_hints) with `cache_ttl_s`."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    turn: dict[str, Any] | None = None  # the open assistant turn
    stage = 0  # how far that turn has got: 0 reasoning, 1 text, 2 calls
    seen_calls: set[str] = set()
    calls: list[Call] = []  # the last assistant turn's calls
    results: list[Answer] = []  # the results after them so far

    def close_results() -> None:
        nonlocal calls, results
        messages.extend(in_call_order(calls, results, complete=False, result_kind="result"))
        calls, results = [], []

    def assistant_turn(at_stage: int) -> dict[str, Any]:
        nonlocal turn, stage
        if turn is None or stage > at_stage:
            close_results()
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        stage = at_stage
        return turn

    for item, path in zip(items, paths):
        kind = item["type"]
        if kind == "reasoning":
            current = assistant_turn(0)
            text = "".join(part["text"] for part in item["content"])
            current["reasoning_content"] = current.get("reasoning_content", "") + text
        elif kind == "message" and item["role"] == "assistant":
            current = assistant_turn(1)
            _mark_parts(current, item, path, content_length(current["content"]), cache_ttl_s)
            current["content"] = build_content([current["content"], parts_content(item["content"], None)])
        elif kind in CALLS:
            if item["call_id"] in seen_calls:
                where = _at(path, "call_id") or "the stored conversation"
                raise InvalidRequest(f"{where}: call_id '{item['call_id']}' is used by an earlier call",
                                     param=_at(path, "call_id"), code=INVALID_TOOL_HISTORY)
            seen_calls.add(item["call_id"])
            entry = {"id": item["call_id"], "type": "function",
                     "function": {"name": visible_name(item.get("name", LOCAL_SHELL), item.get("namespace")),
                                  "arguments": call_arguments(item)}}
            assistant_turn(2).setdefault("tool_calls", []).append(entry)
            calls.append(Call(item["call_id"], _at(path, "call_id")))
        elif kind in RESULTS:
            turn = None
            result = {"role": "tool", "tool_call_id": item["call_id"],
                      "content": parts_content(item["output"], _at(path, "output"))}
            if path is not None and not isinstance(item["output"], str) and any(
                    "prompt_cache_breakpoint" in part for part in item["output"]):
                mark(result, None, cache_ttl_s)
            results.append(Answer(item["call_id"], _at(path, "call_id"), result))
        else:
            turn = None
            close_results()
            role = "system" if item["role"] in ("system", "developer") else "user"
            messages.append({"role": role, "content": parts_content(item["content"], _at(path, "content"))})
            _mark_parts(messages[-1], item, path, 0, cache_ttl_s)
    close_results()
    return messages


def _mark_parts(message: dict[str, Any], item: dict[str, Any], path: str | None, offset: int, ttl_s: float) -> None:
    """Mark where each part of the item that carries a breakpoint ends in the message's content
    (an image takes one unit: cache_hints)."""
    if path is None:
        return  # a stored turn's breakpoints were written when it was sent
    end = offset
    for part in item["content"]:
        end += 1 if part["type"] == "input_image" else len(part.get("text", part.get("refusal", "")))
        if "prompt_cache_breakpoint" in part:
            mark(message, end, ttl_s)


def _at(path: str | None, name: str) -> str | None:
    return f"{path}.{name}" if path else None
