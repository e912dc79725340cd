"""Ollama's `options` (the Modelfile parameters a request may set), `format` and `think`, read into
the neutral SamplingParams, GrammarSpec and thinking settings.

    honoured      temperature, top_p, top_k, min_p, num_predict (-1 or -2: no limit but the window),
                  stop, seed, repeat_penalty, presence_penalty, frequency_penalty
    refused       mirostat, typical_p and tfs_z set to anything but their neutral value: ember has
                  no such samplers
    ignored       how Ollama's runner loads and batches (num_gpu, num_thread, num_batch, ...),
                  repeat_last_n and penalize_newline, and num_ctx where it differs from the
                  server's window: listed in x-ember-ignored-fields, never refused
    unknown       any other name: ember's unknown-field policy (--strict-fields refuses it)
"""

from __future__ import annotations

from typing import Any

from ember.constraint_spec import GrammarSpec
from ember.errors import InvalidRequest
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.errors import unsupported
from ember.protocols.fields import Fields, json_type
from ember.protocols.neutral import ModelInfo, build_sampling_params
from ember.protocols.sampling_fields import read_seed, read_stop
from ember.protocols.structured import json_object_spec, json_schema_spec
from ember.protocols.thinking import settle_thinking
from ember.protocols.unknown_fields import note_ignored, settle
from ember.types import SamplingParams

MAX_STOP_STRINGS = 16
# Ollama's name -> SamplingParams' name, for the numbers ember honours as they are.
NUMBERS = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p", "repeat_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# Samplers ember does not have: each with the value that leaves it off.
NEUTRAL = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}
# How Ollama's runner loads, places and batches the model, and penalty details ember does not
# split out: they change no token of the reply here.
RUNNER_OPTIONS = ("num_keep", "num_batch", "num_gpu", "main_gpu", "low_vram", "use_mmap", "use_mlock", "numa",
                  "num_thread", "vocab_only", "f16_kv", "logits_all", "embedding_only", "repeat_last_n",
                  "penalize_newline", "mirostat_tau", "mirostat_eta")
THINK_LEVELS = ("low", "medium", "high")


def read_options(f: Fields, model: ModelInfo, thinking: bool | None) -> SamplingParams:
    """The request's `options` over the model's defaults for the turn's thinking mode."""
    values: dict[str, Any] = dict(model.sampling_defaults_for(thinking))
    values["max_tokens"] = None
    options = f.object("options")
    if options is None:
        return build_sampling_params(values)
    for name, target in NUMBERS.items():
        if options.has(name):
            values[target] = options.number(name)
    if options.has("top_k"):
        values["top_k"] = options.integer("top_k", low=0)
    predict = options.integer("num_predict", low=-2)
    values["max_tokens"] = predict if predict is not None and predict >= 0 else None
    values["seed"] = read_seed(options)
    values["stop"], _ = read_stop(options, ("stop",), MAX_STOP_STRINGS)
    read_num_ctx(options, model)
    for name, neutral in NEUTRAL.items():
        value = options.number(name)
        if value is not None and value != neutral:
            raise unsupported(options.path_of(name), f"{options.path_of(name)} is {value:g}; ember has no {name} "
                                                     f"sampler, so it may only be {neutral:g} or left out")
    known = {*NUMBERS, *NEUTRAL, "top_k", "num_predict", "seed", "stop", "num_ctx", *RUNNER_OPTIONS}
    note_ignored(*(options.path_of(name) for name in RUNNER_OPTIONS if options.has(name)))
    settle([options.path_of(name) for name, value in options.obj.items() if name not in known and value is not None])
    rename = {target: options.path_of(name) for name, target in NUMBERS.items()}
    rename.update(max_tokens="options.num_predict", top_k="options.top_k", seed="options.seed", stop="options.stop")
    return build_sampling_params(values, rename)


def read_num_ctx(options: Fields, model: ModelInfo) -> None:
    """num_ctx: the window is the server's (--max-model-len), fixed at start; another size is listed
    as ignored rather than refused, since Ollama clients send one by habit."""
    num_ctx = options.integer("num_ctx", low=1)
    if num_ctx is not None and num_ctx != model.window.tokens:
        note_ignored(options.path_of("num_ctx"))


def read_format(f: Fields) -> GrammarSpec | None:
    """`format`: "json" (any JSON object) or a JSON schema object; "" or absent: free text."""
    fmt = f.raw("format")
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return json_object_spec("format")
    if isinstance(fmt, dict):
        return json_schema_spec(fmt, "format")
    shown = f"'{fmt}'" if isinstance(fmt, str) else json_type(fmt)
    raise InvalidRequest(f"format must be \"json\" or a JSON schema object, not {shown}", param="format")


def read_think(f: Fields, features: ChatFeatures, template_kwargs: dict[str, Any]) -> tuple[bool | None, str | None]:
    """`think`: true or false, or an effort (low, medium, high) for templates that take one; absent:
    the template's (or server's) default. Settles the template's thinking arguments alike."""
    raw = f.raw("think")
    if raw is None:
        enable, effort = None, None
    elif isinstance(raw, bool):
        enable, effort = raw, None
    else:
        effort = f.string("think", choices=THINK_LEVELS)
        enable = True
    return settle_thinking(enable, effort, "think", features, template_kwargs)


def refuse_logprobs(f: Fields) -> None:
    if f.boolean("logprobs", False) or f.integer("top_logprobs", 0, low=0):
        raise unsupported("logprobs", "logprobs are not given on Ollama's routes; ask /v1/chat/completions with "
                                      "logprobs: true for them")
