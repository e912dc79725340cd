"""The sampling values a request starts from, before its own fields (which always win).

Three layers, each over the one before: the model's generation config (`generation_config.json`,
or a GGUF file's), `--override-generation-config JSON` (vLLM's shape: an object merged over the
model's generation config), and the single flags (`--temperature`, `--top-p`, `--top-k`,
`--min-p`, `--presence-penalty`, `--frequency-penalty`, and `--greedy`, which is temperature 0).
"""

from __future__ import annotations

from typing import Any, Mapping

from ember.errors import InvalidRequest
from ember.types import SamplingParams

# generation-config keys ember samples with, each a SamplingParams field of the same name
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
         "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty"}


def sampling_defaults(generation_config: Mapping[str, Any], override: Mapping[str, Any],
                      flags: Mapping[str, Any]) -> dict[str, Any]:
    """The merged defaults: only keys ember samples with, and only numbers (a generation config may
    hold other settings, which are not sampling defaults)."""
    merged = {**generation_config, **override, **flags}
    return {key: merged[key] for key in SAMPLING_KEYS if _is_number(merged.get(key))}


def check_override(override: Mapping[str, Any]) -> None:
    """--override-generation-config: every key one ember samples with, every value a number in its
    range. Raises ValueError naming the key, so nothing given at the start is dropped unseen."""
    for key, value in override.items():
        if key not in SAMPLING_KEYS:
            hint = " (the output limit is --default-max-tokens)" if key in ("max_new_tokens", "max_tokens") else ""
            raise ValueError(f"--override-generation-config: '{key}' is not a sampling setting ember applies{hint}; "
                             f"it takes {', '.join(SAMPLING_KEYS)}")
        if not _is_number(value) or (key == "top_k" and not float(value).is_integer()):
            kind = "an integer" if key == "top_k" else "a number"
            raise ValueError(f"--override-generation-config: '{key}' must be {kind}, not {value!r}")
    _check_ranges(dict(override), "--override-generation-config: ")


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
