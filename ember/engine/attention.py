"""Paged attention over the engine's KV cache: the reference backend, plain torch.

Every sequence attends only to its own keys, and padding never changes a result: scores are
masked to -inf, softmax runs in float32 and padded probabilities are exact zeros. In exact mode
(the batch-invariant default) no shape a sequence's arithmetic sees depends on its neighbours:
decoding sequences are grouped by their own padded width, long decodes run chunk by chunk,
and prefill runs in fixed query tiles and key blocks (PrefillSeq). A sequence's output is then
the same alone or inside any batch, however its prompt was chunked. What still moves results
is a token decoded in one step and recomputed in a prefill later (after a preemption): the two
paths round differently in the last bits.

On CPU, a decoding sequence with more than LONG_DECODE_CHUNK keys does not join the padded
batch, whose gather would copy its whole KV at every layer and step: its keys are read in fixed
logical chunks of that size, in place where the chunk's blocks are consecutive (the block
manager hands out runs) and gathered only where they are not. The chunks depend on the
sequence's length alone, never on where its blocks lie, so neither do its results.

Sliding windows (KVCache.layer_windows): a layer with window W lets the token at position p see
the keys at positions p - W + 1 to p. Its masks add that lower bound to the causal one, from
positions alone, so a windowed row keeps every promise above. A model with any window decodes
every sequence in the padded batch (the long-decode chunks do not take a window).

Bidirectional spans (Request.bidirectional_spans, Gemma 3's image tokens): in a prefill chunk,
the tokens of one span also see each other's later keys, a layer's window still bounding them
(a key is seen when it is not later than the query or both are in the span, and, on a windowed
layer, within the window). The scheduler never ends a chunk inside a span, so the chunk holds the
span's later keys. Decoding is plain causal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ember.engine.host_memory import HUGE_PAGE, ResidentPages, huge_page_tensor


@dataclass(slots=True)
class DecodeGroup:
    """Sequences that add one token this step, attended together over padded block tables."""

    token_index: torch.Tensor  # (B,) rows of the step's flat token batch
    block_table: torch.Tensor  # (B, max_blocks) block ids, padded with the null block 0
    key_mask: torch.Tensor  # (1, B, 1, max_blocks * block_size) True where a key exists
    lengths: torch.Tensor | None = None  # (B,) keys of each sequence, its new token's included
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> key_mask within it

    def mask(self, window: int | None) -> torch.Tensor:
        """key_mask, limited to each sequence's last `window` keys when the layer has a window."""
        if window is None:
            return self.key_mask
        if window not in self.window_masks:
            keys = torch.arange(self.key_mask.shape[-1], device=self.key_mask.device)
            recent = keys[None, :] >= (self.lengths - window)[:, None]  # (B, keys)
            self.window_masks[window] = self.key_mask & recent[None, :, None, :]
        return self.window_masks[window]


# Keys per chunk of a long decode: one fused attention call per layer and chunk (or run of chunks).
LONG_DECODE_CHUNK = 2048

# (out, logsumexp, ...) of softmax attention without a mask, reading strided inputs in place; a
# torch internal, so a build without it decodes every sequence in the padded batch instead.
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(slots=True)
class LongDecode:
    """One sequence adding one token over more than LONG_DECODE_CHUNK keys.

    Its keys, in order, are cut into logical chunks of LONG_DECODE_CHUNK (the last one shorter).
    Each piece covers `count` chunks: cache slots [start, stop) when their blocks are consecutive
    (a run of whole chunks is one piece), else one chunk's (keys,) slot indices, to gather.
    """

    row: int  # its row in the step's flat token batch
    pieces: list[tuple[slice | torch.Tensor, int]]


def long_decode_available() -> bool:
    return _flash_cpu is not None


def long_decode(row: int, block_ids: list[int], length: int, block_size: int, device: torch.device,
                chunk: int = LONG_DECODE_CHUNK, exact: bool = True) -> LongDecode:
    """The pieces of a sequence attending to `length` keys (its new token's included).

    Exact: one piece per chunk, so every chunk goes through the same call whatever the layout
    (a float32 call over a run of chunks rounds differently from calls over each). Else a run
    of consecutive whole chunks is one piece, read in one call.
    """
    pieces: list[tuple[slice | torch.Tensor, int]] = []
    for lo in range(0, length, chunk):
        hi = min(length, lo + chunk)
        blocks = block_ids[lo // block_size: -(-hi // block_size)]
        start = blocks[0] * block_size
        if blocks != list(range(blocks[0], blocks[0] + len(blocks))):
            slots = (torch.tensor(blocks)[:, None] * block_size + torch.arange(block_size)).flatten()
            pieces.append((slots[:hi - lo].to(device, non_blocking=True), 1))
        elif (not exact and hi - lo == chunk and pieces and isinstance(pieces[-1][0], slice)
              and pieces[-1][0].stop == start):
            run, count = pieces[-1]  # only the last chunk is ever short, so a run holds whole chunks
            pieces[-1] = (slice(run.start, start + chunk), count + 1)
        else:
            pieces.append((slice(start, start + hi - lo), 1))
    return LongDecode(row, pieces)


# Exact prefill (batch-invariant mode): query rows go through the flash kernel in tiles of
# _QUERY_TILE, keys in whole blocks of _KEY_BLOCK, so a row's arithmetic never depends on how its
# prompt was cut into chunks or how much of it came from the prefix cache.
_QUERY_TILE = 32
_KEY_BLOCK = 512  # the CPU flash kernel's key split once there are that many keys


@dataclass(slots=True)
class PrefillSeq:
    """One sequence adding several tokens: rows [begin, end) of the flat batch.

    Exact mode: key_slots is padded with the null block's slot 0 to a multiple of _KEY_BLOCK and
    mask is (tiles, 1, row tile, keys); else mask is (n, keys), or None for plain causal.
    spans: the bidirectional spans [start, stop) among its new tokens' positions.
    """

    begin: int
    end: int
    key_slots: torch.Tensor  # (keys,) cache slots of every key it sees
    mask: torch.Tensor | None  # additive, 0 where a new token sees a key, -inf elsewhere
    exact: bool
    start_pos: int = 0
    dtype: torch.dtype = torch.float32  # the masks' dtype: attention's (KVCache.dtype)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask within it
    spans: list[tuple[int, int]] = field(default_factory=list)

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The prefill mask, with keys before each row's window hidden too when the layer has one."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            n, keys = self.end - self.begin, self.key_slots.shape[0]
            rows = self.mask.shape[0] * self.mask.shape[2] if self.exact else n
            mask = _causal_mask(self.start_pos, rows, keys, n, self.dtype, self.key_slots.device, window,
                                self.spans)
            self.window_masks[window] = mask.view(-1, 1, self.mask.shape[2], keys) if self.exact else mask
        return self.window_masks[window]


def prefill_seq(begin: int, start_pos: int, key_slots: torch.Tensor, dtype: torch.dtype,
                device: torch.device, exact: bool, spans: list[tuple[int, int]] = ()) -> PrefillSeq:
    """key_slots: (L,) every key's slot, the n = L - start_pos new tokens' included; spans: the
    bidirectional spans within the new tokens' positions [start_pos, L). Built once per step; every
    layer shares it."""
    tile = _QUERY_TILE
    total = key_slots.shape[0]
    n = total - start_pos
    spans = list(spans)
    if not exact:
        if start_pos == 0 and not spans:
            return PrefillSeq(begin, begin + n, key_slots.to(device), None, False, start_pos, dtype)
        mask = _causal_mask(start_pos, n, total, n, dtype, device, spans=spans)
        return PrefillSeq(begin, begin + n, key_slots.to(device), mask, False, start_pos, dtype, spans=spans)
    padded = -(-total // _KEY_BLOCK) * _KEY_BLOCK
    key_slots = torch.cat((key_slots, key_slots.new_zeros(padded - total)))
    rows = -(-n // tile) * tile
    mask = _causal_mask(start_pos, rows, padded, n, dtype, device, spans=spans).view(-1, 1, tile, padded)
    return PrefillSeq(begin, begin + n, key_slots.to(device), mask, True, start_pos, dtype, spans=spans)


def _causal_mask(start_pos: int, rows: int, keys: int, n: int, dtype: torch.dtype, device: torch.device,
                 window: int | None = None, spans: list[tuple[int, int]] = ()) -> torch.Tensor:
    """(rows, keys) additive mask; rows past the n new tokens repeat the last one's. A row in one of
    the bidirectional `spans` also sees the span's later keys; with a window, a row does not see
    keys `window` or more positions behind it."""
    query_pos = torch.arange(start_pos, start_pos + rows, device=device).clamp(max=start_pos + n - 1)
    key_pos = torch.arange(keys, device=device)[None, :]
    hidden = key_pos > query_pos[:, None]
    if spans:
        span_of = torch.full((keys,), -1, device=device)  # key position -> its span's index, -1: none
        for index, (span_start, span_stop) in enumerate(spans):
            span_of[span_start:span_stop] = index
        query_span = span_of[query_pos][:, None]
        hidden &= (query_span != span_of[None, :]) | (query_span < 0)
    if window is not None:
        hidden |= key_pos <= query_pos[:, None] - window
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


# Bytes of a key's or value's int8 scale (float32), after its head_dim int8 values.
INT8_SCALE_BYTES = 4


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) -> (..., head_dim + 4) int8: each row as round(x / scale) in [-127, 127],
    then its scale's float32 bytes, scale = max |x| / 127 (0 for a row of zeros). A row's bits
    depend on that row alone. ember's kernel (kv_int8.h, store_row) rounds the same way."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    values = torch.where(scale > 0, x / scale, 0.0).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat((values, scale.view(torch.int8)), -1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_rows' (..., head_dim + 4) rows back to (..., head_dim) values in `dtype`."""
    scales = rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-INT8_SCALE_BYTES].float() * scales).to(dtype)


class KVCache:
    """The paged K/V tensors of every layer. Slot s of a layer is block s // block_size.

    Torch layout: (kv_heads, slots, head_dim) per layer, heads before slots, so a gathered run of
    blocks is already (kv_heads, keys, head_dim), the layout the attention matmuls read without a
    copy. Kernel layout (`kernel_layout`, blocks of 16): each block arranged for ember's attention
    kernel (see ember/kernels/attention.cpp), in groups of GROUP_BLOCKS blocks: the pool is
    (groups, layers, k/v, kv_heads, GROUP_BLOCKS, 16 * head_dim), so a layer's view is (groups,
    kv_heads, GROUP_BLOCKS, 16 * head_dim) and a run of a group's blocks of one KV head lies in one
    piece. On the host the pool lies on huge pages where it can (engine.host_memory): no page walk
    per 4 KiB as attention reads a step's keys and values, while the first write to a group's
    blocks makes that group's pages resident (23 MB for the default model), not a 2 MiB page in
    each layer's keys and values of each KV head as it would with the layers outermost, and
    populate_ahead has the next group's made resident before the steps reach it
    (bench/kv_pool_pages.py, docs/cpu-kernels.md).

    `dtype` is what attention computes in (the model's); `kv_dtype` what the cache stores. A float
    kv_dtype other than dtype is cast on write and back on read. int8 (quantize_rows) stores each
    key and value row with its own scale: in the torch layout a slot is (head_dim + 4) int8, its
    values then its scale's bytes; in the kernel layout a block is its 16 * head_dim int8 values
    (laid out as float32's) then its 16 float32 scales. Either way `block(b)` is block b's
    (layers, k/v, kv_heads, block elements), scales included, and a token's bits depend on its own
    K/V alone.
    """

    GROUP_BLOCKS = 64  # blocks whose keys (or values) of one layer and KV head lie in one piece
    POPULATE_PAGES = 1  # huge pages a thread makes resident ahead of the steps, at most, per step

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, kernel_layout: bool = False,
                 layer_windows: list[int | None] | None = None, kv_dtype: torch.dtype | None = None) -> None:
        self.block_size = block_size
        # per layer: the sliding window (keys a token sees, its own included), None where global
        self.layer_windows = list(layer_windows) if layer_windows else [None] * num_layers
        self.num_blocks = num_blocks
        self.kernel_layout = kernel_layout
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        row = head_dim + INT8_SCALE_BYTES if self.kv_dtype == torch.int8 else head_dim  # elements per slot
        self._pages: ResidentPages | None = None
        self._resident_to = 0  # bytes of the pool up to which populate_ahead has made it resident
        if kernel_layout:
            # The kernel never reads a slot past a row's keys, so the pool need not be written up
            # front: the process holds only the pages its requests have used. A fresh huge-page
            # region reads as zeros, null block 0 included; it starts a cache line past a huge
            # page, as torch's allocations start past a page (on the boundary itself, every block
            # on a 2 KiB one, the AVX2 path's attention lost time: bench/kv_pool_pages.py).
            groups = -(-num_blocks // self.GROUP_BLOCKS)
            shape = (groups, num_layers, 2, num_kv_heads, self.GROUP_BLOCKS, block_size * row)
            pool = huge_page_tensor(shape, self.kv_dtype, offset=64) if torch.device(device).type == "cpu" else None
            # The pages of the group after the furthest one in use are made resident ahead of its
            # first writes (populate_ahead).
            self._pages = None if pool is None else ResidentPages(pool)
            if pool is None:
                pool = torch.empty(shape, dtype=self.kv_dtype, device=device)
                pool[0, :, :, :, 0].zero_()  # the null block
            self.tensor = pool
            self.layers = [(pool[:, i, 0], pool[:, i, 1]) for i in range(num_layers)]  # (k, v) views
        else:
            # (layers, k/v, kv_heads, slots, row). The torch paths weigh padded slots by exact
            # zeros, which must not meet a NaN.
            self.tensor = torch.zeros(num_layers, 2, num_kv_heads, num_blocks * block_size, row,
                                      dtype=self.kv_dtype, device=device)
            self.layers = [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(num_layers)]  # (k, v) views
            # (layers, k/v, kv_heads, blocks, block elements)
            self._blocks = self.tensor.view(num_layers, 2, num_kv_heads, num_blocks, -1)

    def populate_ahead(self, block_id: int) -> None:
        """Where the pool lies on huge pages, called before each step with the furthest block it
        writes: block_id's group made resident now if it is not yet, and once block_id is past the
        middle of its group the next group's pages too, a few at a time (POPULATE_PAGES a thread
        each step), so that a step's first writes rarely wait for a page. Blocks are first handed
        out in order, so the next group is where the pool's first writes go next; a group passed
        over is left to the writes that reach it."""
        if self._pages is None or self._pages.refused:
            return
        group, within = divmod(block_id, self.GROUP_BLOCKS)
        total = self.tensor.numel() * self.tensor.element_size()
        group_bytes = total // self.tensor.shape[0]
        needed = min(total, (group + 1) * group_bytes)
        ahead = min(total, (group + 2) * group_bytes) if 2 * within >= self.GROUP_BLOCKS else needed
        first = max(self._resident_to, group * group_bytes)
        end = min(ahead, max(needed, first + self.POPULATE_PAGES * torch.get_num_threads() * HUGE_PAGE))
        if end > first:
            self._pages.populate(first, end - first)
            self._resident_to = end

    def block(self, block_id: int) -> torch.Tensor:
        """Block `block_id`'s data in place, (layers, k/v, kv_heads, block elements), in either layout."""
        if self.kernel_layout:
            return self.tensor[block_id // self.GROUP_BLOCKS, :, :, :, block_id % self.GROUP_BLOCKS]
        return self._blocks[:, :, :, block_id]

    def block_layout(self) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of read_block's copies (what the tiers keep)."""
        return tuple(self.block(0).shape), self.kv_dtype

    def read_block(self, block_id: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A copy of one block's keys and values (int8: and their scales), (layers, k/v, kv_heads,
        block elements), on `device`."""
        return self.block(block_id).to(device, copy=True)

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Put read_block's copy (of a block of this layout) into block `block_id`."""
        self.block(block_id).copy_(data, non_blocking=True)

    def copy_blocks(self, sources: dict[int, int]) -> None:
        """Each block of `sources` (target -> source) takes its source's data, every source read
        as it was before any of them was written."""
        if sources.keys().isdisjoint(sources.values()):  # as good as always: block by block
            for target, source in sources.items():
                self.block(target).copy_(self.block(source))
            return
        copies = {target: self.block(source).clone() for target, source in sources.items()}
        for target, data in copies.items():
            self.block(target).copy_(data)

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """New keys or values (..., head_dim) as the torch layout stores them."""
        return quantize_rows(x) if self.kv_dtype == torch.int8 else x.to(self.kv_dtype)

    def loaded(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows read from the torch layout (..., slot row) as (..., head_dim) values in `dtype`."""
        return dequantize_rows(rows, self.dtype) if self.kv_dtype == torch.int8 else rows.to(self.dtype)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        kv_dtype: torch.dtype) -> int:
        row = head_dim + INT8_SCALE_BYTES if kv_dtype == torch.int8 else head_dim * torch.finfo(kv_dtype).bits // 8
        return num_layers * 2 * block_size * num_kv_heads * row


class PagedAttention:
    """The attention handle a model sees for one step: `attend(layer, q, k, v)`."""

    def __init__(self, cache: KVCache, slot_mapping: torch.Tensor, decodes: list[DecodeGroup],
                 prefills: list[PrefillSeq], long_decodes: list[LongDecode] = ()) -> None:
        self.cache = cache
        self.slot_mapping = slot_mapping  # (T,) where each new token's K/V goes
        self.decodes = decodes
        self.prefills = prefills
        self.long_decodes = long_decodes

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D) -> (T, H, D)."""
        cache = self.cache
        k_cache, v_cache = cache.layers[layer_idx]  # (KVH, slots, slot row) each
        k_cache.index_copy_(1, self.slot_mapping, cache.stored(k).transpose(0, 1))
        v_cache.index_copy_(1, self.slot_mapping, cache.stored(v).transpose(0, 1))
        window = cache.layer_windows[layer_idx]
        if len(self.decodes) == 1 and not self.prefills and not self.long_decodes:
            return self._decode(q, k_cache, v_cache, self.decodes[0], window)
        out = torch.empty_like(q)
        for group in self.decodes:
            out[group.token_index] = self._decode(q[group.token_index], k_cache, v_cache, group, window)
        for seq in self.long_decodes:
            out[seq.row] = _long_decode(q[seq.row], k_cache, v_cache, seq, cache)
        for seq in self.prefills:
            out[seq.begin:seq.end] = _prefill(q[seq.begin:seq.end], cache.loaded(k_cache[:, seq.key_slots]),
                                              cache.loaded(v_cache[:, seq.key_slots]), seq, seq.mask_for(window))
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                group: DecodeGroup, window: int | None) -> torch.Tensor:
        batch, heads, head_dim = q.shape
        kv_heads = k_cache.shape[0]
        block_size = self.cache.block_size
        blocks = group.block_table.flatten()
        row = k_cache.shape[-1]
        # (KVH, B * max_blocks, block_size, D) -> (KVH * B, keys, D): one batch entry per (head, sequence)
        keys = self.cache.loaded(k_cache.view(kv_heads, -1, block_size, row).index_select(1, blocks))
        values = self.cache.loaded(v_cache.view(kv_heads, -1, block_size, row).index_select(1, blocks))
        keys = keys.view(kv_heads * batch, -1, head_dim)
        values = values.view(kv_heads * batch, -1, head_dim)
        grouped_q = q.view(batch, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)  # (KVH, B, G, D)
        grouped_q = grouped_q.reshape(kv_heads * batch, heads // kv_heads, head_dim)
        scores = torch.bmm(grouped_q, keys.transpose(1, 2)).float() * head_dim ** -0.5  # (KVH * B, G, keys)
        scores.view(kv_heads, batch, -1, scores.shape[-1]).masked_fill_(~group.mask(window), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.bmm(probs, values)  # (KVH * B, G, D)
        return out.view(kv_heads, batch, -1, head_dim).transpose(0, 1).reshape(batch, heads, head_dim)


def _long_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: LongDecode,
                 cache: KVCache) -> torch.Tensor:
    """One new token over a long sequence, chunk by chunk. q: (H, D) -> (H, D).

    Torch's CPU flash kernel reads cache views through their strides (a matmul would copy them
    first); the G query heads of a KV head are its G query rows, and the chunks of a run are its
    batch. Chunk outputs are merged by their log-sum-exps in float32. A cache stored in another
    dtype than q's (int8 among them) is converted chunk by chunk instead.
    """
    heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    grouped_q = q.view(1, kv_heads, heads // kv_heads, head_dim)  # (1, KVH, G, D)
    outs, lses = [], []
    for piece, count in seq.pieces:
        # (KVH, count * keys, D) -> (count, KVH, keys, D)
        keys = cache.loaded(k_cache[:, piece]).unflatten(1, (count, -1)).transpose(0, 1)
        values = cache.loaded(v_cache[:, piece]).unflatten(1, (count, -1)).transpose(0, 1)
        out, lse = _flash_cpu(grouped_q.expand(count, -1, -1, -1), keys, values)[:2]
        outs.append(out)
        lses.append(lse)
    weights = torch.softmax(torch.cat(lses), dim=0)  # (chunks, KVH, G): each chunk's share of the mass
    out = (weights[..., None] * torch.cat(outs).float()).sum(dim=0)  # (KVH, G, D)
    return out.view(heads, head_dim).to(q.dtype)


def _prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq: PrefillSeq,
             mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of n new tokens over every key of one sequence, theirs included, under the mask
    (causal, opened within bidirectional spans; None: plain causal).

    q: (n, H, D); keys, values: (KVH, keys, D) -> (n, H, D). Fused attention (a flash kernel on
    CPU) streams over key blocks with an online softmax, so no (n, keys) score matrix is held.
    The kernel sizes its query blocks by the number of rows, and its last key block by the
    number of keys; the exact mode fixes both (padded rows are dropped, padded keys masked).
    """
    n, heads, head_dim = q.shape
    gqa = keys.shape[0] != heads
    if not seq.exact:
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                             attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    count, tile = mask.shape[0], mask.shape[2]
    tiles = F.pad(q, (0, 0, 0, 0, 0, count * tile - n)).view(count, tile, heads, head_dim).transpose(1, 2)
    # (count, H, tile, D), every tile reading the same keys
    out = F.scaled_dot_product_attention(tiles, keys.expand(count, -1, -1, -1), values.expand(count, -1, -1, -1),
                                         attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(-1, heads, head_dim)[:n]


