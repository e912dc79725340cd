"""Tiny random vision-language models: transformers' model, the Hugging Face folder it saves (with a
tokenizer), ember's twin loaded from that folder by the engine's loader, and prompts whose images
are expanded into placeholder tokens as transformers' processors expand them."""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import transformers
from model_builders import randomize_
from model_stores import tiny_tokenizer
from PIL import Image
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from ember.config import EngineConfig, ModelConfig
from ember.engine.loading import load_model
from ember.loaders.hf_folder import load_hf_folder

VOCAB = 300  # past the test tokenizer's specials and 256 byte tokens
IMAGE_TOKEN = 299
BOI_TOKEN, EOI_TOKEN = 297, 298  # Gemma 3's image brackets
TEXT_IDS = (3, 250)  # the range random text tokens come from
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
# (width, height): square, landscape, portrait, small, wide: tiles (or crops) from 1 to 10
IMAGE_SIZES = ((40, 40), (100, 60), (50, 90), (20, 12), (128, 30))


@dataclass(frozen=True)
class Case:
    config_class: str
    model_class: str
    processor_class: str
    config: dict[str, Any]
    processor: dict[str, Any] = field(default_factory=dict)


CASES = {
    # 8 x 8 patches per tile, 2 x 2 of them shuffled into a token: 16 tokens per tile
    "smolvlm": Case("SmolVLMConfig", "SmolVLMForConditionalGeneration", "SmolVLMImageProcessorPil", dict(
        text_config=TEXT, vision_config={**VISION, "image_size": 32, "patch_size": 4}, scale_factor=2,
        image_token_id=IMAGE_TOKEN), dict(max_image_size={"longest_edge": 32}, size={"longest_edge": 96})),
    # 9 x 9 patches (positions bucketed by float steps that are not exact), 3 x 3 shuffled: 9 tokens
    # per tile; the LM head tied to the embeddings
    "idefics3": Case("Idefics3Config", "Idefics3ForConditionalGeneration", "Idefics3ImageProcessorPil", dict(
        text_config=TEXT, vision_config={**VISION, "image_size": 36, "patch_size": 4}, scale_factor=3,
        image_token_id=IMAGE_TOKEN, tie_word_embeddings=True),
        dict(max_image_size={"longest_edge": 36}, size={"longest_edge": 108})),
    # 8 x 8 patches pooled to 4 x 4 tokens; local layers (window 12, shorter than an image's 16 tokens)
    # around a global one, scaled queries; pan-and-scan crops. No final_logit_softcapping: Gemma 3
    # leaves it off, and transformers' Gemma3ForConditionalGeneration would not apply it
    "gemma3": Case("Gemma3Config", "Gemma3ForConditionalGeneration", "Gemma3ImageProcessorPil", dict(
        text_config={**TEXT, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 12,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                     "query_pre_attn_scalar": 24},
        vision_config={**VISION, "image_size": 32, "patch_size": 4, "vision_use_head": False},
        mm_tokens_per_image=16, image_token_index=IMAGE_TOKEN, boi_token_index=BOI_TOKEN,
        eoi_token_index=EOI_TOKEN), dict(
        size={"height": 32, "width": 32}, do_pan_and_scan=True, pan_and_scan_min_crop_size=8,
        pan_and_scan_max_num_crops=3, pan_and_scan_min_ratio_to_activate=1.2)),
}


def reference_model(case: str) -> torch.nn.Module:
    """transformers' model in float32 with random weights (O(1) activations)."""
    spec = CASES[case]
    config = getattr(transformers, spec.config_class)(**spec.config)
    config._attn_implementation = "eager"
    for sub in (config.text_config, config.vision_config):
        sub._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, spec.model_class)(config).float().eval()
    randomize_(model)
    return model


def save_folder(model: torch.nn.Module, parent: pathlib.Path) -> pathlib.Path:
    """A Hugging Face folder as save_pretrained writes it, with a tokenizer ember can read."""
    folder = parent / model.config.model_type
    model.save_pretrained(folder)
    tiny_tokenizer(VOCAB).save(folder)
    return folder


def load_ember(folder: pathlib.Path, dtype: str = "float32", fused: bool = False
               ) -> tuple[torch.nn.Module, ModelConfig]:
    """ember's model from the folder, through the engine's loader (torch paths or ember's CPU kernels)."""
    built = load_model(load_hf_folder(folder), EngineConfig(dtype=dtype, quantization="none", cpu_kernels=fused))
    return built.model, built.model_config


def random_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def processor(case: str):
    spec = CASES[case]
    return getattr(transformers, spec.processor_class)(**spec.processor)


@dataclass
class ProcessedImage:
    inputs: dict[str, torch.Tensor]  # what ember's encode_images takes for this one image
    placeholder: list[int]  # the image's span of the prompt, as the processor expands it


def process_image(case: str, image: Image.Image, image_seq_len: int) -> ProcessedImage:
    """One image through transformers' image processor, and its prompt span from the processor's
    own expansion (SmolVLM's get_image_prompt_string; Gemma 3's full image sequence per crop)."""
    if case == "gemma3":
        out = processor(case)(images=[image], return_tensors="pt")
        one = [BOI_TOKEN] + [IMAGE_TOKEN] * image_seq_len + [EOI_TOKEN]
        crops = int(out["num_crops"][0])
        # "Here is the original image <image> and here are some crops to help you see better <crop> <crop>"
        placeholder = one + ([5] + sum(([6] + one for _ in range(crops)), []) if crops else [])
        return ProcessedImage({"pixel_values": out["pixel_values"]}, placeholder)
    out = processor(case)(images=[[image]], return_tensors="pt", return_row_col_info=True)
    text = get_image_prompt_string(out["rows"][0][0], out["cols"][0][0], image_seq_len,
                                   "<fake_token_around_image>", "<image>", "<global-img>")
    return ProcessedImage({"pixel_values": out["pixel_values"][0],
                           "pixel_attention_mask": out["pixel_attention_mask"][0]}, hand_tokenize(text))


_MARKERS: dict[str, int] = {}  # a marker's id, given in order of first use


def hand_tokenize(text: str) -> list[int]:
    """The expanded image prompt as ids: <image> is the image token, every other marker (<row_1_col_2>,
    <global-img>, ...) and character its own id from 250 up."""
    ids = []
    for piece in re.findall(r"<[^<>]+>|.|\n", text):
        if piece == "<image>":
            ids.append(IMAGE_TOKEN)
        else:
            ids.append(_MARKERS.setdefault(piece, 250 + len(_MARKERS)))
            assert ids[-1] < BOI_TOKEN
    return ids


@dataclass
class Prompt:
    ids: torch.Tensor  # (T,)
    images: list[ProcessedImage]
    starts: list[int]  # where each image's span begins in ids

    def reference_inputs(self, case: str) -> dict[str, torch.Tensor]:
        """transformers' forward inputs for this prompt as a batch of one."""
        inputs: dict[str, torch.Tensor] = {"input_ids": self.ids[None]}
        if case == "gemma3":
            inputs["pixel_values"] = torch.cat([im.inputs["pixel_values"] for im in self.images])
            inputs["token_type_ids"] = (self.ids == IMAGE_TOKEN).long()[None]
        else:
            inputs["pixel_values"] = torch.cat([im.inputs["pixel_values"] for im in self.images])[None]
            inputs["pixel_attention_mask"] = torch.cat([im.inputs["pixel_attention_mask"] for im in self.images])[None]
        return inputs

    def image_groups(self) -> torch.Tensor:
        """Per position: the index of the run of image tokens it is in (-1: not an image token), as
        transformers groups token_type_ids for Gemma 3's bidirectional attention."""
        is_image = self.ids == IMAGE_TOKEN
        starts = is_image & ~torch.cat((torch.tensor([False]), is_image[:-1]))
        return torch.where(is_image, torch.cumsum(starts.long(), 0) - 1, -1)


def build_prompt(case: str, images: list[Image.Image], image_seq_len: int, seed: int = 0) -> Prompt:
    """Random text, each image's expanded span, random text between and after."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    processed, starts = [], []
    for image in images:
        ids += torch.randint(*TEXT_IDS, (5,), generator=gen).tolist()
        item = process_image(case, image, image_seq_len)
        starts.append(len(ids))
        ids += item.placeholder
        processed.append(item)
    ids += torch.randint(*TEXT_IDS, (7,), generator=gen).tolist()
    return Prompt(torch.tensor(ids), processed, starts)
