"""The served model as /v1/models and /health describe it: its card (one per served name), and
the identity of what was loaded (weights, their format and size, the digest of every component)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import ember

GB = 10**9


def model_card(state, name: str, status: str = "ready") -> dict[str, Any]:
    """The card of a model under `name`, its public id or an alias (`root`: the public id), in its
    pool state (server.model_pool.public_state). A model not loaded now shows what it was when last
    loaded; one never loaded, only its name."""
    model, loaded = state.model, state.loaded
    card: dict[str, Any] = {"id": name, "object": "model", "created": state.started, "owned_by": "ember",
                            "state": status}
    if model is None:
        names = state.names
        return {**card, "root": names[0] if names else name, "aliases": names[1:], "max_model_len": None}
    chat = model.chat
    card.update({"root": model.name, "aliases": list(model.aliases), "max_model_len": model.max_model_len,
                 "kv_cache_tokens": model.kv_capacity_tokens, "prefix_cache": state.config.engine.enable_prefix_caching,
                 "slots": state.config.engine.max_num_seqs,
                 "input_modalities": ["text", "image"] if model.image_marker is not None else ["text"],
                 "task": model.task.kind,
                 "capabilities": {"reasoning": chat.think is not None, "tool_calls": chat.tool_format is not None}})
    if loaded is not None:
        card.update(cache_ram_mib=loaded.engine.info.cache_ram_bytes // 2**20, **weight_fields(loaded))
    if model.image_marker is not None:  # the limits a client (the chat page) can check before sending
        limits = state.config.media_limits
        card["capabilities"]["vision"] = True
        card["max_images"], card["max_image_bytes"] = limits.max_images, limits.max_image_bytes
    return card


def weight_fields(loaded) -> dict[str, Any]:
    """What was loaded and what it takes: `weights` (the file or folder), `weights_format` (gguf or
    safetensors), `weight_formats` (the linear layers per format they run in), `gb` (the weights
    in memory; under tensor parallelism one rank's share times the ranks), `bpw` (bits per weight)."""
    info = loaded.engine.info
    if info is None:
        return {}
    ranks = info.tensor_parallel_size
    num_bytes, num_weights = info.weight_bytes * ranks, info.num_weights * ranks
    return {"weights": loaded.path, "weights_format": "gguf" if loaded.path.endswith(".gguf") else "safetensors",
            "weight_formats": info.weight_formats, "gb": round(num_bytes / GB, 3),
            "bpw": round(num_bytes * 8 / num_weights, 2) if num_weights else None}


def component_set_sha(loaded, config) -> str:
    """A digest of everything that decides the replies: ember's version, the weights (where from,
    in what formats, how many bytes), the tokenizer's chat template and the reply parsers, the
    sampling defaults and the engine's settings. Two servers with the same digest answer alike."""
    info = loaded.engine.info
    components = {"ember": ember.__version__, "model": loaded.name, "weights": loaded.path, "dtype": loaded.dtype,
                  "weight_formats": info.weight_formats, "weight_bytes": info.weight_bytes,
                  "chat_template": loaded.tokenizer.chat_template, "reasoning_parser": config.reasoning_parser,
                  "tool_call_parser": config.tool_call_parser, "sampling_defaults": loaded.sampling_defaults,
                  "max_model_len": loaded.max_model_len, "tensor_parallel_size": info.tensor_parallel_size}
    encoded = json.dumps(components, sort_keys=True, default=str).encode()
    return hashlib.sha256(encoded).hexdigest()
