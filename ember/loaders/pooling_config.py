"""How a model turns a prompt into one vector, read from its own files.

A Hugging Face folder says it in sentence-transformers' files: modules.json lists the modules (a
Pooling module, an optional Normalize), the Pooling module's config.json names its mode (the
current `pooling_mode` or the older `pooling_mode_*` booleans), sentence_bert_config.json the
tokens an input may hold, and config_sentence_transformers.json the instruction prompts. A GGUF
file says it in `<arch>.pooling_type` (llama.cpp's enum), which the GGUF loader copies into the
config as `gguf_pooling_type`; llama.cpp normalises such vectors by default, and so does ember.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from ember.errors import ModelLoadError

# sentence-transformers' pooling modes -> ember's pooling methods (ember.types.POOLING_METHODS)
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_LEGACY_FLAGS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                    "pooling_mode_weightedmean_tokens": "weightedmean"}
# llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last, 4 rank
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
GGUF_POOLING_KEY = "gguf_pooling_type"
_MODULE_KINDS = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    method: str  # "last", "mean" or "cls"
    normalize: bool  # vectors are scaled to unit length
    max_input_tokens: int | None = None  # sentence-transformers' max_seq_length; None: the context window
    prompts: dict[str, str] = field(default_factory=dict)  # instruction prefixes by name
    default_prompt_name: str | None = None  # the prompt every input takes unless the request names another

    @property
    def default_prompt(self) -> str:
        return self.prompts.get(self.default_prompt_name, "") if self.default_prompt_name else ""


def read_pooling_config(path: str | pathlib.Path, hf_config: dict[str, Any]) -> PoolingConfig | None:
    """The pooling a model's files define (an HF folder's or a GGUF's), or None when they define none."""
    if GGUF_POOLING_KEY in hf_config:
        kind = hf_config[GGUF_POOLING_KEY]
        if kind not in _GGUF_POOLING:
            return None  # none (a generative model), or rank (a reranker's head, which ember does not read)
        return PoolingConfig(_GGUF_POOLING[kind], normalize=True)
    folder = pathlib.Path(path)
    if not (folder / "modules.json").is_file():
        return None
    return _sentence_transformers_config(folder)


def _sentence_transformers_config(folder: pathlib.Path) -> PoolingConfig | None:
    modules = _read_json(folder / "modules.json")
    kinds = {_module_kind(m.get("type", "")): m.get("path", "") for m in modules if isinstance(m, dict)}
    if "Pooling" not in kinds:
        return None
    unknown = [kind for kind in kinds if kind not in _MODULE_KINDS]
    if unknown:
        raise ModelLoadError(f"{folder.name}: sentence-transformers module {unknown[0]} is not supported by ember "
                             f"(supported: {', '.join(_MODULE_KINDS)})", param="model", code="unsupported_pooling")
    pooling = _read_json(folder / kinds["Pooling"] / "config.json")
    mode = _pooling_mode(pooling)
    if mode not in _ST_MODES:
        raise ModelLoadError(f"{folder.name}: pooling mode {mode!r} is not supported by ember "
                             f"(supported: {', '.join(_ST_MODES)})", param="model", code="unsupported_pooling")
    method = _ST_MODES[mode]
    if method == "mean" and pooling.get("include_prompt") is False:
        raise ModelLoadError(f"{folder.name}: mean pooling that leaves the prompt out (include_prompt false) is "
                             "not supported by ember", param="model", code="unsupported_pooling")
    bert = _read_json(folder / "sentence_bert_config.json", {})
    st = _read_json(folder / "config_sentence_transformers.json", {})
    prompts = {str(k): str(v) for k, v in (st.get("prompts") or {}).items()}
    default_name = st.get("default_prompt_name")
    return PoolingConfig(method, normalize="Normalize" in kinds, max_input_tokens=bert.get("max_seq_length"),
                         prompts=prompts, default_prompt_name=default_name if default_name in prompts else None)


def _pooling_mode(config: dict[str, Any]) -> str:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for flag, name in _ST_LEGACY_FLAGS.items() if config.get(flag)]
        mode = modes if len(modes) != 1 else modes[0]
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else "+".join(mode) or "none"
    return str(mode)


def _module_kind(type_name: str) -> str:
    """`sentence_transformers.models.Pooling` (or a newer module path) -> `Pooling`."""
    return type_name.rsplit(".", 1)[-1]


def _read_json(path: pathlib.Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if default is not None:
            return default
        raise ModelLoadError(f"{path.parent.name}/{path.name} is missing", param="model") from None
    except ValueError as exc:
        raise ModelLoadError(f"{path.name} is not valid JSON: {exc}", param="model") from None
