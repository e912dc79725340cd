"""Reranking on the engine, through /v1/rerank's and /v1/score's own parse and scoring functions
(no server), against transformers on the same tiny random folders in float32:

- cross-encoders (Llama, Qwen2, Qwen3 `...ForSequenceClassification`, one label): each pair is the
  tokenizer's pair encoding, and its relevance is the sigmoid of the score head's logit at the last
  token, as transformers (and sentence-transformers' CrossEncoder) compute it; a score keeps its
  bits alone and in a batch;
- a yes/no reranker (Qwen3-Reranker style): the relevance is softmax([logit_yes, logit_no])[0] at
  the last position of rerank_prompt.
"""

import pytest
import torch

from embedding_models import cross_encoder_folder, yes_no_reranker_folder
from ember.errors import InvalidRequest, ModelLoadError
from ember.llm import LLM
from ember.loaders.serving_task import resolve_serving_task
from ember.protocols.neutral import ModelInfo, RunResult, encode_prompt
from ember.protocols.rerank import parse_rerank, parse_score, pair_scores, rerank_prompt
from ember.types import CLASSIFY, SamplingParams

QUERY = "Where does the keeper light the lamp?"
DOCUMENTS = ["The keeper lit the lamp at dusk, at the top of the tower.", "Gulls", "Tide tables for the harbour, "
             "printed weekly, with the times of high and low water " * 2, "Fog horns sounded twice."]


def engine(folder, max_model_len: int = 256, **flags) -> tuple[LLM, ModelInfo]:
    llm = LLM(str(folder), dtype="float32", quantization="none", max_model_len=max_model_len,
              max_num_batched_tokens=64, block_size=16, kv_cache_tokens=4096)
    task = resolve_serving_task(llm.source, **flags)
    return llm, ModelInfo(folder.name, max_model_len, llm.source.hf_config["vocab_size"], task=task)


def run(llm: LLM, info: ModelInfo, parse, body: dict) -> tuple[list[float], list[list[int]]]:
    """The request's pair scores, computed as the server does (its prompts encoded, run as one
    batch, scored by the dialect); and the prompts' token ids."""
    request = parse(body, info)
    prompts = [encode_prompt(r.prompt, llm.tokenizer) for r in request.batch]
    outputs = llm.generate(prompts, [r.params for r in request.batch])
    result = RunResult(len(prompts), prompts[0], batch_prompt_ids=prompts)
    for index, output in enumerate(outputs):
        result.add(index, output)
    return pair_scores(request.dialect_options, result.choices), prompts


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def cross_encoder(request, tmp_path_factory):
    folder = cross_encoder_folder(tmp_path_factory.mktemp(f"cross-{request.param}"), request.param)
    llm, info = engine(folder)
    yield folder, llm, info
    assert not llm.engine.has_unfinished()
    llm.engine.check_invariants()
    assert llm.engine.kv_manager.num_used_blocks == 0


def test_cross_encoder_scores_match_transformers(cross_encoder):
    import transformers

    folder, llm, info = cross_encoder
    assert info.task.cross_encoder
    reference_model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    scores, prompts = run(llm, info, parse_rerank, {"query": QUERY, "documents": DOCUMENTS})
    for document, ids, score in zip(DOCUMENTS, prompts, scores):
        pair = tokenizer(QUERY, document)["input_ids"]
        assert ids == pair  # the tokenizer's pair encoding, its separator and end token included
        with torch.no_grad():
            logit = reference_model(torch.tensor([pair])).logits[0, 0]
        assert abs(score - torch.sigmoid(logit).item()) <= 1e-5


def test_cross_encoder_matches_sentence_transformers(cross_encoder):
    from sentence_transformers import CrossEncoder

    folder, llm, info = cross_encoder
    reference = CrossEncoder(str(folder), device="cpu")
    reference.tokenizer.pad_token = "<|im_start|>"  # a token no pair holds: no row is taken for padding
    reference.model.config.pad_token_id = reference.tokenizer.pad_token_id
    expected = reference.predict([(QUERY, d) for d in DOCUMENTS], batch_size=1)
    scores, _ = run(llm, info, parse_score, {"text_1": QUERY, "text_2": DOCUMENTS})
    assert all(abs(mine - float(theirs)) <= 1e-5 for mine, theirs in zip(scores, expected))


def test_a_score_keeps_its_bits_alone_and_in_a_batch(cross_encoder):
    _, llm, _ = cross_encoder
    prompts = [llm.tokenizer.encode(QUERY, pair=d, add_special_tokens=True) for d in DOCUMENTS]
    classify = SamplingParams(max_tokens=0, pooling=CLASSIFY)
    alone = [llm.generate([p], classify)[0].pooled for p in prompts]
    together = [o.pooled for o in llm.generate(prompts + prompts[:2], classify)][:len(prompts)]
    assert len(alone[0]) == 1 and alone == together


def test_a_cross_encoder_neither_generates_nor_embeds(cross_encoder):
    _, llm, info = cross_encoder
    with pytest.raises(InvalidRequest) as caught:
        llm.generate("The keeper", SamplingParams(max_tokens=2))
    assert caught.value.param == "pooling"
    with pytest.raises(InvalidRequest) as caught:
        parse_rerank({"query": QUERY, "documents": DOCUMENTS, "instruction": "Judge"}, info)
    assert caught.value.param == "instruction"
    with pytest.raises(ModelLoadError):
        resolve_serving_task(llm.source, embeddings=True)


def test_a_head_of_several_labels_is_refused(tmp_path):
    from ember.loaders import load_model_source

    source = load_model_source(str(cross_encoder_folder(tmp_path, "qwen3", num_labels=3)))
    with pytest.raises(ModelLoadError, match="3 labels"):
        resolve_serving_task(source)


def test_classify_pooling_needs_a_classification_head(tmp_path):
    llm, _ = engine(yes_no_reranker_folder(tmp_path))
    with pytest.raises(InvalidRequest) as caught:
        llm.generate("The keeper", SamplingParams(max_tokens=0, pooling=CLASSIFY))
    assert caught.value.param == "pooling"


@pytest.fixture(scope="module")
def yes_no(tmp_path_factory):
    folder = yes_no_reranker_folder(tmp_path_factory.mktemp("yes-no"))
    llm, info = engine(folder, 1024, rerank=True)  # the reranker's prompt takes about 300 tiny tokens
    yield folder, llm, info
    assert llm.engine.kv_manager.num_used_blocks == 0


def test_yes_no_relevance_matches_transformers(yes_no):
    import transformers

    folder, llm, info = yes_no
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    yes, no = tokenizer.convert_tokens_to_ids(["yes", "no"])
    assert info.task.label_token_ids == (yes, no)
    instruction = "Given a question, find the passage that answers it"
    scores, prompts = run(llm, info, parse_rerank, {"query": QUERY, "documents": DOCUMENTS,
                                                    "instruction": instruction})
    for document, ids, score in zip(DOCUMENTS, prompts, scores):
        text = rerank_prompt(QUERY, document, instruction)
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = reference_model(torch.tensor([ids])).logits[0, -1]
        expected = torch.softmax(torch.stack([logits[yes], logits[no]]), dim=0)[0].item()
        assert abs(score - expected) <= 1e-5
