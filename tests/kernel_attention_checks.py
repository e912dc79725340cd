"""Shared by the tests of ember's attention kernel, whatever the cache stores (bfloat16, float32,
int8): running sequences through it, and the check that a row's bits do not depend on how it is
computed."""

import torch


def run_kernel(cache, sequences):
    """sequences: (block ids, first position, q rows) each -> their rows' outputs, in order."""
    from ember.engine.kernel_attention import kernel_attention
    rows = [(blocks, start, len(q)) for blocks, start, q in sequences]
    attn = kernel_attention(cache, rows, torch.zeros(sum(len(q) for _, _, q in sequences), dtype=torch.long))
    return attn.attend(0, torch.cat([q for _, _, q in sequences]))


def assert_rows_keep_their_bits(cache, blocks, q):
    """Each row of a 700-row sequence gets the same bits decoded alone, in a prompt chunk from
    several starts, in a drafted round's few rows, batched beside other rows of it, and with its
    blocks moved elsewhere in the pool."""
    whole = run_kernel(cache, [(blocks, 0, q)])
    for position in (0, 15, 16, 63, 64, 255, 256, 257, 699):  # around blocks, chunks and splits
        assert torch.equal(run_kernel(cache, [(blocks, position, q[position:position + 1])])[0], whole[position])
    for start in (1, 300, 511):  # a prompt chunk from `start` on, its earlier keys cached
        assert torch.equal(run_kernel(cache, [(blocks, start, q[start:])]), whole[start:])
    # a drafted round's few rows: one tile a KV head, whose splits the threads share
    for start, count in ((600, 16), (250, 9), (255, 2), (692, 8)):
        assert torch.equal(run_kernel(cache, [(blocks, start, q[start:start + count])]), whole[start:start + count])
    # batched: decodes and chunks of the same sequence side by side in one call
    together = run_kernel(cache, [(blocks, 699, q[699:]), (blocks, 100, q[100:300]), (blocks, 5, q[5:6])])
    assert torch.equal(together, torch.cat((whole[699:], whole[100:300], whole[5:6])))
    moved = list(reversed(blocks))  # the same blocks (an int8 cache's scales included) elsewhere in the pool
    copies = [cache.read_block(block) for block in blocks]
    for block, copy in zip(moved, copies):
        cache.write_block(block, copy)
    assert torch.equal(run_kernel(cache, [(moved, 650, q[650:])]), whole[650:])
