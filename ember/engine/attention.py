"""Paged attention over the engine's KV cache: the reference backend, plain torch.

Every sequence attends only to its own keys, and padding never changes a result: scores are
masked to -inf, softmax runs in float32 and padded probabilities are exact zeros. With matmuls
kept to the row tile (see models.layers), a sequence's output is the same alone or inside any
batch. What still moves results in bfloat16 is the number of keys in one call: a prompt
prefilled in other chunks can round differently in the last bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.models.layers import row_tile

# Query rows x key columns per score tile for long prefills: bounds the float32 scores tensor.
_MAX_SCORE_ELEMENTS = 1 << 24


@dataclass(slots=True)
class DecodeGroup:
    """Sequences that add one token this step, attended together over padded block tables."""

    token_index: torch.Tensor  # (B,) rows of the step's flat token batch
    block_table: torch.Tensor  # (B, max_blocks) block ids, padded with the null block 0
    key_mask: torch.Tensor  # (1, B, 1, max_blocks * block_size) True where a key exists


@dataclass(slots=True)
class PrefillSeq:
    """One sequence adding several tokens: rows [begin, end) of the flat batch."""

    begin: int
    end: int
    start_pos: int  # absolute position of the first new token
    key_slots: torch.Tensor  # (start_pos + end - begin,) cache slots of every key it sees


class KVCache:
    """The paged K/V tensors of every layer. Slot s of a layer is block s // block_size.

    Heads come before slots, so a gathered run of blocks is already (kv_heads, keys, head_dim),
    the layout the attention matmuls read without a copy.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        # (layers, k/v, kv_heads, slots, head_dim)
        self.tensor = torch.zeros(num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim,
                                  dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


class PagedAttention:
    """The attention handle a model sees for one step: `attend(layer, q, k, v)`."""

    def __init__(self, cache: KVCache, slot_mapping: torch.Tensor, decode: DecodeGroup | None,
                 prefills: list[PrefillSeq]) -> None:
        self.cache = cache
        self.slot_mapping = slot_mapping  # (T,) where each new token's K/V goes
        self.decode = decode
        self.prefills = prefills

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D) -> (T, H, D)."""
        k_cache, v_cache = self.cache.tensor[layer_idx]  # (KVH, slots, D) each
        k_cache.index_copy_(1, self.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, self.slot_mapping, v.transpose(0, 1))
        if self.decode is not None and not self.prefills:
            return self._decode(q, k_cache, v_cache)
        out = torch.empty_like(q)
        if self.decode is not None:
            out[self.decode.token_index] = self._decode(q[self.decode.token_index], k_cache, v_cache)
        for seq in self.prefills:
            out[seq.begin:seq.end] = _prefill(q[seq.begin:seq.end], k_cache[:, seq.key_slots],
                                              v_cache[:, seq.key_slots], seq.start_pos)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        group = self.decode
        batch, heads, head_dim = q.shape
        kv_heads = k_cache.shape[0]
        block_size = self.cache.block_size
        blocks = group.block_table.flatten()
        # (KVH, B * max_blocks, block_size, D) -> (KVH * B, keys, D): one batch entry per (head, sequence)
        keys = k_cache.view(kv_heads, -1, block_size, head_dim).index_select(1, blocks)
        values = v_cache.view(kv_heads, -1, block_size, head_dim).index_select(1, blocks)
        keys = keys.view(kv_heads * batch, -1, head_dim)
        values = values.view(kv_heads * batch, -1, head_dim)
        grouped_q = q.view(batch, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)  # (KVH, B, G, D)
        grouped_q = grouped_q.reshape(kv_heads * batch, heads // kv_heads, head_dim)
        scores = torch.bmm(grouped_q, keys.transpose(1, 2)).float() * head_dim ** -0.5  # (KVH * B, G, keys)
        scores.view(kv_heads, batch, -1, scores.shape[-1]).masked_fill_(~group.key_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.bmm(probs, values)  # (KVH * B, G, D)
        return out.view(kv_heads, batch, -1, head_dim).transpose(0, 1).reshape(batch, heads, head_dim)


def _prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Causal attention of n new tokens over all L = start_pos + n keys of one sequence.

    q: (n, H, D); keys, values: (KVH, L, D) -> (n, H, D).
    """
    n, heads, head_dim = q.shape
    kv_heads, total = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    # One batch entry per query head, so a tile's rows are query positions (up to the row tile).
    k = keys.repeat_interleave(group, dim=0).transpose(1, 2) if group > 1 else keys.transpose(1, 2)  # (H, D, L)
    v = values.repeat_interleave(group, dim=0) if group > 1 else values  # (H, L, D)
    q_by_head = q.transpose(0, 1)  # (H, n, D)
    out = torch.empty(n, heads, head_dim, dtype=q.dtype, device=q.device)
    key_pos = torch.arange(total, device=q.device)
    rows_per_tile = max(1, _MAX_SCORE_ELEMENTS // (heads * total))
    tile = row_tile()
    if tile is not None:  # keep each matmul at most `tile` rows, as the linears do
        rows_per_tile = min(rows_per_tile, tile)
    for lo in range(0, n, rows_per_tile):
        hi = min(n, lo + rows_per_tile)
        scores = torch.bmm(q_by_head[:, lo:hi], k).float() * head_dim ** -0.5  # (H, rows, L)
        query_pos = torch.arange(start_pos + lo, start_pos + hi, device=q.device)
        scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[lo:hi] = torch.bmm(probs, v).transpose(0, 1)
    return out
