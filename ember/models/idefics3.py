"""Idefics3 and SmolVLM (model_type "smolvlm", the same model): a SigLIP vision tower, a
pixel-shuffle connector and the Llama decoder.

What differs from the Llama model:
- an image comes as tiles (the image processor's crops in reading order, then the whole image
  downscaled), each a SigLIP tower input (models.siglip) with Idefics3's patch positions, computed
  from the processor's pixel mask;
- the connector folds each scale_factor x scale_factor block of a tile's patches into one vector
  (pixel shuffle) and projects it to the text width: a tile becomes image_seq_len embeddings;
- those embeddings replace the token embeddings of the prompt's image placeholders before the first
  layer (forward's `embeds`); attention stays causal everywhere;
- checkpoint names: model.text_model.* is the decoder ("model." here), model.vision_model.* the tower,
  model.connector.modality_projection.proj the connector's projection; tie_word_embeddings is the
  outer config's (ModelConfig.from_hf), which transformers leaves False by default.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ember.config import ModelConfig
from ember.errors import ModelLoadError
from ember.models import llama
from ember.models.layers import Linear, load_checkpoint, rename_prefixes
from ember.models.siglip import (Steps, VisionConfig, VisionTransformer, drain, navit_position_ids,
                                 patch_weights)

# Idefics3VisionConfig's defaults where they differ from SigLIP's
VISION_DEFAULTS = dict(hidden_size=1152, num_attention_heads=16, patch_size=32)
DEFAULT_IMAGE_TOKEN_ID = 128257  # Idefics3Config's
_PREFIXES = (("model.text_model.", "model."), ("model.vision_model.", "vision_model."),
             ("model.connector.modality_projection.", "connector."))


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """(side * side, dim) -> (side * side / scale², dim * scale²): each scale x scale block of a tile's
    patches becomes one vector, in transformers' order of views and transposes."""
    seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.reshape(side, side // scale, dim * scale)
    x = x.permute(1, 0, 2).reshape(side // scale, side // scale, dim * scale * scale)
    return x.permute(1, 0, 2).reshape(seq // (scale * scale), dim * scale * scale)


class Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.proj = Linear(vision_hidden * scale_factor ** 2, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One tile: (patches, vision hidden) -> (patches / scale², text hidden)."""
        # rows in memory order: a matmul over a strided view may sum in another order
        return self.proj(pixel_shuffle(x, self.scale_factor).contiguous())


class Model(llama.Model):
    """llama.Model's contract, plus `encode_images` and forward's `embeds`. For the engine:
    image_token_id is config.json's image_token_id (the placeholder the processor repeats), and
    image_seq_len (tokens per tile) is (image_size / patch_size)² / scale_factor², as transformers
    computes it from vision_config and scale_factor."""

    images_attend_bidirectionally = False  # an image's tokens attend causally, like text

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        outer = config.multimodal
        if "vision_config" not in outer:
            raise ModelLoadError(f"a {config.model_type} config needs a vision_config")
        vision = VisionConfig.from_hf(outer["vision_config"], **VISION_DEFAULTS)
        scale = int(outer.get("scale_factor", 2))
        if vision.patches_per_side % scale:
            raise ModelLoadError(f"scale_factor {scale} does not divide the tower's {vision.patches_per_side} "
                                 "patches per side")
        self.vision_model = VisionTransformer(vision)
        self.connector = Connector(vision.hidden_size, config.hidden_size, scale)
        self.image_token_id = int(outer.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))
        self.image_seq_len = vision.patches_per_side ** 2 // scale ** 2

    def encode_images(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """One image's tiles as the image processor gives them: pixel_values (tiles, 3, H, W) and
        pixel_attention_mask (tiles, H, W), nonzero on real pixels (None: all of them) ->
        (tiles * image_seq_len, hidden), tile after tile: the embeddings of the image's placeholders
        in prompt order."""
        return drain(self.encode_image_steps(pixel_values, pixel_attention_mask))

    def encode_image_steps(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None
                           ) -> Steps:
        """`encode_images` a piece at a time (models.siglip: the engine spreads it over steps)."""
        p = self.vision_model.config.patch_size
        tiles, _, height, width = pixel_values.shape
        rows, cols = height // p, width // p
        if pixel_attention_mask is None:
            patch_mask = torch.ones(tiles, rows, cols, dtype=torch.bool, device=pixel_values.device)
        else:  # a patch is real where any of its pixels is
            patch_mask = pixel_attention_mask[:, :rows * p, :cols * p].reshape(tiles, rows, p, cols, p).sum((2, 4)) > 0
        positions = navit_position_ids(patch_mask, self.vision_model.config.patches_per_side)
        keys = patch_mask.reshape(tiles, -1)
        outputs = []
        for i in range(tiles):  # a tile per call (models.siglip)
            hidden = yield from self.vision_model.steps(pixel_values[i], positions[i], keys[i])
            outputs.append(self.connector(hidden))
        return torch.cat(outputs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """As llama.Model's; embeds: (rows (R,), values (R, hidden)) replace the token embeddings of
        those rows of the flattened batch, e.g. a slice of encode_images' output."""
        return self.model(input_ids, positions, attn, embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The names of transformers' Idefics3ForConditionalGeneration and SmolVLMForConditionalGeneration."""
        skip = llama.HARMLESS + (("lm_head.weight",) if self.config.tie_word_embeddings else ())
        load_checkpoint(self, patch_weights(rename_prefixes(weights, _PREFIXES)), llama.FUSED, skip)
