"""Test helpers: tiny random Hugging Face models, and the default model's GGUF parsed once per run."""

from __future__ import annotations

import functools
from typing import Any

import torch

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny random model of the given HF model_type, every parameter random (norms included)."""
    import transformers
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}
    config_class, model_class = classes[model_type]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY, **overrides}))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)
    return model.eval()


def state_dict_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint as save_pretrained writes it (no lm_head when it is tied)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@functools.lru_cache(maxsize=1)
def default_gguf_model() -> Any:
    """The default model's GGUF, parsed (not dequantized) once for the whole test run."""
    from ember.loaders.default_model import default_model_path
    from ember.loaders.gguf_file import GGUFModel
    return GGUFModel(default_model_path())
