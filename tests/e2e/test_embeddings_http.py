"""Embeddings over HTTP: one server on a tiny random Qwen3 embedding folder (sentence-transformers'
files beside it), driven by the openai client (float and base64) and plain httpx for /v1/rerank and
/v1/score; the refusals name their field; the generative shared server refuses /v1/embeddings."""

import math

import httpx
import openai
import pytest

from conftest import ServerProcess
from embedding_models import embedding_folder, sentence_transformer

MODEL = "tiny-qwen3"  # the folder's name
TEXTS = ["The keeper lit the lamp.", "Storms over the bay", "Gulls"]


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    folder = embedding_folder(tmp_path_factory.mktemp("embed"), "qwen3", "last",
                              prompts={"query": "Query: "}, default_prompt_name=None)
    process = ServerProcess(str(folder), "--dtype", "float32", "--quantization", "none", "--max-model-len", "128",
                            "--max-num-seqs", "8", "--max-total-input-tokens", "300").start()
    process.folder = folder
    yield process
    process.stop()


@pytest.fixture(scope="module")
def embed_client(embed_server):
    return openai.OpenAI(base_url=embed_server.url + "/v1", api_key="none")


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_openai_client_float_and_base64_match_sentence_transformers(embed_server, embed_client):
    reference = sentence_transformer(embed_server.folder).encode(TEXTS)
    floats = embed_client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    packed = embed_client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    for mine, unpacked, theirs in zip(floats.data, packed.data, reference):
        assert mine.embedding == unpacked.embedding
        assert cosine(mine.embedding, theirs.tolist()) >= 0.99999
        assert abs(sum(v * v for v in mine.embedding) - 1) < 1e-5


def test_dimensions_token_ids_and_prompt_name(embed_server, embed_client):
    whole = embed_client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float").data[0].embedding
    cut = embed_client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=8, encoding_format="float").data[0].embedding
    assert len(cut) == 8 and abs(sum(v * v for v in cut) - 1) < 1e-5
    norm = math.sqrt(sum(v * v for v in whole[:8]))
    assert all(abs(a - b / norm) < 1e-6 for a, b in zip(cut, whole[:8]))
    ids = httpx.post(embed_server.url + "/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = embed_client.embeddings.create(model=MODEL, input=[ids], encoding_format="float").data[0].embedding
    assert by_ids == whole
    query = sentence_transformer(embed_server.folder).encode([TEXTS[0]], prompt_name="query")[0]
    prompted = httpx.post(embed_server.url + "/v1/embeddings",
                          json={"input": TEXTS[0], "prompt_name": "query"}).json()["data"][0]["embedding"]
    assert cosine(prompted, query.tolist()) >= 0.99999


def test_rerank_and_score_by_cosine(embed_server, embed_client):
    vectors = [d.embedding for d in embed_client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float").data]
    expected = [cosine(vectors[0], v) for v in vectors[1:]]
    reply = httpx.post(embed_server.url + "/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:],
                                                               "top_n": 2}).json()
    scores = {r["index"]: r["relevance_score"] for r in reply["results"]}
    assert [r["index"] for r in reply["results"]] == sorted(scores, key=lambda i: -scores[i])
    assert all(abs(scores[i] - expected[i]) < 1e-5 for i in scores)
    assert reply["results"][0]["document"]["text"] == TEXTS[1:][reply["results"][0]["index"]]
    score = httpx.post(embed_server.url + "/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["index"] for d in score["data"]] == [0, 1]
    assert all(abs(d["score"] - e) < 1e-5 for d, e in zip(score["data"], expected))


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": ["fine", ""]}, "input[1]"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 65}, "dimensions"),
    ({"input": ["short", "long " * 300]}, "input[1]"),
    ({"input": "x", "prompt_name": "nope"}, "prompt_name"),
    ({"input": "x", "colour": "red"}, "colour"),
])
def test_embedding_refusals_name_their_field(embed_server, body, param):
    reply = httpx.post(embed_server.url + "/v1/embeddings", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_request_holds_at_most_max_total_input_tokens(embed_server):
    fits = httpx.post(embed_server.url + "/v1/embeddings", json={"input": [[5] * 100] * 3})
    assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] == 300
    for route, body, param in (("/v1/embeddings", {"input": [[5] * 100] * 4}, "input"),
                               ("/v1/score", {"text_1": "lamp", "text_2": ["x " * 40] * 8}, "text_2")):
        reply = httpx.post(embed_server.url + route, json=body)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param and reply.json()["error"]["code"] == "too_many_tokens"


def test_truncation_only_when_asked(embed_server):
    long = "long " * 300
    reply = httpx.post(embed_server.url + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 16})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == 16


def test_an_embedding_model_refuses_to_generate(embed_client):
    with pytest.raises(openai.BadRequestError) as caught:
        embed_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_generative"


def test_a_generative_model_refuses_embeddings(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="any", input="hi")
    assert caught.value.code == "embeddings_disabled" and "--embeddings" in caught.value.message


def test_ollama_embed_equals_the_openai_route_and_truncates_by_default(embed_server, embed_client):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=embed_server.url)
    reply = client.embed(model=MODEL, input=TEXTS)
    openai_vectors = [d.embedding for d in embed_client.embeddings.create(model=MODEL, input=TEXTS,
                                                                          encoding_format="float").data]
    assert [list(v) for v in reply.embeddings] == openai_vectors  # the model normalises: the same vectors
    assert reply.prompt_eval_count > len(TEXTS) and reply.total_duration > 0
    one = client.embed(model=MODEL + ":latest", input=TEXTS[0], dimensions=8)
    assert len(one.embeddings[0]) == 8 and abs(sum(v * v for v in one.embeddings[0]) - 1) < 1e-5
    assert client.embeddings(model=MODEL, prompt=TEXTS[1]).embedding == openai_vectors[1]
    long = "long " * 300
    assert client.embed(model=MODEL, input=long).prompt_eval_count == 128  # the window's first tokens
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model=MODEL, input=long, truncate=False)
    assert caught.value.status_code == 400 and "maximum context length is 128 tokens" in caught.value.error
    refused = httpx.post(embed_server.url + "/api/embed", json={"model": MODEL, "input": [TEXTS[0], 7]})
    assert refused.status_code == 400 and "input[1]" in refused.json()["error"]
