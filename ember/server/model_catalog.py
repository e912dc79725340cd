"""The models one `ember serve` serves: the names on its command line, a --models-dir scanned for
GGUF files and model folders, and a --models-config file (TOML or YAML) of public names, aliases
and per-model flags. Each becomes a ServerConfig of its own (the flags of the command line, then
the model's own over them); the first one listed is the default model.

A models file:

    [models.chat]                      # the public id clients send as `model`
    model = "org/name:Q4_K_M"          # what `ember serve` takes as a model name
    aliases = ["default"]
    max_model_len = 8192               # any per-model flag, by its name without the dashes
    speculate = "ngram"

YAML takes the same shape (`models: {chat: {model: ..., aliases: [...]}}`).
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.server.config import ServerConfig
from ember.server.flags import build_config, serve_parser
from ember.server.model_pool import PoolPolicy

# The flag groups whose settings belong to a model (the rest are the server's: address, keys,
# queue, logs, stores); a models file may set these per model.
_MODEL_GROUPS = ("model", "reasoning and tool calls", "sampling defaults", "speculative decoding", "images")
_SERVER_WIDE = {"max_images_encoding", "image_urls", "image_fetch_timeout", "served_model_name"}
_MODEL_ENGINE_FLAGS = {"max_model_len", "rope_scaling", "max_num_seqs", "max_num_batched_tokens",
                       "attention_cost_tokens", "no_cpu_kernels", "no_batch_invariant", "no_prefix_caching",
                       "kv_cache_mib", "kv_dtype", "gpu_memory_utilization", "cache_ram", "cache_dir", "cache_disk_mib",
                       "kv_pin_share", "background_wait_steps", "default_max_tokens", "data_parallel_size",
                       "tensor_parallel_size", "worker_stall_timeout"}


@dataclass(slots=True)
class ModelEntry:
    name: str  # the public id
    model: str  # as `ember serve` takes a model name
    aliases: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # per-model flags by dest name
    source: str = "the command line"


def model_configs(args: argparse.Namespace) -> tuple[list[ServerConfig], PoolPolicy]:
    """Every model's settings and the pool's policy from `ember serve`'s flags; ValueError for the user."""
    policy = pool_policy(args)
    names = list(args.model or [])
    if len(names) <= 1 and not args.models_dir and not args.models_config:
        return [build_config(args)], policy
    if args.served_model_name:
        raise ValueError("--served-model-name names the one model of a server; with several, give names and "
                         "aliases in a --models-config file")
    entries = [ModelEntry(public_name(name), name) for name in names]
    if args.models_config:
        entries += read_models_file(Path(args.models_config))
    if args.models_dir:
        entries += scan_models_dir(Path(args.models_dir))
    if not entries:
        raise ValueError(f"no models found in {args.models_dir}: it holds no .gguf file and no folder with "
                         "config.json")
    seen: dict[str, str] = {}
    for entry in entries:
        for name in (entry.name, *entry.aliases):
            if name in seen:
                raise ValueError(f"two models are served as '{name}' ({seen[name]} and {entry.source}); give one "
                                 "of them another name in a --models-config file")
            seen[name] = entry.source
    parser = serve_parser()
    allowed = per_model_flags(parser)
    return [_entry_config(entry, args, parser, allowed) for entry in entries], policy


def pool_policy(args: argparse.Namespace) -> PoolPolicy:
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        raise ValueError(f"--max-loaded-models must be at least 1, got {args.max_loaded_models}")
    if args.models_memory_mib is not None and args.models_memory_mib <= 0:
        raise ValueError(f"--models-memory-mib must be positive, got {args.models_memory_mib}")
    if args.idle_unload_seconds is not None and args.idle_unload_seconds < 0:
        raise ValueError(f"--idle-unload-seconds must be 0 or more, got {args.idle_unload_seconds}")
    return PoolPolicy(args.max_loaded_models, args.models_memory_mib, args.idle_unload_seconds)


def public_name(model: str) -> str:
    """A model's id when nothing names it: a file's name less .gguf, a folder's name, else the name as given."""
    path = Path(model)
    if path.is_file():
        return path.name.removesuffix(".gguf")
    if path.is_dir():
        return path.resolve().name
    return model


def per_model_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> action of the flags a model may set for itself."""
    flags = {}
    for group in parser._action_groups:
        in_model_group = any(group.title and group.title.startswith(title) for title in _MODEL_GROUPS)
        for action in group._group_actions:
            if not action.option_strings:
                continue
            if (in_model_group and action.dest not in _SERVER_WIDE) or action.dest in _MODEL_ENGINE_FLAGS:
                flags[action.dest] = action
    return flags


def read_models_file(path: Path) -> list[ModelEntry]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the models file {path}: {exc.strerror}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            document = yaml.safe_load(text)
        else:
            import tomllib  # Python 3.11 on

            document = tomllib.loads(text)
    except Exception as exc:  # tomllib's and yaml's errors name the line
        raise ValueError(f"the models file {path} does not parse: {exc}") from None
    models = document.get("models") if isinstance(document, dict) else None
    if not isinstance(models, dict) or not models:
        raise ValueError(f"the models file {path} has no models: it needs a `models` table of NAME = {{model = ...}}")
    entries = []
    for name, table in models.items():
        where = f"{path}: models.{name}"
        if not isinstance(table, dict) or not isinstance(table.get("model"), str) or not table["model"]:
            raise ValueError(f"{where} needs `model`, the name of what to serve (a path, repo id or ollama: name)")
        aliases = table.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(alias, str) and alias for alias in aliases):
            raise ValueError(f"{where}: aliases must be a list of names")
        settings = {key: value for key, value in table.items() if key not in ("model", "aliases")}
        entries.append(ModelEntry(str(name), table["model"], list(aliases), settings, where))
    return entries


def scan_models_dir(directory: Path) -> list[ModelEntry]:
    """Every .gguf file (not a vision projector) and every folder with config.json, by name."""
    if not directory.is_dir():
        raise ValueError(f"--models-dir {directory} is not a folder")
    entries = []
    for item in sorted(directory.iterdir()):
        if item.suffix.lower() == ".gguf" and item.is_file() and not item.name.lower().startswith("mmproj"):
            entries.append(ModelEntry(item.name.removesuffix(".gguf"), str(item), source=str(item)))
        elif item.is_dir() and (item / "config.json").exists():
            entries.append(ModelEntry(item.name, str(item), source=str(item)))
    return entries


def _entry_config(entry: ModelEntry, args: argparse.Namespace, parser: argparse.ArgumentParser,
                  allowed: dict[str, argparse.Action]) -> ServerConfig:
    namespace = copy.copy(args)
    argv = []
    for key, value in entry.settings.items():
        action = allowed.get(key)
        if action is None:
            raise ValueError(f"{entry.source}: '{key}' is not a per-model setting (these are: "
                             f"{', '.join(sorted(allowed))}); server-wide flags go on the command line")
        argv += _as_flags(action, value, f"{entry.source}: {key}")
    if argv:
        try:
            parser.parse_args(argv, namespace=namespace)
        except (argparse.ArgumentError, SystemExit) as exc:
            raise ValueError(f"{entry.source}: {exc}") from None
    namespace.model = entry.model
    namespace.served_model_name = [",".join([entry.name, *entry.aliases])]
    try:
        return build_config(namespace)
    except ValueError as exc:
        raise ValueError(f"{entry.source}: {exc}") from None


def _as_flags(action: argparse.Action, value: Any, where: str) -> list[str]:
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ValueError(f"{where} is a switch: true or false")
        return [flag] if value else []
    if isinstance(value, dict):  # a JSON-object flag's value (the flag's own reading refuses it elsewhere)
        return [flag, json.dumps(value)]
    if isinstance(value, (bool, list)) or value is None:
        raise ValueError(f"{where}: {value!r} is not a value of {flag}")
    return [flag, str(value)]
