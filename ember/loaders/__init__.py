"""Model sources: the default model, Hugging Face folders and GGUF files (local, or named by a Hugging Face
repo id or an `ollama:` name, see resolve.py), each turned into one shape:
a Hugging Face style config dict, a tokenizer, generation defaults and an iterator of float weights
under Hugging Face checkpoint names (a ModelSource)."""

from __future__ import annotations

import pathlib

from ember.errors import ModelLoadError
from ember.loaders.gguf_cache import load_or_convert
from ember.loaders.gguf_file import is_gguf_file
from ember.loaders.hf_folder import load_hf_folder
from ember.loaders.mmproj import AUTO, NONE, attach_mmproj
from ember.loaders.resolve import resolve_model
from ember.loaders.source import ModelSource, check_architecture, supported_architectures

DEFAULT_CACHE_DIR = pathlib.Path("~/.cache/ember")


def load_model_source(model: str | None = None, cache_dir: pathlib.Path | None = None, *,
                      revision: str | None = None, ollama_models: pathlib.Path | None = None,
                      mmproj: str = NONE) -> ModelSource:
    """Open a model: None (the default model), a Hugging Face folder, a .gguf file, a Hugging Face repo id
    (`org/name[@revision][:QUANT]`, through the hub cache) or `ollama:NAME[:TAG]` (Ollama's store at
    ollama_models, default ~/.ollama/models). A named model's source carries the name as given.

    A GGUF model's vision part (loaders.mmproj): `mmproj` names its file, or is "auto" (an mmproj file
    beside the GGUF, or the repo's) or "none" (a text model).
    GGUF files are dequantized once and cached under cache_dir (default ~/.cache/ember).
    Raises ModelLoadError with a one-line reason for anything that cannot be loaded.
    """
    resolved = resolve_model(model, revision=revision, ollama_models=ollama_models)
    path = resolved.path
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(model)!r} does not exist (ember loads a Hugging Face folder, a .gguf file, a "
            f"Hugging Face repo id org/name, or ollama:NAME)", param="model", code="model_not_found")
    cache_dir = pathlib.Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    if path.is_dir():
        if mmproj not in (AUTO, NONE):
            raise ModelLoadError(f"--mmproj goes with a GGUF model, and {path} is a Hugging Face folder (whose "
                                 f"config names its vision part)", param="mmproj", code="invalid_model")
        source = load_hf_folder(path)
    elif path.suffix.lower() == ".gguf" or is_gguf_file(path):
        source = attach_mmproj(load_or_convert(path.resolve(), cache_dir), path, mmproj)
    else:
        raise ModelLoadError(f"{path} is neither a Hugging Face model folder nor a .gguf file",
                             param="model", code="invalid_model")
    if resolved.name.is_named:
        source.name = resolved.name.text
    return source


__all__ = ["DEFAULT_CACHE_DIR", "ModelSource", "check_architecture", "load_model_source", "supported_architectures"]


def source_opener(cache_dir: str | pathlib.Path | None = None, ollama_models: str | pathlib.Path | None = None):
    """load_model_source with the stores fixed: `open(name, revision=None, mmproj="none")` (the served
    model's, with EngineConfig.mmproj; a draft model's, a text model)."""
    def open_source(model: str | None, revision: str | None = None, mmproj: str = NONE) -> ModelSource:
        return load_model_source(model, pathlib.Path(cache_dir) if cache_dir else None, revision=revision,
                                 ollama_models=pathlib.Path(ollama_models) if ollama_models else None,
                                 mmproj=mmproj)
    return open_source
