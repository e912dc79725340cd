"""The parts a step runs on, sized for a model and a config: the KV pool (its block manager and
tensors), the scheduler with its budget, and the runner with its sampler."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ember import kernels
from ember.config import EngineConfig, ModelConfig
from ember.engine.attention import KVCache
from ember.engine.cache_tiers import CacheTiers, build_cache_tiers, namespace
from ember.engine.kernel_attention import KERNEL_BLOCK_SIZE
from ember.engine.kv_cache import KVCacheManager
from ember.engine.runner import ModelRunner
from ember.engine.sampler import Sampler
from ember.engine.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger("ember.engine")

_DEFAULT_CPU_KV_GIB = 2.0
_CPU_STEP_TOKENS, _GPU_STEP_TOKENS = 512, 2048  # default step budgets (EngineConfig.max_num_batched_tokens)
_MAX_DEFAULT_CACHE_RAM_MB = 8192  # the host tier's default: a quarter of the available memory, at most this
# Measured: ember's CPU attention kernel does about a third of the linear kernel's work per second
# (1,500- and 8,000-token prefills on AMD EPYC Zen 4), so a key costs three times its FLOPs' share.
_ATTENTION_WORK_RATIO = 3


@dataclass(slots=True)
class StepParts:
    kv_manager: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner  # rank 0's under tensor parallelism (engine.parallel.LeaderRunner)
    max_num_batched_tokens: int
    kv_capacity_tokens: int  # the most tokens the pool holds
    kv_cache_bytes: int
    uses_cpu_kernels: bool  # the KV cache is laid out for ember's attention kernel
    tiers: CacheTiers | None  # the host and disk tiers behind the pool, where they are on


def build_step_parts(model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig, max_model_len: int,
                     num_kv_heads: int, device: torch.device, dtype: torch.dtype, group=None,
                     bidirectional_spans: bool = False, cache_identity: dict | None = None,
                     draft: ModelConfig | None = None) -> StepParts:
    """`num_kv_heads`: the KV heads this process caches (its shard's under tensor parallelism);
    `bidirectional_spans`: some prompts' spans attend both ways (engine.images), which ember's
    attention kernel does not do (it is causal only), so attention takes the torch path;
    `cache_identity`: the model's part of the disk tier's namespace (cache_tiers.namespace), None
    where the model has no files to name (then there is no disk tier); `draft`: a draft model's
    config, whose own KV entries take a share of the memory budget (its cache has as many blocks as
    the pool, addressed by the same block ids: engine.spec.draft_model)."""
    max_num_batched_tokens = config.max_num_batched_tokens or (_CPU_STEP_TOKENS if device.type == "cpu"
                                                               else _GPU_STEP_TOKENS)
    kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype)
    draft_bytes = 0 if draft is None else KVCache.bytes_per_block(
        draft.num_hidden_layers, config.block_size, draft.num_key_value_heads, draft.head_dim, kv_dtype)
    num_blocks = num_kv_blocks(config, model_config, num_kv_heads, kv_dtype, device, max_model_len, draft_bytes)
    if group is not None:  # rank 0 hands out the block ids: every rank must hold them all
        num_blocks = group.agree_min(num_blocks)
    cache = build_kv_cache(model_config, config, num_blocks, num_kv_heads, device, dtype, bidirectional_spans)
    uses_cpu_kernels = cache.kernel_layout
    if bidirectional_spans and config.cpu_kernels and device.type == "cpu":
        logger.info("attention: the torch path, as this model's image tokens attend both ways and ember's "
                    "attention kernel is causal only (the linear kernels stay)")
    if kv_dtype not in (dtype, torch.int8) and config.cpu_kernels and device.type == "cpu":
        logger.info("attention: the torch path, as ember's attention kernel reads a KV cache in the model's "
                    "dtype or int8, not %s (--kv-dtype)", kv_dtype)
    tiers = None
    if config.enable_prefix_caching and group is None:
        description = None if cache_identity is None else namespace.describe(
            cache_identity, config, model_config, dtype=dtype, kv_dtype=kv_dtype, device=device,
            kernel_layout=uses_cpu_kernels, num_kv_heads=num_kv_heads)
        host_mb = default_cache_ram_mb() if config.cache_ram_mb is None else config.cache_ram_mb
        tiers = build_cache_tiers(cache, int(host_mb * 2**20), config.cache_disk_dir if description else None,
                                  int(config.cache_disk_mb * 2**20), description)
    # runs of blocks: what ember's attention kernel reads fastest (not under tensor parallelism, where
    # every rank's shard would have to take the copies the core makes in its own cache)
    kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                config.max_pinned_kv_share, tiers=tiers, keep_runs=uses_cpu_kernels and group is None)
    scheduler = Scheduler(
        SchedulerConfig(config.max_num_seqs, max_num_batched_tokens, max_model_len,
                        attention_cost_tokens(model_config, config.attention_cost_tokens),
                        config.background_wait_steps, release_window=local_only_window(model_config.layer_windows)),
        kv_manager)
    sampler = Sampler(model_config.vocab_size, device,
                      cpu_kernel=config.cpu_kernels and device.type == "cpu" and kernels.available())
    runner = ModelRunner(model, cache, sampler, device, exact=config.batch_invariant and device.type == "cpu")
    if group is not None:
        runner = group.wrap_runner(runner)
    capacity = (num_blocks - 1) * config.block_size
    kv_cache_bytes = cache.tensor.numel() * cache.tensor.element_size()
    logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)", num_blocks - 1, config.block_size,
                capacity, kv_cache_bytes / 2**30, kv_dtype)
    return StepParts(kv_manager, scheduler, runner, max_num_batched_tokens, capacity, kv_cache_bytes,
                     uses_cpu_kernels, tiers)


def build_kv_cache(model_config: ModelConfig, config: EngineConfig, num_blocks: int, num_kv_heads: int,
                   device: torch.device, dtype: torch.dtype, bidirectional_spans: bool = False) -> KVCache:
    """A cache of `num_blocks` blocks for the model, in the layout of ember's attention kernel where
    the kernel can read it (the CPU, blocks of its size, bfloat16 or float32, heads a multiple of
    16 wide, a cache in the model's dtype or int8, causal attention only), else the torch layout."""
    kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype)
    kernel_layout = (config.cpu_kernels and device.type == "cpu" and config.block_size == KERNEL_BLOCK_SIZE
                     and dtype in (torch.bfloat16, torch.float32) and model_config.head_dim % 16 == 0
                     and kv_dtype in (dtype, torch.int8) and kernels.available() and not bidirectional_spans)
    return KVCache(model_config.num_hidden_layers, num_blocks, config.block_size, num_kv_heads,
                   model_config.head_dim, dtype, device, kernel_layout=kernel_layout,
                   layer_windows=model_config.layer_windows, kv_dtype=kv_dtype)


def default_cache_ram_mb() -> float:
    """The host tier's size when none is asked for: a quarter of the memory available now, at most
    _MAX_DEFAULT_CACHE_RAM_MB (it takes memory only as blocks are evicted into it)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return min(_MAX_DEFAULT_CACHE_RAM_MB, int(line.split()[1]) / 1024 / 4)
    except OSError:
        pass
    return 1024.0


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """EngineConfig.kv_dtype as what the cache stores; auto: the model's `dtype`."""
    return {"auto": dtype, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
            "fp32": torch.float32, "int8": torch.int8}[name]


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, num_kv_heads: int, kv_dtype: torch.dtype,
                  device: torch.device, max_model_len: int, extra_bytes_per_block: int = 0) -> int:
    """The pool's blocks, the null block 0 included: as the config asks, else what the memory
    budget holds (in `kv_dtype`, int8's scales counted, each block's `extra_bytes_per_block` of a
    draft model's entries too), never more than every sequence at full length needs."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks + 1
    if config.kv_cache_tokens is not None:
        return -(-config.kv_cache_tokens // config.block_size) + 1
    per_block = KVCache.bytes_per_block(model_config.num_hidden_layers, config.block_size, num_kv_heads,
                                        model_config.head_dim, kv_dtype) + extra_bytes_per_block
    if config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 2**30
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * config.gpu_memory_utilization
    else:
        budget = _DEFAULT_CPU_KV_GIB * 2**30
    most_needed = config.max_num_seqs * -(-max_model_len // config.block_size)
    return max(2, min(int(budget // per_block), most_needed)) + 1


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
