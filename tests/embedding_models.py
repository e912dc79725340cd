"""Tiny random embedding and reranking models (no network), shared by the engine and HTTP tests of
embeddings: sentence-transformers folders, cross-encoders with a classification head, and yes/no
rerankers whose tokenizer holds "yes" and "no"."""

from __future__ import annotations

import json
import pathlib

import torch

from model_stores import TINY_GENERATION_CONFIG, tiny_hf_folder, tiny_tokenizer
from unit.gguf_models import TINY, tiny_model

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


YES_NO_MERGES = (("y", "e"), ("ye", "s"), ("n", "o"))  # "yes" and "no" become tokens of their own
# a cross-encoder's pair template, as BERT-style tokenizers write one: a separator between the texts
# and an end token after them (the tiny tokenizer's own template adds nothing)
PAIR_TEMPLATE = {"single": "$A <|endoftext|>", "pair": "$A <|im_end|> $B <|endoftext|>"}


def cross_encoder_folder(parent: pathlib.Path, model_type: str = "qwen3", num_labels: int = 1) -> pathlib.Path:
    """A tiny random `<Arch>ForSequenceClassification` folder (every parameter random, the score
    head included) whose tokenizer encodes a pair with a separator between the texts and has no
    chat template."""
    import transformers
    from tokenizers.processors import TemplateProcessing

    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForSequenceClassification)}
    config_class, model_class = classes[model_type]
    torch.manual_seed(0)
    model = model_class(config_class(**TINY, num_labels=num_labels, tie_word_embeddings=False))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)
    folder = parent / f"tiny-{model_type}-cross-encoder"
    model.save_pretrained(folder)
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    specials = [(token, tokenizer.hf.convert_tokens_to_ids(token)) for token in ("<|im_end|>", "<|endoftext|>")]
    tokenizer.hf.backend_tokenizer.post_processor = TemplateProcessing(**PAIR_TEMPLATE, special_tokens=specials)
    # no chat template, as a cross-encoder's tokenizer has none (sentence-transformers would write a
    # pair as chat messages through one)
    tokenizer.hf.chat_template = None
    tokenizer.save(folder)
    return folder


def yes_no_reranker_folder(parent: pathlib.Path) -> pathlib.Path:
    """A tiny random Qwen3 causal LM whose tokenizer has "yes" and "no" as tokens of their own."""
    model = tiny_model("qwen3", tie_word_embeddings=False)
    folder = parent / "tiny-qwen3-yes-no"
    model.save_pretrained(folder)
    tiny_tokenizer(model.config.vocab_size, YES_NO_MERGES).save(folder)
    (folder / "generation_config.json").write_text(json.dumps(TINY_GENERATION_CONFIG))
    return folder
