"""Pooling requests on tiny random Qwen3 and Llama embedding models, against sentence-transformers
on the same folder in float32: the engine's vectors point the same way (cosine >= 0.99999), keep
their bits alone and in a batch of mixed lengths, and leave no KV blocks behind; a model's
max_seq_length cuts its inputs as sentence-transformers cuts them."""

import math

import pytest
import torch

from embedding_models import embedding_folder, sentence_transformer
from ember.llm import LLM
from ember.loaders.pooling_config import read_pooling_config
from ember.loaders.serving_task import resolve_serving_task
from ember.protocols.embeddings import pooling_run
from ember.protocols.neutral import encode_prompt
from ember.tokenization.tokenizer import Tokenizer
from ember.types import SamplingParams

TEXTS = ["The keeper lit the lamp at dusk.", "Ships", "A storm rolled in from the west and the waves rose high "
         "over the rocks below the lighthouse, " * 3, "Fog horns sounded twice."]


def unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vector))
    return [v / norm for v in vector]


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(unit(list(a)), unit(list(b))))


def embed(llm: LLM, texts: list[str], method: str) -> list[list[float]]:
    outputs = llm.generate([llm.tokenizer.encode(t, add_special_tokens=True) for t in texts],
                           SamplingParams(max_tokens=0, pooling=method))
    return [output.pooled for output in outputs]


@pytest.fixture(scope="module", params=[("qwen3", "last"), ("llama", "mean"), ("qwen3", "cls")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tmp_path_factory):
    model_type, method = request.param
    folder = embedding_folder(tmp_path_factory.mktemp(f"{model_type}-{method}"), model_type, method)
    # a small chunk budget, so the long text runs in several prefill chunks
    llm = LLM(str(folder), dtype="float32", quantization="none", max_model_len=256, max_num_batched_tokens=64,
              block_size=16, kv_cache_tokens=4096)
    yield folder, method, llm
    assert not llm.engine.has_unfinished()
    llm.engine.check_invariants()
    assert llm.engine.kv_manager.num_used_blocks == 0


def test_the_folder_says_its_pooling(case):
    folder, method, llm = case
    config = read_pooling_config(folder, llm.source.hf_config)
    assert config.method == method and config.normalize


def test_vectors_match_sentence_transformers(case):
    folder, method, llm = case
    reference = sentence_transformer(folder).encode(TEXTS, convert_to_tensor=True, batch_size=1)
    ours = embed(llm, TEXTS, method)
    for mine, theirs in zip(ours, reference):
        assert len(mine) == theirs.shape[0]
        assert cosine(mine, theirs.tolist()) >= 0.99999


def test_a_vector_keeps_its_bits_alone_and_in_a_batch(case):
    _, method, llm = case
    alone = [embed(llm, [text], method)[0] for text in TEXTS]
    together = embed(llm, TEXTS + ["Gulls", "Tide tables for the harbour, " * 5], method)[:len(TEXTS)]
    assert torch.equal(torch.tensor(alone), torch.tensor(together))


def test_a_repeated_prompt_gives_the_same_vector(case):
    """The second run may meet the first's blocks in the prefix cache (last-token pooling takes
    them; mean and first-row pooling compute every row again): the same bits either way."""
    _, method, llm = case
    first = embed(llm, [TEXTS[2]], method)
    assert embed(llm, [TEXTS[2]], method) == first


def test_pooling_beside_a_generating_request(case):
    _, method, llm = case
    prompt = llm.tokenizer.encode(TEXTS[0], add_special_tokens=True)
    pooled, talking = llm.generate([prompt, prompt], [SamplingParams(max_tokens=0, pooling=method),
                                                      SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)])
    assert talking.pooled is None and len(talking.token_ids) == 3
    assert pooled.token_ids == [] and pooled.pooled == embed(llm, [TEXTS[0]], method)[0]


def test_max_seq_length_cuts_inputs_as_sentence_transformers_does(tmp_path):
    """sentence_bert_config.json's max_seq_length: a text keeps its first tokens (the tokenizer's
    special tokens kept), as sentence-transformers cuts it; token ids keep their first ones."""
    from tokenizers.processors import TemplateProcessing

    folder = embedding_folder(tmp_path, "qwen3", "last", max_seq_length=12)
    tokenizer = Tokenizer.from_pretrained_folder(folder)  # an end token after each text, as Qwen3-Embedding has
    tokenizer.hf.backend_tokenizer.post_processor = TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", tokenizer.hf.convert_tokens_to_ids("<|endoftext|>"))])
    tokenizer.save(folder)
    llm = LLM(str(folder), dtype="float32", quantization="none", max_model_len=256, kv_cache_tokens=4096)
    task = resolve_serving_task(llm.source)
    assert task.pooling.max_input_tokens == 12
    reference = sentence_transformer(folder)
    runs = [pooling_run(text, task, "input") for text in TEXTS]
    prompts = [encode_prompt(run.prompt, llm.tokenizer) for run in runs]
    assert prompts == [reference.tokenize([text])["input_ids"][0].tolist() for text in TEXTS]
    assert len(prompts[2]) == 12 and prompts[2][-1] == prompts[1][-1]  # cut, its end token kept
    ours = [o.pooled for o in llm.generate(prompts, [run.params for run in runs])]
    for mine, theirs in zip(ours, reference.encode(TEXTS, batch_size=1)):
        assert cosine(mine, theirs.tolist()) >= 0.99999
    ids = pooling_run(list(range(3, 40)), task, "input").prompt.token_ids
    assert ids == list(range(3, 15))
