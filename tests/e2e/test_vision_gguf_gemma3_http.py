"""Gemma 3 as llama.cpp ships it, under a real `ember serve <language.gguf>`: a tiny random Gemma 3
folder converted by llama.cpp's own converter (tests/gguf_vision.py) into a float16 pair, the mmproj
beside the language GGUF, where the default `--mmproj auto` finds it. Through the openai client
library, an image's prompt and reply are those the folder itself gives in process: the float16 pair
holds the folder's weights exactly, so nothing may differ."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import ServerProcess, wait_idle
from ember import LLM, SamplingParams
from gguf_vision import convert_pair, copy_converter, llama_cpp_source, write_convertible_gemma3
from vision_fixtures import GEMMA3_TOKENS_PER_IMAGE, conversation, data_url, picture

QUESTION = "What is in this picture?"
EXACT_FLAGS = ("--dtype", "float32", "--quantization", "none", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the folder, its language GGUF with its mmproj beside it)."""
    root = tmp_path_factory.mktemp("gguf_gemma3_http")
    script = copy_converter(llama_cpp_source(), root / "llama.cpp")
    folder = write_convertible_gemma3(root / "gemma3-tiny")
    language, _ = convert_pair(script, folder, root / "pair", "f16")
    return folder, language


@pytest.fixture(scope="module")
def pair_server(converted, tmp_path_factory):
    process = ServerProcess(str(converted[1]), *EXACT_FLAGS,
                            env={"EMBER_CACHE_DIR": str(tmp_path_factory.mktemp("ember_cache"))}).start()
    yield process
    process.stop()


def test_the_pair_found_beside_the_model_answers_an_image_as_its_folder_does(converted, pair_server):
    client = openai.OpenAI(base_url=pair_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [model.id for model in client.models.list()] == ["gemma3-tiny"]
    image = picture(150, 90, seed=1)
    reply = client.chat.completions.create(
        model="gemma3-tiny", max_tokens=6, temperature=0, logprobs=True, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                               {"type": "text", "text": QUESTION}]}])
    folder = LLM(str(converted[0]), dtype="float32", quantization="none", max_model_len=1024)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    expected = folder.generate([conversation(image, text=QUESTION)], params)[0]
    folder.close()
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids) > GEMMA3_TOKENS_PER_IMAGE
    assert reply.choices[0].message.content == expected.text
    assert [lp.logprob for lp in reply.choices[0].logprobs.content] == [lp.logprob for lp in expected.logprobs]
    with httpx.Client(base_url=pair_server.url, timeout=60) as http:
        wait_idle(http)
