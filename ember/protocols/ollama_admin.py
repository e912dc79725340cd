"""Ollama's requests about models rather than text: a chat or generate request with nothing to
answer (it asks for the model to be loaded), /api/show, /api/pull and /api/delete bodies."""

from __future__ import annotations

from typing import Any

from ember.errors import InvalidRequest
from ember.protocols.errors import Forbidden
from ember.protocols.fields import Fields
from ember.protocols.neutral import ModelInfo
from ember.protocols.ollama_common import read_keep_alive, read_model, read_stream, timestamp
from ember.protocols.unknown_fields import reads_fields


def is_load_request(body: Any, prompt_field: str) -> bool:
    """A chat request without messages, or a generate request without a prompt or images."""
    return isinstance(body, dict) and not body.get(prompt_field) and not body.get("images")


@reads_fields
def load_reply(body: Any, model: ModelInfo, *, chat: bool) -> dict[str, Any]:
    """The answer to a load request: the model is loaded already (done_reason load). A keep_alive of
    0 cannot unload it while ember serves one model: it is listed as ignored (read_keep_alive)."""
    f = Fields(body)
    label = read_model(f, model)
    read_keep_alive(f)
    read_stream(f)
    for name in ("messages", "prompt", "options", "format", "think", "tools", "system", "raw"):
        f.raw(name)  # nothing to run: what they would change does not arise
    reply: dict[str, Any] = {"model": label, "created_at": timestamp()}
    reply.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return {**reply, "done": True, "done_reason": "load"}


def model_field(f: Fields) -> str:
    """`model` (or `name`, its older spelling), required."""
    name = f.string("model", non_empty=True) or f.string("name", non_empty=True)
    if name is None:
        raise InvalidRequest("model is required", param="model")
    return name


@reads_fields
def parse_show(body: Any, model: ModelInfo) -> str:
    f = Fields(body)
    f.boolean("verbose")
    f.raw("system")
    return read_model(Fields({"model": model_field(f)}), model)


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
