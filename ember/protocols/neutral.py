"""The neutral middle every dialect shares: one request type in, one result record out.

A dialect validates its JSON into a `GenerationRequest`; the server turns the prompt into token
ids (`encode_prompt`), fits max_tokens to the context window (`resolve_sampling`), runs the
choices on the engine and feeds each output into a `RunResult`, which the dialect renders.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Union

from ember.constraint_spec import GrammarSpec
from ember.context_window import ContextWindow, OutputFit, fit_output
from ember.errors import EmberError, InvalidRequest
from ember.loaders.serving_task import GENERATE, ServingTask
from ember.media.prompt import PromptImage, lay_out_images
from ember.parsers.events import ContentText, ParsedReply, ReplyEvent
from ember.parsers.reply import ReplyParser
from ember.parsers.tool_prompt import prepare_conversation
from ember.protocols.cache_hints import Breakpoint, cache_pins
from ember.protocols.chat_reply import ChatFeatures, ChatOptions, ReplyPlan
from ember.protocols.errors import ErrorShape
from ember.protocols.sse import ServerEvent
from ember.protocols.stream_format import SSE, StreamFormat
from ember.tokenization.chat_prompt import drop_closed_reasoning
from ember.types import (CachePin, FinishReason, GenerationOutput, RequestTimings, SamplingParams, SpeculationCounts,
                         TokenLogprob)

if TYPE_CHECKING:
    from ember.media.processing import ImageProcessing


@dataclass(slots=True)
class ChatPrompt:
    """Messages ready for the model's chat template."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    cache_breakpoints: list[Breakpoint] = field(default_factory=list)
    # The breakpoints as token positions: written by encode_prompt (positions exist only once the
    # prompt is rendered), read by resolve_sampling into SamplingParams.cache_pins.
    cache_pins: list[CachePin] = field(default_factory=list)
    # closed assistant turns keep their reasoning; the template receives it as preserve_thinking too
    preserve_thinking: bool = True
    # Its images' token spans: written by encode_prompt (its images are message parts
    # {"type": "image", "image": ImageRef, then ImageInput once read}).
    media: list[PromptImage] = field(default_factory=list)


@dataclass(slots=True)
class TextPrompt:
    text: str
    add_special_tokens: bool = True  # the tokenizer's own (a BOS token, where the model has one)
    # images the text's markers stand for, in order (an ImageRef until read); their spans once encoded
    images: list[Any] = field(default_factory=list)
    media: list[PromptImage] = field(default_factory=list)
    keep_last_tokens: int | None = None  # only this many of its tokens, the last ones (truncate_prompt_tokens)
    text_pair: str | None = None  # a second text, encoded with `text` as the tokenizer's pair (cross-encoders)
    # at most this many tokens, its first ones, special tokens kept (an embedding model's max_seq_length)
    max_length: int | None = None


@dataclass(slots=True)
class TokenPrompt:
    token_ids: list[int]


Prompt = Union[ChatPrompt, TextPrompt, TokenPrompt]

# The version of the served weights, as SGLang names it: a running ember server never swaps its
# weights, so every token of every reply comes from this one.
WEIGHT_VERSION = "default"

DEFAULT_MAX_MESSAGES = 256  # messages one request may carry unless --max-messages says otherwise
# prompt tokens of one embeddings, rerank or score request, all its inputs together, unless
# --max-total-input-tokens says otherwise (2048 inputs of 128 tokens)
DEFAULT_MAX_TOTAL_INPUT_TOKENS = 262144


@dataclass(slots=True)
class ModelInfo:
    """What request validation needs to know of the served model: plain data, no engine."""

    name: str  # the public id
    max_model_len: int
    vocab_size: int
    aliases: tuple[str, ...] = ()  # other ids requests may use
    has_chat_template: bool = True
    default_max_tokens: int | None = None  # None: up to the end of the context window
    kv_capacity_tokens: int | None = None  # the most tokens one request can hold in the KV cache
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # from the model's generation config
    # thinking on / off -> that mode's defaults (server.sampling_defaults); empty: as sampling_defaults
    mode_sampling_defaults: dict[bool, dict[str, Any]] = field(default_factory=dict)
    chat: ChatFeatures = field(default_factory=ChatFeatures)  # reasoning markers and tool-call format
    default_seed: int | None = None  # the seed of sampled requests that bring none (--seed); None: a fresh one each
    # text -> the id of the one token it encodes to, None when it takes more or fewer tokens
    single_token_id: Callable[[str], int | None] = lambda text: None
    image_marker: str | None = None  # what stands for an image in a text prompt; None: the model reads no images
    max_messages: int | None = DEFAULT_MAX_MESSAGES  # messages (Responses: input items) a request may carry
    max_total_input_tokens: int | None = DEFAULT_MAX_TOTAL_INPUT_TOKENS  # see check_total_input_tokens
    task: ServingTask = ServingTask(GENERATE)  # generating, embeddings or reranking (loaders.serving_task)

    def check_message_count(self, count: int, param: str) -> None:
        """A conversation longer than --max-messages is a 400 naming its field."""
        if self.max_messages is not None and count > self.max_messages:
            raise InvalidRequest(f"{param} holds {count} entries; this server takes at most {self.max_messages} "
                                 "(--max-messages)", param=param, code="too_many_messages")

    def check_total_input_tokens(self, prompts: list[list[int]], param: str) -> None:
        """The inputs of an embeddings, rerank or score request, encoded, hold at most
        --max-total-input-tokens together; else a 400 naming the field that holds them."""
        total = sum(len(ids) for ids in prompts)
        if self.max_total_input_tokens is not None and total > self.max_total_input_tokens:
            raise InvalidRequest(f"{param} holds {total} tokens in all; this server takes at most "
                                 f"{self.max_total_input_tokens} in one request (--max-total-input-tokens)",
                                 param=param, code="too_many_tokens")

    def sampling_defaults_for(self, thinking: bool | None) -> dict[str, Any]:
        """The defaults of a turn whose thinking is settled on or off; None (not settled: the
        template's own default decides, or no chat at all) takes the top-level ones."""
        if thinking is None:
            return self.sampling_defaults
        return self.mode_sampling_defaults.get(thinking, self.sampling_defaults)

    def accepts(self, model: str) -> bool:
        return model == self.name or model in self.aliases

    @property
    def window(self) -> ContextWindow:
        return ContextWindow(self.max_model_len, self.kv_capacity_tokens)


@dataclass(slots=True)
class PromptRun:
    """One prompt of a batch, with its own sampling settings."""

    prompt: Prompt
    params: SamplingParams
    prompt_param: str  # the field blamed when this prompt does not fit


@dataclass(slots=True)
class GenerationRequest:
    """A validated request of any dialect, before its prompt is tokenized."""

    prompt: Prompt
    params: SamplingParams  # validated; max_tokens is the client's value (None: not given)
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # streams: a usage record at the end
    return_token_ids: bool = False
    echo: bool = False  # completions: the prompt text leads the output
    prompt_param: str = "messages"  # the field blamed when the prompt does not fit
    return_progress: bool = False  # streams: prompt_progress chunks while the prompt is processed
    timings_per_token: bool = False  # streams: running timings on every delta chunk
    chat: ChatOptions | None = None  # chat dialects: tools and thinking
    grammar: GrammarSpec | None = None  # structured output: what the reply (its answer, after reasoning) must match
    # several prompts run together, one choice each (n is 1; prompt and params are the first's)
    batch: list[PromptRun] | None = None
    dialect_options: Any = None  # what only the dialect's own renderer reads
    # a batch of inputs capped together (ModelInfo.check_total_input_tokens): the field that holds them
    total_tokens_param: str | None = None
    session: str | None = None  # the client's session key (prompt_cache_key), as sent
    keep_alive: float | None = None  # seconds the model stays loaded once idle (negative: for good); None: the server's

    def prompt_runs(self) -> list[PromptRun]:
        return self.batch if self.batch is not None else [PromptRun(self.prompt, self.params, self.prompt_param)]


@dataclass(slots=True)
class ResponseMeta:
    """What every rendered object repeats: its id, creation time, model id and fingerprint."""

    response_id: str
    created: int
    model: str
    system_fingerprint: str
    decode: Callable[[list[int]], str]  # token ids -> text (echoed prompts, logprob tokens)
    request_id: str = ""  # the x-request-id, for dialects that repeat it in error events

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])


def prompt_images(prompt: Prompt) -> list[Any]:
    """The prompt's images in order: ImageRefs as parsed, ImageInputs once read."""
    if isinstance(prompt, TextPrompt):
        return list(prompt.images)
    if isinstance(prompt, ChatPrompt):
        return [part["image"] for message in prompt.messages if isinstance(message.get("content"), list)
                for part in message["content"] if part.get("type") == "image"]
    return []


def encode_prompt(prompt: Prompt, tokenizer, tool_format=None, vision: ImageProcessing | None = None) -> list[int]:
    """Prompt token ids, counted once: the same ids run on the engine and count for usage.

    A chat prompt is first fitted to what the template can take (see parsers.tool_prompt);
    without preserve_thinking, closed turns lose their reasoning first, prefixes included.
    Its cache breakpoints become token positions in `prompt.cache_pins`. Its images (read already:
    ImageInputs) are laid out by `vision`, the model's image preparation, their spans written in
    `prompt.media`."""
    if isinstance(prompt, TokenPrompt):
        return list(prompt.token_ids)
    if isinstance(prompt, TextPrompt):
        if not prompt.images:
            ids = tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens, pair=prompt.text_pair,
                                   max_length=prompt.max_length)
            return ids[-prompt.keep_last_tokens:] if prompt.keep_last_tokens else ids
        ids, prompt.media = lay_out_images(prompt.text, prompt.images, vision, lambda text: tokenizer.encode(
            text, add_special_tokens=prompt.add_special_tokens), "text")
        return ids
    try:
        messages = prompt.messages if prompt.preserve_thinking else drop_closed_reasoning(prompt.messages)
        template_kwargs = {"preserve_thinking": prompt.preserve_thinking, **prompt.template_kwargs}
        ids, prompt.media = _render_chat(prompt, messages, tokenizer, tool_format, prompt.add_generation_prompt,
                                         template_kwargs, vision)
    except InvalidRequest:
        raise
    except Exception as exc:  # a template that fails on this conversation (TypeError, KeyError ...)
        raise InvalidRequest(f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                             param="messages") from None
    if prompt.cache_breakpoints:
        closed = {k: v for k, v in template_kwargs.items() if k != "continue_final_message"}

        def render_prefix(messages: list[dict[str, Any]]) -> list[int] | None:
            try:
                return _render_chat(prompt, messages, tokenizer, tool_format, False, closed, vision)[0]
            except Exception:  # the template cannot render this prefix alone: the breakpoint is dropped
                return None

        prompt.cache_pins = cache_pins(prompt.cache_breakpoints, messages, ids, render_prefix)
    return ids


def _render_chat(prompt: ChatPrompt, messages: list[dict[str, Any]], tokenizer, tool_format,
                 add_generation_prompt: bool, template_kwargs: dict[str, Any],
                 vision: ImageProcessing | None) -> tuple[list[int], list[PromptImage]]:
    """(token ids, the images' spans) of the conversation."""
    messages, tools = prepare_conversation(messages, prompt.tools, tokenizer.template_traits, tool_format)
    images = [part["image"] for message in messages if isinstance(message.get("content"), list)
              for part in message["content"] if part.get("type") == "image"]
    if not images:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **template_kwargs), []
    text = tokenizer.render_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                          **template_kwargs)
    return lay_out_images(text, images, vision, lambda text: tokenizer.encode(text, add_special_tokens=False),
                          "messages")


def resolve_sampling(request: GenerationRequest, num_prompt_tokens: int, model: ModelInfo,
                     params: SamplingParams | None = None, prompt_param: str | None = None
                     ) -> tuple[SamplingParams, OutputFit]:
    """The request's SamplingParams (or a batch prompt's `params`) as they run: max_tokens fitted to
    the room the prompt leaves, by the rule in ember.context_window (over HTTP a max_tokens beyond
    the room is capped), and the seed of a sampled request that names none (SamplingParams.seeded);
    and the fit."""
    params = (params if params is not None else request.params).seeded(model.default_seed)
    fit = fit_output(model.window, num_prompt_tokens, params.max_tokens, default_max_tokens=model.default_max_tokens,
                     prompt_param=prompt_param or request.prompt_param)
    if params.min_tokens > fit.max_tokens:
        raise InvalidRequest(f"min_tokens ({params.min_tokens}) is more than the {fit.room} tokens the context "
                             f"window leaves after the prompt", param="min_tokens")
    if fit.max_tokens != params.max_tokens:
        params = dataclasses.replace(params, max_tokens=fit.max_tokens)
    if isinstance(request.prompt, ChatPrompt) and request.prompt.cache_pins:  # chat prompts never batch
        params = dataclasses.replace(params, cache_pins=list(request.prompt.cache_pins))
    return params, fit


def build_sampling_params(values: dict[str, Any], rename: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams validates ranges itself; its refusals are renamed to the wire's field names."""
    try:
        return SamplingParams(**values)
    except InvalidRequest as exc:
        if rename and exc.param in rename:
            exc.param = rename[exc.param]
        raise


def choice_seeds(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice; seeded choices get distinct seeds so they differ."""
    if n == 1:
        return [params]
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


# ---- results ----------------------------------------------------------------------------------

def token_sha(token_ids: list[int]) -> str:
    """A reply's tokens in one hash, so two replies can be compared for exactness without their ids:
    the SHA-256, in hex, of the ids written in decimal and joined by commas ("533,451,2443")."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


CACHE_TIERS = ("device", "host", "disk")  # where cached prompt tokens come from: the KV pool, then the tiers behind it


def cached_tokens_details(by_tier: dict[str, int]) -> dict[str, int]:
    """Cached prompt tokens by where they were found, every tier named (0 where none came from it)."""
    return {tier: by_tier.get(tier, 0) for tier in CACHE_TIERS}


@dataclass(slots=True)
class ChoiceResult:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the whole text, known once finished
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # num_cached_tokens by where they were found
    num_pinned_tokens: int = 0  # leading prompt tokens the request's cache pins keep
    timings: RequestTimings | None = None
    error: str | None = None
    speculation: SpeculationCounts | None = None  # its drafted rounds, when it had any
    num_preemptions: int = 0  # times the engine preempted it (its KV freed, recomputed later)
    num_budget_closes: int = 0  # times its thinking budget closed the think block
    dp_rank: int | None = None  # the data-parallel worker that ran it; None: one engine
    parser: ReplyParser | None = None  # chat replies with reasoning or tools
    events: list[ReplyEvent] = field(default_factory=list)  # what the latest output added
    pooled: list[float] | None = None  # a pooling request's vector (engine.pooling)

    @property
    def matched_stop(self) -> str | int | None:
        """What ended the reply: the stop string or token id, or the end-of-sequence token (the
        engine's other way to stop); None when it did not stop (length, abort, error)."""
        if self.finish_reason != FinishReason.STOP:
            return None
        if self.stop_reason is not None:
            return self.stop_reason
        return self.token_ids[-1] if self.token_ids else None

    @property
    def token_sha(self) -> str:
        """Of every token the choice generated, through the one that completed a stop string."""
        return token_sha(self.token_ids)

    @property
    def cached_tokens_details(self) -> dict[str, int]:
        return cached_tokens_details(self.cached_tokens_by_tier)

    @property
    def reply(self) -> ParsedReply:
        """The reply split into reasoning, content and tool calls (content only, unparsed)."""
        return self.parser.reply if self.parser is not None else ParsedReply(content=self.text)


def weight_versions(num_tokens: int) -> dict[str, Any]:
    """SGLang's weight_version fields for a reply of `num_tokens` tokens."""
    return {"weight_version": WEIGHT_VERSION,
            "weight_versions": [{"version": WEIGHT_VERSION, "start": 0, "end": num_tokens}]}


def reply_token_fields(request: GenerationRequest, result: "RunResult") -> dict[str, Any]:
    """What a one-choice reply (Responses, Messages) says of its tokens once it is done: `token_sha`,
    and with return_token_ids the prompt's ids and the reply's."""
    choice = result.choices[0]
    fields: dict[str, Any] = {"token_sha": choice.token_sha}
    if request.return_token_ids:
        fields.update(prompt_token_ids=result.prompt_token_ids, token_ids=choice.token_ids)
    return fields


class RunResult:
    """The outputs of one request's choices, gathered as they arrive."""

    def __init__(self, num_choices: int, prompt_token_ids: list[int], received: float | None = None,
                 plan: ReplyPlan | None = None, fit: OutputFit | None = None,
                 batch_prompt_ids: list[list[int]] | None = None) -> None:
        self.prompt_token_ids = prompt_token_ids  # a batch's first prompt
        self.batch_prompt_ids = batch_prompt_ids  # a batch: choice i runs prompt i
        self.fit = fit  # how max_tokens was fitted to the context window
        self.received = received if received is not None else time.time()
        self.dispatched = time.time()  # made once the request is admitted, as it goes to the engine
        self.load_seconds = 0.0  # how long the request waited for its model to load
        self.plan = plan
        self.choices = [ChoiceResult(i, parser=plan.parser() if plan else None) for i in range(num_choices)]
        self.num_finished = 0

    def add(self, index: int, output: GenerationOutput) -> ChoiceResult:
        choice = self.choices[index]
        choice.token_ids = output.token_ids
        choice.num_cached_tokens = output.num_cached_tokens
        choice.cached_tokens_by_tier = output.cached_tokens_by_tier or {}
        choice.num_pinned_tokens = max(choice.num_pinned_tokens, output.num_pinned_tokens)
        choice.timings = output.timings
        choice.speculation = output.speculation
        choice.num_preemptions = max(choice.num_preemptions, output.num_preemptions)  # progress outputs carry 0
        choice.dp_rank = output.dp_rank
        choice.num_budget_closes = max(choice.num_budget_closes, output.num_budget_closes)
        if output.logprobs is not None:
            choice.logprobs = output.logprobs
        if choice.parser is not None:
            choice.events = choice.parser.feed(output.text_delta, output.new_token_ids)
        else:
            choice.events = [ContentText(output.text_delta)] if output.text_delta else []
        if output.finish_reason is not None and choice.finish_reason is None:
            choice.finish_reason = output.finish_reason
            choice.stop_reason = output.stop_reason
            choice.text = output.text
            choice.error = output.error
            choice.pooled = output.pooled
            if choice.parser is not None:
                choice.events += choice.parser.finish()
            self.num_finished += 1
        return choice

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.choices)

    @property
    def error(self) -> str | None:
        for choice in self.choices:
            if choice.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                return choice.error or "the request was cancelled"
        return None

    def choice_prompt_ids(self, index: int) -> list[int]:
        return self.batch_prompt_ids[index] if self.batch_prompt_ids is not None else self.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        """A batch counts every prompt."""
        if self.batch_prompt_ids is not None:
            return sum(len(ids) for ids in self.batch_prompt_ids)
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def num_reasoning_tokens(self) -> int | None:
        """None when the model has no reasoning parser."""
        if self.plan is None or not self.plan.counts_reasoning:
            return None
        return sum(c.reply.num_reasoning_tokens for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the first choice found in the prefix cache (later choices share its prompt);
        a batch counts every prompt's."""
        if self.batch_prompt_ids is not None:
            return sum(c.num_cached_tokens for c in self.choices)
        return self.choices[0].num_cached_tokens

    @property
    def cached_tokens_details(self) -> dict[str, int]:
        """num_cached_tokens by where they were found (cached_tokens_details), counted the same way."""
        if self.batch_prompt_ids is None:
            return self.choices[0].cached_tokens_details
        return {tier: sum(c.cached_tokens_details[tier] for c in self.choices) for tier in CACHE_TIERS}

    @property
    def num_pinned_tokens(self) -> int:
        """Leading prompt tokens the first choice's cache pins keep (its breakpoints, as honoured)."""
        return self.choices[0].num_pinned_tokens

    @property
    def speculation(self) -> SpeculationCounts | None:
        """Every choice's drafted rounds together; None when none was drafted."""
        counted = [c.speculation for c in self.choices if c.speculation is not None]
        if not counted:
            return None
        total = SpeculationCounts()
        for counts in counted:
            total.merge(counts)
        return total

    def speculative_usage(self) -> dict[str, Any]:
        """usage's `speculative` entry (drafted and kept tokens) when the reply was drafted."""
        counts = self.speculation
        return {} if counts is None else {"speculative": {"proposed": counts.proposed, "accepted": counts.accepted}}

    def first_token_time(self) -> float | None:
        times = [c.timings.first_token for c in self.choices if c.timings and c.timings.first_token]
        return min(times) if times else None

    def timings(self) -> dict[str, float | int]:
        """llama.cpp's timings block; every value is a finite number."""
        stamps = [c.timings for c in self.choices if c.timings is not None]
        scheduled = _earliest(t.scheduled for t in stamps)
        first = _earliest(t.first_token for t in stamps)
        # A reply cut short (its client gone) or still running counts its decode up to now.
        finished = _latest(t.finished for t in stamps) if all(t.finished for t in stamps) else time.time()
        cache_n = self.num_cached_tokens
        prompt_n = max(self.num_prompt_tokens - cache_n, 0)
        predicted_n = self.num_completion_tokens
        prompt_s = _span(scheduled, first)
        predicted_s = _span(first, finished)
        # The first token of each choice belongs to the prompt's time; decode speed counts the rest.
        decoded = max(predicted_n - sum(1 for c in self.choices if c.token_ids), 0)
        drafted = self.speculation
        drafts = {} if drafted is None else {"draft_n": drafted.proposed, "draft_n_accepted": drafted.accepted}
        return {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_s * 1000.0,
            "prompt_per_token_ms": per_token_ms(prompt_s, prompt_n),
            "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_s * 1000.0,
            "predicted_per_token_ms": per_token_ms(predicted_s, decoded),
            "predicted_per_second": decoded / predicted_s if predicted_s > 0 else 0.0,
            "queue_ms": _span(self.received, scheduled) * 1000.0,
            **drafts,
        }


def per_token_ms(seconds: float, num_tokens: int) -> float:
    """llama.cpp's milliseconds per token; 0 where no token or no time was spent (never NaN)."""
    return seconds * 1000.0 / num_tokens if num_tokens > 0 and seconds > 0 else 0.0


def _earliest(values) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _latest(values) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _span(start: float | None, end: float | None) -> float:
    if start is None or end is None:
        return 0.0
    return max(end - start, 0.0)


# ---- dialects -----------------------------------------------------------------------------------

class Renderer(Protocol):
    """Turns one request's results into a dialect's JSON: whole, or as a stream of events."""

    def stream_start(self) -> list[ServerEvent]: ...

    def stream_output(self, choice: ChoiceResult, output: GenerationOutput) -> list[ServerEvent]: ...

    def stream_end(self) -> list[ServerEvent]: ...

    def stream_error(self, error: EmberError) -> list[ServerEvent]: ...

    def response(self) -> Any: ...  # a JSON value, or bytes of JSON the dialect wrote itself


class NeverStreamed:
    """A renderer's stream methods, for the routes that only ever answer whole."""

    def stream_start(self) -> list[ServerEvent]:
        return []

    def stream_output(self, choice: ChoiceResult, output: GenerationOutput) -> list[ServerEvent]:
        return []

    def stream_end(self) -> list[ServerEvent]:
        return []

    def stream_error(self, error: EmberError) -> list[ServerEvent]:
        return []


@dataclass(frozen=True, slots=True)
class Dialect:
    """One API dialect: how to validate its requests and render its results and errors."""

    name: str  # in logs and metrics
    id_prefix: str  # of response ids
    parse: Callable[[Any, ModelInfo], GenerationRequest]
    renderer: Callable[[GenerationRequest, RunResult, ResponseMeta], Renderer]
    errors: ErrorShape  # how refusals on its routes are answered
    read_body: Callable[[bytes], Any] | None = None  # JSON bytes -> the body parse takes; None: plain JSON
    tasks: tuple[str, ...] = (GENERATE,)  # the serving tasks (loaders.serving_task) whose models it serves
    stream_format: StreamFormat = SSE
