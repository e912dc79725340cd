"""The engine core: owns the model, the KV cache, the scheduler; add, abort and step."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any
from dataclasses import replace

import torch

from ember.config import EngineConfig, ModelConfig
from ember.engine.attention import KVCache
from ember.engine.host_memory import move_to_huge_pages, release_freed_heap
from ember.engine.kernel_attention import KERNEL_BLOCK_SIZE
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request, RequestStatus
from ember.engine.runner import ModelRunner
from ember.engine.sampler import Sampler
from ember.engine.scheduler import Scheduler, SchedulerConfig
from ember.engine.spec.speculator import Proposer, build_speculator
from ember.engine.stats import EngineCounters, EngineStats
from ember.context_window import ContextWindow, fit_output
from ember.errors import InvalidRequest
from ember.models import get_model_class
from ember import kernels
from ember.engine import invariance
from ember.models.layers import block_weights, prepare_linears, use_fused_ops
from ember.types import FinishReason, SamplingParams, StepOutput, TokenConstraint

logger = logging.getLogger("ember.engine")

_DEFAULT_CPU_KV_GIB = 2.0
_CPU_STEP_TOKENS, _GPU_STEP_TOKENS = 512, 2048  # default step budgets (EngineConfig.max_num_batched_tokens)
_CUDA_MEMORY_FRACTION = 0.85  # of the memory still free after the weights are loaded
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineCore:
    """Synchronous engine. Not thread-safe: one thread calls everything (see AsyncEngine)."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 eos_token_ids: set[int], device: torch.device, dtype: torch.dtype,
                 draft_proposer: Proposer | None = None, group=None) -> None:
        self.model_config = model_config
        self.group = group  # engine.parallel.TensorGroup of a tensor-parallel rank, else None
        # KV heads this process caches: its shard's under tensor parallelism
        self.num_kv_heads = group.plan.num_kv_heads if group is not None else model_config.num_key_value_heads
        self.config = config
        self.device = device
        self.dtype = dtype
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            logger.warning("max_model_len %d is above the model's trained length %d; quality may drop",
                           self.max_model_len, model_config.max_position_embeddings)
        self.max_num_batched_tokens = config.max_num_batched_tokens or (_CPU_STEP_TOKENS if device.type == "cpu"
                                                                        else _GPU_STEP_TOKENS)
        num_blocks = self._num_kv_blocks()
        if group is not None:  # rank 0 hands out the block ids: every rank must hold them all
            num_blocks = group.agree_min(num_blocks)
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                         config.max_pinned_kv_share)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                            attention_cost_tokens(model_config, config.attention_cost_tokens),
                            config.background_wait_steps,
                            release_window=local_only_window(model_config.layer_windows)),
            self.kv_manager)
        self.uses_cpu_kernels = (config.cpu_kernels and device.type == "cpu" and config.block_size == KERNEL_BLOCK_SIZE
                                 and dtype in (torch.bfloat16, torch.float32) and model_config.head_dim % 16 == 0
                                 and kernels.available())
        cache = KVCache(model_config.num_hidden_layers, num_blocks, config.block_size,
                        self.num_kv_heads, model_config.head_dim, dtype, device,
                        kernel_layout=self.uses_cpu_kernels, layer_windows=model_config.layer_windows)
        sampler = Sampler(model_config.vocab_size, device,
                          cpu_kernel=config.cpu_kernels and device.type == "cpu" and kernels.available())
        self.runner = ModelRunner(model, cache, sampler, device, exact=config.batch_invariant and device.type == "cpu")
        if group is not None:
            self.runner = group.wrap_runner(self.runner)
        self.kv_capacity_tokens = (num_blocks - 1) * config.block_size
        self._scheduled_at: dict[str, float] = {}
        self._progress_ids: set[str] = set()  # requests that asked for prefill progress outputs
        self.counters = EngineCounters()
        self.kv_cache_bytes = cache.tensor.numel() * cache.tensor.element_size()
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)", num_blocks - 1,
                    config.block_size, self.kv_capacity_tokens,
                    self.kv_cache_bytes / 2**30, dtype)
        self.speculator = None  # the startup check below probes plain decoding
        self.invariance = self._check_invariance()
        self.speculator = build_speculator(config.speculative, self.max_model_len, draft_proposer)
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
            return invariance.not_promised("not checked under tensor parallelism (sums over ranks)")
        if self.device.type != "cpu":
            return invariance.not_promised(f"not promised on {self.device.type} devices")
        report = invariance.check(self)
        if report.holds:
            logger.info("batch invariance holds: %s (%.1f s)", report.reason, report.seconds)
        else:
            logger.warning("batch invariance does NOT hold: %s. A request's bits may depend on its batch.",
                           report.reason)
        return report

    @classmethod
    def from_source(cls, source, config: EngineConfig, open_source: Callable[[str], Any] | None = None,
                    group=None) -> "EngineCore":
        """Build the model described by a loaders.ModelSource and wrap it in an engine. `open_source`
        opens a model by name (a draft model's; default: loaders.load_model_source); with a
        tensor-parallel `group` (engine.parallel), this rank's shard of it."""
        if config.tensor_parallel_size > 1 and group is None:
            raise InvalidRequest("tensor parallelism needs its group of ranks: serve with the engine worker "
                                 "(ember serve) or use ember.llm.LLM", param="tensor_parallel_size")
        device = resolve_device(config.device)
        if group is not None:
            device = group.device(device)
        dtype = resolve_dtype(config.dtype)
        if config.num_threads and device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        model_config = ModelConfig.from_hf(source.hf_config)
        if config.rope_scaling:
            model_config = model_config.with_rope_scaling(config.rope_scaling)
        model = build_model(group.local_config(model_config) if group is not None else model_config,
                            dtype, device, config.max_model_len)
        block_kernels = device.type == "cpu" and config.cpu_kernels and kernels.available()
        model.load_weights(source.weights(blocks=block_kernels and config.quantization != "none",
                                          cut=group.cut if group is not None else None))
        if group is not None:
            group.attach(model)
        formats = prepare_linears(model, config.quantization, block_kernels)
        if block_kernels:  # every step streams them all: on huge pages it streams faster
            move_to_huge_pages(block_weights(model), "packed")
        if block_kernels and dtype in (torch.bfloat16, torch.float32):
            use_fused_ops(model)
        logger.info("linear layers: %s", ", ".join(f"{count} {name}" for name, count in formats.items()))
        eos = set(model_config.eos_token_ids) | set(source.tokenizer.eos_token_ids)
        generation_eos = source.generation_config.get("eos_token_id")
        if generation_eos is not None:
            eos |= {generation_eos} if isinstance(generation_eos, int) else set(generation_eos)
        draft = None
        if config.speculative.draft_model:
            from ember.engine.spec.draft_model import load_draft_proposer
            from ember.loaders import source_opener

            draft = load_draft_proposer(config, source, open_source or source_opener(), cls.from_source)
        return cls(model, model_config, config, eos, device, dtype, draft, group)

    def _num_kv_blocks(self) -> int:
        cfg, mc = self.config, self.model_config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks + 1
        if cfg.kv_cache_tokens is not None:
            return -(-cfg.kv_cache_tokens // cfg.block_size) + 1
        per_block = KVCache.bytes_per_block(mc.num_hidden_layers, cfg.block_size, self.num_kv_heads,
                                            mc.head_dim, self.dtype)
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * _CUDA_MEMORY_FRACTION
        else:
            budget = _DEFAULT_CPU_KV_GIB * 2**30
        # No use holding more than every sequence at full length.
        most_needed = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        return max(2, min(int(budget // per_block), most_needed)) + 1

    # ---- requests ------------------------------------------------------------------------------

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Check that a request can ever run; return its max_tokens with None resolved (the rule
        is ember.context_window's; the Python API refuses a max_tokens beyond the room)."""
        window = ContextWindow(self.max_model_len, self.kv_capacity_tokens)
        return fit_output(window, num_prompt_tokens, max_tokens, over_room="refuse").max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    constraint: TokenConstraint | None = None,
                    report_progress: bool = False) -> None:
        if self.scheduler.get_request(request_id) is not None:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequest(f"the prompt holds a token id outside the vocabulary (0..{vocab - 1})",
                                 param="prompt")
        max_tokens = self.resolve_max_tokens(len(prompt_token_ids), params.max_tokens)
        params = params.seeded(self.config.seed)
        request = Request(request_id, list(prompt_token_ids), params, max_tokens=max_tokens,
                          eos_token_ids=self.eos_token_ids, arrival_time=arrival_time or time.time(),
                          priority=params.priority, cache_salt=cache_salt, constraint=constraint)
        self.scheduler.add_request(request)
        if report_progress:  # opt-in: an empty output after each prefill chunk, with num_computed_prompt_tokens
            self._progress_ids.add(request_id)

    def abort(self, request_ids: list[str]) -> list[StepOutput]:
        """Abort live requests (unknown ids are ignored); returns a final output for each aborted one."""
        return self._finish_all(request_ids, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        began = time.perf_counter()
        counters = self.counters
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        counters.num_preemptions += len(plan.preempted)
        if not plan.scheduled:
            return []
        now = time.time()
        for item in plan.scheduled:
            request = item.request
            if request.request_id not in self._scheduled_at:  # first admission
                self._scheduled_at[request.request_id] = now
                counters.admitted_prompt_tokens += request.num_prompt_tokens
                counters.cached_prompt_tokens += request.num_cached_tokens
        forward_began = time.perf_counter()
        result = self.runner.execute(plan.scheduled)
        if self.speculator is not None and all(item.samples and item.num_new_tokens == 1 + len(item.draft_token_ids)
                                               for item in plan.scheduled):  # decode rows only: what drafting pays
            ended = time.perf_counter()
            self.speculator.observe_step(len(plan.scheduled), plan.num_scheduled_tokens,
                                         any(item.draft_token_ids for item in plan.scheduled),
                                         sum(map(len, result.sampled.values())), ended - forward_began, ended - began)
        self.scheduler.update_from_output(plan, result.sampled, result.accepted)
        outputs = []
        num_decode_tokens = 0
        for item in plan.scheduled:
            request = item.request
            counters.prompt_tokens += max(0, min(item.start + item.num_new_tokens, request.num_prompt_tokens)
                                          - item.start)
            num_drafted = len(item.draft_token_ids)
            num_accepted = result.accepted.get(request.request_id, 0)
            if item.num_new_tokens - num_drafted == 1 and item.start >= request.num_prompt_tokens:
                num_decode_tokens += item.num_new_tokens
            if num_drafted:
                self.speculator.record(request.request_id, num_drafted, num_accepted)
                counters.spec_rounds += 1
                counters.spec_proposed_tokens += num_drafted
                counters.spec_accepted_tokens += num_accepted
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
            ))
            if finished:
                self._forget(request.request_id)
        for request_id, reason in result.failed.items():  # a constraint gave up: that request alone ends
            outputs += self._finish_all([request_id], FinishReason.ERROR, reason)
        counters.add_step(time.perf_counter() - began, plan.num_scheduled_tokens - num_decode_tokens,
                          num_decode_tokens)
        return outputs

    def _progress_output(self, request: Request) -> StepOutput:
        return StepOutput(request.request_id, [], None, None, request.num_prompt_tokens,
                          request.num_cached_tokens, scheduled_time=self._scheduled_at[request.request_id],
                          num_computed_prompt_tokens=min(request.num_computed_tokens, request.num_prompt_tokens),
                          num_pinned_tokens=request.num_pinned_tokens)

    def fail_all(self, message: str) -> list[StepOutput]:
        """End every live request with an error (after an engine fault)."""
        return self._finish_all(list(self.scheduler.requests), FinishReason.ERROR, message)

    def _finish_all(self, request_ids: list[str], reason: FinishReason, error: str | None = None) -> list[StepOutput]:
        finished = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        outputs = [StepOutput(r.request_id, [], None, reason, r.num_prompt_tokens, r.num_cached_tokens,
                              scheduled_time=self._scheduled_at.get(r.request_id), error=error)
                   for r in finished]
        for request in finished:
            self._forget(request.request_id)
        return outputs

    def _forget(self, request_id: str) -> None:
        """Drop what the core keeps of a request that ended."""
        self._scheduled_at.pop(request_id, None)
        self._progress_ids.discard(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def stats(self) -> EngineStats:
        kv = self.kv_manager
        return EngineStats.build(
            self.counters,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_prefilling=self.scheduler.num_prefilling,
            kv_blocks_total=kv.num_blocks - 1,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_cached=kv.num_cached_blocks,
            kv_blocks_pinned=kv.num_pinned_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
        )

    def reset_counters(self) -> None:
        """Zero the counters (after a warm-up, so statistics count clients' work only)."""
        self.counters = EngineCounters()
        self.kv_manager.prefix_cache_queries = self.kv_manager.prefix_cache_hits = 0

    def check_invariants(self) -> None:
        """Raise AssertionError if blocks leaked; meaningful when no request is live."""
        self.kv_manager.check_invariants()
        if not self.has_unfinished():
            assert self.kv_manager.num_used_blocks == 0, f"{self.kv_manager.num_used_blocks} blocks still in use"


# Measured: ember's CPU attention kernel does about a third of the linear kernel's work per second
# (1,500- and 8,000-token prefills on AMD EPYC Zen 4), so a key costs three times its FLOPs' share.
_ATTENTION_WORK_RATIO = 3


def attention_cost_tokens(config: ModelConfig, setting: int | None) -> int | None:
    """The context at which a token's attention costs as much as its linear layers (the rest of its
    step), for the scheduler's budget; `setting` overrides it (0: no attention cost)."""
    if setting is not None:
        return setting or None
    heads, kv_heads, head_dim, hidden = (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                         config.hidden_size)
    linear = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * config.intermediate_size
    per_key = 2 * heads * head_dim  # q.k and p.v, per layer; 2 FLOPs per weight in the linears cancel
    return max(1, round(linear / per_key / _ATTENTION_WORK_RATIO))


def local_only_window(layer_windows: list[int | None]) -> int | None:
    """The widest window when every layer has one (no layer reads keys behind it), else None."""
    if layer_windows and all(layer_windows):
        return max(layer_windows)
    return None


def build_model(model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_model_len: int | None = None) -> torch.nn.Module:
    """An empty model of the config's architecture, its parameters waiting for load_weights."""
    if max_model_len and max_model_len > model_config.max_position_embeddings:
        if model_config.rope_scaling:
            raise InvalidRequest(
                f"max_model_len {max_model_len} is beyond the model's trained length "
                f"{model_config.max_position_embeddings}, which ember extends only for plain rotary "
                f"embeddings, not for {model_config.rope_scaling.get('rope_type')} scaling", param="max_model_len")
        # Plain rotary embeddings are defined at every position: widen the table.
        model_config = replace(model_config, max_position_embeddings=max_model_len)
    with _default_dtype(dtype), device:
        return get_model_class(model_config.model_type)(model_config).eval()


def resolve_device(name: str) -> torch.device:
    """`auto` is the CPU: ember's CUDA path has not yet been run on a GPU by its tests, so a GPU is
    used only when named (`--device cuda`), and its presence is pointed out."""
    if name == "auto":
        if torch.cuda.is_available():
            logger.warning("a CUDA device is present, but ember's CUDA path is not yet checked on a GPU by its "
                           "tests: serving on the CPU (--device cuda chooses the GPU)")
        return torch.device("cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    # bfloat16 by default, on the CPU too: half of float32's memory traffic, and what the CPU kernels take.
    return torch.bfloat16 if name == "auto" else _DTYPES[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
