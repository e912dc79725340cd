"""Gemma 3 with its vision tower (model_type "gemma3"): SigLIP (models.siglip), a pooling projector
and the Gemma 3 decoder (models.gemma3_text).

What differs from the text model:
- an image is one tower input at the tower's image_size (the processor's pan-and-scan crops are
  images of their own); its patches' last hidden states are average-pooled to mm_tokens_per_image,
  normalised by Gemma's RMSNorm (1 + weight) and projected to the text width;
- those embeddings replace the prompt's image-token embeddings after the sqrt(hidden_size) scaling
  (forward's `embeds`), as transformers scatters them into the scaled embeddings;
- in prefill one image's tokens attend to each other in both directions (transformers' token_type_ids):
  the attention object applies it (images_attend_bidirectionally tells the engine to); the layers
  are the text model's;
- checkpoint names: the original release's (language_model.model.*, vision_tower.vision_model.*,
  multi_modal_projector.*) or transformers' own (model.language_model.*, model.vision_tower.* with or
  without vision_model., model.multi_modal_projector.*, lm_head.*); the projection is stored
  (vision, text) and transposed on load; a SigLIP pooling head, if present, is unused and skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.config import ModelConfig
from ember.errors import ModelLoadError
from ember.models import gemma3_text
from ember.models.gemma3_text import GemmaRMSNorm
from ember.models.layers import Linear, load_checkpoint, rename_prefixes
from ember.models.siglip import Steps, VisionConfig, VisionTransformer, drain, grid_position_ids, patch_weights

DEFAULT_IMAGE_TOKEN_ID = 262144  # Gemma3Config's image_token_index
DEFAULT_TOKENS_PER_IMAGE = 256
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", "vision_tower."),
             ("vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector."))
_PROJECTION = "multi_modal_projector.mm_input_projection_weight"
_UNUSED = ("vision_tower.head.",)  # SigLIP's attention-pooling head (vision_use_head)


class Projector(nn.Module):
    def __init__(self, vision: VisionConfig, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        self.tokens_per_side = int(tokens_per_image ** 0.5)
        if self.tokens_per_side ** 2 != tokens_per_image or vision.patches_per_side % self.tokens_per_side:
            raise ModelLoadError(f"mm_tokens_per_image {tokens_per_image} does not pool the tower's "
                                 f"{vision.patches_per_side} x {vision.patches_per_side} patches into a square")
        self.kernel = vision.patches_per_side // self.tokens_per_side
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.mm_input_projection = Linear(vision.hidden_size, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One image: (patches, vision hidden) -> (tokens_per_image, text hidden)."""
        patches, dim = x.shape
        side = int(patches ** 0.5)
        grid = x.t().reshape(1, dim, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).reshape(dim, -1).t()  # (tokens, dim)
        # contiguous rows for the norm: its mean over a transposed view sums in another order
        return self.mm_input_projection(self.mm_soft_emb_norm(pooled.contiguous()))


def projection_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The projector's (vision, text) matrix as its linear layer's (text, vision) weight."""
    for name, tensor in weights:
        if name == _PROJECTION:
            name, tensor = "multi_modal_projector.mm_input_projection.weight", tensor.t()
        yield name, tensor


class Model(gemma3_text.Model):
    """gemma3_text.Model's contract, plus `encode_images` and forward's `embeds`. For the engine:
    image_token_id is config.json's image_token_index (the placeholder the processor repeats), and
    image_seq_len is mm_tokens_per_image (the tokens of one image or crop)."""

    images_attend_bidirectionally = True  # in prefill, among one image's tokens

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        outer = config.multimodal
        if "vision_config" not in outer:
            raise ModelLoadError("a gemma3 config needs a vision_config (text-only Gemma 3 is gemma3_text)")
        vision = VisionConfig.from_hf(outer["vision_config"])
        self.image_seq_len = int(outer.get("mm_tokens_per_image") or DEFAULT_TOKENS_PER_IMAGE)
        self.image_token_id = int(outer.get("image_token_index", outer.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID)))
        self.vision_tower = VisionTransformer(vision)
        self.multi_modal_projector = Projector(vision, config.hidden_size, self.image_seq_len)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values (images, 3, image_size, image_size) as the image processor gives them (an image
        and its pan-and-scan crops, in prompt order) -> (images * image_seq_len, hidden)."""
        return drain(self.encode_image_steps(pixel_values))

    def encode_image_steps(self, pixel_values: torch.Tensor) -> Steps:
        """`encode_images` a piece at a time (models.siglip: the engine spreads it over steps)."""
        positions = grid_position_ids(self.vision_tower.config.patches_per_side ** 2, pixel_values.device)
        outputs = []
        for pixels in pixel_values:  # an image per call (models.siglip)
            hidden = yield from self.vision_tower.steps(pixels, positions)
            outputs.append(self.multi_modal_projector(hidden))
        return torch.cat(outputs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """As gemma3_text.Model's; embeds: (rows (R,), values (R, hidden)) replace the scaled token
        embeddings of those rows of the flattened batch, e.g. a slice of encode_images' output."""
        return self.model(input_ids, positions, attn, embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = _UNUSED + (("lm_head.weight",) if self.lm_head is self.model.embed_tokens else ())
        renamed = projection_weights(rename_prefixes(weights, _PREFIXES))
        load_checkpoint(self, patch_weights(renamed), gemma3_text.FUSED, skip)
