"""Model sources: the default model, Hugging Face folders and GGUF files, each turned into one shape:
a Hugging Face style config dict, a tokenizer, generation defaults and an iterator of float weights
under Hugging Face checkpoint names (a ModelSource)."""

from __future__ import annotations

import pathlib

from ember.errors import ModelLoadError
from ember.loaders.default_model import default_model_path
from ember.loaders.gguf_cache import load_or_convert
from ember.loaders.gguf_file import is_gguf_file
from ember.loaders.hf_folder import load_hf_folder
from ember.loaders.source import ModelSource, check_architecture, supported_architectures

DEFAULT_CACHE_DIR = pathlib.Path("~/.cache/ember")


def load_model_source(model: str | None = None,
                      cache_dir: pathlib.Path | None = None) -> ModelSource:
    """Open a model: None (the default model), a Hugging Face folder, or a .gguf file.

    GGUF files are dequantized once and cached under cache_dir (default ~/.cache/ember).
    Raises ModelLoadError with a one-line reason for anything that cannot be loaded.
    """
    path = default_model_path() if model is None else pathlib.Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(model)!r} does not exist (ember loads a local Hugging Face folder "
            f"or .gguf file; it never downloads)", param="model", code="model_not_found")
    cache_dir = pathlib.Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    if path.is_dir():
        return load_hf_folder(path)
    if path.suffix.lower() == ".gguf" or is_gguf_file(path):
        return load_or_convert(path.resolve(), cache_dir)
    raise ModelLoadError(f"{path} is neither a Hugging Face model folder nor a .gguf file",
                         param="model", code="invalid_model")


__all__ = ["DEFAULT_CACHE_DIR", "ModelSource", "check_architecture", "load_model_source", "supported_architectures"]
