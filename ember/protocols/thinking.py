"""What every chat dialect decides alike about thinking once it has read its own spellings: the
server's defaults (--no-thinking, --reasoning-effort, --preserve-thinking), whether the loaded chat
template offers the effort asked for, and what the template receives.

Efforts: `none` turns thinking off; any other effort turns it on and reaches the template as
`reasoning_effort`. A template that renders some efforts apart (ChatFeatures.efforts) takes only
those: another is a 400 `reasoning_effort_not_supported`. A template that ignores efforts
altogether takes them all, and then an effort only means thinking on.
"""

from __future__ import annotations

from typing import Any

from ember.errors import InvalidRequest
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.fields import Fields

EFFORT_NOT_SUPPORTED = "reasoning_effort_not_supported"


def settle_thinking(thinking: bool | None, effort: str | None, effort_param: str, features: ChatFeatures,
                    template_kwargs: dict[str, Any]) -> tuple[bool | None, str | None]:
    """(thinking on / off / the template's default, the effort) after the server's defaults.
    `thinking` and `effort` are the request's, already free of contradictions; the template's
    `enable_thinking` and `reasoning_effort` arguments are set to match in `template_kwargs`."""
    if effort is None and thinking is not False:
        default = features.default_reasoning_effort
        if default is not None and not (default == "none" and thinking is True):
            effort = default
        elif thinking is None:
            thinking = features.default_thinking
    elif effort is not None and effort != "none":
        check_effort(effort, effort_param, features)
    if effort == "none":
        thinking = False
    elif effort is not None and thinking is None:
        thinking = True
    template_kwargs.pop("reasoning_effort", None)
    if thinking is not None:
        template_kwargs["enable_thinking"] = thinking
    if effort not in (None, "none"):
        template_kwargs["reasoning_effort"] = effort
    return thinking, effort


def check_effort(effort: str, param: str, features: ChatFeatures) -> None:
    offered = features.efforts
    if offered is None or effort in offered:
        return
    listed = ", ".join(offered) if offered else "no effort"
    raise InvalidRequest(f"{param} '{effort}' is not an effort the loaded chat template offers (it offers "
                         f"{listed}; 'none' turns thinking off)", param=param, code=EFFORT_NOT_SUPPORTED)


def read_preserve_thinking(f: Fields, template_kwargs: dict[str, Any], default: bool) -> bool:
    """preserve_thinking, top level or in chat_template_kwargs (the two must agree; taken out of
    them), else `default`. It goes in ChatPrompt.preserve_thinking, which the template also receives."""
    top = f.boolean("preserve_thinking")
    in_kwargs = template_kwargs.pop("preserve_thinking", None)
    if in_kwargs is not None and not isinstance(in_kwargs, bool):
        raise InvalidRequest("chat_template_kwargs.preserve_thinking must be true or false",
                             param="chat_template_kwargs.preserve_thinking")
    if top is not None and in_kwargs is not None and top != in_kwargs:
        raise InvalidRequest(f"preserve_thinking ({str(top).lower()}) and chat_template_kwargs.preserve_thinking "
                             f"({str(in_kwargs).lower()}) are two names of one setting and disagree; send one",
                             param="chat_template_kwargs.preserve_thinking", code="conflicting_parameters")
    return top if top is not None else in_kwargs if in_kwargs is not None else default
