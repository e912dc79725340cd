"""Hugging Face repo ids resolved through huggingface_hub and its cache.

A repo whose needed files are already in the cache is served from there with no network; otherwise
only the files ember loads are downloaded (config, tokenizer files, chat template, generation
config, safetensors weights, or one GGUF file and the mmproj file that goes with it, a vision
model's projector, where the repo has one), with huggingface_hub's progress bars; files already
in the cache are not fetched again. huggingface_hub reads its own settings (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE,
HF_TOKEN, HF_ENDPOINT); `cache_dir` and `offline` override the first and third for the caller.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import re
from collections.abc import Iterator

from ember.errors import ModelLoadError
from ember.loaders.gguf_choice import choose_gguf, choose_mmproj, gguf_files, quant_tag
from ember.loaders.model_names import LocalModel, ModelName

logger = logging.getLogger("ember.loaders")

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                "chat_template.jinja", "chat_template.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
SHARD_INDEX = "model.safetensors.index.json"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache_dir(cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """The Hugging Face cache folder in use: `cache_dir`, else huggingface_hub's (HF_HUB_CACHE, HF_HOME)."""
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    from huggingface_hub import constants
    return pathlib.Path(constants.HF_HUB_CACHE).expanduser()


def resolve_hub_model(name: ModelName, *, cache_dir: pathlib.Path | None = None, offline: bool | None = None,
                      refresh: bool = False) -> pathlib.Path:
    """The local folder (safetensors) or .gguf file for a repo id, downloading what is missing.
    `refresh` asks the hub for the revision's latest files even when the cache could serve (unless offline)."""
    cache = hub_cache_dir(cache_dir)
    if offline is None:
        from huggingface_hub import constants
        offline = bool(constants.HF_HUB_OFFLINE)
    snapshot = cached_snapshot(name.repo_id, name.revision, cache)
    lacking = "it is not there"
    if snapshot is not None and (not refresh or offline):
        found, lacking = _from_snapshot(snapshot, name)
        if found is not None:
            logger.info("%s: using the cached copy %s", name.text, found)
            return found
    if offline:
        raise ModelLoadError(
            f"{_label(name)} cannot be served offline: the Hugging Face cache {cache} was searched and {lacking}. "
            f"Download it first (`ember pull {name.text}` with network access), or unset HF_HUB_OFFLINE",
            param="model", code="model_not_found")
    with _hub_errors(name, cache):
        sizes = _remote_files(name)
        wanted = files_to_fetch(sizes, name)
        folder = _download(name, wanted, cache)
        if SHARD_INDEX in wanted:  # the index names the shards: fetch those, not every *.safetensors
            shards = _index_shards(folder / SHARD_INDEX)
            missing = sorted(set(shards) - set(sizes))
            if missing:
                raise ModelLoadError(f"{_label(name)}: its {SHARD_INDEX} names files the repo lacks: "
                                     f"{', '.join(missing)}", param="model", code="invalid_model")
            folder = _download(name, shards, cache)
    gguf = [f for f in wanted if f.lower().endswith(".gguf")]
    return folder / gguf[0] if gguf else folder


def files_to_fetch(sizes: dict[str, int], name: ModelName) -> list[str]:
    """The repo files ember needs (sizes: repo path -> bytes). A GGUF file (first) and its mmproj
    (gguf_choice.choose_mmproj) when a tag is named or the repo has no config.json; else the config
    and tokenizer files and the weights (the shard index alone when there is one: it names the shards)."""
    top = {path for path in sizes if "/" not in path}
    ggufs = gguf_files(sizes)
    if name.tag is not None or ("config.json" not in top and ggufs):
        chosen = choose_gguf(ggufs, name.tag, _label(name))
        mmproj = choose_mmproj(sorted(sizes), chosen)
        return [chosen] if mmproj is None else [chosen, mmproj]
    if "config.json" not in top:
        raise ModelLoadError(f"{_label(name)} has neither a config.json nor GGUF files, so it holds no model "
                             f"ember can load", param="model", code="invalid_model")
    configs = sorted(path for path in top if path in CONFIG_FILES)
    if SHARD_INDEX in top:
        return [*configs, SHARD_INDEX]
    weights = sorted(path for path in top if path.endswith(".safetensors"))
    if not weights:
        pickles = sorted(path for path in top if path.endswith((".bin", ".pt", ".pth")))
        hint = f" (it has {', '.join(pickles)}; ember loads safetensors only)" if pickles else ""
        raise ModelLoadError(f"{_label(name)} has no *.safetensors weights{hint}", param="model",
                             code="invalid_model")
    return [*configs, *weights]


def cached_snapshot(repo_id: str, revision: str | None, cache: pathlib.Path) -> pathlib.Path | None:
    """The cache's snapshot folder for a repo at a revision (a branch or tag through refs/, or a commit)."""
    from huggingface_hub.file_download import repo_folder_name

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    revision = revision or "main"
    commit = revision if _COMMIT.match(revision) else None
    ref = storage / "refs" / revision
    if commit is None and ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    snapshot = storage / "snapshots" / commit if commit else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None


def list_hub_models(cache: pathlib.Path) -> list[LocalModel]:
    """What the cache holds that ember loads: a snapshot with config.json and safetensors weights, and
    each GGUF file (org/name:TAG, or its path when its name carries no tag)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    found: list[LocalModel] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: r.commit_hash):
            refs = sorted(revision.refs)
            base = repo.repo_id if "main" in refs else f"{repo.repo_id}@{refs[0] if refs else revision.commit_hash}"
            sizes = {str(f.file_path.relative_to(revision.snapshot_path)): f.size_on_disk for f in revision.files}
            snapshot = pathlib.Path(revision.snapshot_path)
            if "config.json" in sizes and any(p.endswith(".safetensors") and "/" not in p for p in sizes):
                weights = sum(s for p, s in sizes.items() if "/" not in p)
                found.append(LocalModel(base, weights, "safetensors", "huggingface", str(snapshot)))
            for path, size in sorted(gguf_files(sizes).items()):
                tag = quant_tag(path)
                # a file without a tag in its name is served by its path
                found.append(LocalModel(f"{base}:{tag}" if tag else str(snapshot / path), size, "gguf",
                                        "huggingface", str(snapshot / path)))
    return found


def _from_snapshot(snapshot: pathlib.Path, name: ModelName) -> tuple[pathlib.Path | None, str]:
    """(what to load, None when the snapshot cannot serve the request; why not)."""
    sizes = {str(p.relative_to(snapshot)): p.stat().st_size for p in snapshot.rglob("*") if p.is_file()}
    try:
        wanted = files_to_fetch(sizes, name)
    except ModelLoadError as exc:
        return None, f"the cached copy cannot serve it ({exc.message})"
    gguf = [f for f in wanted if f.lower().endswith(".gguf")]
    if gguf:
        return snapshot / gguf[0], ""
    if not any(f in sizes for f in TOKENIZER_FILES):
        return None, "the cached copy has no tokenizer files"
    if SHARD_INDEX in sizes:
        try:
            missing = sorted(set(_index_shards(snapshot / SHARD_INDEX)) - set(sizes))
        except ModelLoadError as exc:
            return None, exc.message
        if missing:
            return None, f"the cached copy lacks weight files: {', '.join(missing)}"
    return snapshot, ""


def _remote_files(name: ModelName) -> dict[str, int]:
    from huggingface_hub import HfApi

    info = HfApi().model_info(name.repo_id, revision=name.revision, files_metadata=True)
    return {s.rfilename: int(s.size or 0) for s in info.siblings or []}


def _download(name: ModelName, files: list[str], cache: pathlib.Path) -> pathlib.Path:
    from huggingface_hub import snapshot_download

    logger.info("downloading %s from %s into %s: %s", name.text, name.repo_id, cache, ", ".join(files))
    return pathlib.Path(snapshot_download(name.repo_id, revision=name.revision, cache_dir=cache,
                                          allow_patterns=files))


def _index_shards(index: pathlib.Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{index} is not a readable shard index ({exc})", param="model",
                             code="invalid_model") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index} has no weight_map", param="model", code="invalid_model")
    return sorted(set(map(str, weight_map.values())))


@contextlib.contextmanager
def _hub_errors(name: ModelName, cache: pathlib.Path) -> Iterator[None]:
    """huggingface_hub's failures as one-line ModelLoadErrors naming the repo and the cache."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    label = _label(name)
    try:
        yield
    except ModelLoadError:
        raise
    except GatedRepoError:
        raise ModelLoadError(f"{label} is gated on {constants.ENDPOINT}: accept its terms there and set HF_TOKEN",
                             param="model", code="model_not_found") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{label} was not found on {constants.ENDPOINT} (nor in the cache {cache}); a private "
                             f"repo needs HF_TOKEN", param="model", code="model_not_found") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{label}: the repo has no revision {name.revision!r}", param="revision",
                             code="model_not_found") from None
    except Exception as exc:  # connection failures, HTTP errors, a full disk
        raise ModelLoadError(f"{label} could not be downloaded from {constants.ENDPOINT} into {cache} "
                             f"({type(exc).__name__}: {_first_line(exc)})", param="model",
                             code="model_not_found") from None


def _label(name: ModelName) -> str:
    return f"{name.repo_id}" + (f" (revision {name.revision})" if name.revision else "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
