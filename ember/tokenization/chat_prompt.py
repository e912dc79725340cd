"""What the model's chat template can take, and the conversation changes that need no reply format.

Templates differ in what they can take. Probing the template once tells ember whether it lists
tools, whether it accepts a system message (at the start, and later in the conversation) and which
reasoning efforts it renders apart. Where a template cannot take a system message, its text moves to
the top of the first user message; where it takes one only at the start, the leading system
messages join into one and a later one becomes a user turn that says it is a system message; where
it cannot list tools, ember.parsers.tool_prompt writes them (and past calls) in the model's
tool-call format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.tokenization.message_content import build_content

_PROBE = "ember_template_probe"
LATER_SYSTEM_LABEL = "[System message]"  # leads the user turn a later system message becomes
EFFORTS = ("minimal", "low", "medium", "high", "xhigh", "max")  # the efforts a request may name, "none" aside


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    takes_tools: bool
    takes_system: bool
    efforts: tuple[str, ...] | None = None  # the reasoning efforts it renders apart; None: it ignores efforts
    later_system_refused: bool = False  # it takes a system message at the start only


def probe_template(tokenizer) -> TemplateTraits:
    """What the tokenizer's chat template does with tools, with a system message and with efforts."""
    tool = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    user = {"role": "user", "content": "hello"}
    takes_system = _renders_with(tokenizer, [{"role": "system", "content": _PROBE}, user])
    later_system = [user, {"role": "assistant", "content": "hi"}, {"role": "system", "content": _PROBE}, user]
    return TemplateTraits(
        takes_tools=_renders_with(tokenizer, [user], tools=[tool]),
        takes_system=takes_system,
        efforts=_template_efforts(tokenizer, [user]),
        later_system_refused=takes_system and not _renders_with(tokenizer, later_system),
    )


def _template_efforts(tokenizer, messages: list[dict[str, Any]]) -> tuple[str, ...] | None:
    """An effort is offered when the template renders it otherwise than an effort it cannot know;
    a template that renders every effort as it renders none ignores them (None)."""
    def render(**kwargs: Any) -> str | None:
        try:
            return tokenizer.render_chat_template(messages, enable_thinking=True, **kwargs)
        except Exception:  # a template that refuses the value: not offered
            return None

    plain, unknown = render(), render(reasoning_effort=_PROBE)
    rendered = {effort: render(reasoning_effort=effort) for effort in EFFORTS}
    if all(text == plain for text in (unknown, *rendered.values())):
        return None
    return tuple(effort for effort, text in rendered.items() if text is not None and text != unknown)


def _renders_with(tokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> bool:
    try:
        return _PROBE in tokenizer.render_chat_template(messages, **kwargs)
    except Exception:  # a template that refuses the shape: it cannot take it
        return False


def drop_closed_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reasoning stays only in the assistant turns after the last user message (the open turn: a
    reply still calling tools); the ones before it are closed."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    last_user = users[-1] if users else -1
    return [{k: v for k, v in m.items() if k != "reasoning_content"}
            if i < last_user and m.get("role") == "assistant" else m for i, m in enumerate(messages)]


def later_system_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that takes a system message at the start only: the leading system messages join
    into one, and each later one becomes a user turn led by LATER_SYSTEM_LABEL (which leads the user
    message right after it, when there is one, so that roles keep alternating)."""
    leading = 0
    while leading < len(messages) and messages[leading].get("role") == "system":
        leading += 1
    result: list[dict[str, Any]] = []
    if leading:
        texts = [messages[i].get("content") or "" for i in range(leading)]
        result.append({**messages[0], "content": build_content(_joined(texts))})
    pending: list[Any] = []  # later system texts waiting for the next turn
    for message in messages[leading:]:
        if message.get("role") == "system":
            pending += [f"{LATER_SYSTEM_LABEL}\n", message.get("content") or "", "\n\n"]
            continue
        if pending and message.get("role") == "user":
            message = {**message, "content": build_content([*pending, message.get("content") or ""])}
        elif pending:
            result.append({"role": "user", "content": build_content(pending[:-1])})
        pending = []
        result.append(message)
    if pending:
        result.append({"role": "user", "content": build_content(pending[:-1])})
    return result


def _joined(texts: list[Any]) -> list[Any]:
    pieces: list[Any] = []
    for text in texts:
        pieces += ["\n\n", text] if pieces else [text]
    return pieces


def system_into_first_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that refuses a system message: its text leads the first user message."""
    system = [m.get("content") or "" for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    if not system:
        return rest
    text = "\n\n".join(s for s in system if s)
    for message in rest:
        if message.get("role") == "user":
            message["content"] = build_content([f"{text}\n\n", message.get("content") or ""])
            return rest
    return [{"role": "user", "content": text}, *rest]
