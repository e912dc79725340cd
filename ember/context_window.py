"""Fitting a prompt and its reply into the context window: the one rule every entry point follows.

The window holds min(max_model_len, KV cache capacity) tokens of prompt plus reply: one request
must fit in the cache on its own. For a prompt of P tokens, the room is window - P, and:

- an empty prompt is refused (400 `invalid_request_error`, naming the prompt's field);
- a prompt that leaves no room for one output token is refused (400 `context_length_exceeded`,
  ContextLengthExceeded; the Anthropic dialect words it as Anthropic does), unless it asks for
  no output token (max_tokens 0: a pooling or prefill-only request may fill the window);
- with no max_tokens the reply may run to the window's end, or to the server's default limit
  (`--default-max-tokens`) if that is smaller;
- a max_tokens of 0 asks for the prompt alone: it must fit as any prompt does, and it is prefilled
  (its full blocks then serve later requests from the prefix cache) with no token generated;
- a max_tokens beyond the room is capped to the room over HTTP (`over_room="cap"`: the reply
  then ends with `length`, Anthropic's `model_context_window_exceeded`), since agents routinely
  ask for more than a small window holds; the Python API refuses it with both numbers
  (`over_room="refuse"`), since a program asked for exactly that many tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ember.errors import ContextLengthExceeded, InvalidRequest


@dataclass(frozen=True, slots=True)
class ContextWindow:
    max_model_len: int
    kv_capacity_tokens: int | None = None  # the most tokens one request can hold in the KV cache

    @property
    def tokens(self) -> int:
        if self.kv_capacity_tokens is None:
            return self.max_model_len
        return min(self.max_model_len, self.kv_capacity_tokens)


@dataclass(frozen=True, slots=True)
class OutputFit:
    max_tokens: int  # the reply's limit, within the room
    room: int  # the window's tokens left after the prompt

    @property
    def reaches_window(self) -> bool:
        """Whether the limit is the window's end (a reply that hits it ran out of context)."""
        return self.max_tokens == self.room


def fit_output(window: ContextWindow, num_prompt_tokens: int, max_tokens: int | None, *,
               default_max_tokens: int | None = None, over_room: Literal["cap", "refuse"] = "cap",
               prompt_param: str = "prompt") -> OutputFit:
    """The reply's token limit for this prompt under the rule above; refusals raise InvalidRequest."""
    if num_prompt_tokens == 0:
        raise InvalidRequest("the prompt is empty", param=prompt_param)
    limit = window.tokens
    if num_prompt_tokens > limit or (num_prompt_tokens == limit and max_tokens != 0):
        error = ContextLengthExceeded(limit, num_prompt_tokens)
        error.param = prompt_param
        raise error
    room = limit - num_prompt_tokens
    if max_tokens is None:
        return OutputFit(min(default_max_tokens or room, room), room)
    if max_tokens > room and over_room == "refuse":
        raise InvalidRequest(
            f"max_tokens ({max_tokens}) plus the prompt ({num_prompt_tokens} tokens) exceeds the {limit} tokens "
            f"of the context window ({_window_words(window)})", param="max_tokens", code="context_length_exceeded")
    return OutputFit(min(max_tokens, room), room)


def _window_words(window: ContextWindow) -> str:
    if window.tokens < window.max_model_len:
        return f"the KV cache holds {window.kv_capacity_tokens} tokens, less than the model's {window.max_model_len}"
    return "the model's maximum context length"
