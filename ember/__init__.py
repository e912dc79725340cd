"""ember: a self-hosted LLM server with its own PyTorch engine."""

from ember.types import CachePin, FinishReason, GenerationOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncEngine", "SamplingParams", "CachePin", "GenerationOutput", "FinishReason"]


def __getattr__(name: str):
    # Heavy imports (torch, transformers) only when the engine is actually wanted.
    if name == "LLM":
        from ember.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from ember.engine.engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
