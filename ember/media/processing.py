"""Each vision architecture's image preparation, through transformers' own image processors and
the model folder's processor config (or the same settings from a GGUF model's mmproj metadata,
loaders.mmproj), so that the pixels ember encodes are transformers' pixels.

Two halves of one object, so the layout the prompt gets and the pixels the tower gets agree:
- `layout(image)` (the front end): the text that stands for an image in the prompt (its image
  tokens, with the architecture's tile and row markers) from the image's size alone;
- `prepare(data)` (the engine worker): the pixel arrays the tower takes, split along their first
  dimension into units the tower encodes independently (Idefics3's tiles; Gemma 3's one view).
The chat template writes `marker` where an image goes; the front end replaces each marker with its
image's layout text.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ember.errors import ModelLoadError

VISION_ARCHITECTURES = ("gemma3", "idefics3", "smolvlm")


@dataclass(frozen=True, slots=True)
class ImageLayout:
    text: str  # what replaces the image's marker in the rendered prompt
    num_image_tokens: int  # the image-token ids in it, each taking one row of the image's embeddings
    num_units: int  # the pixel arrays' first dimension (tiles, views)


class ImageProcessing:
    """An architecture's image preparation (see the module's docstring)."""

    marker: str  # what the chat template writes for an image part
    image_token: str  # the token whose positions take the image's embeddings
    image_token_id: int

    def layout(self, width: int, height: int) -> ImageLayout:
        raise NotImplementedError

    def prepare(self, data: bytes) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _pixels(self, data: bytes, **kwargs: Any) -> dict[str, Any]:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return self.processor(images=[[image.convert("RGB")]], return_tensors="np", **kwargs)


class Idefics3Processing(ImageProcessing):
    """Idefics3 and SmolVLM: the image cut into tiles of max_image_size (rows x cols, each with a
    <row_r_col_c> marker) plus the whole image resized to one tile, image_seq_len tokens each."""

    marker = "<image>"
    image_token = "<image>"

    def __init__(self, model_type: str, folder: Path, hf_config: dict[str, Any], token_id,
                 settings: dict[str, Any] | None = None) -> None:
        # Idefics3's processor writes the same layout as SmolVLM's get_image_prompt_string, inline
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        if model_type == "smolvlm":
            from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as cls
        else:
            from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as cls
        self.processor = _image_processor(cls, folder, settings)
        self._prompt_string = get_image_prompt_string
        processor_config = _read_json(folder / "processor_config.json") if settings is None else {}
        vision = hf_config.get("vision_config") or {}
        self.image_seq_len = int(processor_config.get("image_seq_len") or
                                 (vision["image_size"] // vision["patch_size"]) ** 2 // hf_config["scale_factor"] ** 2)
        self.image_token_id = hf_config.get("image_token_id") or token_id(self.image_token)

    def layout(self, width: int, height: int) -> ImageLayout:
        _, rows, cols = self.processor.get_number_of_image_patches(height, width, {})
        text = self._prompt_string(rows, cols, self.image_seq_len, fake_token_around_image="<fake_token_around_image>",
                                   image_token=self.image_token, global_image_token="<global-img>")
        units = rows * cols + 1
        return ImageLayout(text, self.image_seq_len * units, units)

    def prepare(self, data: bytes) -> dict[str, np.ndarray]:
        out = self._pixels(data, return_row_col_info=True)
        return {"pixel_values": np.ascontiguousarray(out["pixel_values"][0]),
                "pixel_attention_mask": np.ascontiguousarray(out["pixel_attention_mask"][0])}


class Gemma3Processing(ImageProcessing):
    """Gemma 3: the image resized to one square view, mm_tokens_per_image tokens between
    <start_of_image> and <end_of_image> (pan and scan's extra crops are not taken)."""

    marker = "<start_of_image>"
    image_token = "<image_soft_token>"

    def __init__(self, folder: Path, hf_config: dict[str, Any], token_id,
                 settings: dict[str, Any] | None = None) -> None:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        self.processor = _image_processor(Gemma3ImageProcessorPil, folder, settings)
        if getattr(self.processor, "do_pan_and_scan", False):
            raise ModelLoadError("this model's image processor asks for pan and scan, which ember does not take; "
                                 "set do_pan_and_scan to false in its preprocessor_config.json",
                                 param="preprocessor_config.json")
        self.num_tokens = int(hf_config.get("mm_tokens_per_image", 256))
        self.image_token_id = hf_config.get("image_token_index") or token_id(self.image_token)
        self._text = f"\n\n{self.marker}{self.image_token * self.num_tokens}<end_of_image>\n\n"

    def layout(self, width: int, height: int) -> ImageLayout:
        return ImageLayout(self._text, self.num_tokens, 1)

    def prepare(self, data: bytes) -> dict[str, np.ndarray]:
        return {"pixel_values": np.ascontiguousarray(self._pixels(data)["pixel_values"])}


def reads_images(hf_config: dict[str, Any], vision: bool) -> bool:
    """Whether a model of this config reads images, `vision` (--no-vision turns it off) allowing."""
    model_type = hf_config.get("model_type")
    return vision and model_type in VISION_ARCHITECTURES and "vision_config" in hf_config


def source_image_processing(source, vision: bool) -> ImageProcessing | None:
    """The image preparation of a loaders.ModelSource; None when it reads no images (a text model, or
    `vision` off)."""
    if not reads_images(source.hf_config, vision):
        return None
    return load_image_processing(source.hf_config["model_type"], source.path, source.hf_config,
                                 source.tokenizer.hf.convert_tokens_to_ids, source.preprocessor_config)


def load_image_processing(model_type: str, folder: str | Path, hf_config: dict[str, Any],
                          token_id, preprocessor_config: dict[str, Any] | None = None) -> ImageProcessing:
    """The image preparation of a vision model's folder; `token_id(text)`: a token's id in its
    tokenizer; `preprocessor_config`: the image processor's settings where they do not come from the
    folder's preprocessor_config.json (an mmproj's). ModelLoadError when the folder lacks what it needs."""
    folder = Path(folder)
    if preprocessor_config is None and not (folder / "preprocessor_config.json").is_file():
        raise ModelLoadError(f"{folder} has no preprocessor_config.json: ember cannot prepare this model's images",
                             param="model")
    if model_type in ("idefics3", "smolvlm"):
        return Idefics3Processing(model_type, folder, hf_config, token_id, preprocessor_config)
    if model_type == "gemma3":
        return Gemma3Processing(folder, hf_config, token_id, preprocessor_config)
    raise ModelLoadError(f"ember does not read images for model type {model_type!r} (it does for "
                         f"{', '.join(VISION_ARCHITECTURES)})", param="model")


def _image_processor(cls, folder: Path, settings: dict[str, Any] | None):
    """transformers' image processor of class `cls`: from `settings` (preprocessor_config.json's fields)
    when given, else from the folder's files."""
    return cls.from_dict(settings) if settings is not None else cls.from_pretrained(str(folder))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
