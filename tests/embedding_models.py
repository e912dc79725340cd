"""Tiny random embedding models saved as sentence-transformers folders (no network), shared by the
engine and HTTP tests of embeddings."""

from __future__ import annotations

import json
import pathlib

from model_stores import tiny_hf_folder

ST_POOLING_MODES = {"last": "lasttoken", "mean": "mean", "cls": "cls"}


def embedding_folder(parent: pathlib.Path, model_type: str = "qwen3", pooling: str = "last",
                     normalize: bool = True, prompts: dict[str, str] | None = None,
                     default_prompt_name: str | None = None, max_seq_length: int | None = None) -> pathlib.Path:
    """A tiny random `model_type` causal LM folder with sentence-transformers' files beside it:
    modules.json (Transformer, Pooling, and Normalize when `normalize`), the Pooling config, and the
    prompts in config_sentence_transformers.json."""
    model, folder = tiny_hf_folder(parent, model_type)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": model.config.hidden_size, "pooling_mode": ST_POOLING_MODES[pooling],
         "include_prompt": True}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": prompts or {}, "default_prompt_name": default_prompt_name, "similarity_fn_name": "cosine"}))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return folder


def sentence_transformer(folder: pathlib.Path):
    """sentence-transformers' model on the folder, float32 on the CPU; the tiny tokenizer names no
    padding token, so its end token pads (padded rows are masked out of every pooling)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    model.tokenizer.pad_token = model.tokenizer.eos_token
    return model
