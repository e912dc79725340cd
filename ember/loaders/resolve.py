"""A model argument turned into what is on disk: the default model, a path, a Hugging Face repo id
(through the hub cache, downloading what is missing) or an `ollama:` name (its GGUF blob)."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from ember.loaders.default_model import default_model_path
from ember.loaders.hub import resolve_hub_model
from ember.loaders.model_names import ModelName, parse_model_name
from ember.loaders.ollama import resolve_ollama_model


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: pathlib.Path  # a Hugging Face folder or a GGUF file (which may not exist, for a bad path)
    name: ModelName


def resolve_model(model: str | None, *, revision: str | None = None, ollama_models: pathlib.Path | None = None,
                  hub_cache: pathlib.Path | None = None, offline: bool | None = None,
                  refresh: bool = False) -> ResolvedModel:
    """Where the model is. hub_cache and offline default to huggingface_hub's own settings;
    ollama_models to ~/.ollama/models. Raises ModelLoadError naming what was searched."""
    name = parse_model_name(model, revision)
    if name.kind == "default":
        return ResolvedModel(default_model_path(), name)
    if name.kind == "hub":
        return ResolvedModel(resolve_hub_model(name, cache_dir=hub_cache, offline=offline, refresh=refresh), name)
    if name.kind == "ollama":
        return ResolvedModel(resolve_ollama_model(name, ollama_models), name)
    return ResolvedModel(pathlib.Path(name.text).expanduser(), name)
