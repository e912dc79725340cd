"""SigLIP's vision transformer as Idefics3 / SmolVLM and Gemma 3 use it: image tiles in, one hidden
state per patch out (no pooling head).

- the patch embedding is a convolution whose stride is its kernel (patch_size); it runs here as one
  linear layer over each patch's flattened pixels, in the convolution weight's (channel, row, column)
  order, so it sits on the weight-format seam with every other linear layer (`patch_weights`
  reshapes the checkpoint's convolution weight);
- learned position embeddings, indexed by position ids the caller chooses (`grid_position_ids`: the
  patch's row-major index; `navit_position_ids`: Idefics3's positions for a tile whose real pixels
  cover only part of it);
- pre-norm encoder layers (LayerNorm with bias), full non-causal attention over one tile's patches
  (padding patches masked as keys), an MLP with tanh-approximated GELU; a final LayerNorm;
- attention is torch's, except in bfloat16 on the CPU with ember's kernels loaded, where ember's
  own kernel (ember/kernels/tower_attention.cpp) takes it: torch's runs bfloat16 no faster than
  float32 there.

The tower takes one tile (an image, or a crop of one) per call: a matmul may round otherwise when
handed more rows, and a tile's bits must not depend on the tiles encoded beside it. The multimodal
models loop over an image's tiles.

Within a tile, the work goes in pieces of PIECE_ROWS patches through one stage of one layer (the
projections into queries, keys and values; attention and its output; the MLP's first linear layer
and activation; its second), and `steps` yields
after each piece, so the engine can spread one image's encoding over many steps and keep the
streams beside it at their pace (engine.images). Every call takes the same pieces (`forward`
runs them all at once), so a tile's bits do not depend on how its pieces were spread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.errors import ModelLoadError
from ember.models.layers import Embedding, Linear, QKVLinear

PIECE_ROWS = 256  # patches a piece of work takes through one stage of a layer
Steps = Generator[None, None, torch.Tensor]  # yields after each piece; returns the result


def drain(steps: Steps) -> torch.Tensor:
    """Run a generator of steps to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _pieces(rows: int) -> list[slice]:
    return [slice(start, min(start + PIECE_ROWS, rows)) for start in range(0, rows, PIECE_ROWS)]


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A vision_config's fields, with transformers' SiglipVisionConfig defaults (config.json files
    often leave the defaults out; Idefics3 passes its own)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **defaults: Any) -> "VisionConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        config = cls(**{**defaults, **{k: v for k, v in hf.items() if k in names}})
        if config.hidden_act != "gelu_pytorch_tanh":
            raise ModelLoadError(f"the vision tower's hidden_act {config.hidden_act!r} is not supported "
                                 "(supported: gelu_pytorch_tanh)")
        if not isinstance(config.image_size, int) or not isinstance(config.patch_size, int):
            raise ModelLoadError("the vision tower's image_size and patch_size must be single numbers")
        if config.hidden_size % config.num_attention_heads:
            raise ModelLoadError(f"the vision tower's hidden_size ({config.hidden_size}) is not a multiple of "
                                 f"num_attention_heads ({config.num_attention_heads})")
        return config

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Embeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.patch_embedding = Linear(config.num_channels * config.patch_size ** 2, config.hidden_size, bias=True)
        self.position_embedding = Embedding(config.patches_per_side ** 2, config.hidden_size)

    def forward(self, pixels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """pixels (channels, H, W), position_ids (patches,) -> (patches, hidden), patches row-major.
        Pixels past the last whole patch are left out, as the convolution leaves them."""
        channels, height, width = pixels.shape
        p = self.patch_size
        rows, cols = height // p, width // p
        patches = (pixels[:, :rows * p, :cols * p].reshape(channels, rows, p, cols, p)
                   .permute(1, 3, 0, 2, 4).reshape(rows * cols, channels * p * p))
        patches = patches.to(self.patch_embedding.weight.dtype)
        return self.patch_embedding(patches) + self.position_embedding(position_ids)


@dataclass(frozen=True, slots=True)
class LayerKeys:
    """Every patch's keys and values of one layer, as `Attention.attend` reads them: for torch's
    attention (1, heads, patches, head_dim) with the mask (1, patches); packed for ember's kernel
    (ember/kernels/tower_attention.cpp) with the mask (patches,). mask: True where a patch holds
    pixels, None when all do."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    patches: int
    packed: bool


class Attention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv_proj = QKVLinear(config.hidden_size, self.num_heads, self.num_heads, self.head_dim, bias=True)
        self.out_proj = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.fused = False  # ember's CPU kernels are loaded (use_fused_ops)

    def _kernel_serves(self, k: torch.Tensor) -> bool:
        """ember's kernel attends in bfloat16 on the CPU, for head_dim 64 to 128 in multiples of 8, where
        the processor has bfloat16 dot products (else the op is not built); float32 keeps torch's."""
        return (self.fused and k.dtype == torch.bfloat16 and k.device.type == "cpu" and self.head_dim % 8 == 0
                and 64 <= self.head_dim <= 128 and hasattr(torch.ops.ember, "tower_attention"))

    def keys(self, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> LayerKeys:
        """k, v (patches, heads, head_dim) of every patch; key_mask (patches,), True where a patch holds
        pixels, or None when all do -> what `attend` takes, made once per layer."""
        if self._kernel_serves(k):
            k_packed, v_packed = torch.ops.ember.tower_pack_kv(k, v)
            mask = None if key_mask is None else key_mask.contiguous()
            return LayerKeys(k_packed, v_packed, mask, k.shape[0], packed=True)
        # 4-D (1, heads, patches, head_dim): torch's fused CPU kernel takes batched inputs only (3-D
        # ones fall back to a matmul-softmax-matmul path four times slower)
        mask = None if key_mask is None else key_mask[None, :]
        return LayerKeys(k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, k.shape[0], packed=False)

    def attend(self, q: torch.Tensor, keys: LayerKeys) -> torch.Tensor:
        """q (rows, heads, head_dim) of some patches, scaled by head_dim ** -0.5 -> (rows, hidden) after
        out_proj."""
        if keys.packed:
            out = torch.ops.ember.tower_attention(q, keys.k, keys.v, keys.mask, keys.patches, self.head_dim ** -0.5)
        else:
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.k, keys.v, attn_mask=keys.mask)[0]
            out = out.transpose(0, 1).reshape(q.shape[0], -1)
        return self.out_proj(out)


class MLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, bias=True)

    def up(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc1(x), approximate="tanh")


class EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.self_attn = Attention(config)
        self.layer_norm2 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.mlp = MLP(config)

    def steps(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> Steps:
        """x (patches, hidden) -> the layer's output, piece by piece (x is not changed)."""
        pieces = _pieces(x.shape[0])
        projected = []
        for rows in pieces:
            projected.append(self.self_attn.qkv_proj(self.layer_norm1(x[rows])))
            yield
        q, k, v = (torch.cat(parts) for parts in zip(*projected))  # (patches, heads, head_dim) each
        keys = self.self_attn.keys(k, v, key_mask)
        x = x.clone()
        for rows in pieces:
            x[rows] += self.self_attn.attend(q[rows], keys)
            yield
        hidden = []
        for rows in pieces:
            hidden.append(self.mlp.up(self.layer_norm2(x[rows])))
            yield
        for rows, up in zip(pieces, hidden):
            x[rows] += self.mlp.fc2(up)
            yield
        return x


class Encoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))


class VisionTransformer(nn.Module):
    """The checkpoint's vision model (model.vision_model.* in Idefics3, vision_tower.vision_model.*
    in Gemma 3): embeddings, encoder.layers, post_layernorm."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, position_ids: torch.Tensor,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One tile: pixels (channels, H, W); position_ids (patches,); key_mask (patches,), or None when
        every patch holds pixels -> (patches, hidden)."""
        return drain(self.steps(pixels, position_ids, key_mask))

    def steps(self, pixels: torch.Tensor, position_ids: torch.Tensor, key_mask: torch.Tensor | None = None) -> Steps:
        """`forward` a piece at a time."""
        if key_mask is not None and bool(key_mask.all()):
            key_mask = None  # every patch real: attention without a mask takes torch's fused path
        x = self.embeddings(pixels, position_ids)
        yield
        for layer in self.encoder.layers:
            x = yield from layer.steps(x, key_mask)
        return self.post_layernorm(x)


def grid_position_ids(patches: int, device: torch.device) -> torch.Tensor:
    """(patches,): each patch's row-major index, for a tile of the tower's own image size."""
    return torch.arange(patches, device=device)


def navit_position_ids(patch_mask: torch.Tensor, patches_per_side: int) -> torch.Tensor:
    """Idefics3's positions (NaViT's): a tile whose real pixels span r x c patches spreads them over the
    whole patches_per_side x patches_per_side table, each patch taking the bucket its fractional
    coordinate falls in (float32 steps, as transformers computes them); padding patches take 0.
    patch_mask (tiles, rows, cols) bool -> (tiles, rows * cols)."""
    tiles, rows, cols = patch_mask.shape
    device = patch_mask.device
    step = 1 / patches_per_side
    boundaries = torch.arange(step, 1.0, step, dtype=torch.float32, device=device)
    real_rows = patch_mask[:, :, 0].sum(dim=1).to(torch.float32)  # (tiles,)
    real_cols = patch_mask[:, 0, :].sum(dim=1).to(torch.float32)
    row_coords = torch.arange(rows, dtype=torch.float32, device=device)[None, :] * (1.0 / real_rows)[:, None]
    col_coords = torch.arange(cols, dtype=torch.float32, device=device)[None, :] * (1.0 / real_cols)[:, None]
    row_buckets = torch.bucketize(row_coords.clamp(max=1.0 - 1e-6), boundaries, right=True)
    col_buckets = torch.bucketize(col_coords.clamp(max=1.0 - 1e-6), boundaries, right=True)
    ids = (row_buckets[:, :, None] * patches_per_side + col_buckets[:, None, :]).reshape(tiles, -1)
    return torch.where(patch_mask.reshape(tiles, -1), ids, 0)


def patch_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's patch convolution weight (hidden, channels, p, p) as the patch embedding's
    linear weight (hidden, channels * p * p); every other tensor as it is."""
    for name, tensor in weights:
        if name.endswith("embeddings.patch_embedding.weight") and tensor.dim() == 4:
            tensor = tensor.reshape(tensor.shape[0], -1)
        yield name, tensor
