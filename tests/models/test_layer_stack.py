"""The decoder's layers as one kernel call (models.layer_stack) against the Python loop of ops it
replaces: the same bits in the hidden states and in every cache slot, for prompt chunks, decode
rows and drafted rows in one step, in float32 and bfloat16, with and without a sliding window
(Gemma 3's local and global layers among them); and the loop wherever the call does not fit."""

from __future__ import annotations

import pytest
import torch
from block_formats import blocks_of_format
from model_builders import build_pair

from ember import kernels
from ember.engine.attention import KVCache
from ember.engine.host_memory import move_to_huge_pages
from ember.engine.kernel_attention import KERNEL_BLOCK_SIZE, kernel_attention
from ember.models.layers import Linear, block_weights, prepare_linears
from ember.models.weights import StackedBlockWeights

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"ember's CPU kernels: {kernels.status()}")

# (sequence, first position, rows) per step: two prompts, one in two chunks; then decode rows,
# one with three drafted rows, beside the rest of the chunked prompt
STEPS = [[(0, 0, 21), (1, 0, 9)],
         [(0, 21, 1), (1, 9, 4)],
         [(0, 22, 1), (1, 13, 1)]]


def block_model(case: str, dtype: torch.dtype, window: int | None = None):
    """The tiny twin of `case` on the kernels: 4-bit blocks (the LM head 8-bit), fused ops."""
    _, model, config = build_pair(case, dtype, fused=True)
    prepare_linears(model, "int4", block_kernels=True)
    if window is not None:
        config.layer_windows = [window] * config.num_hidden_layers
    return model, config


def mixed_block_model(case: str, dtype: torch.dtype):
    """The tiny twin with its projections in blocks as a file stages them, a fused projection's
    shards alternating between 4-bit blocks with steps and 8-bit ones with the halves' steps
    (format 20 beside 24, as a Q4_K_M file's Q4_K queries beside Q6_K values): each shard keeps
    its own layout (StackedBlockWeights)."""
    _, model, config = build_pair(case, dtype, fused=True)
    for module in model.model.layers.modules():
        if isinstance(module, Linear):
            sizes = getattr(module, "out_sizes", [module.out_features])
            for index, size in enumerate(sizes):
                shard = module.weight.data.narrow(0, sum(sizes[:index]), size).float()
                module.stage_blocks(index, blocks_of_format(shard, (20, 24)[index % 2], seed=index))
    prepare_linears(model, "auto", block_kernels=True)
    stacked = [layer.self_attn.qkv_proj.weights for layer in model.model.layers]
    assert all(type(w) is StackedBlockWeights and [p.format for p in w.parts] == [20, 24, 20] for w in stacked)
    return model, config


def cache_for(config, dtype: torch.dtype) -> KVCache:
    cache = KVCache(config.num_hidden_layers, 16, KERNEL_BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                    dtype, torch.device("cpu"), kernel_layout=True, layer_windows=config.layer_windows)
    cache.tensor.zero_()  # the pool starts unwritten; zeros let two caches be compared whole
    return cache


def run_steps(model, config, cache: KVCache, use_stack: bool) -> list[torch.Tensor]:
    decoder = model.model
    decoder._stack = None if use_stack else False  # None: decided again at the next step
    blocks = {0: [1, 2, 3], 1: [4, 5]}
    tokens = torch.Generator().manual_seed(1)
    hidden = []
    for step in STEPS:
        ids, positions, slots, rows = [], [], [], []
        for seq, start, count in step:
            ids += torch.randint(0, config.vocab_size, (count,), generator=tokens).tolist()
            positions += range(start, start + count)
            slots += [blocks[seq][p // KERNEL_BLOCK_SIZE] * KERNEL_BLOCK_SIZE + p % KERNEL_BLOCK_SIZE
                      for p in range(start, start + count)]
            rows.append((blocks[seq], start, count))
        attn = kernel_attention(cache, rows, torch.tensor(slots))
        with torch.inference_mode():
            hidden.append(model(torch.tensor(ids), torch.tensor(positions), attn))
        assert (decoder._layer_stack() is not None) == use_stack
    return hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case,window", [("llama_llama3", None), ("mistral_head_dim", None), ("mistral_head_dim", 8),
                                         ("gemma3_local_global", None)],
                         ids=["llama", "mistral-head-dim", "mistral-window-8", "gemma3-local-global"])
def test_the_one_call_gives_the_loops_bits(case, window, dtype):
    model, config = block_model(case, dtype, window)
    loop_cache, stack_cache = cache_for(config, dtype), cache_for(config, dtype)
    by_loop = run_steps(model, config, loop_cache, use_stack=False)
    by_stack = run_steps(model, config, stack_cache, use_stack=True)
    for step, (ours, theirs) in enumerate(zip(by_stack, by_loop)):
        assert torch.equal(ours, theirs), f"step {step}"
    assert loop_cache.tensor.count_nonzero() > 0
    assert torch.equal(stack_cache.tensor, loop_cache.tensor)


@pytest.mark.parametrize("case", ["llama_llama3", "gemma3_local_global"], ids=["llama", "gemma3"])
def test_the_one_call_gives_the_loops_bits_with_parts_in_layouts_of_their_own(case):
    model, config = mixed_block_model(case, torch.bfloat16)
    loop_cache, stack_cache = cache_for(config, torch.bfloat16), cache_for(config, torch.bfloat16)
    by_loop = run_steps(model, config, loop_cache, use_stack=False)
    by_stack = run_steps(model, config, stack_cache, use_stack=True)
    for step, (ours, theirs) in enumerate(zip(by_stack, by_loop)):
        assert torch.equal(ours, theirs), f"step {step}"
    assert torch.equal(stack_cache.tensor, loop_cache.tensor)
    projections = model.model._layer_stack().projections
    parts = [part for linear in projections.linears for part in getattr(linear.weights, "parts", [linear.weights])]
    assert all(ours is part.packed for ours, part in zip(projections.arguments(torch.bfloat16)[0], parts))
    if move_to_huge_pages(block_weights(model), "packed"):  # the parts' new tensors are seen at the next call
        assert all(ours is part.packed for ours, part in zip(projections.arguments(torch.bfloat16)[0], parts))


def one_row_attention(config):
    return kernel_attention(cache_for(config, torch.float32), [([1], 0, 1)], torch.tensor([KERNEL_BLOCK_SIZE]))


@pytest.mark.parametrize("case", ["llama_tied_bias", "qwen2_bias", "qwen3_qk_norm", "phi3_fused"])
def test_layers_the_call_does_not_cover_keep_the_loop(case):
    """Biases, q/k norms and attention classes of their own (phi3's partial rotary) keep the loop."""
    model, config = block_model(case, torch.float32)
    stack = model.model._layer_stack()
    assert stack is None or stack.run(torch.zeros(1, config.hidden_size), None, None, one_row_attention(config)) is None


def test_hooks_dense_weights_another_dtype_or_attention_keep_the_loop():
    model, config = block_model("llama_llama3", torch.float32)
    decoder = model.model
    stack = decoder._layer_stack()
    assert stack is not None
    x = torch.zeros(1, config.hidden_size)
    assert stack.run(x, None, None, object()) is None  # attention without the kernel cache layout
    assert stack.run(x.bfloat16(), None, None, one_row_attention(config)) is None  # not the weights' dtype
    handle = decoder.layers[1].mlp.down_proj.register_forward_hook(lambda *args: None)
    try:  # a hook must see its module run
        decoder._stack = None
        assert decoder._layer_stack() is None
    finally:
        handle.remove()
    _, dense, _ = build_pair("llama_llama3", torch.float32, fused=True)  # fused ops, dense weights
    assert dense.model._layer_stack().run(x, None, None, one_row_attention(config)) is None


def test_the_call_follows_weights_moved_or_replaced_after_it_is_built():
    """The projections' arguments are kept between steps; a move onto huge pages (new packed tensors)
    or a replaced weights object is seen at the next call."""
    model, config = block_model("llama_llama3", torch.float32)
    decoder = model.model
    stack = decoder._layer_stack()
    linears = stack.projections.linears
    before = stack.projections.arguments(torch.float32)
    assert before is not None and stack.projections.arguments(torch.float32) is before

    def one_step(use_stack: bool) -> torch.Tensor:
        decoder._stack = stack if use_stack else False
        with torch.inference_mode():
            return model(torch.tensor([7]), torch.tensor([0]), one_row_attention(config))

    if move_to_huge_pages(block_weights(model), "packed"):
        after = stack.projections.arguments(torch.float32)
        assert all(ours is linear.weights.packed for ours, linear in zip(after[0], linears))
        assert not any(ours is theirs for ours, theirs in zip(after[0], before[0]))
    assert stack.projections.arguments(torch.float32) is not None  # so the step below takes the call
    assert torch.equal(one_step(use_stack=True), one_step(use_stack=False))
    _, dense, _ = build_pair("llama_llama3", torch.float32, fused=True)
    linears[5].weights = dense.model.layers[1].self_attn.o_proj.weights  # not in blocks
    assert stack.projections.arguments(torch.float32) is None
    assert stack.run(torch.zeros(1, config.hidden_size), None, None, one_row_attention(config)) is None
