"""Model architectures, one module per Hugging Face model_type, each exporting `Model`."""

from __future__ import annotations

import importlib

from ember.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("gemma3", "gemma3_text", "idefics3", "llama", "mistral", "phi3", "qwen2", "qwen3",
                           "qwen3_moe")
# model_type -> the module that implements it
ALIASES = {"smolvlm": "idefics3"}  # SmolVLM is Idefics3 under another name


def get_model_class(model_type: str) -> type:
    """The `Model` class for a Hugging Face model_type; ModelLoadError if none implements it."""
    name = ALIASES.get(model_type, model_type)
    if name not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES + tuple(ALIASES))
        raise ModelLoadError(f"model type {model_type!r} is not supported (supported: {supported})")
    return importlib.import_module(f"ember.models.{name}").Model
