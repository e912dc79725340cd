"""The GGUF conversion cache: parsing and dequantizing a GGUF takes seconds, so the result (float
weights as safetensors, config, generation config, tokenizer files) is kept under the cache dir,
keyed by the file's absolute path, size, mtime and the conversion version.

Layout: <cache_dir>/gguf/<name>-<key>/{model.safetensors, config.json, generation_config.json,
tokenizer/, source.json}. source.json is written last and marks the entry complete; an entry
that fails to open is deleted and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ember.loaders.source import ModelSource, check_architecture, cut_each
from ember.loaders.gguf_file import GGUFModel, model_name_from_file
from ember.loaders.hf_folder import read_json, read_safetensors
from ember.tokenization.tokenizer import Tokenizer, gguf_eos_token_ids

if TYPE_CHECKING:  # torch only where weights are read: a server's front end opens a source without it
    import torch

logger = logging.getLogger("ember.loaders")

# Bump whenever the converted output would differ (names, config fields, tokenizer build).
CONVERSION_VERSION = 1
_MARKER = "source.json"
_WEIGHTS = "model.safetensors"


def cache_entry(path: pathlib.Path, cache_dir: pathlib.Path) -> pathlib.Path:
    """Where the converted form of this GGUF file lives (whether or not it exists yet)."""
    stat = path.stat()
    key_text = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CONVERSION_VERSION}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    return cache_dir / "gguf" / f"{model_name_from_file(path)}-{key}"


def load_or_convert(path: pathlib.Path, cache_dir: pathlib.Path) -> ModelSource:
    entry = cache_entry(path, cache_dir)
    if (entry / _MARKER).is_file():
        try:
            source = _open_entry(entry, path)
        except Exception as exc:  # any damage to the entry: rebuild it
            logger.warning("GGUF cache entry %s is unusable (%s); rebuilding it", entry,
                           str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            shutil.rmtree(entry, ignore_errors=True)
        else:
            logger.info("loading %s from the GGUF cache %s", path.name, entry)
            return source

    model = GGUFModel(path)
    tokenizer = Tokenizer.from_gguf_metadata(model.metadata)
    eos_ids = gguf_eos_token_ids(model.metadata)
    hf_config = model.hf_config(eos_ids)
    generation_config = model.generation_config(eos_ids)
    logger.info("converting %s into the GGUF cache %s (once per file)", path.name, entry)
    try:
        _write_entry(entry, path, model, hf_config, generation_config, tokenizer)
    except OSError as exc:
        logger.warning("cannot write the GGUF cache under %s (%s); the file will be converted "
                       "again on every load", cache_dir, exc)
        return ModelSource(
            name=model_name_from_file(path), path=str(path), hf_config=hf_config,
            tokenizer=tokenizer, generation_config=generation_config,
            read_weights=lambda skip, cut=None: cut_each(model.weights(hf_config, skip=skip), cut), format="gguf",
            read_blocks=lambda: read_blocks(path, hf_config))
    _remove_older_entries(entry, path)
    return _source(entry, path, hf_config, generation_config, tokenizer, from_cache=False)


def _source(entry: pathlib.Path, path: pathlib.Path, hf_config: dict[str, Any],
            generation_config: dict[str, Any], tokenizer: Tokenizer, *,
            from_cache: bool) -> ModelSource:
    weights_file = entry / _WEIGHTS
    return ModelSource(
        name=model_name_from_file(path), path=str(path), hf_config=hf_config, tokenizer=tokenizer,
        generation_config=generation_config, read_weights=lambda skip, cut=None: _float32(weights_file, skip, cut),
        format="gguf", cache_path=str(entry), from_cache=from_cache, read_blocks=lambda: read_blocks(path, hf_config))


def read_blocks(path: pathlib.Path, hf_config: dict[str, Any]):
    from ember.loaders.gguf_blocks import read_blocks as read

    return read(path, hf_config)


def _float32(weights_file: pathlib.Path, skip: frozenset[str], cut=None) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    for name, tensor in read_safetensors([weights_file], skip, cut):
        yield name, tensor if tensor.dtype == torch.float32 else tensor.float()


def _open_entry(entry: pathlib.Path, path: pathlib.Path) -> ModelSource:
    from safetensors import safe_open

    marker = read_json(entry / _MARKER)
    if marker.get("conversion_version") != CONVERSION_VERSION or marker.get("source") != str(path):
        raise ValueError("the entry was made for another file or conversion version")
    hf_config = read_json(entry / "config.json")
    check_architecture(hf_config.get("model_type"), path.name)
    generation_config = read_json(entry / "generation_config.json")
    with safe_open(str(entry / _WEIGHTS), framework="numpy") as reader:  # the header only
        if len(list(reader.keys())) != marker.get("num_tensors"):
            raise ValueError("the weights file lacks tensors")
    tokenizer = Tokenizer.from_pretrained_folder(
        entry / "tokenizer", extra_eos_token_ids=generation_config.get("eos_token_id") or [])
    return _source(entry, path, hf_config, generation_config, tokenizer, from_cache=True)


def _write_entry(entry: pathlib.Path, path: pathlib.Path, model: GGUFModel,
                 hf_config: dict[str, Any], generation_config: dict[str, Any],
                 tokenizer: Tokenizer) -> None:
    from safetensors.torch import save_file

    stat = path.stat()
    staging = entry.parent / f".{entry.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        # F16/BF16 stay as they are (exact); dequantized blocks need float32 to stay exact.
        tensors = dict(model.weights(hf_config, keep_half=True))
        save_file(tensors, str(staging / _WEIGHTS), metadata={"format": "pt"})
        num_tensors = len(tensors)
        del tensors
        _write_json(staging / "config.json", hf_config)
        _write_json(staging / "generation_config.json", generation_config)
        tokenizer.save(staging / "tokenizer")
        _write_json(staging / _MARKER, {
            "source": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "conversion_version": CONVERSION_VERSION, "num_tensors": num_tensors})
        shutil.rmtree(entry, ignore_errors=True)
        try:
            os.rename(staging, entry)
        except OSError:
            if not (entry / _MARKER).is_file():  # not a concurrent loader that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_older_entries(entry: pathlib.Path, path: pathlib.Path) -> None:
    """Drop entries converted from an earlier version of the same file."""
    for marker in entry.parent.glob(f"*/{_MARKER}"):
        if marker.parent == entry:
            continue
        try:
            if json.loads(marker.read_text(encoding="utf-8")).get("source") == str(path):
                logger.info("removing the outdated GGUF cache entry %s", marker.parent)
                shutil.rmtree(marker.parent, ignore_errors=True)
        except (OSError, ValueError):
            continue


def _write_json(file: pathlib.Path, value: dict[str, Any]) -> None:
    file.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
