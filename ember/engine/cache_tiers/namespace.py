"""The cache namespace: a digest of everything a KV block's bits depend on, so that blocks on
disk are read back only by a server that would have computed the same bits itself.

It covers the model's files (each weight and config file's name, size and modification time, and
the resolved config), how they are run (dtype, weight format, the KV cache's dtype, block size and
layout, ember's kernels on or off, batch invariance, rotary scaling), ember's own code (a digest of
its sources: a new version may round differently), torch's version, and the processor (its model
and instruction-set flags: an Intel with AMX and an AMD without it round some kernels differently),
plus the disk format's version. Any change gives another folder; nothing is shared across them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from pathlib import Path
from typing import Any

import torch

CACHE_FORMAT_VERSION = 1
_MODEL_FILE_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json", ".model")


@functools.cache
def _ember_sources_digest() -> str:
    root = Path(__file__).parents[2]  # the ember package
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and path.is_file():
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _processor(device: torch.device) -> str:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return f"cuda {properties.name} {properties.major}.{properties.minor}"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in lines if ":" in line}
        return f"{fields.get('model name', '')} | {fields.get('flags', '')}"
    except OSError:
        return platform.processor()


def _files(path: str | None) -> list[list[Any]]:
    """(name, size, modification time) of a model's weight and config files."""
    if not path:
        return []
    root = Path(path)
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in _MODEL_FILE_SUFFIXES)
    return [[str(p.name if root.is_file() else p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns]
            for p in paths if p.is_file()]


def model_identity(source) -> dict[str, Any]:
    """The model's part of the namespace, from its loaders.ModelSource."""
    return {"model": source.name, "format": source.format, "config": source.hf_config,
            "files": _files(source.path) + _files(source.mmproj_path)}


def describe(identity: dict[str, Any], config, model_config, *, dtype: torch.dtype, kv_dtype: torch.dtype,
             device: torch.device, kernel_layout: bool, num_kv_heads: int) -> dict[str, Any]:
    """What the blocks' bits depend on, as a JSON-able mapping (written beside the blocks):
    `identity` (model_identity) and how this engine runs it."""
    return {
        "cache_format": CACHE_FORMAT_VERSION,
        **identity,
        "dtype": str(dtype),
        "kv_dtype": str(kv_dtype),
        "quantization": config.quantization,
        "block_size": config.block_size,
        "kernel_layout": kernel_layout,
        "cpu_kernels": config.cpu_kernels,
        "batch_invariant": config.batch_invariant,
        "rope_scaling": config.rope_scaling,
        "layers": model_config.num_hidden_layers,
        "kv_heads": num_kv_heads,
        "head_dim": model_config.head_dim,
        "ember_sources": _ember_sources_digest(),
        "torch": torch.__version__,
        "processor": _processor(device),
    }


def digest(description: dict[str, Any]) -> bytes:
    """16 bytes naming the namespace."""
    text = json.dumps(description, sort_keys=True, default=str).encode()
    return hashlib.blake2b(text, digest_size=16).digest()
