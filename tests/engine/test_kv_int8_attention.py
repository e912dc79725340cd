"""The int8 KV cache on random tensors: rows quantized the same way by torch and by ember's kernel,
both attention paths computing plain causal attention over the dequantized keys and values, a
kernel row keeping its bits however it is batched, chunked or placed, and the pool and the tiers
counting and carrying the scales with the values."""

import pytest
import torch

from kernel_attention_checks import assert_rows_keep_their_bits, run_kernel as _kernel
from ember.engine.attention import (DecodeGroup, KVCache, PagedAttention, dequantize_rows, long_decode, prefill_seq,
                                    quantize_rows)

CPU = torch.device("cpu")
BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # the default model's shape
LENGTH = 700  # past two of the kernel's 256-key splits


def _kernels():
    from ember import kernels
    assert kernels.available(), kernels.status()


def _slots(blocks: list[int], length: int) -> torch.Tensor:
    return (torch.tensor(blocks)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:length]


def _reference(q, keys, values, window=None):
    """Plain softmax attention in float32 over int8's dequantized keys and values: q (L, H, D),
    keys and values (L, KVH, D) as written -> (L, H, D)."""
    length, heads, head_dim = q.shape
    group = heads // keys.shape[1]
    k = dequantize_rows(quantize_rows(keys), torch.float32).repeat_interleave(group, 1).transpose(0, 1)
    v = dequantize_rows(quantize_rows(values), torch.float32).repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.einsum("lhd,hkd->hlk", q.float(), k) * head_dim ** -0.5
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    hidden = key > query
    if window is not None:
        hidden |= key <= query - window
    return torch.einsum("hlk,hkd->lhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def test_a_row_keeps_its_values_to_half_a_step_of_its_own_scale():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, HEAD_DIM, generator=generator) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7] = 0  # a row of zeros: scale 0, values 0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, HEAD_DIM + 4)
    back = dequantize_rows(rows, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert (back - x).abs().le(scale / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[7], torch.zeros_like(back[7]))
    # a row's bits depend on that row alone
    assert torch.equal(quantize_rows(x[20:21]), rows[20:21])


@pytest.fixture(params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def int8_kernel_case(request):
    """A one-layer int8 kernel-layout cache holding one sequence of LENGTH tokens in scattered blocks,
    written by the kernel from keys and values in the model dtype `request.param`."""
    _kernels()
    dtype = request.param
    generator = torch.Generator().manual_seed(0)
    num_blocks = LENGTH // BLOCK + 8
    cache = KVCache(1, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype, CPU, kernel_layout=True, kv_dtype=torch.int8)
    blocks = (torch.randperm(num_blocks - 1, generator=generator) + 1)[: -(-LENGTH // BLOCK)].tolist()
    keys, values = (torch.randn(LENGTH, KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
    k_cache, v_cache = cache.layers[0]
    torch.ops.ember.store_kv_(keys, values, k_cache, v_cache, _slots(blocks, LENGTH))
    q = torch.randn(LENGTH, HEADS, HEAD_DIM, generator=generator).to(dtype)
    return cache, blocks, keys, values, q


def test_the_kernel_quantizes_a_row_as_torch_does(int8_kernel_case):
    cache, blocks, keys, values, _ = int8_kernel_case
    slots = _slots(blocks, LENGTH)
    k_cache, v_cache = cache.layers[0]
    for packed, rows, is_values in ((k_cache, keys, False), (v_cache, values, True)):
        unpacked = torch.ops.ember.unpack_cache(packed, is_values, HEAD_DIM)[:, slots]
        assert torch.equal(unpacked, dequantize_rows(quantize_rows(rows), torch.float32).transpose(0, 1))


def test_the_int8_kernel_matches_plain_causal_attention_over_the_dequantized_cache(int8_kernel_case):
    cache, blocks, keys, values, q = int8_kernel_case
    out = _kernel(cache, [(blocks, 0, q)])
    tolerance = 1e-5 if q.dtype == torch.float32 else 2e-2  # bfloat16: the output's own rounding
    torch.testing.assert_close(out.float(), _reference(q, keys, values), rtol=tolerance, atol=tolerance)


def test_an_int8_kernel_row_gets_the_same_bits_decoded_chunked_batched_or_moved(int8_kernel_case):
    cache, blocks, _, _, q = int8_kernel_case
    assert_rows_keep_their_bits(cache, blocks, q)


@pytest.mark.parametrize("window", [16, 100, 300])
def test_the_int8_kernel_keeps_to_a_sliding_window(int8_kernel_case, window):
    cache, blocks, keys, values, q = int8_kernel_case
    cache.layer_windows = [window]
    out = _kernel(cache, [(blocks, 0, q)])
    tolerance = 1e-5 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), _reference(q, keys, values, window), rtol=tolerance, atol=tolerance)
    for position in (15, 299, 300, 699):
        assert torch.equal(_kernel(cache, [(blocks, position, q[position:position + 1])])[0], out[position])


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (8, 2, 128), (10, 2, 80), (12, 2, 32)])
def test_the_int8_kernel_keeps_its_promises_for_other_head_shapes(heads, kv_heads, head_dim):
    """One, four, five and six query heads per KV head (passes of up to four), head dims from 32 to
    128 (80: a run of 64 dims, then 16)."""
    _kernels()
    length = 300
    generator = torch.Generator().manual_seed(1)
    cache = KVCache(1, length // BLOCK + 2, BLOCK, kv_heads, head_dim, torch.bfloat16, CPU, kernel_layout=True,
                    kv_dtype=torch.int8)
    keys, values = (torch.randn(length, kv_heads, head_dim, generator=generator).bfloat16() for _ in range(2))
    blocks = list(range(1, length // BLOCK + 2))
    k_cache, v_cache = cache.layers[0]
    torch.ops.ember.store_kv_(keys, values, k_cache, v_cache, _slots(blocks, length))
    q = torch.randn(length, heads, head_dim, generator=generator).bfloat16()
    whole = _kernel(cache, [(blocks, 0, q)])
    torch.testing.assert_close(whole.float(), _reference(q, keys, values), rtol=2e-2, atol=2e-2)
    for position in (0, 17, 256, 299):
        assert torch.equal(_kernel(cache, [(blocks, position, q[position:position + 1])])[0], whole[position])
    together = _kernel(cache, [(blocks, 299, q[299:]), (blocks, 40, q[40:90])])
    assert torch.equal(together, torch.cat((whole[299:], whole[40:90])))


# ---- the torch path: rows quantized as they are written, dequantized as they are gathered -------

TORCH_BLOCK, TORCH_LENGTH = 4, 45


def _torch_case():
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(TORCH_LENGTH, 6, 16, generator=generator)
    keys, values = (torch.randn(TORCH_LENGTH, 2, 16, generator=generator) for _ in range(2))
    cache = KVCache(1, 40, TORCH_BLOCK, 2, 16, torch.float32, CPU, kv_dtype=torch.int8)
    block_ids = [3, 4, 5, 9, 10, 11, 12, 20, 21, 22, 23, 30]  # a run, then scattered
    slots = (torch.tensor(block_ids)[:, None] * TORCH_BLOCK + torch.arange(TORCH_BLOCK)).flatten()[:TORCH_LENGTH]
    return cache, block_ids, slots, q, keys, values


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_torch_prefill_decode_and_long_decode_read_an_int8_cache(exact):
    cache, block_ids, slots, q, keys, values = _torch_case()
    expected = _reference(q, keys, values)
    prefill = prefill_seq(0, 0, slots, torch.float32, CPU, exact)
    out = PagedAttention(cache, slots, [], [prefill]).attend(0, q, keys, values)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # the last token again, decoded: in the padded batch, then in chunks read in place or gathered
    table = torch.tensor([block_ids])
    key_mask = (torch.arange(table.shape[1] * TORCH_BLOCK) < TORCH_LENGTH)[None, None, None, :]
    group = DecodeGroup(torch.tensor([0]), table, key_mask, torch.tensor([TORCH_LENGTH]))
    last = (q[-1:], keys[-1:], values[-1:])
    decoded = PagedAttention(cache, slots[-1:], [group], []).attend(0, *last)
    torch.testing.assert_close(decoded, expected[-1:], rtol=1e-5, atol=1e-5)
    seq = long_decode(0, block_ids, TORCH_LENGTH, TORCH_BLOCK, CPU, chunk=12, exact=exact)
    chunked = PagedAttention(cache, slots[-1:], [], [], [seq]).attend(0, *last)
    torch.testing.assert_close(chunked, expected[-1:], rtol=1e-5, atol=1e-5)


def test_an_exact_torch_prefill_keeps_a_rows_bits_however_its_prompt_is_chunked():
    cache, _, slots, q, keys, values = _torch_case()
    whole = PagedAttention(cache, slots, [], [prefill_seq(0, 0, slots, torch.float32, CPU, True)]).attend(
        0, q, keys, values)
    start = 29  # the rest of the prompt, its first 29 keys already in the cache
    rest = PagedAttention(cache, slots[start:], [], [prefill_seq(0, start, slots, torch.float32, CPU, True)])
    assert torch.equal(rest.attend(0, q[start:], keys[start:], values[start:]), whole[start:])


# ---- the pool and the tiers --------------------------------------------------------------------

@pytest.mark.parametrize("kernel_layout", [False, True], ids=["torch", "kernel"])
def test_an_int8_block_carries_its_scales_and_takes_about_half_the_bytes(kernel_layout):
    cache = KVCache(2, 4, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, CPU, kernel_layout=kernel_layout,
                    kv_dtype=torch.int8)
    shape, dtype = cache.block_layout()
    assert dtype == torch.int8 and shape == (2, 2, KV_HEADS, BLOCK * (HEAD_DIM + 4))
    per_block = KVCache.bytes_per_block(2, BLOCK, KV_HEADS, HEAD_DIM, torch.int8)
    assert per_block == cache.block(0).numel()  # one byte each element
    bf16 = KVCache.bytes_per_block(2, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16)
    assert bf16 / per_block == pytest.approx(2 * HEAD_DIM / (HEAD_DIM + 4))  # 1.88 at head_dim 64
    generator = torch.Generator().manual_seed(2)
    cache.block(1)[:] = torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)
    block = cache.read_block(1)
    assert block.shape == shape and block.dtype == dtype
    cache.write_block(3, block)
    assert torch.equal(cache.read_block(3), block)
