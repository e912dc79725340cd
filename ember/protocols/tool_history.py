"""Tool results against the calls they answer: the one rule Anthropic Messages and Responses share.

The results that follow an assistant turn answer that turn's calls (an Anthropic user turn's
tool_result blocks; Responses' *_output items after the call items). Each result must name one of
those calls, once; the results are put back in call order, the order the template renders calls and
results in. Whether every call needs its result is the dialect's choice (`complete`): Anthropic
asks for all of them, as Anthropic's API does; Responses keeps a turn none of whose calls has a
result (the client moved on) but refuses a partial set, which no template can render faithfully.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ember.errors import InvalidRequest

INVALID_TOOL_HISTORY = "invalid_tool_history"


@dataclass(frozen=True, slots=True)
class Call:
    call_id: str
    param: str | None  # where the call names its id in the request (None: stored history)


@dataclass(frozen=True, slots=True)
class Answer:
    call_id: str
    param: str | None  # where the result names its call (None: stored history)
    value: Any  # what the dialect renders for it


def in_call_order(calls: Sequence[Call], answers: Sequence[Answer], *, complete: bool,
                  turn_param: str | None = None, result_kind: str = "result") -> list[Any]:
    """The answers' values in the order of their calls. `turn_param` names the place the results
    were due (a missing one is refused there; without it, at the call's own id)."""
    position = {call.call_id: i for i, call in enumerate(calls)}
    answered: set[str] = set()
    for answer in answers:
        where = answer.param or "the stored conversation"
        if answer.call_id not in position:
            known = ", ".join(f"'{call.call_id}'" for call in calls) or "none"
            raise InvalidRequest(f"{where}: '{answer.call_id}' answers no call of the assistant turn before it "
                                 f"(its calls: {known})", param=answer.param, code=INVALID_TOOL_HISTORY)
        if answer.call_id in answered:
            raise InvalidRequest(f"{where}: the call '{answer.call_id}' already has a {result_kind}",
                                 param=answer.param, code=INVALID_TOOL_HISTORY)
        answered.add(answer.call_id)
    missing = [call for call in calls if call.call_id not in answered]
    if missing and (complete or answered):
        call = missing[0]
        param = turn_param or call.param or next((answer.param for answer in answers if answer.param), None)
        rule = ("every call of an assistant turn needs its result in the turn after it" if complete else
                "the other calls of its turn have theirs; send a result for every call of a turn, or none")
        raise InvalidRequest(f"{param or 'the stored conversation'}: the call '{call.call_id}' has no "
                             f"{result_kind}: {rule}", param=param, code=INVALID_TOOL_HISTORY)
    return [answer.value for answer in sorted(answers, key=lambda answer: position[answer.call_id])]
