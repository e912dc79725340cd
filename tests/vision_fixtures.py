"""Tiny vision model folders for the tests: transformers' own config and image processor config,
and the default model's tokenizer with the architecture's image tokens and a chat template that
writes its image marker for an image part.

SmolVLM (write_smolvlm_folder), without weights: add them (a random transformers
SmolVLMForConditionalGeneration of `folder_config(folder)`, add_random_weights) where a test runs the
model. A 64-pixel tile of 16-pixel patches, merged 2x2 (scale_factor 2), is 4 image tokens; an
image is cut into tiles of 64 pixels after its longest side is brought to at most `longest_edge`
(128: up to 2x2 tiles), plus the whole image as one more tile.

Gemma 3 (write_gemma3_folder), with random weights: an image is resized to one 32-pixel view of
4-pixel patches, average-pooled 2x2 into 16 image tokens; the decoder's local layers have a window
of 12, shorter than an image's run of tokens.
"""

from __future__ import annotations

import base64
import io
import json
import pathlib
from typing import Any

from unit.gguf_models import default_gguf_model

FAKE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
TILE_TOKENS = tuple(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))
# SmolVLM's vocabulary adds them in this order after the text model's own tokens
VISION_TOKENS = (GLOBAL_IMAGE_TOKEN, *TILE_TOKENS, FAKE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE)

TINY_TEXT_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5)
TINY_VISION_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def smolvlm_tokenizer():
    """The default model's tokenizer with SmolVLM's image tokens and chat template."""
    from tokenizers import AddedToken
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    from ember.tokenization.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(default_gguf_model().metadata)
    tokenizer.hf.add_tokens([AddedToken(token, special=True, normalized=False) for token in VISION_TOKENS],
                            special_tokens=True)
    tokenizer.hf.chat_template = tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def write_smolvlm_folder(folder: pathlib.Path, *, image_size: int = 64, patch_size: int = 16, scale_factor: int = 2,
                         longest_edge: int = 128, text_config: dict[str, Any] | None = None,
                         vision_config: dict[str, Any] | None = None) -> pathlib.Path:
    """Write the folder (created if need be) and return it: config.json (model_type smolvlm),
    preprocessor_config.json (SmolVLMImageProcessorPil), processor_config.json (image_seq_len),
    generation_config.json (<end_of_utterance> ends a reply) and the tokenizer's files."""
    from transformers import SmolVLMConfig
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = smolvlm_tokenizer()
    tokenizer.save(folder)
    token_id = tokenizer.hf.convert_tokens_to_ids
    config = SmolVLMConfig(
        text_config={"model_type": "llama", **TINY_TEXT_CONFIG, "vocab_size": tokenizer.vocab_size,
                     **(text_config or {})},
        vision_config={**TINY_VISION_CONFIG, "image_size": image_size, "patch_size": patch_size,
                       **(vision_config or {})},
        scale_factor=scale_factor, image_token_id=token_id(IMAGE_TOKEN))
    config.save_pretrained(folder)
    SmolVLMImageProcessorPil(size={"longest_edge": longest_edge},
                             max_image_size={"longest_edge": image_size}).save_pretrained(folder)
    image_seq_len = (image_size // patch_size) ** 2 // scale_factor ** 2
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_len": image_seq_len}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": token_id(END_OF_UTTERANCE)}))
    return folder


GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")  # boi, image, eoi
GEMMA3_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
# Gemma 3's own template, in short: a system text opens the first user turn; an image part is <start_of_image>
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' ~ role ~ '\n' }}"
    "{%- if loop.first and system is not none -%}{{ system ~ '\n\n' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA3_TOKENS_PER_IMAGE = 16


def write_gemma3_folder(folder: pathlib.Path, *, sliding_window: int = 12, seed: int = 0,
                        text_config: dict[str, Any] | None = None) -> pathlib.Path:
    """Write the folder (created if need be) and return it: a random transformers
    Gemma3ForConditionalGeneration (float32) saved with save_pretrained, preprocessor_config.json
    (Gemma3ImageProcessorPil, no pan and scan), and the tokenizer's files; its tokenizer_config.json
    names the image tokens (boi_token, image_token, eoi_token) as Gemma 3's does, so that
    transformers' Gemma3Processor can be built on it. `text_config`: fields that replace the tiny
    decoder's."""
    import torch
    import transformers
    from tokenizers import AddedToken
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from ember.tokenization.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_gguf_metadata(default_gguf_model().metadata)
    tokenizer.hf.add_tokens([AddedToken(token, special=True, normalized=False)
                             for token in GEMMA3_IMAGE_TOKENS + GEMMA3_TURN_TOKENS], special_tokens=True)
    tokenizer.hf.chat_template = tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save(folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.update(zip(("boi_token", "image_token", "eoi_token"), GEMMA3_IMAGE_TOKENS))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    boi, image, eoi = tokenizer.hf.convert_tokens_to_ids(list(GEMMA3_IMAGE_TOKENS))
    config = transformers.Gemma3Config(
        text_config={**TINY_TEXT_CONFIG, "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 16,
                     "vocab_size": tokenizer.vocab_size, "sliding_window": sliding_window,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], **(text_config or {})},
        vision_config={**TINY_VISION_CONFIG, "image_size": 32, "patch_size": 4, "vision_use_head": False},
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE, image_token_index=image, boi_token_index=boi,
        eoi_token_index=eoi)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # activations near unit scale, so that greedy tokens are not ties
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, parameter[0].numel() ** -0.5)
    model.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=False).save_pretrained(folder)
    return folder


def folder_config(folder: pathlib.Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def load_vision(folder: pathlib.Path):
    """(the folder's Tokenizer, its ImageProcessing), as the server loads them."""
    from ember.media.processing import load_image_processing
    from ember.tokenization.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained_folder(folder)
    config = folder_config(folder)
    return tokenizer, load_image_processing(config["model_type"], folder, config, tokenizer.hf.convert_tokens_to_ids)


def image_bytes(width: int, height: int, color: tuple[int, int, int] = (200, 40, 40), fmt: str = "PNG") -> bytes:
    """A one-color image file."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format=fmt)
    return out.getvalue()


def picture(width: int, height: int, seed: int) -> bytes:
    """A noisy image file (PNG), so that tiles differ."""
    import torch
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def conversation(*images: bytes, text: str = "What is in this picture?") -> list[dict]:
    """One user turn: the images, then the text."""
    return [{"role": "user", "content": [*({"type": "image", "image": image} for image in images),
                                         {"type": "text", "text": text}]}]


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def add_random_weights(folder: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Save a random transformers SmolVLMForConditionalGeneration of the folder's config into it
    (float32; activations kept near unit scale so that greedy tokens are not ties)."""
    import torch
    import transformers

    config = transformers.SmolVLMConfig.from_pretrained(folder)
    torch.manual_seed(seed)
    model = transformers.SmolVLMForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, parameter.shape[-1] ** -0.5)
    model.save_pretrained(folder)
    return folder
