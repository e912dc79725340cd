"""Ollama's requests about models rather than text: a chat or generate request with nothing to
answer (it asks for the model to be loaded), /api/show, /api/pull and /api/delete bodies."""

from __future__ import annotations

from typing import Any

from ember.errors import InvalidRequest
from ember.protocols.errors import Forbidden
from ember.protocols.fields import Fields
from ember.protocols.ollama_common import read_keep_alive, read_stream, timestamp
from ember.protocols.unknown_fields import reads_fields


def is_load_request(body: Any, prompt_field: str) -> bool:
    """A chat request without messages, or a generate request without a prompt or images."""
    return isinstance(body, dict) and not body.get(prompt_field) and not body.get("images")


@reads_fields
def load_request(body: Any, *, chat: bool) -> tuple[dict[str, Any], float | None]:
    """A load request's reply and its keep_alive (None: not given). A keep_alive of 0 asks for an
    unload (done_reason unload); anything else for a load (done_reason load). The caller has
    routed `model` to a model of the server."""
    f = Fields(body)
    label = model_field(f)
    keep_alive = read_keep_alive(f)
    read_stream(f)
    for name in ("messages", "prompt", "options", "format", "think", "tools", "system", "raw"):
        f.raw(name)  # nothing to run: what they would change does not arise
    reply: dict[str, Any] = {"model": label, "created_at": timestamp()}
    reply.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return {**reply, "done": True, "done_reason": "unload" if keep_alive == 0 else "load"}, keep_alive


def model_field(f: Fields) -> str:
    """`model` (or `name`, its older spelling), required."""
    name = f.string("model", non_empty=True) or f.string("name", non_empty=True)
    if name is None:
        raise InvalidRequest("model is required", param="model")
    return name


@reads_fields
def parse_show(body: Any) -> str:
    """The name to show (the caller routes it)."""
    f = Fields(body)
    f.boolean("verbose")
    f.raw("system")
    return model_field(f)


@reads_fields
def parse_pull(body: Any) -> tuple[str, bool]:
    """(the name to pull, whether to stream the progress)."""
    f = Fields(body)
    f.boolean("insecure")
    return model_field(f), read_stream(f)


@reads_fields
def refuse_delete(body: Any) -> None:
    name = model_field(Fields(body))
    raise Forbidden(f"ember does not delete models: '{name}' stays where it is (remove files with the tool that "
                    "fetched them: `ollama rm`, or `hf cache delete` for the Hugging Face cache)",
                    code="delete_refused")
