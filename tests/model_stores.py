"""Model stores built on disk for the tests: a Hugging Face cache in huggingface_hub's layout, an
Ollama store, and the tiny Hugging Face folder they are filled from (no network anywhere)."""

from __future__ import annotations

import hashlib
import json
import pathlib

from unit.gguf_helpers import CHAT_TEMPLATE, byte_level_vocab
from unit.gguf_models import tiny_model

TINY_GENERATION_CONFIG = {"eos_token_id": [2, 0], "temperature": 0.7, "top_p": 0.9}


def tiny_tokenizer(vocab_size: int, extra_merges: tuple[tuple[str, str], ...] = ()):
    from ember.tokenization.tokenizer import Tokenizer

    tokens, types, merges = byte_level_vocab(vocab_size, extra_merges)
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.chat_template": CHAT_TEMPLATE})


def tiny_hf_folder(parent: pathlib.Path, model_type: str = "llama", **save_kwargs) -> tuple:
    """(the random transformers model, a Hugging Face folder holding it with a tokenizer and generation config)."""
    model = tiny_model(model_type, tie_word_embeddings=False)
    folder = parent / f"tiny-{model_type}"
    model.save_pretrained(folder, **save_kwargs)
    tiny_tokenizer(model.config.vocab_size).save(folder)
    (folder / "generation_config.json").write_text(json.dumps(TINY_GENERATION_CONFIG))
    return model, folder


def write_hub_repo(cache: pathlib.Path, repo_id: str, files: dict[str, pathlib.Path | bytes], *,
                   revision: str = "main", commit: str | None = None) -> pathlib.Path:
    """A repo in the Hugging Face cache layout: blobs/<etag>, snapshots/<commit>/<path> -> blob, refs/<revision>.
    A Path's blob is a link to that file (no copy of a large model); bytes are written. Returns the snapshot."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    commit = commit or hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    for path, content in files.items():
        data_key = str(content.resolve()) if isinstance(content, pathlib.Path) else content
        etag = hashlib.sha256(data_key.encode() if isinstance(data_key, str) else data_key).hexdigest()
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            if isinstance(content, pathlib.Path):
                blob.symlink_to(content.resolve())
            else:
                blob.write_bytes(content)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(pathlib.Path(*[".."] * (len(pathlib.PurePosixPath(path).parts) + 1), "blobs", etag))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    return snapshot


def folder_files(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    return {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}


def write_ollama_model(store: pathlib.Path, name: str, tag: str, gguf: pathlib.Path) -> pathlib.Path:
    """An Ollama manifest for `name:tag` whose model layer is `gguf` (linked, not copied), as `ollama pull`
    leaves it: a config layer, the model layer, a template layer. Returns the model blob."""
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    blob = blobs / f"sha256-{digest}"
    if not blob.exists():
        blob.symlink_to(gguf.resolve())
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
               "size": gguf.stat().st_size}]
    for media_type, text in (("application/vnd.ollama.image.template", "{{ .Prompt }}"),
                             ("application/vnd.ollama.image.params", '{"stop": ["<|im_end|>"]}')):
        data = text.encode()
        layer_digest = hashlib.sha256(data).hexdigest()
        (blobs / f"sha256-{layer_digest}").write_bytes(data)
        layers.append({"mediaType": media_type, "digest": f"sha256:{layer_digest}", "size": len(data)})
    config = json.dumps({"model_format": "gguf", "model_family": "llama"}).encode()
    config_digest = hashlib.sha256(config).hexdigest()
    (blobs / f"sha256-{config_digest}").write_bytes(config)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "digest": f"sha256:{config_digest}", "size": len(config)},
                "layers": layers}
    path = store / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return blob
