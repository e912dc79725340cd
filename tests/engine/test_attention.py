"""Paged attention on random tensors: long decodes read in chunks agree with the padded batch
path and give the same bits wherever the sequence's blocks lie; prefill matches plain causal
attention, and in exact mode gives a row the same bits however its prompt was chunked."""

import pytest
import torch

from ember.engine.attention import DecodeGroup, KVCache, PagedAttention, long_decode, prefill_seq

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 4, 2, 6, 16
LENGTH = 45  # keys, the new token's included: 12 blocks, the last one partial


def _cache_holding(keys, values, block_ids, dtype):
    """A one-layer cache with the sequence's keys written into the given blocks, in order."""
    cache = KVCache(1, 40, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"))
    slots = (torch.tensor(block_ids)[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:LENGTH]
    cache.tensor[0, 0][:, slots] = keys.to(dtype)
    cache.tensor[0, 1][:, slots] = values.to(dtype)
    return cache, slots


def _long_decode(q, keys, values, block_ids, dtype, chunk):
    cache, slots = _cache_holding(keys, values, block_ids, dtype)
    new_slot = slots[-1:]  # the new token's own key is the last one, rewritten by attend
    seq = long_decode(0, block_ids, LENGTH, BLOCK_SIZE, torch.device("cpu"), chunk=chunk)
    attn = PagedAttention(cache, new_slot, [], [], [seq])
    return attn.attend(0, q.to(dtype), keys[:, -1:].transpose(0, 1).to(dtype), values[:, -1:].transpose(0, 1).to(dtype)), seq


def _padded_batch_decode(q, keys, values, block_ids, dtype):
    cache, slots = _cache_holding(keys, values, block_ids, dtype)
    table = torch.tensor([block_ids + [0] * 4])
    key_mask = (torch.arange(table.shape[1] * BLOCK_SIZE) < LENGTH)[None, None, None, :]
    attn = PagedAttention(cache, slots[-1:], [DecodeGroup(torch.tensor([0]), table, key_mask)], [])
    return attn.attend(0, q.to(dtype), keys[:, -1:].transpose(0, 1).to(dtype), values[:, -1:].transpose(0, 1).to(dtype))


@pytest.fixture
def tensors():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=generator)
    keys = torch.randn(KV_HEADS, LENGTH, HEAD_DIM, generator=generator)
    values = torch.randn(KV_HEADS, LENGTH, HEAD_DIM, generator=generator)
    return q, keys, values


CONSECUTIVE = list(range(3, 15))  # with chunks of 4 blocks: a run of two whole chunks, then the last
RUNS_APART = [3, 4, 5, 6, 20, 21, 22, 23, 8, 9, 10, 11]  # three runs of one chunk each
SCATTERED = [30, 2, 5, 33, 17, 18, 19, 20, 8, 9, 25, 26]  # gather, in place, gather


def test_pieces_read_runs_in_place_and_gather_only_broken_chunks():
    cpu = torch.device("cpu")
    # exact (the default): one piece per chunk, whatever the layout; else runs of whole chunks merge
    assert long_decode(0, CONSECUTIVE, LENGTH, BLOCK_SIZE, cpu, chunk=16).pieces == [
        (slice(12, 28), 1), (slice(28, 44), 1), (slice(44, 57), 1)]
    assert long_decode(0, CONSECUTIVE, LENGTH, BLOCK_SIZE, cpu, chunk=16, exact=False).pieces == [
        (slice(12, 44), 2), (slice(44, 57), 1)]
    assert long_decode(0, RUNS_APART, LENGTH, BLOCK_SIZE, cpu, chunk=16).pieces == [
        (slice(12, 28), 1), (slice(80, 96), 1), (slice(32, 45), 1)]
    seq = long_decode(7, SCATTERED, LENGTH, BLOCK_SIZE, cpu, chunk=16)
    assert seq.row == 7
    gathered, in_place, last = seq.pieces
    assert gathered[0].tolist() == [120, 121, 122, 123, 8, 9, 10, 11, 20, 21, 22, 23, 132, 133, 134, 135]
    assert in_place == (slice(68, 84), 1)
    assert last[0].tolist() == [32, 33, 34, 35, 36, 37, 38, 39, 100, 101, 102, 103, 104] and last[1] == 1


def test_a_long_decode_matches_the_padded_batch_path_in_float32(tensors):
    q, keys, values = tensors
    batched = _padded_batch_decode(q, keys, values, CONSECUTIVE, torch.float32)
    for chunk in (8, 16, 44, 64):
        for layout in (CONSECUTIVE, SCATTERED):
            out, _ = _long_decode(q, keys, values, layout, torch.float32, chunk)
            torch.testing.assert_close(out, batched, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_long_decode_gives_the_same_bits_wherever_its_blocks_lie(tensors, dtype):
    q, keys, values = tensors
    results = [_long_decode(q, keys, values, layout, dtype, chunk=16)[0] for layout in (CONSECUTIVE, RUNS_APART, SCATTERED)]
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def _prefill_rows(q, keys, values, start, end, dtype, exact):
    """Rows [start, end) of a sequence prefilled as one chunk from `start` (keys [0, start) cached)."""
    total = keys.shape[1]
    cache = KVCache(1, total // BLOCK_SIZE + 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"))
    slots = torch.arange(BLOCK_SIZE, BLOCK_SIZE + end)  # blocks 1.. in order; block 0 is the null block
    cache.tensor[0, 0][:, slots[:start]] = keys[:, :start].to(dtype)
    cache.tensor[0, 1][:, slots[:start]] = values[:, :start].to(dtype)
    seq = prefill_seq(0, start, slots, dtype, torch.device("cpu"), exact)
    attn = PagedAttention(cache, slots[start:], [], [seq])
    new_k, new_v = keys[:, start:end].transpose(0, 1).to(dtype), values[:, start:end].transpose(0, 1).to(dtype)
    return attn.attend(0, q[start:end].to(dtype), new_k, new_v)


def _naive_causal(q, keys, values):
    """(n, H, D) float32 reference: every head's softmax over the keys up to its own position."""
    group = HEADS // KV_HEADS
    k, v = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # (H, n, D)
    scores = torch.einsum("nhd,hkd->hnk", q, k) * HEAD_DIM ** -0.5
    scores = scores.masked_fill(torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hnk,hkd->nhd", scores.softmax(-1), v)


@pytest.fixture
def long_prompt():
    generator = torch.Generator().manual_seed(1)
    n = 600  # past one 512-key block of the flash kernel
    return (torch.randn(n, HEADS, HEAD_DIM, generator=generator), torch.randn(KV_HEADS, n, HEAD_DIM, generator=generator),
            torch.randn(KV_HEADS, n, HEAD_DIM, generator=generator))


@pytest.mark.parametrize("exact", [True, False])
def test_prefill_matches_plain_causal_attention_in_float32(long_prompt, exact):
    q, keys, values = long_prompt
    expected = _naive_causal(q, keys, values)
    whole = _prefill_rows(q, keys, values, 0, 600, torch.float32, exact)
    torch.testing.assert_close(whole, expected, rtol=1e-4, atol=1e-5)
    tail = _prefill_rows(q, keys, values, 300, 600, torch.float32, exact)
    torch.testing.assert_close(tail, expected[300:], rtol=1e-4, atol=1e-5)


def test_exact_prefill_rows_keep_their_bits_however_the_prompt_is_chunked(long_prompt):
    q, keys, values = long_prompt
    whole = _prefill_rows(q, keys, values, 0, 600, torch.bfloat16, exact=True)
    for start, end in ((300, 600), (577, 600), (13, 600), (511, 513)):
        part = _prefill_rows(q, keys, values, start, end, torch.bfloat16, exact=True)
        assert torch.equal(part, whole[start:end]), (start, end)


# ---- ember's paged decode kernel (ember.kernels) ----------------------------------------------

KERNEL_LENGTHS = [1, 17, 255, 256, 257, 1000]  # around the kernel's 256-key splits


def _kernel_case(dtype, seed=0):
    """Keys and values of sequences of KERNEL_LENGTHS in scattered blocks of a 4-token cache."""
    from ember import kernels
    assert kernels.available(), kernels.status()
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // BLOCK_SIZE) for n in KERNEL_LENGTHS]
    order = (torch.randperm(sum(blocks_needed), generator=generator) + 1).tolist()  # block 0 stays null
    tables, at = [], 0
    for count in blocks_needed:
        tables.append(order[at:at + count])
        at += count
    cache = KVCache(1, sum(blocks_needed) + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"))
    cache.tensor.normal_(generator=generator)
    q = torch.randn(len(KERNEL_LENGTHS), HEADS, HEAD_DIM, generator=generator).to(dtype)
    return cache, tables, q


def _kernel_decode(cache, tables, lengths, q):
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache, v_cache = cache.tensor[0]
    return torch.ops.ember.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32),
                                                  BLOCK_SIZE, HEAD_DIM ** -0.5)


def _dense_reference(cache, tables, q):
    outs = []
    for b, (table, length) in enumerate(zip(tables, KERNEL_LENGTHS)):
        slots = (torch.tensor(table)[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:length]
        keys, values = cache.tensor[0, 0][:, slots].float(), cache.tensor[0, 1][:, slots].float()
        grouped = q[b].float().view(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        probs = (torch.einsum("kgd,kld->kgl", grouped, keys) * HEAD_DIM ** -0.5).softmax(-1)
        outs.append(torch.einsum("kgl,kld->kgd", probs, values).reshape(HEADS, HEAD_DIM))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_matches_plain_attention(dtype):
    cache, tables, q = _kernel_case(dtype)
    out = _kernel_decode(cache, tables, KERNEL_LENGTHS, q)
    expected = _dense_reference(cache, tables, q)
    torch.testing.assert_close(out.float(), expected, rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_gives_a_sequence_the_same_bits_alone_and_wherever_its_blocks_lie(dtype):
    cache, tables, q = _kernel_case(dtype)
    together = _kernel_decode(cache, tables, KERNEL_LENGTHS, q)
    for b, (table, length) in enumerate(zip(tables, KERNEL_LENGTHS)):
        assert torch.equal(_kernel_decode(cache, [table], [length], q[b:b + 1])[0], together[b]), length
    # the longest sequence's keys copied into the blocks in another order give the same bits
    table, length = tables[-1], KERNEL_LENGTHS[-1]
    moved = list(reversed(table))
    slots_of = lambda blocks: (torch.tensor(blocks)[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()
    cache.tensor[0][:, :, slots_of(moved)] = cache.tensor[0][:, :, slots_of(table)].clone()
    assert torch.equal(_kernel_decode(cache, [moved], [length], q[-1:])[0], together[-1])
