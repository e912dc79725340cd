"""What a served model is for, decided once when it loads: generating text, embeddings, or reranking.

- Embeddings: a model whose files define a pooling (loaders.pooling_config), or any model served
  with --embeddings (last-token pooling, normalised, unless --pooling names another method).
- Reranking: a cross-encoder, a checkpoint with a classification head of one label
  (Llama, Qwen2 or Qwen3 `...ForSequenceClassification`): a pair's relevance is the sigmoid of its
  logit, as sentence-transformers' CrossEncoder reports it; or a Qwen3-Reranker-style model read the
  way its model card documents (the probability of "yes" against "no" as the next token after a
  fixed prompt), chosen by --rerank or by a causal-LM folder whose name says it is a reranker.
- Generating: everything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.config import classifier_labels
from ember.errors import InvalidRequest, ModelLoadError
from ember.loaders.pooling_config import PoolingConfig, read_pooling_config

GENERATE, EMBED, RERANK = "generate", "embed", "rerank"
RERANK_LABELS = ("yes", "no")
CROSS_ENCODERS = ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
                  "Qwen3ForSequenceClassification")


@dataclass(frozen=True, slots=True)
class ServingTask:
    kind: str  # GENERATE, EMBED or RERANK
    pooling: PoolingConfig | None = None  # EMBED: how a prompt becomes a vector
    dimension: int = 0  # EMBED: the length of the model's vectors
    label_token_ids: tuple[int, int] | None = None  # RERANK by next token: the ids of "yes" and "no"
    cross_encoder: bool = False  # RERANK by the model's classification head (one logit per pair)


_REFUSALS = {
    GENERATE: ("this server runs the model for {kind} and does not generate text; serve a generative model "
               "without --embeddings or --rerank for this route", "model_not_generative"),
    EMBED: ("this server does not serve embeddings for its model: start `ember serve` with --embeddings, or "
            "serve a model whose files define a pooling (sentence-transformers' modules.json)", "embeddings_disabled"),
    RERANK: ("this server does not serve reranking for its model: start `ember serve` with --rerank for a "
             "Qwen3-Reranker-style model, or with --embeddings to score by cosine similarity", "rerank_disabled"),
}
_KIND_NAMES = {EMBED: "embeddings", RERANK: "reranking", GENERATE: "generating"}


def check_serves(task: ServingTask, route_tasks: tuple[str, ...]) -> None:
    """A 400 when the served model's task is not one a route serves."""
    if task.kind not in route_tasks:
        message, code = _REFUSALS[route_tasks[-1]]
        raise InvalidRequest(message.format(kind=_KIND_NAMES[task.kind]), param="model", code=code)


def resolve_serving_task(source: Any, *, embeddings: bool = False, rerank: bool = False,
                         pooling: str | None = None) -> ServingTask:
    """The task for a loaders.ModelSource and the serve flags (--embeddings, --rerank, --pooling)."""
    if classifier_labels(source.hf_config):
        return _cross_encoder_task(source, embeddings)
    if rerank or (not embeddings and "reranker" in source.name.lower()):
        if embeddings:
            raise ModelLoadError("--embeddings and --rerank exclude each other: a model serves one of them",
                                 param="rerank")
        return ServingTask(RERANK, label_token_ids=_label_token_ids(source))
    found = read_pooling_config(source.path, source.hf_config)
    if found is None and not embeddings:
        if pooling is not None:
            raise ModelLoadError("--pooling needs --embeddings (the model's files define no pooling)",
                                 param="pooling")
        return ServingTask(GENERATE)
    config = found or PoolingConfig("last", normalize=True)
    if pooling is not None and pooling != config.method:
        config = PoolingConfig(pooling, config.normalize, config.max_input_tokens, config.prompts,
                               config.default_prompt_name)
    return ServingTask(EMBED, pooling=config, dimension=int(source.hf_config["hidden_size"]))


def _cross_encoder_task(source: Any, embeddings: bool) -> ServingTask:
    architecture = str(source.hf_config["architectures"][0])
    if architecture not in CROSS_ENCODERS:
        raise ModelLoadError(f"{source.name}: ember reads the classification head of {', '.join(CROSS_ENCODERS)}, "
                             f"not of {architecture}", param="model", code="unsupported_architecture")
    labels = classifier_labels(source.hf_config)
    if labels != 1:
        raise ModelLoadError(f"{source.name}: its classification head has {labels} labels; ember reranks with a head "
                             "of one label (relevance: the sigmoid of its logit), and no convention turns "
                             "several labels into one relevance", param="model", code="unsupported_architecture")
    if embeddings:
        raise ModelLoadError(f"{source.name} is a cross-encoder (a classification head): it scores pairs for "
                             "/v1/rerank and /v1/score, and does not serve embeddings", param="embeddings")
    return ServingTask(RERANK, cross_encoder=True)


def _label_token_ids(source: Any) -> tuple[int, int]:
    ids = []
    for label in RERANK_LABELS:
        token_id = source.tokenizer.hf.convert_tokens_to_ids(label)
        if not isinstance(token_id, int) or token_id == source.tokenizer.hf.unk_token_id:
            raise ModelLoadError(f"{source.name}: the tokenizer has no token {label!r} of its own, so the model "
                                 "cannot be read as a yes/no reranker", param="model", code="not_a_reranker")
        ids.append(token_id)
    return ids[0], ids[1]
