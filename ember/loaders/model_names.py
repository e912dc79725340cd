"""What a model argument names: the default model, a local path, a Hugging Face repo id
(`org/name[@revision][:TAG]`) or a model in Ollama's store (`ollama:NAME[:TAG]`)."""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

from ember.errors import ModelLoadError

OLLAMA_PREFIX = "ollama:"
# org/name, then an optional @revision (git refs cannot hold ':'), then an optional :TAG (a GGUF quantization)
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^:\s@]+))?(?::(?P<tag>[\w.-]+))?$")


@dataclass(frozen=True, slots=True)
class ModelName:
    kind: str  # "default" | "path" | "hub" | "ollama"
    text: str  # what the user wrote ("" for the default model)
    repo_id: str = ""  # hub: org/name; ollama: the name without its tag
    revision: str | None = None  # hub: a branch, tag or commit (None: main)
    tag: str | None = None  # hub: a GGUF quantization (Q4_K_M ...); ollama: the tag (None: latest)

    @property
    def is_named(self) -> bool:
        """True for a name a store resolves (the user then sees this name as the model's id)."""
        return self.kind in ("hub", "ollama")


def parse_model_name(model: str | None, revision: str | None = None) -> ModelName:
    """Read a model argument. An existing path always wins over a repo id of the same spelling.
    `revision` (--revision) applies to a repo id; it must agree with an `@revision` in the name."""
    name = _parse(model, revision)
    if revision and name.kind != "hub":
        raise ModelLoadError(f"--revision applies to a Hugging Face repo id, and {model or 'the default model'!r} "
                             f"is not one", param="revision", code="invalid_model")
    return name


def _parse(model: str | None, revision: str | None) -> ModelName:
    if model is None:
        return ModelName("default", "")
    if model.startswith(OLLAMA_PREFIX):
        return _ollama_name(model)
    if pathlib.Path(model).expanduser().exists():
        return ModelName("path", model)
    found = _HUB_ID.match(model) if not model.startswith((".", "/", "~")) else None
    if found is None:
        return ModelName("path", model)
    named_revision = found["revision"]
    if revision and named_revision and revision != named_revision:
        raise ModelLoadError(f"{model!r} names revision {named_revision!r} but --revision says {revision!r}",
                             param="revision", code="invalid_model")
    return ModelName("hub", model, repo_id=found["repo"], revision=named_revision or revision or None,
                     tag=found["tag"])


def _ollama_name(model: str) -> ModelName:
    rest = model[len(OLLAMA_PREFIX):]
    name, _, tag = rest.rpartition(":") if ":" in rest.rsplit("/", 1)[-1] else (rest, "", "")
    if not name or not re.fullmatch(r"[\w.-]+(/[\w.-]+){0,2}", name) or (tag and not re.fullmatch(r"[\w.-]+", tag)):
        raise ModelLoadError(f"{model!r} is not an Ollama model name (ollama:NAME or ollama:NAME:TAG, e.g. "
                             f"ollama:qwen3:0.6b)", param="model", code="invalid_model")
    return ModelName("ollama", model, repo_id=name, tag=tag or None)


@dataclass(frozen=True, slots=True)
class LocalModel:
    """A model a store holds on this machine, as `ember models` lists it."""

    name: str  # what to pass to `ember serve`
    size_bytes: int
    format: str  # "safetensors" or "gguf"
    store: str  # "huggingface" or "ollama"
    path: str  # the snapshot folder or the GGUF file
