"""Cache breakpoints: where a client asks the prefix cache to keep a prompt's prefix, and how long.

A dialect reads its hints (Anthropic's `cache_control`, OpenAI's `prompt_cache_breakpoint` and
`prompt_cache_options`) and marks the neutral messages it builds: `mark(message, cut, ttl_s)`, where
`cut` is how much of the message's content the prefix keeps, in characters of text and one unit
per image (tokenization.message_content), None: the whole message.
`collect_breakpoints` takes the marks off once the conversation is final and returns
`Breakpoint`s. When the prompt is encoded, each becomes a token position (`cache_pins`): how far
the prompt's token ids agree with the conversation rendered only up to the breakpoint. That
agreement is the exact shared prefix whatever the template does around the cut (it never pins a
token the prompt does not have); a breakpoint the template cannot render alone is dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ember.errors import InvalidRequest
from ember.protocols.fields import Fields
from ember.tokenization.message_content import content_length, cut_content
from ember.types import CachePin

MARK = "ember_cache_breakpoints"  # bookkeeping key on a neutral message; removed before rendering
ANTHROPIC_TTLS = {"5m": 300.0, "1h": 3600.0}
MAX_ANTHROPIC_BREAKPOINTS = 4
OPENAI_MAX_WRITES = 4  # breakpoints one request writes; the implicit one takes a slot in implicit mode
OPENAI_DEFAULT_TTL = "30m"
_DURATION = re.compile(r"^([1-9][0-9]*)([mh])$")
_MAX_TTL_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """The prefix ends after messages[:num_messages], the last of them cut to `cut` units of content
    (characters, one per image; None: whole)."""

    num_messages: int
    cut: int | None
    ttl_s: float


def mark(message: dict[str, Any], cut: int | None, ttl_s: float) -> None:
    message.setdefault(MARK, []).append((cut, ttl_s))


def shift_marks(message: dict[str, Any], offset: int) -> list[tuple[int | None, float]]:
    """A message's marks as they stand once `offset` characters are put before its content."""
    return [(None if cut is None else cut + offset, ttl) for cut, ttl in message.get(MARK, ())]


def collect_breakpoints(messages: list[dict[str, Any]]) -> list[Breakpoint]:
    """Take the marks off the messages, in order."""
    found = []
    for index, message in enumerate(messages):
        for cut, ttl_s in message.pop(MARK, ()):
            found.append(Breakpoint(index + 1, cut, ttl_s))
    return found


def probe_messages(messages: Sequence[dict[str, Any]], breakpoint: Breakpoint) -> list[dict[str, Any]]:
    probe = [dict(m) for m in messages[:breakpoint.num_messages]]
    if probe and breakpoint.cut is not None and breakpoint.cut < content_length(probe[-1].get("content")):
        last = probe[-1]
        last["content"] = cut_content(last["content"], breakpoint.cut)
        last.pop("tool_calls", None)  # calls follow the text; the cut comes before them
    return probe


def cache_pins(breakpoints: Sequence[Breakpoint], messages: Sequence[dict[str, Any]], prompt_ids: Sequence[int],
               render: Callable[[list[dict[str, Any]]], Sequence[int] | None]) -> list[CachePin]:
    """Each breakpoint's token position in the prompt, with its TTL (the longest for one position)."""
    ttls: dict[int, float] = {}
    for breakpoint in breakpoints:
        probe_ids = render(probe_messages(messages, breakpoint))
        if probe_ids is None:
            continue
        shared = 0
        for a, b in zip(prompt_ids, probe_ids):
            if a != b:
                break
            shared += 1
        if shared:
            ttls[shared] = max(ttls.get(shared, 0.0), breakpoint.ttl_s)
    return [CachePin(num_tokens, ttl_s) for num_tokens, ttl_s in sorted(ttls.items())]


# ---- Anthropic ----------------------------------------------------------------------------------

class AnthropicBreakpoints:
    """Counts `cache_control` marks as they are read; a fifth is refused, naming it."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def read(self, holder: Fields, *, counts: bool = True) -> float | None:
        """The TTL in seconds of `holder.cache_control`, or None when it has none."""
        control = holder.object("cache_control")
        if control is None:
            return None
        if control.string("type", choices=("ephemeral",)) is None:
            raise InvalidRequest(f"{control.path_of('type')} is required: ephemeral", param=control.path_of("type"))
        ttl = control.string("ttl", "5m", choices=ANTHROPIC_TTLS)
        if not counts:
            return ANTHROPIC_TTLS[ttl]
        self.paths.append(control.path)
        if len(self.paths) > MAX_ANTHROPIC_BREAKPOINTS:
            raise InvalidRequest(f"at most {MAX_ANTHROPIC_BREAKPOINTS} blocks may carry cache_control; "
                                 f"{control.path} is one more", param=control.path)
        return ANTHROPIC_TTLS[ttl]


# ---- OpenAI -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class OpenAICacheOptions:
    explicit: bool  # mode "explicit": no implicit breakpoint takes a write slot
    ttl_s: float
    key: str | None = None  # prompt_cache_key: the session the request belongs to


def read_openai_cache_options(f: Fields) -> OpenAICacheOptions:
    """`prompt_cache_options` ({mode, ttl}) and `prompt_cache_key` (the session: it tags the request
    in the log and keeps a session on one data-parallel worker); `prompt_cache_retention` is checked
    and otherwise unused (ember's cache lives in memory, and matches by content)."""
    key = f.string("prompt_cache_key") or None
    f.string("prompt_cache_retention", choices=("in_memory", "24h"))
    options = f.object("prompt_cache_options")
    if options is None:
        return OpenAICacheOptions(False, duration_seconds(OPENAI_DEFAULT_TTL, "prompt_cache_options.ttl"), key)
    mode = options.string("mode", "implicit", choices=("implicit", "explicit"))
    ttl = options.string("ttl", OPENAI_DEFAULT_TTL)
    return OpenAICacheOptions(mode == "explicit", duration_seconds(ttl, options.path_of("ttl")), key)


def duration_seconds(text: str, path: str) -> float:
    """'30m', '1h', ...: whole minutes or hours, from one minute to 24 hours."""
    found = _DURATION.match(text)
    seconds = int(found.group(1)) * (60 if found.group(2) == "m" else 3600) if found else 0
    if not 60 <= seconds <= _MAX_TTL_S:
        raise InvalidRequest(f"{path} must be a duration such as '30m' or '1h', from 1m to 24h; got '{text}'",
                             param=path)
    return float(seconds)


def read_openai_breakpoint(part: Fields) -> bool:
    """Whether a content part carries `prompt_cache_breakpoint: {"mode": "explicit"}`."""
    breakpoint = part.object("prompt_cache_breakpoint")
    if breakpoint is None:
        return False
    if breakpoint.string("mode", choices=("explicit",)) is None:
        raise InvalidRequest(f"{breakpoint.path_of('mode')} is required: explicit", param=breakpoint.path_of("mode"))
    return True


def openai_writes(breakpoints: list[Breakpoint], options: OpenAICacheOptions) -> list[Breakpoint]:
    """The breakpoints a request writes: the latest four explicit ones, or three beside the implicit
    one (which ember's ordinary prefix cache already is). Earlier ones are accepted and unused."""
    keep = OPENAI_MAX_WRITES - (0 if options.explicit else 1)
    return breakpoints[-keep:]
