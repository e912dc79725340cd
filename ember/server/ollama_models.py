"""The server's models as Ollama's /api/tags, /api/show and /api/ps describe them, from what was loaded:
its file (size, date, a GGUF file's metadata) and the engine's numbers. Read once, off the loop."""

from __future__ import annotations

import json
import pathlib
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from ember.loaders.gguf_choice import quant_tag
from ember.protocols.ollama_common import FOREVER, timestamp
from ember.server.model_pool import file_bytes

# Ollama's Modelfile parameter -> ember's sampling default of the same meaning.
PARAMETERS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
              "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
              "frequency_penalty": "frequency_penalty"}
# config.json's names -> the GGUF metadata key suffixes Ollama's model_info uses.
HF_CONFIG_KEYS = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
                  "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
                  "intermediate_size": "feed_forward_length", "rope_theta": "rope.freq_base",
                  "vocab_size": "vocab_size"}


@dataclass(slots=True)
class ModelFacts:
    format: str  # gguf or safetensors
    family: str  # the architecture
    size: int  # bytes of the weights on disk
    modified_at: str
    parameter_size: str
    quantization_level: str
    model_info: dict[str, Any] = field(default_factory=dict)

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": self.format, "family": self.family,
                "families": [self.family] if self.family else None, "parameter_size": self.parameter_size,
                "quantization_level": self.quantization_level}


def read_facts(loaded) -> ModelFacts:
    info = loaded.engine.info
    path = pathlib.Path(loaded.path)
    num_weights = info.num_weights * info.tensor_parallel_size
    if path.suffix.lower() == ".gguf":
        model_info = _gguf_info(path)
        family = str(model_info.get("general.architecture", ""))
        files, quantization = [path], quant_tag(path.name) or ""
        fmt = "gguf"
    else:
        config = _json(path / "config.json")
        family = str(config.get("model_type", ""))
        model_info = {"general.architecture": family, **{f"{family}.{key}": config[name]
                                                          for name, key in HF_CONFIG_KEYS.items() if name in config}}
        files, quantization = sorted(path.glob("*.safetensors")), loaded.dtype.upper()
        fmt = "safetensors"
    model_info["general.parameter_count"] = num_weights
    model_info[f"{family}.context_length"] = loaded.max_model_len
    stamps = [f.stat().st_mtime for f in files if f.exists()]
    modified = datetime.fromtimestamp(max(stamps), timezone.utc) if stamps else datetime.now(timezone.utc)
    return ModelFacts(fmt, family, sum(f.stat().st_size for f in files if f.exists()), timestamp(modified),
                      parameter_size(num_weights), quantization, model_info)


def parameter_size(num_weights: int) -> str:
    """Ollama's spelling: 135.0M, 8.0B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if num_weights >= scale:
            return f"{num_weights / scale:.1f}{unit}"
    return str(num_weights)


def _gguf_info(path: pathlib.Path) -> dict[str, Any]:
    """The file's metadata less its arrays (the vocabulary and merges), as Ollama shows it unless verbose."""
    from ember.loaders.gguf_file import GGUFFile

    metadata = GGUFFile(path).metadata
    return {key: value for key, value in metadata.items() if isinstance(value, (str, int, float, bool))
            and not key.startswith("tokenizer.chat_template")}


def _json(path: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def tag_entry(name: str, facts: ModelFacts | None, state) -> dict[str, Any]:
    """One model of /api/tags; one not loaded since the server started shows its name, and its
    file's size and date when it is a local file or folder."""
    if facts is None:
        facts = _facts_before_loading(state.config.model)
    return {"name": name, "model": name, "modified_at": facts.modified_at, "size": facts.size,
            "digest": state.component_set_sha, "details": facts.details()}


def _facts_before_loading(model: str | None) -> ModelFacts:
    """What a model's name tells before it is loaded: a local file's or folder's format, size and date."""
    path = pathlib.Path(model) if model else None
    if path is None or not path.exists():
        return ModelFacts("", "", 0, timestamp(datetime.now(timezone.utc)), "", "")
    stamp = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    return ModelFacts("gguf" if path.is_file() else "safetensors", "", file_bytes(model), timestamp(stamp), "", "")


def running_entry(name: str, facts: ModelFacts, state, idle_unload_s: float | None) -> dict[str, Any]:
    """One model of /api/ps: in memory its weights and KV cache (on the GPU, size_vram), and when it
    will be unloaded if it stays idle (Go's largest time when it is kept for good)."""
    loaded = state.loaded
    info = loaded.engine.info
    size = info.weight_bytes * info.tensor_parallel_size + info.kv_cache_bytes
    keep = state.keep_alive if state.keep_alive is not None else idle_unload_s
    now = datetime.now(timezone.utc)
    if keep is None or keep < 0:
        expires = now + FOREVER
    else:
        expires = now + timedelta(seconds=max(0.0, keep - (time.monotonic() - state.last_used)))
    return {"name": name, "model": name, "size": size, "digest": state.component_set_sha, "details": facts.details(),
            "expires_at": timestamp(expires), "size_vram": size if info.device.startswith("cuda") else 0,
            "context_length": loaded.max_model_len}


def show_body(facts: ModelFacts, loaded, features) -> dict[str, Any]:
    """/api/show: details, model_info, the chat template, the sampling defaults as Modelfile
    parameters, and what the model takes (capabilities)."""
    defaults = loaded.sampling_defaults
    pairs = [(name, defaults[key]) for name, key in PARAMETERS.items() if key in defaults]
    pairs.append(("num_ctx", loaded.max_model_len))
    capabilities = ["completion"]
    if features.tool_format is not None:
        capabilities.append("tools")
    if features.think is not None:
        capabilities.append("thinking")
    if loaded.vision is not None:
        capabilities.append("vision")
    template = loaded.tokenizer.chat_template or ""
    modelfile = "\n".join([f"# Modelfile of the model ember serves\nFROM {loaded.path}",
                           *(f"PARAMETER {name} {value}" for name, value in pairs)])
    parameters = "\n".join(f"{name:<30} {value}" for name, value in pairs)
    return {"modelfile": modelfile, "parameters": parameters, "template": template, "license": "",
            "details": facts.details(), "model_info": facts.model_info, "capabilities": capabilities,
            "modified_at": facts.modified_at}
