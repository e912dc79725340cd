"""Dense reference attention for model tests: the `attn` object a model's forward receives."""

from __future__ import annotations

import torch


class ReferenceAttention:
    """One sequence: a dense per-layer K/V list, causal masking by absolute position (and by a
    layer's sliding window, when given).

    Call `set_positions` before each forward with that forward's positions (T,); prefill, chunked
    prefill and decode steps are then all the same call.

    image_groups (the sequence's length,): per position, the image whose tokens attend to each other
    in both directions (Gemma 3's prefill), -1 for every other token. A query then also sees the
    later keys of its own image that the same forward holds; a sliding window still bounds it
    (transformers: window AND (causal OR same image)).
    """

    def __init__(self, windows: list[int | None] | None = None, image_groups: torch.Tensor | None = None) -> None:
        self.windows = windows or []  # per layer: its sliding window, None (or none listed) for global
        self.image_groups = image_groups
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (S, kv_heads, head_dim)
        self.values: dict[int, torch.Tensor] = {}
        self.key_positions: dict[int, torch.Tensor] = {}  # layer -> (S,)
        self.positions: torch.Tensor | None = None

    def set_positions(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, heads, D), k, v: (T, kv_heads, D) -> (T, heads, D)."""
        assert self.positions is not None and self.positions.shape[0] == q.shape[0]
        if layer_idx in self.keys:
            k = torch.cat((self.keys[layer_idx], k))
            v = torch.cat((self.values[layer_idx], v))
            key_positions = torch.cat((self.key_positions[layer_idx], self.positions))
        else:
            key_positions = self.positions
        self.keys[layer_idx], self.values[layer_idx] = k, v
        self.key_positions[layer_idx] = key_positions

        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)  # (S, heads, D)
        v = v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * q.shape[-1] ** -0.5
        allowed = key_positions[None, :] <= self.positions[:, None]  # (T, S)
        if self.image_groups is not None:
            query_group = self.image_groups[self.positions][:, None]
            allowed |= (query_group == self.image_groups[key_positions][None, :]) & (query_group >= 0)
        window = self.windows[layer_idx] if self.windows else None
        if window is not None:
            allowed &= key_positions[None, :] > self.positions[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), v.float())
        return out.to(q.dtype)


class BatchAttention:
    """Several sequences flattened together: tokens are split by per-sequence counts and each
    sequence attends on its own ReferenceAttention, so neighbours cannot leak into a row."""

    def __init__(self, parts: list[tuple[ReferenceAttention, torch.Tensor]]) -> None:
        self.parts = parts  # (sequence's attention, its positions in this forward)
        for seq_attn, positions in parts:
            seq_attn.set_positions(positions)
        self.counts = [positions.shape[0] for _, positions in parts]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = [seq_attn.attend(layer_idx, qs, ks, vs) for (seq_attn, _), qs, ks, vs in
                zip(self.parts, q.split(self.counts), k.split(self.counts), v.split(self.counts))]
        return torch.cat(outs)
