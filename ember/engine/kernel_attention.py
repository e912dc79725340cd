"""The attention handle of a step on ember's CPU kernels (ember.kernels): every row of the step,
decoding or part of a prompt chunk, attends through one kernel call per layer, over a cache in
the kernel's layout (KVCache with kernel_layout).

The kernel computes a row from its position and its own keys alone, in fixed key splits and
blocks (see ember/kernels/attention.cpp), so its bits are the same alone or in any batch, however
its prompt was chunked or cached, and whether the token was decoded or recomputed in a prefill.
A layer with a sliding window (KVCache.layer_windows) passes it to the kernel, which then reads
only the blocks that hold the window's keys. An int8 cache is quantized by the kernel as it stores
the rows, and read with its scales in the kernel's inner loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.engine.attention import KVCache

KERNEL_BLOCK_SIZE = 16  # the kernel's block: the engine's block_size must match


@dataclass(slots=True)
class KernelAttention:
    cache: KVCache
    slot_mapping: torch.Tensor  # (T,) int64: where each row's new K/V goes
    block_table: torch.Tensor  # (S, max_blocks) int32: each scheduled sequence's blocks, padded with 0
    row_begin: torch.Tensor  # (S + 1,) int32: sequence s owns rows [row_begin[s], row_begin[s + 1])
    first_pos: torch.Tensor  # (S,) int32: the position of each sequence's first row

    def rotate_and_store(self, layer_idx: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         heads: int, kv_heads: int) -> torch.Tensor:
        """A fused qkv projection (T, (H + 2 KVH) D): rotary embeddings on q and k in place and the
        new k and v into the cache, in one call. Returns q (T, H, D), a view; attend it alone."""
        k_cache, v_cache = self.cache.layers[layer_idx]
        torch.ops.ember.rotary_store_(qkv, cos, sin, k_cache, v_cache, self.slot_mapping, heads, kv_heads)
        head_dim = self.cache.head_dim
        return qkv[:, :heads * head_dim].view(qkv.shape[0], heads, head_dim)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None = None,
               v: torch.Tensor | None = None) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D), or None when rotate_and_store wrote them -> (T, H, D)."""
        k_cache, v_cache = self.cache.layers[layer_idx]
        if k is not None:
            torch.ops.ember.store_kv_(k, v, k_cache, v_cache, self.slot_mapping)
        window = self.cache.layer_windows[layer_idx] or 0  # 0: the whole sequence
        return torch.ops.ember.paged_attention(q, k_cache, v_cache, self.block_table, self.row_begin,
                                               self.first_pos, q.shape[-1] ** -0.5, window)

    def layer_arguments(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], torch.Tensor, torch.Tensor,
                                       torch.Tensor, torch.Tensor, float]:
        """What ember.kernels' decoder_layers takes to run every layer's attention of this step:
        k caches, v caches, windows (0: the whole sequence), slots, block table, row ranges, first
        positions, the score scale (attend's)."""
        layers = self.cache.layers
        head_dim = self.cache.head_dim
        return ([k for k, _ in layers], [v for _, v in layers], [w or 0 for w in self.cache.layer_windows],
                self.slot_mapping, self.block_table, self.row_begin, self.first_pos, head_dim ** -0.5)


def kernel_attention(cache: KVCache, scheduled_rows: list[tuple[list[int], int, int]],
                     slot_mapping: torch.Tensor) -> KernelAttention:
    """scheduled_rows: (block ids, first position, row count) per scheduled sequence, in row order."""
    width = max(-(-(start + count) // KERNEL_BLOCK_SIZE) for _, start, count in scheduled_rows)
    tables, row_begin, first_pos = [], [0], []
    newest = 0  # the furthest block a sequence's last is: new blocks are handed out at the tails
    for block_ids, start, count in scheduled_rows:
        blocks = block_ids[: -(-(start + count) // KERNEL_BLOCK_SIZE)]
        tables.append(blocks + [0] * (width - len(blocks)))
        row_begin.append(row_begin[-1] + count)
        first_pos.append(start)
        newest = max(newest, blocks[-1])
    cache.populate_ahead(newest)
    return KernelAttention(cache, slot_mapping, torch.tensor(tables, dtype=torch.int32),
                           torch.tensor(row_begin, dtype=torch.int32), torch.tensor(first_pos, dtype=torch.int32))
