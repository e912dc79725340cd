"""A vision model as llama.cpp ships it, under a real `ember serve <language.gguf> --mmproj <mmproj.gguf>`:
a tiny random SmolVLM folder converted by llama.cpp's own converter (tests/gguf_vision.py) into a
float16 pair, the mmproj in a folder of its own so that only --mmproj names it. Through the openai
client library, an image's prompt and reply are the token ids the folder itself gives in process:
the float16 pair holds the folder's weights exactly (they are float16 values), so nothing may
differ. The model's name is the language GGUF's, and text alone still works."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import ServerProcess, wait_idle
from ember import LLM, SamplingParams
from gguf_vision import convert_pair, copy_converter, llama_cpp_source, write_convertible_smolvlm
from test_vision_http import QUESTION, chat
from vision_fixtures import conversation, picture

EXACT_FLAGS = ("--dtype", "float32", "--quantization", "none", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the folder, its language GGUF, its mmproj in another folder)."""
    root = tmp_path_factory.mktemp("gguf_vision_http")
    script = copy_converter(llama_cpp_source(), root / "llama.cpp")
    folder = write_convertible_smolvlm(root / "tiny-smolvlm")  # the name test_vision_http.chat asks for
    language, mmproj = convert_pair(script, folder, root / "pair", "f16")
    (root / "vision").mkdir()
    return folder, language, mmproj.rename(root / "vision" / mmproj.name)


@pytest.fixture(scope="module")
def pair_server(converted, tmp_path_factory):
    _, language, mmproj = converted
    process = ServerProcess(str(language), "--mmproj", str(mmproj), *EXACT_FLAGS,
                            env={"EMBER_CACHE_DIR": str(tmp_path_factory.mktemp("ember_cache"))}).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(pair_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=pair_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_pair_answers_an_image_as_its_folder_does(converted, pair_server, client):
    assert [model.id for model in client.models.list()] == ["tiny-smolvlm"]
    folder = LLM(str(converted[0]), dtype="float32", quantization="none", max_model_len=1024)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    replies = []
    for seed in (1, 2):
        image = picture(150, 90, seed=seed)
        reply = chat(client, image, logprobs=True)
        expected = folder.generate([conversation(image, text=QUESTION)], params)[0]
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids) > 20  # 2x2 tiles and the whole image
        assert reply.choices[0].message.content == expected.text
        assert [lp.logprob for lp in reply.choices[0].logprobs.content] == [lp.logprob for lp in expected.logprobs]
        replies.append(expected.token_ids)
    folder.close()
    assert replies[0] != replies[1]  # the reply depends on the image
    with httpx.Client(base_url=pair_server.url, timeout=60) as http:
        wait_idle(http)


def test_text_alone_is_answered_too(client):
    reply = client.chat.completions.create(model="tiny-smolvlm", max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True},
                                           messages=[{"role": "user", "content": QUESTION}])
    assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"
