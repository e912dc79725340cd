"""Hugging Face model folders: config.json, *.safetensors (sharded or not), tokenizer files,
generation_config.json."""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

from ember.errors import ModelLoadError
from ember.loaders.source import ModelSource, check_architecture

logger = logging.getLogger("ember.loaders")


def load_hf_folder(folder: pathlib.Path) -> ModelSource:
    from ember.tokenization.tokenizer import Tokenizer

    folder = folder.resolve()
    config_file = folder / "config.json"
    if not config_file.is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        hint = f"; to load a GGUF file, pass its path (found: {', '.join(ggufs)})" if ggufs else ""
        raise ModelLoadError(f"{folder} has no config.json, so it is not a Hugging Face model "
                             f"folder{hint}", param="model", code="invalid_model")
    hf_config = read_json(config_file)
    model_type = hf_config.get("model_type")
    if model_type is None and isinstance(hf_config.get("text_config"), dict):
        model_type = hf_config["text_config"].get("model_type")
    check_architecture(model_type, str(folder))

    weight_files = safetensors_files(folder)
    for file in weight_files:
        _check_safetensors(file)

    generation_file = folder / "generation_config.json"
    generation_config = read_json(generation_file) if generation_file.is_file() else {}
    eos_ids = _merge_ids(generation_config.get("eos_token_id"), hf_config.get("eos_token_id"))
    tokenizer = Tokenizer.from_pretrained_folder(folder, extra_eos_token_ids=eos_ids)
    if tokenizer.hf.eos_token_id is not None:
        eos_ids = _merge_ids(eos_ids, tokenizer.hf.eos_token_id)
    # One stop set everywhere: the config, the generation defaults and the tokenizer agree.
    hf_config = {**hf_config, "eos_token_id": eos_ids}
    generation_config = {**generation_config, "eos_token_id": eos_ids}
    tokenizer.eos_token_ids = set(eos_ids)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _chat_template_file(folder)

    return ModelSource(
        name=folder.name, path=str(folder), hf_config=hf_config, tokenizer=tokenizer,
        generation_config=generation_config,
        read_weights=lambda skip, cut=None: read_safetensors(weight_files, skip, cut), format="hf")


def safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map", param="model", code="invalid_model")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder} lacks weight files named in its index: "
                                 f"{', '.join(missing)}", param="model", code="invalid_model")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {', '.join(other)}; only safetensors is supported)" if other else ""
        raise ModelLoadError(f"{folder} has no *.safetensors weights{hint}", param="model",
                             code="invalid_model")
    return files


def read_safetensors(files: list[pathlib.Path], skip: frozenset[str] = frozenset(),
                     cut: Callable[[str], Any] | None = None) -> Iterator[tuple[str, Any]]:
    """Every tensor not in skip; with `cut`, only the slice cut(name) of each is read (models.sharding.Cut)."""
    from safetensors import safe_open
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():
                if name in skip:
                    continue
                part = cut(name) if cut is not None else None
                if part is None:
                    yield name, reader.get_tensor(name)
                else:
                    index = (slice(None),) * part.dim + (slice(part.start, part.stop),)
                    yield name, reader.get_slice(name)[index]


def _check_safetensors(file: pathlib.Path) -> None:
    """Open the header, which also checks the file is as long as the header says."""
    from safetensors import safe_open
    try:
        with safe_open(str(file), framework="numpy") as reader:  # the header only
            reader.keys()
    except Exception as exc:  # safetensors raises SafetensorError and OSError variants
        raise ModelLoadError(f"{file} is not a readable safetensors file (truncated or corrupt: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
                             param="model", code="invalid_model") from None


def read_json(file: pathlib.Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{file} is not readable JSON ({type(exc).__name__}: {exc})",
                             param="model", code="invalid_model") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{file} does not hold a JSON object", param="model",
                             code="invalid_model")
    return value


def _chat_template_file(folder: pathlib.Path) -> str | None:
    file = folder / "chat_template.jinja"
    return file.read_text(encoding="utf-8") if file.is_file() else None


def _merge_ids(*values: Any) -> list[int]:
    """Ids from int / list / None values, in first-seen order, without repeats."""
    merged: list[int] = []
    for value in values:
        for item in ([] if value is None else [value] if isinstance(value, int) else value):
            if int(item) not in merged:
                merged.append(int(item))
    return merged
