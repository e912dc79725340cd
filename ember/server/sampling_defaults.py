"""The sampling values a request starts from, before its own fields (which always win).

Three layers, each over the one before: the model's generation config (`generation_config.json`,
or a GGUF file's), `--override-generation-config JSON` (vLLM's shape: an object merged over the
model's generation config), and the single flags (`--temperature`, `--top-p`, `--top-k`,
`--min-p`, `--presence-penalty`, `--frequency-penalty`, and `--greedy`, which is temperature 0).

A model's recommended values often differ by thinking mode, so the generation config and the
override may each hold a `thinking` and a `non_thinking` object of the same keys: a chat turn
whose thinking is settled on or off (by the request or the server's defaults) starts from its
mode's values, each such object over its own layer; anything else starts from the top level.
"""

from __future__ import annotations

from typing import Any, Mapping

from ember.errors import InvalidRequest
from ember.types import SamplingParams

# generation-config keys ember samples with, each a SamplingParams field of the same name
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
MODES = {"thinking": True, "non_thinking": False}  # a layer's per-mode object -> the thinking it applies to
FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
         "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty"}


def sampling_defaults(generation_config: Mapping[str, Any], override: Mapping[str, Any],
                      flags: Mapping[str, Any]) -> dict[str, Any]:
    """The merged defaults: only keys ember samples with, and only numbers (a generation config may
    hold other settings, which are not sampling defaults)."""
    merged = {**generation_config, **override, **flags}
    return {key: merged[key] for key in SAMPLING_KEYS if _is_number(merged.get(key))}


def mode_sampling_defaults(generation_config: Mapping[str, Any], override: Mapping[str, Any],
                           flags: Mapping[str, Any]) -> dict[bool, dict[str, Any]]:
    """thinking on / off -> the merged defaults of that mode: each layer, then its object for the mode."""
    result = {}
    for key, thinking in MODES.items():
        merged: dict[str, Any] = {}
        for layer in (generation_config, _mode(generation_config, key), override, _mode(override, key), flags):
            merged.update(layer)
        result[thinking] = {name: merged[name] for name in SAMPLING_KEYS if _is_number(merged.get(name))}
    return result


def _mode(layer: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = layer.get(key)
    return value if isinstance(value, Mapping) else {}


def check_override(override: Mapping[str, Any], within: str = "") -> None:
    """--override-generation-config: every key one ember samples with, every value a number in its
    range, and at the top a `thinking` or `non_thinking` object holding such keys. Raises ValueError
    naming the key, so nothing given at the start is dropped unseen."""
    flag = "--override-generation-config: "
    for key, value in override.items():
        if key in MODES and not within:
            if not isinstance(value, Mapping):
                raise ValueError(f"{flag}'{key}' must be an object of sampling settings, not {value!r}")
            check_override(value, within=f"{key}.")
            continue
        if key not in SAMPLING_KEYS:
            hint = " (the output limit is --default-max-tokens)" if key in ("max_new_tokens", "max_tokens") else ""
            raise ValueError(f"{flag}'{within}{key}' is not a sampling setting ember applies{hint}; "
                             f"it takes {', '.join(SAMPLING_KEYS)}" + ("" if within else ", thinking, non_thinking"))
        if not _is_number(value) or (key == "top_k" and not float(value).is_integer()):
            kind = "an integer" if key == "top_k" else "a number"
            raise ValueError(f"{flag}'{within}{key}' must be {kind}, not {value!r}")
    _check_ranges({key: value for key, value in override.items() if key not in MODES}, f"{flag}{within}")


def check_flags(flags: Mapping[str, Any]) -> None:
    """The single flags' values, within the ranges a request's fields have."""
    _check_ranges(dict(flags), "", names=FLAGS)


def _check_ranges(values: dict[str, Any], prefix: str, names: Mapping[str, str] | None = None) -> None:
    try:
        SamplingParams(**values)
    except InvalidRequest as exc:
        name = (names or {}).get(exc.param or "", exc.param)
        raise ValueError(f"{prefix}{name}: {exc.message}") from None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
