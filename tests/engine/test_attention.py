"""Paged attention on random tensors: long decodes read in chunks agree with the padded batch
path and give the same bits wherever the sequence's blocks lie; prefill matches plain causal
attention, and in exact mode gives a row the same bits however its prompt was chunked. The
kernel's bfloat16 paths (dot products, AMX tiles, and the AVX2 and Ice Lake builds' widening)
keep those promises for several head shapes."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kernel_attention_checks import assert_rows_keep_their_bits, run_kernel as _kernel
from ember import kernels
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


# ---- ember's attention kernel (ember.kernels) over its own cache layout -----------------------

KERNEL_HEADS, KERNEL_KV_HEADS, KERNEL_HEAD_DIM, KERNEL_BLOCK = 9, 3, 64, 16
KERNEL_LENGTH = 700  # past two of the kernel's 256-key splits


def _take_bfloat16_path(path: str) -> None:
    """bfloat16 attention from now on on AMX tiles (where the processor has them and Linux grants
    them: else the test is skipped) or on the dot-product instructions."""
    from ember import kernels
    assert kernels.available(), kernels.status()
    tiles = path == "tiles"
    if torch.ops.ember.attention_tiles(tiles) != tiles:
        torch.ops.ember.attention_tiles(True)
        pytest.skip("no AMX tiles here: this processor lacks them or Linux does not grant them")


BFLOAT16_PATHS = ["dot products", "tiles"]
KERNEL_DTYPES = [pytest.param((torch.float32, "dot products"), id="float32"),
                 *(pytest.param((torch.bfloat16, path), id=f"bfloat16-{path}") for path in BFLOAT16_PATHS)]


@pytest.fixture
def kernel_case(request):
    """A kernel-layout cache holding one sequence of KERNEL_LENGTH tokens in scattered blocks; every
    slot past them (the last block's tail among them) holds NaN, which no row may read."""
    dtype, path = request.param
    _take_bfloat16_path(path)
    generator = torch.Generator().manual_seed(0)
    num_blocks = KERNEL_LENGTH // KERNEL_BLOCK + 8
    cache = KVCache(1, num_blocks, KERNEL_BLOCK, KERNEL_KV_HEADS, KERNEL_HEAD_DIM, dtype, torch.device("cpu"),
                    kernel_layout=True)
    blocks = (torch.randperm(num_blocks - 1, generator=generator) + 1)[: -(-KERNEL_LENGTH // KERNEL_BLOCK)]
    slots = (blocks[:, None] * KERNEL_BLOCK + torch.arange(KERNEL_BLOCK)).flatten()[:KERNEL_LENGTH]
    keys, values = (torch.randn(KERNEL_LENGTH, KERNEL_KV_HEADS, KERNEL_HEAD_DIM, generator=generator).to(dtype)
                    for _ in range(2))
    k_cache, v_cache = cache.layers[0]
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    torch.ops.ember.store_kv_(keys, values, k_cache, v_cache, slots)
    q = torch.randn(KERNEL_LENGTH, KERNEL_HEADS, KERNEL_HEAD_DIM, generator=generator).to(dtype)
    yield cache, blocks.tolist(), keys, values, q
    torch.ops.ember.attention_tiles(True)


@pytest.mark.parametrize("kernel_case", KERNEL_DTYPES[:2], indirect=True)  # the store is the same on both paths
def test_the_cache_layout_round_trips(kernel_case):
    cache, blocks, keys, values, _ = kernel_case
    slots = (torch.tensor(blocks)[:, None] * KERNEL_BLOCK + torch.arange(KERNEL_BLOCK)).flatten()[:KERNEL_LENGTH]
    k_cache, v_cache = cache.layers[0]
    assert torch.equal(torch.ops.ember.unpack_cache(k_cache, False, KERNEL_HEAD_DIM)[:, slots], keys.transpose(0, 1))
    assert torch.equal(torch.ops.ember.unpack_cache(v_cache, True, KERNEL_HEAD_DIM)[:, slots], values.transpose(0, 1))


@pytest.mark.parametrize("kernel_case", KERNEL_DTYPES, indirect=True)
def test_the_pools_groups_of_blocks_read_and_store_as_one_run_per_kv_head_does(kernel_case):
    """The engine's pool keeps blocks in groups (KVCache.GROUP_BLOCKS); the kernel takes a cache of
    one run of blocks per KV head as well, and the same blocks give the same bits either way."""
    cache, blocks, keys, values, q = kernel_case
    grouped = cache.layers[0]
    assert grouped[0].dim() == 4 and grouped[0].shape[2] == KVCache.GROUP_BLOCKS
    # the same blocks as (kv_heads, blocks, block elements)
    runs = [c.transpose(0, 1).reshape(KERNEL_KV_HEADS, -1, c.shape[-1]).clone() for c in grouped]
    table = torch.tensor([blocks], dtype=torch.int32)
    for start, count in ((0, KERNEL_LENGTH), (699, 1), (300, 17)):
        row_begin = torch.tensor([0, count], dtype=torch.int32)
        first = torch.tensor([start], dtype=torch.int32)
        rows = q[start:start + count]
        assert torch.equal(torch.ops.ember.paged_attention(rows, *grouped, table, row_begin, first, 0.125, 0),
                           torch.ops.ember.paged_attention(rows, *runs, table, row_begin, first, 0.125, 0))
    qkv = torch.randn(3, (KERNEL_HEADS + 2 * KERNEL_KV_HEADS) * KERNEL_HEAD_DIM).to(q.dtype)
    angles = torch.rand(3, KERNEL_HEAD_DIM // 2) * 6.3
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
    slots = torch.tensor([blocks[-1] * KERNEL_BLOCK + 15, blocks[0] * KERNEL_BLOCK + 1, 17 * KERNEL_BLOCK + 3])
    rotated = [qkv.clone(), qkv.clone()]
    torch.ops.ember.rotary_store_(rotated[0], cos, sin, *grouped, slots, KERNEL_HEADS, KERNEL_KV_HEADS)
    torch.ops.ember.rotary_store_(rotated[1], cos, sin, *runs, slots, KERNEL_HEADS, KERNEL_KV_HEADS)
    assert torch.equal(rotated[0], rotated[1])
    for mine, theirs in zip(grouped, runs):
        assert torch.equal(mine.transpose(0, 1).reshape(theirs.shape).nan_to_num(7.0), theirs.nan_to_num(7.0))


@pytest.mark.parametrize("kernel_case", KERNEL_DTYPES, indirect=True)
def test_the_attention_kernel_matches_plain_causal_attention(kernel_case):
    cache, blocks, keys, values, q = kernel_case
    out = _kernel(cache, [(blocks, 0, q)])
    group = KERNEL_HEADS // KERNEL_KV_HEADS
    k = keys.float().repeat_interleave(group, 1).transpose(0, 1)  # (H, L, D)
    v = values.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.einsum("lhd,hkd->hlk", q.float(), k) * KERNEL_HEAD_DIM ** -0.5
    scores = scores.masked_fill(torch.ones(KERNEL_LENGTH, KERNEL_LENGTH, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hlk,hkd->lhd", scores.softmax(-1), v)
    tolerance = 1e-5 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kernel_case", KERNEL_DTYPES, indirect=True)
def test_a_row_gets_the_same_bits_decoded_chunked_batched_or_moved(kernel_case):
    cache, blocks, _, _, q = kernel_case
    assert_rows_keep_their_bits(cache, blocks, q)


# ---- sliding windows: a row sees its last `window` keys, its own included ---------------------

def _windowed_reference(q, keys, values, window):
    """Plain softmax attention in float32 over each row's window: q (L, H, D) -> (L, H, D)."""
    length, heads, head_dim = q.shape
    group = heads // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1).transpose(0, 1)  # (H, L, D)
    v = values.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.einsum("lhd,hkd->hlk", q.float(), k) * head_dim ** -0.5
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    scores = scores.masked_fill((key > query) | (key <= query - window), float("-inf"))
    return torch.einsum("hlk,hkd->lhd", scores.softmax(-1), v)


@pytest.fixture(params=[16, 100, 300])  # one block; inside a split, off the block grid; across a split
def window(request, kernel_case) -> int:
    """The kernel case's one layer given this sliding window."""
    kernel_case[0].layer_windows = [request.param]
    return request.param


@pytest.mark.parametrize("kernel_case", KERNEL_DTYPES, indirect=True)
def test_the_attention_kernel_keeps_to_a_sliding_window(kernel_case, window):
    cache, blocks, keys, values, q = kernel_case
    out = _kernel(cache, [(blocks, 0, q)])
    tolerance = 1e-5 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), _windowed_reference(q, keys, values, window), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kernel_case", KERNEL_DTYPES, indirect=True)
def test_a_windowed_row_keeps_its_bits_and_never_reads_blocks_before_its_window(kernel_case, window):
    cache, blocks, keys, values, q = kernel_case
    whole = _kernel(cache, [(blocks, 0, q)])
    for position in (15, 16, 255, 299, 300, 301, 699):
        assert torch.equal(_kernel(cache, [(blocks, position, q[position:position + 1])])[0], whole[position])
    together = _kernel(cache, [(blocks, 650, q[650:]), (blocks, 100, q[100:300]), (blocks, 5, q[5:6])])
    assert torch.equal(together, torch.cat((whole[650:], whole[100:300], whole[5:6])))
    # the last row's window starts at position 700 - window: poison every block wholly before it
    before = blocks[: (KERNEL_LENGTH - window) // KERNEL_BLOCK]
    for block_id in before:
        cache.block(block_id).fill_(float("nan"))
    assert torch.equal(_kernel(cache, [(blocks, 699, q[699:])]), whole[699:])


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_torch_prefill_and_decode_keep_to_a_sliding_window(exact):
    window, length = 7, LENGTH
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(length, HEADS, HEAD_DIM, generator=generator)
    keys = torch.randn(KV_HEADS, length, HEAD_DIM, generator=generator)
    values = torch.randn(KV_HEADS, length, HEAD_DIM, generator=generator)
    expected = _windowed_reference(q, keys.transpose(0, 1), values.transpose(0, 1), window)
    block_ids = list(range(1, 13))
    cache, slots = _cache_holding(keys, values, block_ids, torch.float32)
    cache.layer_windows = [window]
    for start in (0, 20):  # the whole prompt, and a chunk over cached keys
        seq = prefill_seq(0, start, slots, torch.float32, torch.device("cpu"), exact)
        attn = PagedAttention(cache, slots[start:], [], [seq])
        out = attn.attend(0, q[start:], keys[:, start:].transpose(0, 1), values[:, start:].transpose(0, 1))
        torch.testing.assert_close(out, expected[start:], rtol=1e-5, atol=1e-5)
    table = torch.tensor([block_ids + [0] * 4])
    key_mask = (torch.arange(table.shape[1] * BLOCK_SIZE) < length)[None, None, None, :]
    group = DecodeGroup(torch.tensor([0]), table, key_mask, torch.tensor([length]))
    attn = PagedAttention(cache, slots[-1:], [group], [])
    out = attn.attend(0, q[-1:], keys[:, -1:].transpose(0, 1), values[:, -1:].transpose(0, 1))
    torch.testing.assert_close(out, expected[-1:], rtol=1e-5, atol=1e-5)


# ---- other head shapes: a group's heads share each block's loads, in passes ---------------------

@pytest.fixture(params=BFLOAT16_PATHS)
def bfloat16_path(request):
    _take_bfloat16_path(request.param)
    yield request.param
    torch.ops.ember.attention_tiles(True)


HEAD_SHAPES = [(4, 4, 64), (8, 4, 64), (8, 2, 128), (10, 2, 80), (12, 2, 32)]


@pytest.mark.parametrize("heads, kv_heads, head_dim", HEAD_SHAPES)
def test_the_bfloat16_kernel_keeps_its_promises_for_other_head_shapes(heads, kv_heads, head_dim, bfloat16_path):
    """One, two, four, five and six query heads per KV head, head dims from 32 to 128: plain causal
    attention's values, and a row's bits alone, in a prompt chunk, or among other sequences; the
    slots past the last key hold NaN, which no row may read."""
    check_bfloat16_promises(torch.ops.ember, heads, kv_heads, head_dim)


def check_bfloat16_promises(ops, heads, kv_heads, head_dim) -> torch.Tensor:
    """The promises above for the kernel build `ops`; returns its output for the whole prompt."""
    length, block = 300, KERNEL_BLOCK  # past the kernel's first split of 256 keys
    generator = torch.Generator().manual_seed(1)
    num_blocks = length // block + 1
    k_cache = torch.full((kv_heads, num_blocks, block * head_dim), float("nan"), dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys, values = (torch.randn(length, kv_heads, head_dim, generator=generator).bfloat16() for _ in range(2))
    ops.store_kv_(keys, values, k_cache, v_cache, torch.arange(length))
    q = torch.randn(length, heads, head_dim, generator=generator).bfloat16()
    table = torch.arange(num_blocks, dtype=torch.int32)[None]

    def attend(sequences):  # (first position, rows) each
        rows = torch.cat([rows for _, rows in sequences])
        begins = torch.tensor([0] + [len(r) for _, r in sequences], dtype=torch.int32).cumsum(0).to(torch.int32)
        firsts = torch.tensor([start for start, _ in sequences], dtype=torch.int32)
        return ops.paged_attention(rows, k_cache, v_cache, table.expand(len(sequences), -1).contiguous(),
                                   begins, firsts, head_dim ** -0.5, 0)

    whole = attend([(0, q)])
    group = heads // kv_heads
    k = keys.float().repeat_interleave(group, 1).transpose(0, 1)
    v = values.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.einsum("lhd,hkd->hlk", q.float(), k) * head_dim ** -0.5
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hlk,hkd->lhd", scores.softmax(-1), v)
    torch.testing.assert_close(whole.float(), expected, rtol=2e-2, atol=2e-2)
    for position in (0, 17, 255, 256, 299):
        assert torch.equal(attend([(position, q[position:position + 1])])[0], whole[position])
    assert torch.equal(attend([(131, q[131:])]), whole[131:])
    together = attend([(299, q[299:]), (40, q[40:90]), (7, q[7:8])])
    assert torch.equal(together, torch.cat((whole[299:], whole[40:90], whole[7:8])))
    return whole


# The instructions an Ice Lake build may use beyond AVX-512 VNNI, as /proc/cpuinfo names them.
_ICELAKE_FLAGS = {"avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq", "gfni", "vaes",
                  "vpclmulqdq"}


@pytest.fixture(scope="module")
def widening_builds() -> dict:
    """bfloat16 attention built for AVX2 alone and for Ice Lake (AVX-512 without the bfloat16
    instructions): the paths that widen the cache's bfloat16 pairs to floats, eight and sixteen
    lanes at a time, which this processor's own build passes by where it has those instructions.
    Built side by side, each one compiler process."""
    assert kernels.available(), kernels.status()
    if torch.ops.ember.vector_bits() != 512 or not _ICELAKE_FLAGS <= kernels.processor_flags():
        pytest.skip("the widening paths run as this processor's own build here, if at all")
    source = Path(kernels.__file__).parent / "attention.cpp"
    with ThreadPoolExecutor(2) as pool:
        started = {target: pool.submit(kernels.kernel_copy, source, f"ember_{target}_attention", target)
                   for target in ("avx2", "icelake")}
        return {target: future.result() for target, future in started.items()}


@pytest.mark.parametrize("heads, kv_heads, head_dim", HEAD_SHAPES)
def test_the_widening_paths_keep_the_promises_with_the_same_bits(widening_builds, heads, kv_heads, head_dim):
    """Each lane's arithmetic is the same eight lanes or sixteen at a time, and so are the softmax
    step's sums: the Ice Lake build gives the AVX2 build's bits."""
    outputs = [check_bfloat16_promises(ops, heads, kv_heads, head_dim) for ops in widening_builds.values()]
    assert torch.equal(*outputs)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("rows_of", [[1], [8], [12], [16], [21, 3, 40], [9, 9]], ids=str)
def test_rotating_and_storing_in_one_call_matches_the_two_steps(cache_dtype, rows_of):
    """rotary_store_ (rows split among the threads by cache block and head) leaves q and the cache
    as rotary_ then store_kv_ do: sequences of 1 to 40 rows from positions inside a block, so that
    rows of one block and of several blocks, sequences and threads meet."""
    from ember import kernels
    assert kernels.available(), kernels.status()
    heads, kv_heads, head_dim = KERNEL_HEADS, KERNEL_KV_HEADS, KERNEL_HEAD_DIM
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    generator = torch.Generator().manual_seed(sum(rows_of))
    slots = torch.cat([start * KERNEL_BLOCK + 5 + torch.arange(rows)
                       for start, rows in zip((2, 9, 20), rows_of)])  # each sequence from its own blocks
    T = len(slots)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    angles = torch.rand(T, head_dim // 2, generator=generator) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    block_bytes = KERNEL_BLOCK * (head_dim + 4) if cache_dtype == torch.int8 else KERNEL_BLOCK * head_dim
    caches = [tuple(torch.zeros(kv_heads, 32, block_bytes, dtype=cache_dtype) for _ in range(2)) for _ in range(2)]

    fused = qkv.clone()
    torch.ops.ember.rotary_store_(fused, cos, sin, *caches[0], slots, heads, kv_heads)
    apart = qkv.clone().view(T, heads + 2 * kv_heads, head_dim)
    rotated = apart[:, :heads + kv_heads].contiguous()
    torch.ops.ember.rotary_(rotated, cos, sin)
    apart[:, :heads + kv_heads] = rotated
    torch.ops.ember.store_kv_(apart[:, heads:heads + kv_heads].contiguous(), apart[:, heads + kv_heads:].contiguous(),
                              *caches[1], slots)
    assert torch.equal(fused.view(torch.uint8), apart.view(T, -1).view(torch.uint8))
    for ours, theirs in zip(*caches):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
