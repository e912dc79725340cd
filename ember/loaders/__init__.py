"""Model sources: the default model, Hugging Face folders and GGUF files, each turned into one shape:
a Hugging Face style config dict, a tokenizer, generation defaults and an iterator of float weights
under Hugging Face checkpoint names."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from ember.models.weights import QuantBlocks

    from ember.tokenization.tokenizer import Tokenizer

DEFAULT_CACHE_DIR = pathlib.Path("~/.cache/ember")

# Used only until ember.models exports SUPPORTED_ARCHITECTURES (HF model_type names).
_FALLBACK_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelSource:
    """Everything the engine needs to build a model, whatever the file format."""

    name: str  # public model name: the folder name, or the GGUF file name without quant suffix
    path: str  # what was loaded: the folder or the .gguf file
    hf_config: dict[str, Any]  # config.json shaped
    tokenizer: "Tokenizer"
    generation_config: dict[str, Any]  # eos_token_id (list) and any default sampling values
    # read_weights(skip): the float tensors, those named in skip left unread
    read_weights: Callable[[frozenset[str]], Iterator[tuple[str, "torch.Tensor"]]] = field(repr=False)
    format: str = "hf"  # "hf" or "gguf"
    cache_path: str | None = None  # a GGUF's converted cache entry, when there is one
    from_cache: bool = False  # True when a GGUF was served from its cache (no parse, no dequantize)
    read_blocks: Callable[[], Iterator[tuple[str, "QuantBlocks"]]] | None = field(default=None, repr=False)

    def weights(self, blocks: bool = False) -> Iterator[tuple[str, "torch.Tensor | QuantBlocks"]]:
        """(HF checkpoint name, tensor) pairs, read lazily: HF folders yield the stored dtype, GGUF
        files float32. With `blocks`, a GGUF's quantized weights come as QuantBlocks instead
        (models.weights), read from the file without a float round trip where the formats map."""
        if not blocks or self.read_blocks is None:
            yield from self.read_weights(frozenset())
            return
        quantized = dict(self.read_blocks())
        yield from self.read_weights(frozenset(quantized))
        yield from quantized.items()

    @property
    def model_type(self) -> str:
        return self.hf_config["model_type"]


def supported_architectures() -> tuple[str, ...]:
    """The HF model_type names ember can run."""
    try:
        from ember import models
        names = set(models.SUPPORTED_ARCHITECTURES) | set(getattr(models, "ALIASES", {}))
    except (ImportError, AttributeError):
        return _FALLBACK_ARCHITECTURES
    return tuple(sorted(names))


def check_architecture(model_type: Any, where: str) -> str:
    supported = supported_architectures()
    if model_type not in supported:
        raise ModelLoadError(
            f"{where}: architecture {model_type!r} is not supported by ember "
            f"(supported: {', '.join(supported)})", param="model", code="unsupported_architecture")
    return model_type


def load_model_source(model: str | None = None,
                      cache_dir: pathlib.Path | None = None) -> ModelSource:
    """Open a model: None (the default model), a Hugging Face folder, or a .gguf file.

    GGUF files are dequantized once and cached under cache_dir (default ~/.cache/ember).
    Raises ModelLoadError with a one-line reason for anything that cannot be loaded.
    """
    from ember.loaders.default_model import default_model_path
    from ember.loaders.gguf_file import is_gguf_file, load_gguf
    from ember.loaders.hf_folder import load_hf_folder

    path = default_model_path() if model is None else pathlib.Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(model)!r} does not exist (ember loads a local Hugging Face folder "
            f"or .gguf file; it never downloads)", param="model", code="model_not_found")
    cache_dir = pathlib.Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    if path.is_dir():
        return load_hf_folder(path)
    if path.suffix.lower() == ".gguf" or is_gguf_file(path):
        return load_gguf(path, cache_dir)
    raise ModelLoadError(f"{path} is neither a Hugging Face model folder nor a .gguf file",
                         param="model", code="invalid_model")


__all__ = ["DEFAULT_CACHE_DIR", "ModelSource", "load_model_source", "supported_architectures"]
