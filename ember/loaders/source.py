"""What every model source becomes (ModelSource), and the architectures ember can run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

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
    from ember.models import ALIASES, SUPPORTED_ARCHITECTURES  # ember.models imports torch: only when asked
    return tuple(sorted(set(SUPPORTED_ARCHITECTURES) | set(ALIASES)))


def check_architecture(model_type: Any, where: str) -> str:
    supported = supported_architectures()
    if model_type not in supported:
        raise ModelLoadError(
            f"{where}: architecture {model_type!r} is not supported by ember "
            f"(supported: {', '.join(supported)})", param="model", code="unsupported_architecture")
    return model_type
