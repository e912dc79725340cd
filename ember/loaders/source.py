"""What every model source becomes (ModelSource), and the architectures ember can run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from ember.models.sharding import Cut
    from ember.models.weights import QuantBlocks
    from ember.tokenization.tokenizer import Tokenizer


@dataclass
class ModelSource:
    """Everything the engine needs to build a model, whatever the file format."""

    name: str  # public model name: the folder name, or the GGUF file name without quant suffix
    path: str  # what was loaded: the folder or the .gguf file
    hf_config: dict[str, Any]  # config.json shaped
    tokenizer: "Tokenizer"
    generation_config: dict[str, Any]  # eos_token_id (list) and any default sampling values
    # read_weights(skip, cut): the float tensors, those named in skip left unread, each cut to
    # cut(name) when `cut` is given (models.sharding: a tensor-parallel rank's slice)
    read_weights: Callable[..., Iterator[tuple[str, "torch.Tensor"]]] = field(repr=False)
    format: str = "hf"  # "hf" or "gguf"
    cache_path: str | None = None  # a GGUF's converted cache entry, when there is one
    from_cache: bool = False  # True when a GGUF was served from its cache (no parse, no dequantize)
    read_blocks: Callable[[], Iterator[tuple[str, "QuantBlocks"]]] | None = field(default=None, repr=False)
    mmproj_path: str | None = None  # a GGUF's vision part (loaders.mmproj), when it has one
    # the image processor's settings (preprocessor_config.json's fields) where the model's files
    # hold them elsewhere than a folder's preprocessor_config.json: an mmproj's metadata
    preprocessor_config: dict[str, Any] | None = None

    def weights(self, blocks: bool = False, cut: Callable[[str], "Cut | None"] | None = None
                ) -> Iterator[tuple[str, "torch.Tensor | QuantBlocks"]]:
        """(HF checkpoint name, tensor) pairs, read lazily: HF folders yield the stored dtype, GGUF
        files float32. With `blocks`, a GGUF's quantized weights come as QuantBlocks instead
        (models.weights), read from the file without a float round trip where the formats map.
        With `cut`, each tensor is only its slice cut(name): safetensors files read just that
        slice, GGUF tensors are cut once read."""
        if not blocks or self.read_blocks is None:
            yield from self.read_weights(frozenset(), cut)
            return
        quantized = dict(cut_each(self.read_blocks(), cut))
        yield from self.read_weights(frozenset(quantized), cut)
        yield from quantized.items()

    @property
    def model_type(self) -> str:
        return self.hf_config["model_type"]


def cut_each(pairs: Iterator[tuple[str, Any]], cut: Callable[[str], "Cut | None"] | None) -> Iterator[tuple[str, Any]]:
    """The pairs, each tensor cut to cut(name) once read (None: as they are)."""
    if cut is None:
        yield from pairs
        return
    from ember.models.sharding import cut_tensor

    for name, tensor in pairs:
        yield name, cut_tensor(name, tensor, cut(name))


def supported_architectures() -> tuple[str, ...]:
    """The HF model_type names ember can run."""
    from ember.models import ALIASES, SUPPORTED_ARCHITECTURES  # ember.models imports torch: only when asked
    return tuple(sorted(set(SUPPORTED_ARCHITECTURES) | set(ALIASES)))


def check_architecture(model_type: Any, where: str) -> str:
    supported = supported_architectures()
    if model_type not in supported:
        raise ModelLoadError(
            f"{where}: architecture {model_type!r} is not supported by ember "
            f"(supported: {', '.join(supported)})", param="model", code="unsupported_architecture")
    return model_type
