"""The engine core: owns the model, the KV cache, the scheduler; add, abort and step.

Building it is other modules' work: the model from its source (engine.loading), the parts a step
runs on, sized for the model (engine.pool).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ember.config import EngineConfig, ModelConfig
from ember.context_window import ContextWindow, fit_output
from ember.engine import invariance
from ember.engine.cache_tiers import namespace
from ember.engine.weight_footprint import routed_experts, weight_footprint
from ember.engine.images import ImageEncoder, check_spans, images_attend_both_ways
from ember.engine.loading import BuiltModel, load_model
from ember.engine.messages import MediaSpan
from ember.engine.pool import build_kv_cache, build_step_parts
from ember.engine.pooling import PooledPrompts
from ember.engine.request import Request, RequestStatus
from ember.engine.spec.speculator import Proposer, build_speculator
from ember.engine.stats import EngineCounters, EngineStats
from ember.errors import InvalidRequest
from ember.freed_heap import release_freed_heap
from ember.media.processing import ImageProcessing, source_image_processing
from ember.types import CLASSIFY, FinishReason, SamplingParams, StepOutput, TokenConstraint

logger = logging.getLogger("ember.engine")

# While requests decode, a step may spend this share of a decoding step's time on images, so that
# streams keep about 1 / (1 + share) of their pace beside an image being encoded (a piece of work
# cannot be cut: a step that goes over by part of one is why the share stays below the 1.5x
# the time between tokens is held to).
IMAGE_WORK_SHARE = 0.4


class EngineCore:
    """Synchronous engine. Not thread-safe: one thread calls everything (engine.driver)."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 eos_token_ids: set[int], device: torch.device, dtype: torch.dtype,
                 draft_model: BuiltModel | None = None, group=None,
                 image_processing: ImageProcessing | None = None, cache_identity: dict | None = None) -> None:
        """`draft_model`: the model that drafts for this one (--speculate draft), loaded on the same
        device (engine.spec.draft_model.load_draft_model)."""
        self.model_config = model_config
        self.group = group  # engine.parallel.TensorGroup of a tensor-parallel rank, else None
        self.config = config
        self.device = device
        self.dtype = dtype
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            logger.warning("max_model_len %d is above the model's trained length %d; quality may drop",
                           self.max_model_len, model_config.max_position_embeddings)
        # KV heads this process caches: its shard's under tensor parallelism
        num_kv_heads = group.plan.num_kv_heads if group is not None else model_config.num_key_value_heads
        bidirectional = image_processing is not None and images_attend_both_ways(model)
        parts = build_step_parts(model, model_config, config, self.max_model_len, num_kv_heads, device, dtype, group,
                                 bidirectional_spans=bidirectional, cache_identity=cache_identity,
                                 draft=draft_model.model_config if draft_model is not None else None)
        self.kv_manager, self.scheduler, self.runner = parts.kv_manager, parts.scheduler, parts.runner
        self.tiers = parts.tiers  # the host and disk tiers behind the pool (engine.cache_tiers), or None
        self.max_num_batched_tokens = parts.max_num_batched_tokens
        # the prompt tokens a step may hold past its budget: a chunk covers a bidirectional span
        # (one image's tokens) whole (Request.computable)
        self.max_step_overrun = model.image_seq_len - 1 if bidirectional else 0
        self.kv_capacity_tokens, self.kv_cache_bytes = parts.kv_capacity_tokens, parts.kv_cache_bytes
        self.uses_cpu_kernels = parts.uses_cpu_kernels
        self.weights = weight_footprint(model)  # for EngineInfo: /health and the model card
        self.routed_experts = routed_experts(model_config)
        self._scheduled_at: dict[str, float] = {}
        self._progress_ids: set[str] = set()  # requests that asked for prefill progress outputs
        self.counters = EngineCounters()
        self.pooled = PooledPrompts()  # pooling requests' vectors as their chunks run
        # the model's images (engine.images), when it reads them
        self.images = (ImageEncoder(model, image_processing, device, int(config.image_cache_mb * 2**20))
                       if image_processing is not None else None)
        # the last step's time when requests decoded, its image work left out: what image work may add
        self._decode_seconds = 0.0
        self.speculator = None  # the startup check below probes plain decoding
        self.invariance = self._check_invariance()
        self.speculator = build_speculator(config.speculative, self.max_model_len, self._draft_proposer(draft_model))
        if device.type == "cpu":  # loading and the check freed far more than they kept
            release_freed_heap()
        if self.speculator is not None:
            logger.info("speculative decoding: %s, %s tokens per round", self.speculator.method,
                        config.speculative.draft_tokens or "tuned")

    def _check_invariance(self) -> invariance.InvarianceReport:
        """Batch invariance: checked on this processor (engine.invariance), or not promised. A model
        is built with whole-batch linears; only the check gives it another row plan."""
        if not self.config.batch_invariant:
            return invariance.not_promised("turned off (--no-batch-invariant)")
        if self.group is not None:
            return invariance.not_promised("not checked under tensor parallelism (the startup check runs on one process)")
        if self.device.type != "cpu":
            return invariance.not_promised(f"not promised on {self.device.type} devices")
        tiers, self.kv_manager.tiers = self.kv_manager.tiers, None  # the probes compute: no tier serves or keeps them
        try:
            report = invariance.check(self)
        finally:
            self.kv_manager.tiers = tiers
        if report.holds:
            logger.info("batch invariance holds: %s (%.1f s)", report.reason, report.seconds)
        else:
            logger.warning("batch invariance does NOT hold: %s. A request's bits may depend on its batch.",
                           report.reason)
        return report

    def _draft_proposer(self, draft: BuiltModel | None) -> Proposer | None:
        """The draft model's proposer, its KV cache as many blocks as the pool's (the same ids)."""
        if draft is None:
            return None
        from ember.engine.spec.draft_model import DraftModelProposer

        cache = build_kv_cache(draft.model_config, self.config, self.kv_manager.num_blocks,
                               draft.model_config.num_key_value_heads, draft.device, draft.dtype)
        logger.info("the draft model's KV cache: %.2f GiB beside the pool's blocks",
                    cache.tensor.numel() * cache.tensor.element_size() / 2**30)
        positions = max(draft.model_config.max_position_embeddings, self.config.max_model_len or 0)  # build_model widens
        return DraftModelProposer(draft.model, cache, draft.device, positions, self.model_config.vocab_size)

    @classmethod
    def from_source(cls, source, config: EngineConfig, open_source: Callable[[str], Any] | None = None,
                    group=None) -> "EngineCore":
        """Build the model described by a loaders.ModelSource and wrap it in an engine. `open_source`
        opens a model by name (a draft model's; default: loaders.load_model_source); with a
        tensor-parallel `group` (engine.parallel), this rank's shard of it."""
        if config.tensor_parallel_size > 1 and group is None:
            raise InvalidRequest("tensor parallelism needs its group of ranks: serve with the engine worker "
                                 "(ember serve) or use ember.llm.LLM", param="tensor_parallel_size")
        built = load_model(source, config, group)
        processing = source_image_processing(source, config.vision)
        draft = None
        if config.speculative.draft_model:
            from ember.engine.spec.draft_model import load_draft_model
            from ember.loaders import source_opener

            draft = load_draft_model(config, source, open_source or source_opener())
        return cls(built.model, built.model_config, config, built.eos_token_ids, built.device, built.dtype, draft,
                   group, processing, cache_identity=namespace.model_identity(source))

    # ---- requests ------------------------------------------------------------------------------

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Check that a request can ever run; return its max_tokens with None resolved (the rule
        is ember.context_window's; the Python API refuses a max_tokens beyond the room)."""
        window = ContextWindow(self.max_model_len, self.kv_capacity_tokens)
        return fit_output(window, num_prompt_tokens, max_tokens, over_room="refuse").max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    constraint: TokenConstraint | None = None,
                    report_progress: bool = False, media: Sequence[MediaSpan] = ()) -> None:
        if self.scheduler.get_request(request_id) is not None:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if media and self.images is None:
            raise InvalidRequest("this engine reads no images (a text-only model, or images turned off)",
                                 param="media", code="vision_disabled")
        wrong = check_spans(list(media), len(prompt_token_ids))
        if wrong is not None:
            raise InvalidRequest(wrong, param="media")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequest(f"the prompt holds a token id outside the vocabulary (0..{vocab - 1})",
                                 param="prompt")
        self._check_head(params)
        max_tokens = self.resolve_max_tokens(len(prompt_token_ids), params.max_tokens)
        params = params.seeded(self.config.seed)
        request = Request(request_id, list(prompt_token_ids), params, max_tokens=max_tokens,
                          eos_token_ids=self.eos_token_ids, arrival_time=arrival_time or time.time(),
                          priority=params.priority, cache_salt=cache_salt, constraint=constraint, media=media)
        self.scheduler.add_request(request)
        if media:
            self.images.add(request)
        if report_progress:  # opt-in: an empty output after each prefill chunk, with num_computed_prompt_tokens
            self._progress_ids.add(request_id)

    def _check_head(self, params: SamplingParams) -> None:
        """A classifier's head scores prompts (CLASSIFY) and has no vocabulary to generate from; only
        a classifier has a head to classify with."""
        classifier = self.model_config.num_labels > 0
        if classifier and params.pooling is None:
            raise InvalidRequest("this model is a classifier (a sequence-classification checkpoint): it scores "
                                 f"prompts (pooling {CLASSIFY!r}) and does not generate", param="pooling")
        if params.pooling == CLASSIFY and not classifier:
            raise InvalidRequest(f"pooling {CLASSIFY!r} needs a model with a classification head "
                                 "(a ...ForSequenceClassification checkpoint)", param="pooling")

    def abort(self, request_ids: list[str]) -> list[StepOutput]:
        """Abort live requests (unknown ids are ignored); returns a final output for each aborted one."""
        return self._finish_all(request_ids, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_schedulable(self) -> bool:
        """Some unfinished request is not paused: a step has work."""
        return self.scheduler.has_schedulable()

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        began = time.perf_counter()
        counters = self.counters
        outputs: list[StepOutput] = []
        if self.images is not None:
            outputs += self._advance_images()
        image_seconds = time.perf_counter() - began
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        self._move_blocks()  # before the forward writes to blocks the pool let go
        if self.speculator is not None:
            for item in self.speculator.draft(plan):  # a round drafted short gives back its other blocks
                self.kv_manager.trim_blocks(item.request, item.start + item.num_new_tokens)
        counters.num_preemptions += len(plan.preempted)
        for request in plan.preempted:  # it runs its prompt again from the start
            self.pooled.forget(request.request_id)
            if self.speculator is not None:
                self.speculator.restart(request.request_id)
        if not plan.scheduled:
            return outputs
        now = time.time()
        for item in plan.scheduled:
            request = item.request
            if request.request_id not in self._scheduled_at:  # first admission
                self._scheduled_at[request.request_id] = now
                counters.admitted_prompt_tokens += request.num_prompt_tokens
                counters.cached_prompt_tokens += request.num_cached_tokens
        forward_began = time.perf_counter()
        embeds = self.images.embeddings_for(plan.scheduled) if self.images is not None else None
        result = self.runner.execute(plan.scheduled, embeds=embeds) if embeds is not None else \
            self.runner.execute(plan.scheduled)
        if self.speculator is not None:
            self.speculator.after_step(plan, result, began, forward_began, counters)
            self.speculator.follow(plan)
        for request_id, part in result.pooled.items():
            self.pooled.add(request_id, part)
        self.scheduler.update_from_output(plan, result.sampled, result.accepted)
        self._move_blocks()  # newly cached blocks to disk while they are sure to hold their tokens
        num_decode_tokens = 0
        for item in plan.scheduled:
            request = item.request
            counters.prompt_tokens += max(0, min(item.start + item.num_new_tokens, request.num_prompt_tokens)
                                          - item.start)
            num_drafted = len(item.draft_token_ids)
            num_accepted = result.accepted.get(request.request_id, 0)
            if item.num_new_tokens - num_drafted == 1 and item.start >= request.num_prompt_tokens:
                num_decode_tokens += item.num_new_tokens
            new_tokens = result.sampled.get(request.request_id, [])
            finished = request.status.is_finished  # with no new token: a prompt-only request (max_tokens 0)
            if not new_tokens and not finished:
                if request.request_id in self._progress_ids:
                    outputs.append(self._progress_output(request))
                continue
            counters.generation_tokens += len(new_tokens)
            outputs.append(StepOutput(
                request_id=request.request_id,
                new_token_ids=new_tokens,
                logprobs=result.logprobs.get(request.request_id),
                finish_reason=request.finish_reason if finished else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
                scheduled_time=self._scheduled_at[request.request_id],
                stop_token_id=request.stop_reason if finished else None,
                num_pinned_tokens=request.num_pinned_tokens,
                num_drafted_tokens=num_drafted,
                num_accepted_tokens=num_accepted,
                cached_tokens_by_tier=request.cached_tokens_by_tier or None,
                num_preemptions=request.num_preemptions,
                num_budget_closes=getattr(request.constraint, "num_budget_closes", 0) if finished else 0,
                pooled=self._pooled_vector(request) if finished else None,
            ))
            if finished:
                self._forget(request)
        for request_id, reason in result.failed.items():  # a constraint gave up: that request alone ends
            outputs += self._finish_all([request_id], FinishReason.ERROR, reason)
        seconds = time.perf_counter() - began
        counters.add_step(seconds, plan.num_scheduled_tokens - num_decode_tokens, num_decode_tokens)
        if num_decode_tokens:
            self._decode_seconds = seconds - image_seconds
        return outputs

    def _pooled_vector(self, request: Request) -> list[float] | None:
        method = request.sampling_params.pooling
        if method is None or request.finish_reason is not FinishReason.LENGTH:
            return None
        return self.pooled.take(request.request_id, method, request.num_prompt_tokens)

    def _move_blocks(self) -> None:
        moves = self.kv_manager.take_moves()
        if self.tiers is not None:
            self.tiers.move(moves)
        elif moves.relocated:
            self.runner.cache.copy_blocks(moves.relocated)

    def _advance_images(self) -> list[StepOutput]:
        """Encode the images live requests need, for at most IMAGE_WORK_SHARE of a decoding step's
        time while requests decode (all at once otherwise); end the requests whose images failed."""
        running = self.scheduler.running
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in running)
        waiting = [r for r in self.scheduler.requests.values() if r.status is not RequestStatus.RUNNING]
        self.images.advance(running + waiting, IMAGE_WORK_SHARE * self._decode_seconds if decoding else None,
                            self.kv_manager.num_cached_tokens)
        failed = [(r.request_id, error) for r in running + waiting if (error := self.images.failed(r))]
        return [output for request_id, error in failed
                for output in self._finish_all([request_id], FinishReason.ERROR, error)]

    def _progress_output(self, request: Request) -> StepOutput:
        return StepOutput(request.request_id, [], None, None, request.num_prompt_tokens,
                          request.num_cached_tokens, scheduled_time=self._scheduled_at[request.request_id],
                          num_computed_prompt_tokens=min(request.num_computed_tokens, request.num_prompt_tokens),
                          num_pinned_tokens=request.num_pinned_tokens,
                          cached_tokens_by_tier=request.cached_tokens_by_tier or None)

    def fail_all(self, message: str) -> list[StepOutput]:
        """End every live request with an error (after an engine fault)."""
        return self._finish_all(list(self.scheduler.requests), FinishReason.ERROR, message)

    def _finish_all(self, request_ids: list[str], reason: FinishReason, error: str | None = None) -> list[StepOutput]:
        finished = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        outputs = [StepOutput(r.request_id, [], None, reason, r.num_prompt_tokens, r.num_cached_tokens,
                              scheduled_time=self._scheduled_at.get(r.request_id), error=error,
                              cached_tokens_by_tier=r.cached_tokens_by_tier or None,
                              num_preemptions=r.num_preemptions)
                   for r in finished]
        for request in finished:
            self._forget(request)
        return outputs

    def _forget(self, request: Request) -> None:
        """Drop what the core keeps of a request that ended."""
        request_id = request.request_id
        self._scheduled_at.pop(request_id, None)
        self._progress_ids.discard(request_id)
        self.pooled.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request)
        if self.images is not None:
            self.images.remove(request_id)

    def stats(self) -> EngineStats:
        kv = self.kv_manager
        return EngineStats.build(
            self.counters,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_prefilling=self.scheduler.num_prefilling,
            num_paused=self.scheduler.num_paused,
            kv_blocks_total=kv.num_blocks - 1,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_cached=kv.num_cached_blocks,
            kv_blocks_pinned=kv.num_pinned_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            cache_tiers=self.tiers.stats() if self.tiers is not None else {},
        )

    def reset_counters(self) -> None:
        """Zero the counters (after a warm-up, so statistics count clients' work only)."""
        self.counters = EngineCounters()
        self.kv_manager.prefix_cache_queries = self.kv_manager.prefix_cache_hits = 0
        if self.tiers is not None:
            self.tiers.reset_counters()

    def close(self) -> None:
        """Write out what the disk tier still has queued; the core serves nothing after."""
        if self.tiers is not None:
            self.tiers.close()

    def check_invariants(self) -> None:
        """Raise AssertionError if blocks leaked; meaningful when no request is live."""
        self.kv_manager.check_invariants()
        if not self.has_unfinished():
            assert self.kv_manager.num_used_blocks == 0, f"{self.kv_manager.num_used_blocks} blocks still in use"
