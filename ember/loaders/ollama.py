"""Models in Ollama's local store, served from their GGUF blobs without copying them.

Layout under the store (OLLAMA_MODELS, default ~/.ollama/models):
    manifests/<registry>/<namespace>/<model>/<tag>   JSON; its layers name blobs by digest
    blobs/sha256-<hex>                               the layer files; the model layer is a GGUF file
`ollama:qwen3:0.6b` is manifests/registry.ollama.ai/library/qwen3/0.6b; a tag left out is `latest`.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from ember.errors import ModelLoadError
from ember.loaders.model_names import OLLAMA_PREFIX, LocalModel, ModelName

DEFAULT_OLLAMA_MODELS = pathlib.Path("~/.ollama/models")
DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
ADAPTER_LAYER = "application/vnd.ollama.image.adapter"


def resolve_ollama_model(name: ModelName, store: pathlib.Path | None = None) -> pathlib.Path:
    """The GGUF blob an `ollama:NAME[:TAG]` manifest names."""
    store = pathlib.Path(store or DEFAULT_OLLAMA_MODELS).expanduser()
    manifest = manifest_path(store, name.repo_id, name.tag or DEFAULT_TAG)
    if not manifest.is_file():
        known = [model.name for model in list_ollama_models(store)]
        have = f"it has: {', '.join(known)}" if known else "it holds no models"
        raise ModelLoadError(f"{name.text} is not in Ollama's store {store} (no manifest {manifest}); {have}. "
                             f"Fetch it with `ollama pull {name.text[len(OLLAMA_PREFIX):]}`",
                             param="model", code="model_not_found")
    blob, _ = model_blob(manifest, store)
    return blob


def manifest_path(store: pathlib.Path, name: str, tag: str) -> pathlib.Path:
    parts = name.split("/")
    if len(parts) == 1:
        parts = [DEFAULT_REGISTRY, DEFAULT_NAMESPACE, *parts]
    elif len(parts) == 2:
        parts = [DEFAULT_REGISTRY, *parts]
    return store.joinpath("manifests", *parts, tag)


def model_blob(manifest: pathlib.Path, store: pathlib.Path) -> tuple[pathlib.Path, int]:
    """(the model layer's blob, its size). Refuses a manifest with adapters, which ember would drop."""
    layers = _read_manifest(manifest).get("layers")
    if not isinstance(layers, list):
        raise ModelLoadError(f"the Ollama manifest {manifest} has no layers", param="model", code="invalid_model")
    kinds = [layer.get("mediaType") for layer in layers if isinstance(layer, dict)]
    if ADAPTER_LAYER in kinds:
        raise ModelLoadError(f"the Ollama model {manifest} has an adapter layer, which ember cannot apply",
                             param="model", code="invalid_model")
    models = [layer for layer in layers if isinstance(layer, dict) and layer.get("mediaType") == MODEL_LAYER]
    if len(models) != 1 or not isinstance(models[0].get("digest"), str):
        raise ModelLoadError(f"the Ollama manifest {manifest} names {len(models)} model layers (ember needs one)",
                             param="model", code="invalid_model")
    digest = models[0]["digest"]
    blob = store / "blobs" / digest.replace(":", "-", 1)
    if not blob.is_file():
        raise ModelLoadError(f"the Ollama manifest {manifest} names the blob {digest}, which is not in {blob.parent}",
                             param="model", code="model_not_found")
    return blob, blob.stat().st_size


def list_ollama_models(store: pathlib.Path) -> list[LocalModel]:
    """Every manifest in the store whose model blob is there, named as `ollama:` takes it."""
    store = pathlib.Path(store).expanduser()
    root = store / "manifests"
    found = []
    for manifest in sorted(p for p in root.glob("*/*/*/*") if p.is_file()):
        registry, namespace, model, tag = manifest.relative_to(root).parts
        try:
            blob, size = model_blob(manifest, store)
        except ModelLoadError:
            continue  # a manifest without a usable model blob is nothing ember could serve
        name = model if (registry, namespace) == (DEFAULT_REGISTRY, DEFAULT_NAMESPACE) else \
            f"{namespace}/{model}" if registry == DEFAULT_REGISTRY else f"{registry}/{namespace}/{model}"
        found.append(LocalModel(f"{OLLAMA_PREFIX}{name}:{tag}", size, "gguf", "ollama", str(blob)))
    return found


def _read_manifest(manifest: pathlib.Path) -> dict[str, Any]:
    try:
        value = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"the Ollama manifest {manifest} is not readable JSON ({exc})", param="model",
                             code="invalid_model") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"the Ollama manifest {manifest} is not a JSON object", param="model",
                             code="invalid_model")
    return value
