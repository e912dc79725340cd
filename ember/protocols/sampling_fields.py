"""The sampling fields every dialect reads (Chat Completions, Completions, Responses, Anthropic
Messages), each setting under any of its spellings.

A setting with several names (`max_tokens`, `max_completion_tokens`, `max_output_tokens`;
`stop`, `stop_sequences`) is read by `read_spelled`: any one spelling may be sent, several with
the same value are fine, and two with different values are refused naming both. A dialect only
says which names it takes, in its own order.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ember.errors import InvalidRequest
from ember.protocols.fields import Fields, as_string, json_type

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
FRESH_SEED = -1  # the same as leaving the seed out (SamplingParams.seeded decides the seed then)
PRIORITIES = {"foreground": 0, "background": 1}  # the engine's ranks: larger values yield to smaller
NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def read_spelled(f: Fields, names: Sequence[str], read: Callable[[str], Any]) -> tuple[Any, str]:
    """(the value of whichever of `names` is given, that name); (None, names[0]) when none is.
    `read(name)` validates one spelling; two spellings that disagree are a 400 naming both."""
    given = [(name, read(name)) for name in names if f.has(name)]
    if not given:
        return None, names[0]
    first_name, first = given[0]
    for name, value in given[1:]:
        if value != first:
            raise InvalidRequest(f"{f.path_of(first_name)} and {f.path_of(name)} are two names of one setting and "
                                 f"disagree ({first!r} and {value!r}); send one of them", param=f.path_of(name),
                                 code="conflicting_parameters")
    return first, first_name


def read_max_tokens(f: Fields, names: Sequence[str]) -> tuple[int | None, str]:
    """The output limit and the name it came under. 0 asks for the prompt to be processed only."""
    return read_spelled(f, names, lambda name: f.integer(name, low=0))


def read_stop(f: Fields, names: Sequence[str], limit: int) -> tuple[list[str], str]:
    """Stop strings (a string or an array of non-empty strings) and the name they came under."""
    stops, name = read_spelled(f, names, lambda name: _stop_strings(f, name, limit))
    return stops or [], name


def _stop_strings(f: Fields, name: str, limit: int) -> list[str]:
    """`stop` is a string or an array; `stop_sequences` (Anthropic's name) an array only."""
    stop = f.raw(name)
    path = f.path_of(name)
    if isinstance(stop, str) and name != "stop_sequences":
        stop = [stop]
    elif not isinstance(stop, list):
        kinds = "an array of strings" if name == "stop_sequences" else "a string or an array of strings"
        raise InvalidRequest(f"{path} must be {kinds}, not {json_type(stop)}", param=path)
    if len(stop) > limit:
        raise InvalidRequest(f"{path} holds {len(stop)} strings; at most {limit} are allowed", param=path)
    return [as_string(item, f"{path}[{i}]", non_empty=True) for i, item in enumerate(stop)]


def read_seed(f: Fields) -> int | None:
    """The seed; None (the server's --seed, else a fresh one: SamplingParams.seeded) when absent, null or -1."""
    seed = f.integer("seed", low=SEED_RANGE[0], high=SEED_RANGE[1])
    return None if seed == FRESH_SEED else seed


def read_priority(f: Fields) -> int:
    """`priority`: foreground (the default) or background, or the engine's rank as an integer
    (0 foreground, larger values yield to smaller ones; vLLM's spelling, without negatives)."""
    value = f.raw("priority")
    if value is None:
        return 0
    if isinstance(value, str):
        return PRIORITIES[f.string("priority", choices=PRIORITIES)]
    return f.integer("priority", low=0)


def read_sampling_fields(f: Fields, values: dict[str, Any], *, stop_names: Sequence[str],
                         stop_limit: int) -> dict[str, str]:
    """temperature, top_p, top_k, min_p, the penalties, seed, stop and draft into `values` (only those
    given, so the model's defaults stay otherwise). Returns SamplingParams' names -> the wire's
    names, for refusals SamplingParams raises itself."""
    for name in NUMBER_FIELDS:
        if f.has(name):
            values[name] = f.number(name)
    if f.has("top_k"):
        values["top_k"] = f.integer("top_k")
    values["seed"] = read_seed(f)
    values["stop"], stop_name = read_stop(f, stop_names, stop_limit)
    values["draft"] = f.boolean("draft", True)  # false: no speculative decoding for this request
    return {"stop": stop_name}


def read_single_choice(f: Fields, what: str) -> None:
    """`n` on routes that give one reply per request: 1 (or absent) only, refused by name otherwise."""
    n = f.integer("n", 1)
    if n != 1:
        raise InvalidRequest(f"n must be 1: {what} holds one reply; send n separate requests for {n} replies",
                             param="n", code="unsupported_parameter")
