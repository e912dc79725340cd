"""The front end's view of one request: token ids in, text deltas and finished results out."""

from __future__ import annotations

import time

from ember.tokenization.detokenizer import IncrementalDetokenizer, StopStringMatcher
from ember.types import (FinishReason, GenerationOutput, RequestTimings, SamplingParams, SpeculationCounts, StepOutput,
                         TokenLogprob)


class RequestTracker:
    """Detokenizes a request's steps, applies stop strings and keeps its timings.

    When `update` reports `stopped_by_string`, the caller must abort the request in the engine:
    the engine only knows token-level stops.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 backend_tokenizer, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = IncrementalDetokenizer(backend_tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.timings = RequestTimings(arrival=arrival_time or time.time())
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.stopped_by_string = False
        self.speculation: SpeculationCounts | None = None

    def update(self, step: StepOutput) -> GenerationOutput:
        now = time.time()
        if self.timings.scheduled is None:
            self.timings.scheduled = step.scheduled_time or now
        if step.new_token_ids and self.timings.first_token is None:
            self.timings.first_token = now
        new_ids, step_logprobs = step.new_token_ids, step.logprobs
        if len(new_ids) > 1 and self.params.stop:
            new_ids, delta, stop = self._through_stop(new_ids)
            step_logprobs = step_logprobs[:len(new_ids)] if step_logprobs else step_logprobs
        else:
            delta, stop = self.stops.push(self.detokenizer.add(new_ids))
        if step.num_drafted_tokens:
            if self.speculation is None:
                self.speculation = SpeculationCounts()
            self.speculation.add(step.num_drafted_tokens, step.num_accepted_tokens)
        finish = step.finish_reason
        if stop is not None:
            finish, self.stop_reason, self.stopped_by_string = FinishReason.STOP, stop, True
        elif finish is not None:
            delta += self.stops.flush()
            if step.stop_token_id is not None:
                self.stop_reason = step.stop_token_id
        self.token_ids.extend(new_ids)
        if self.logprobs is not None and step_logprobs:
            self.logprobs.extend(step_logprobs)
        if delta:
            self.text_parts.append(delta)
        if finish is not None:
            self.finish_reason = finish
            self.timings.finished = now
        return GenerationOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.token_ids,
            text="".join(self.text_parts) if finish is not None else "",
            new_token_ids=new_ids,
            text_delta=delta,
            logprobs=self.logprobs,
            new_logprobs=step_logprobs if self.logprobs is not None else None,
            finish_reason=finish,
            num_cached_tokens=step.num_cached_tokens,
            timings=self.timings,
            stop_reason=self.stop_reason,
            error=step.error,
            num_computed_prompt_tokens=step.num_computed_prompt_tokens,
            num_pinned_tokens=step.num_pinned_tokens,
            speculation=self.speculation,
            cached_tokens_by_tier=step.cached_tokens_by_tier,
            num_preemptions=step.num_preemptions,
            num_budget_closes=step.num_budget_closes,
            pooled=step.pooled,
        )

    def _through_stop(self, new_ids: list[int]) -> tuple[list[int], str, str | None]:
        """Several tokens in one step (a drafted round): fed one at a time, so that the reply ends
        at the token that completes a stop string, as it would have decoding one token per step."""
        delta = ""
        for count, token_id in enumerate(new_ids, 1):
            piece, stop = self.stops.push(self.detokenizer.add([token_id]))
            delta += piece
            if stop is not None:
                return new_ids[:count], delta, stop
        return new_ids, delta, None
