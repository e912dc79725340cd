"""SGLang's native `POST /generate`: text or token ids in (one prompt or a batch), `sampling_params`,
and `text`, `output_ids` and `meta_info` out, whole or streamed. A single text prompt may carry
images (`image_data`), its text writing the model's image marker where each goes.

A batch (a list of texts or of token lists) runs its prompts together, one choice each; the answer
is a list in the batch's order. Streams send cumulative `text` and `output_ids` (SGLang's default),
each chunk a whole snapshot of its prompt's reply so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ember.errors import EmberError, InvalidRequest
from ember.media.sources import BASE64, ImageRef, image_ref
from ember.protocols.errors import OPENAI_ERRORS, openai_error_body, unsupported
from ember.protocols.fields import Fields, as_integer, as_string, json_type
from ember.protocols.neutral import (
    ChoiceResult, Dialect, GenerationRequest, ModelInfo, PromptRun, ResponseMeta, RunResult, TextPrompt, TokenPrompt,
    build_sampling_params, weight_versions,
)
from ember.protocols.openai_common import MAX_TOP_LOGPROBS, read_logit_bias, read_shared_sampling, read_token_ids
from ember.protocols.sse import DONE, ServerEvent
from ember.protocols.structured import grammar_spec, json_schema_spec, regex_spec
from ember.types import FinishReason, GenerationOutput, SamplingParams, SpeculationCounts, TokenLogprob
from ember.protocols.unknown_fields import reads_fields

MAX_BATCH = 64
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
MAX_TOKEN_IDS_LOGPROB = 64

# sampling_params keys read here, and the wire names SamplingParams' own refusals are renamed to
_RENAMED = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
            "include_stop_str_in_output": "no_stop_trim"}
_SAMPLING_KEYS = {"max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                  "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids",
                  "ignore_eos", "skip_special_tokens", "no_stop_trim", "seed", "logit_bias",
                  "json_schema", "regex", "ebnf", "n", "spaces_between_special_tokens", "stream_interval", "draft"}
_GRAMMAR_KEYS = (("json_schema", json_schema_spec), ("regex", regex_spec), ("ebnf", grammar_spec))
# top-level fields of SGLang's request that ember understands and cannot honour (when set)
_REFUSED = {
    "input_embeds": "input_embeds is not supported; send text or input_ids",
    "video_data": "this server reads no video", "audio_data": "this server reads no audio",
    "lora_path": "LoRA adapters are not supported by this server",
    "session_params": "sessions are not supported by this server",
    "custom_logit_processor": "custom logit processors are not supported by this server",
    "bootstrap_host": "disaggregated prefill is not supported by this server",
    "data_parallel_rank": "this server runs one engine; data_parallel_rank cannot be chosen",
}


@dataclass(slots=True)
class NativeOptions:
    """What only this dialect's renderer reads."""

    rids: list[str | None]  # one per prompt; None: the server makes the id
    is_batch: bool
    return_logprob: bool
    return_text_in_logprobs: bool


@reads_fields
def parse_generate(body: Any, model: ModelInfo) -> GenerationRequest:
    f = Fields(body)
    for name, message in _REFUSED.items():
        if f.has(name):
            raise unsupported(name, message)
    if f.boolean("return_hidden_states", False):
        raise unsupported("return_hidden_states", "hidden states are not returned by this server")
    prompts, prompt_param, is_batch = _read_prompts(f, model.vocab_size)
    _read_images(f, model, prompts, is_batch)
    logprobs, logprob_token_ids = _read_logprobs(f, model.vocab_size)
    params, grammar = _read_sampling_params(f, model, len(prompts), is_batch, logprobs, logprob_token_ids)
    rids = _read_rids(f, len(prompts), is_batch)
    options = NativeOptions(rids, is_batch, logprobs is not None, f.boolean("return_text_in_logprobs", False))
    batch = ([PromptRun(p, sp, f"{prompt_param}[{i}]") for i, (p, sp) in enumerate(zip(prompts, params))]
             if is_batch else None)
    return GenerationRequest(prompts[0], params[0], stream=f.boolean("stream", False), prompt_param=prompt_param,
                             grammar=grammar, batch=batch, dialect_options=options)


def _read_prompts(f: Fields, vocab_size: int) -> tuple[list[TextPrompt | TokenPrompt], str, bool]:
    """`text` (a string or a list of strings) or `input_ids` (a list of ids or a list of lists)."""
    if f.has("text") and f.has("input_ids"):
        raise InvalidRequest("send text or input_ids, not both", param="input_ids")
    if f.has("text"):
        text = f.raw("text")
        if isinstance(text, str):
            return [TextPrompt(as_string(text, "text", non_empty=True))], "text", False
        items = _batch_list(text, "text", "a string or an array of strings")
        return [TextPrompt(as_string(t, f"text[{i}]", non_empty=True)) for i, t in enumerate(items)], "text", True
    ids = f.raw("input_ids")
    if ids is None:
        raise InvalidRequest("text or input_ids is required", param="text")
    if not isinstance(ids, list) or not ids:
        raise InvalidRequest(f"input_ids must be a non-empty array of token ids or of arrays of token ids, "
                             f"not {json_type(ids) if ids != [] else 'an empty array'}", param="input_ids")
    if not isinstance(ids[0], list):
        return [TokenPrompt(_token_ids(ids, "input_ids", vocab_size))], "input_ids", False
    items = _batch_list(ids, "input_ids", "an array of token ids or an array of such arrays")
    prompts = []
    for i, item in enumerate(items):
        if not isinstance(item, list) or not item:
            raise InvalidRequest(f"input_ids[{i}] must be a non-empty array of token ids", param=f"input_ids[{i}]")
        prompts.append(TokenPrompt(_token_ids(item, f"input_ids[{i}]", vocab_size)))
    return prompts, "input_ids", True


def _read_images(f: Fields, model: ModelInfo, prompts: list[TextPrompt | TokenPrompt], is_batch: bool) -> None:
    """`image_data`: one image or a list (each a data URL, base64 or an http(s) URL), the images of
    a single text prompt whose text writes the model's image marker once where each goes."""
    raw = f.raw("image_data")
    if raw is None or raw == []:
        return
    marker = model.image_marker
    if marker is None:
        raise InvalidRequest("image_data holds images, and this server reads none (a text-only model, or "
                             "--no-vision)", param="image_data", code="vision_disabled")
    if is_batch:
        raise unsupported("image_data", "a batch cannot carry images; send each prompt with its images in a request "
                                        "of its own")
    prompt = prompts[0]
    if not isinstance(prompt, TextPrompt):
        raise unsupported("image_data", f"images need a text prompt whose text writes {marker} where each image "
                                        "goes; send text, not input_ids")
    if isinstance(raw, str):
        values = [(raw, "image_data")]
    elif isinstance(raw, list):
        values = [(value, f"image_data[{i}]") for i, value in enumerate(raw)]
    else:
        raise InvalidRequest(f"image_data must be a string or an array of strings, not {json_type(raw)}",
                             param="image_data")
    refs = [_image_ref(as_string(value, param, non_empty=True), param) for value, param in values]
    count = prompt.text.count(marker)
    if count != len(refs):
        raise InvalidRequest(f"text writes the image marker {marker} {count} times for {len(refs)} images in "
                             f"image_data; write it once where each image goes", param="text")
    prompt.images = refs


def _image_ref(value: str, param: str) -> ImageRef:
    """SGLang's image string: a URL (a data URL or an http(s) URL), else base64 (which holds no colon)."""
    if ":" in value[:32]:
        return image_ref(value, param)
    return ImageRef(BASE64, value, param)


def _batch_list(value: Any, param: str, expected: str) -> list:
    if not isinstance(value, list):
        raise InvalidRequest(f"{param} must be {expected}, not {json_type(value)}", param=param)
    if not value:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    if len(value) > MAX_BATCH:
        raise InvalidRequest(f"{param} holds {len(value)} prompts; a batch takes at most {MAX_BATCH}", param=param)
    return value


def _token_ids(values: list, param: str, vocab_size: int) -> list[int]:
    return [as_integer(t, f"{param}[{i}]", low=0, high=vocab_size - 1) for i, t in enumerate(values)]


def _read_logprobs(f: Fields, vocab_size: int) -> tuple[int | None, list[int] | None]:
    """SamplingParams.logprobs (None: off) and the ids whose log probabilities are asked for."""
    start = f.integer("logprob_start_len")
    if start is not None and start != -1:
        raise unsupported("logprob_start_len", "ember returns the log probabilities of output tokens only (it does "
                                               "not score prompt tokens); leave logprob_start_len out or send -1")
    top = f.integer("top_logprobs_num", 0, low=0, high=MAX_TOP_LOGPROBS)
    ids = f.array("token_ids_logprob")
    if ids is not None and len(ids) > MAX_TOKEN_IDS_LOGPROB:
        raise InvalidRequest(f"token_ids_logprob holds {len(ids)} ids; at most {MAX_TOKEN_IDS_LOGPROB} are allowed",
                             param="token_ids_logprob")
    wanted = _token_ids(ids, "token_ids_logprob", vocab_size) if ids else None
    if not f.boolean("return_logprob", False):
        return None, None
    return top, wanted


def _read_sampling_params(f: Fields, model: ModelInfo, num_prompts: int, is_batch: bool, logprobs: int | None,
                          logprob_token_ids: list[int] | None) -> tuple[list[SamplingParams], Any]:
    """One SamplingParams per prompt (one object for all, or a list with one per prompt of a batch)
    and the grammar they share."""
    raw = f.raw("sampling_params", {})
    if isinstance(raw, list):
        if not is_batch:
            raise InvalidRequest("sampling_params is a list, but the request has one prompt; send an object",
                                 param="sampling_params")
        if len(raw) != num_prompts:
            raise InvalidRequest(f"sampling_params holds {len(raw)} objects for {num_prompts} prompts",
                                 param="sampling_params")
        read = [_read_one(Fields(sp, f"sampling_params[{i}]"), model, logprobs, logprob_token_ids)
                for i, sp in enumerate(raw)]
    else:
        read = [_read_one(Fields(raw, "sampling_params"), model, logprobs, logprob_token_ids)] * num_prompts
    grammars = {spec.text if spec else None for _, spec in read}
    if len(grammars) > 1:
        raise unsupported("sampling_params", "the prompts of one batch must share one json_schema, regex or ebnf "
                                             "(or none)")
    return [params for params, _ in read], read[0][1]


def _read_one(sp: Fields, model: ModelInfo, logprobs: int | None, logprob_token_ids: list[int] | None):
    for key in sp.obj:
        if key not in _SAMPLING_KEYS:
            raise InvalidRequest(f"{sp.path_of(key)} is not a sampling parameter this server knows (the seed is "
                                 f"`seed`)", param=sp.path_of(key))
    if sp.integer("n", 1, low=1) != 1:
        raise unsupported(sp.path_of("n"), "n must be 1; send a batch of prompts to get several replies")
    if sp.boolean("spaces_between_special_tokens", True) is False:
        raise unsupported(sp.path_of("spaces_between_special_tokens"), "special tokens are always decoded as written")
    if sp.integer("stream_interval", 1, low=1) != 1:
        raise unsupported(sp.path_of("stream_interval"), "streams send every engine step's tokens; stream_interval "
                                                    "must be 1")
    values: dict[str, Any] = dict(model.sampling_defaults)
    values["max_tokens"] = sp.integer("max_new_tokens", DEFAULT_MAX_NEW_TOKENS, low=0)  # 0: the prompt only
    values["min_tokens"] = sp.integer("min_new_tokens", 0, low=0)
    try:
        read_shared_sampling(sp, values)
        values["stop_token_ids"] = read_token_ids(sp, "stop_token_ids", model.vocab_size)
        values["logit_bias"] = read_logit_bias(sp, model.vocab_size)
    except InvalidRequest as exc:
        raise _under(exc, sp.path) from None
    values["ignore_eos"] = sp.boolean("ignore_eos", False)
    values["skip_special_tokens"] = sp.boolean("skip_special_tokens", True)
    values["include_stop_str_in_output"] = sp.boolean("no_stop_trim", False)
    values["logprobs"] = logprobs
    values["logprob_token_ids"] = logprob_token_ids
    grammar = None
    for key, build in _GRAMMAR_KEYS:
        if sp.has(key):
            if grammar is not None:
                raise InvalidRequest("send at most one of json_schema, regex and ebnf", param=sp.path_of(key))
            grammar = build(sp.raw(key), sp.path_of(key))
    names = {name: sp.path_of(_RENAMED.get(name, name)) for name in SamplingParams.__dataclass_fields__}
    return build_sampling_params(values, names), grammar


def _under(exc: InvalidRequest, path: str) -> InvalidRequest:
    """A refusal of a shared reader (which names the bare field) moved under `path`."""
    if exc.param and not exc.param.startswith(path):
        exc.param = f"{path}.{exc.param}"
    return exc


def _read_rids(f: Fields, num_prompts: int, is_batch: bool) -> list[str | None]:
    rid = f.raw("rid")
    if rid is None:
        return [None] * num_prompts
    if not is_batch:
        return [as_string(rid, "rid", non_empty=True)]
    if not isinstance(rid, list) or len(rid) != num_prompts:
        raise InvalidRequest(f"rid must be a list of {num_prompts} strings, one per prompt", param="rid")
    rids = [as_string(r, f"rid[{i}]", non_empty=True) for i, r in enumerate(rid)]
    if len(set(rids)) != len(rids):
        raise InvalidRequest("the rids of one batch must differ", param="rid")
    return rids


# ---- rendering --------------------------------------------------------------------------------------

def finish_reason_body(choice: ChoiceResult) -> dict[str, Any] | None:
    reason = choice.finish_reason
    if reason is None:
        return None
    if reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(choice.token_ids)}
    if reason is FinishReason.STOP:
        matched = choice.stop_reason
        if matched is None and choice.token_ids:
            matched = choice.token_ids[-1]  # the end-of-sequence token
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": choice.error or "the request was cancelled"}


class GenerateRenderer:
    def __init__(self, request: GenerationRequest, result: RunResult, meta: ResponseMeta) -> None:
        self.request = request
        self.result = result
        self.meta = meta
        self.options: NativeOptions = request.dialect_options
        self.texts = [""] * len(result.choices)  # cumulative streamed text per prompt

    def item_id(self, index: int) -> str:
        rid = self.options.rids[index]
        if rid is not None:
            return rid
        return self.meta.response_id if not self.options.is_batch else f"{self.meta.response_id}-{index}"

    def item(self, choice: ChoiceResult, text: str) -> dict[str, Any]:
        body: dict[str, Any] = {"text": text, "output_ids": list(choice.token_ids), "meta_info": self.meta_info(choice)}
        if self.options.is_batch:
            body["index"] = choice.index
        return body

    def meta_info(self, choice: ChoiceResult) -> dict[str, Any]:
        received = self.result.received
        stamps = choice.timings
        scheduled = stamps.scheduled if stamps else None
        first = stamps.first_token if stamps else None
        finished = stamps.finished if stamps else None
        now = time.time()
        completion = len(choice.token_ids)
        decode_span = (finished or now) - first if first else 0.0
        info: dict[str, Any] = {
            "id": self.item_id(choice.index),
            "finish_reason": finish_reason_body(choice),
            "prompt_tokens": len(self.result.choice_prompt_ids(choice.index)),
            "completion_tokens": completion,
            "cached_tokens": choice.num_cached_tokens,
            "cached_tokens_details": choice.cached_tokens_details,
            "reasoning_tokens": choice.reply.num_reasoning_tokens,
            "num_retractions": choice.num_preemptions,
            "dp_rank": choice.dp_rank,
            **weight_versions(completion),
            "e2e_latency": (finished or now) - received,
            "queue_time": max(scheduled - received, 0.0) if scheduled else None,
            "first_token_latency": first - received if first else None,
            "decode_throughput": (completion - 1) / decode_span if completion > 1 and decode_span > 0 else 0.0,
            "request_received_ts": received,
            "api_server_dispatch_finish_ts": self.result.dispatched,
            "forward_entry_time": scheduled,
            "prefill_finished_time": first,
            "request_finished_ts": finished,
            "response_sent_to_client_ts": now,
        }
        if choice.finish_reason is not None:
            info["token_sha"] = choice.token_sha
        if choice.speculation is not None:
            info.update(speculation_meta(choice.speculation))
        if self.options.return_logprob:
            info.update(self.logprobs(choice.logprobs))
        return info

    def logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        """SGLang's shape: each entry is [logprob, token id, text or null]. Prompt tokens are not scored."""
        def entry(token_id: int, logprob: float) -> list:
            text = self.meta.token_text(token_id) if self.options.return_text_in_logprobs else None
            return [_finite(logprob), token_id, text]

        body: dict[str, Any] = {
            "input_token_logprobs": [], "input_top_logprobs": [],
            "output_token_logprobs": [entry(lp.token_id, lp.logprob) for lp in logprobs],
            "output_top_logprobs": [[entry(t, v) for t, v in lp.top] for lp in logprobs],
        }
        if self.request.params.logprob_token_ids:
            body["input_token_ids_logprobs"] = []
            body["output_token_ids_logprobs"] = [[entry(t, v) for t, v in lp.requested] for lp in logprobs]
        return body

    def stream_start(self) -> list[ServerEvent]:
        return []

    def stream_output(self, choice: ChoiceResult, output: GenerationOutput) -> list[ServerEvent]:
        self.texts[choice.index] += output.text_delta
        if not output.new_token_ids and output.finish_reason is None:
            return []
        text = choice.text if output.finish_reason is not None else self.texts[choice.index]
        return [ServerEvent(self.item(choice, text))]

    def stream_end(self) -> list[ServerEvent]:
        return [ServerEvent(DONE)]

    def stream_error(self, error: EmberError) -> list[ServerEvent]:
        return [ServerEvent(openai_error_body(error)), ServerEvent(DONE)]

    def response(self) -> Any:
        items = [self.item(choice, choice.text) for choice in self.result.choices]
        return items if self.options.is_batch else items[0]


def _finite(value: float) -> float | None:
    """JSON has no -Infinity: an impossible token's log probability is written as null."""
    return value if value == value and abs(value) != float("inf") else None


GENERATE = Dialect(name="generate", id_prefix="", parse=parse_generate, renderer=GenerateRenderer,
                   errors=OPENAI_ERRORS)


def speculation_meta(counts: SpeculationCounts) -> dict[str, Any]:
    """SGLang's speculative counters for one reply: rounds verified, tokens drafted and kept, the
    share kept, tokens gained per round, and how many rounds kept 0, 1, 2 ... drafted tokens."""
    return {
        "spec_verify_ct": counts.rounds,
        "spec_num_proposed_drafts": counts.proposed,
        "spec_num_correct_drafts": counts.accepted,
        "spec_accept_rate": counts.accepted / counts.proposed if counts.proposed else 0.0,
        "spec_accept_length": counts.mean_accepted_length,
        "spec_correct_drafts_histogram": list(counts.histogram),
    }
