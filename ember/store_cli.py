"""`ember models` (what this machine can serve) and `ember pull NAME` (fetch a repo id ahead of time)."""

from __future__ import annotations

import argparse
import pathlib
import sys


def add_store_parsers(commands) -> None:
    models = commands.add_parser(
        "models", help="list the models on this machine that ember can serve",
        description="List the models ember can serve from the Hugging Face cache (HF_HUB_CACHE, HF_HOME; "
                    "snapshots with config.json and safetensors weights, and GGUF files as org/name:QUANT) and "
                    "from Ollama's store ($OLLAMA_MODELS, default ~/.ollama/models), with their sizes. Each "
                    "name can be passed to `ember serve` as it is printed.")
    models.add_argument("--log-level", default="warning", help="debug, info, warning or error")
    pull = commands.add_parser(
        "pull", help="download a Hugging Face repo id into the Hugging Face cache, ready to serve offline",
        description="Fetch the files ember needs for a Hugging Face repo id (org/name[@REVISION], or "
                    "org/name:QUANT for one GGUF file) into the Hugging Face cache, asking the hub for the "
                    "revision's latest files even when a copy is cached. `ember serve` then uses the cache "
                    "without the network. Ollama's models are fetched with `ollama pull`.")
    pull.add_argument("model", help="org/name, org/name@REVISION or org/name:QUANT")
    from ember.server.flags import REVISION_HELP
    pull.add_argument("--revision", default=None, help=REVISION_HELP)
    pull.add_argument("--log-level", default="info", help="debug, info, warning or error")


def run_models(args: argparse.Namespace, ollama_models: pathlib.Path | None) -> int:
    from ember.loaders.hub import hub_cache_dir, list_hub_models
    from ember.loaders.ollama import DEFAULT_OLLAMA_MODELS, list_ollama_models

    hub_cache = hub_cache_dir()
    store = pathlib.Path(ollama_models or DEFAULT_OLLAMA_MODELS).expanduser()
    found = list_hub_models(hub_cache) + list_ollama_models(store)
    print(f"Hugging Face cache: {hub_cache}\nOllama store: {store}")
    if not found:
        print("no models ember can serve were found; `ember pull org/name` downloads one")
        return 0
    width = max(len(model.name) for model in found)
    print(f"{'NAME':<{width}}  {'SIZE':>9}  {'FORMAT':<11}  STORE")
    for model in found:
        print(f"{model.name:<{width}}  {human_size(model.size_bytes):>9}  {model.format:<11}  {model.store}")
    return 0


def run_pull(args: argparse.Namespace, ollama_models: pathlib.Path | None) -> int:
    from ember.errors import InvalidRequest

    try:
        resolved = pull_model(args.model, args.revision, ollama_models)
    except InvalidRequest as exc:
        print(f"ember pull: {exc.message}", file=sys.stderr)
        return 2
    print(f"ember: {args.model} is ready at {resolved.path}; serve it with `ember serve {args.model}`",
          file=sys.stderr)
    return 0


def pull_model(model: str, revision: str | None, ollama_models: pathlib.Path | None):
    """Fetch a Hugging Face repo id's files into the cache, asking the hub even when a copy is
    cached; the ResolvedModel. Any other kind of name is refused (InvalidRequest naming `model`)."""
    from ember.loaders.resolve import resolve_model

    check_pullable(model, revision)
    return resolve_model(model, revision=revision, ollama_models=ollama_models, refresh=True)


def check_pullable(model: str, revision: str | None) -> None:
    """Refuse (InvalidRequest naming `model`) a name that is not a Hugging Face repo id."""
    from ember.errors import InvalidRequest
    from ember.loaders.model_names import parse_model_name

    name = parse_model_name(model, revision)
    if name.kind != "hub":
        what = "is in Ollama's store already or is fetched with `ollama pull`" if name.kind == "ollama" else \
            "is not a Hugging Face repo id (org/name)"
        raise InvalidRequest(f"{model} {what}", param="model", code="not_pullable")


def human_size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"
