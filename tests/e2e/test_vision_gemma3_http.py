"""Gemma 3's images under a real `ember serve` of a tiny random Gemma 3 folder (transformers' own
config, image processor and model; the default model's tokenizer with Gemma 3's image tokens),
asked about an image through the openai client library: the prompt is laid out as transformers'
Gemma3Processor lays it out, the reply depends on the image, and a repeat comes from the prefix
cache with the same reply."""

from __future__ import annotations

import io

import httpx
import openai
import pytest
from PIL import Image

from conftest import ServerProcess, wait_idle
from vision_fixtures import GEMMA3_TOKENS_PER_IMAGE, data_url, picture, write_gemma3_folder

QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_gemma3_folder(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3")


@pytest.fixture(scope="module")
def gemma3_server(folder):
    process = ServerProcess(str(folder), "--max-model-len", "1024", "--dtype", "float32").start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(gemma3_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=gemma3_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def transformers_prompt_length(folder, image: bytes) -> int:
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    processor = transformers.Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(folder),
                                             tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                                             image_seq_length=GEMMA3_TOKENS_PER_IMAGE)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": QUESTION}]}],
                                         add_generation_prompt=True)
    inputs = processor(text=text, images=[[Image.open(io.BytesIO(image)).convert("RGB")]], return_tensors="pt")
    return inputs["input_ids"].shape[1]


def ask(client, image: bytes):
    return client.chat.completions.create(
        model="tiny-gemma3", max_tokens=6, temperature=0, logprobs=True, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                               {"type": "text", "text": QUESTION}]}])


def test_a_gemma3_server_answers_about_an_image(folder, gemma3_server, client):
    image = picture(50, 40, seed=1)
    reply = ask(client, image)
    assert reply.usage.prompt_tokens == transformers_prompt_length(folder, image)
    assert reply.usage.completion_tokens == 6 and reply.choices[0].finish_reason == "length"
    first = [entry.logprob for entry in reply.choices[0].logprobs.content]

    other = ask(client, picture(64, 32, seed=2))
    assert [entry.logprob for entry in other.choices[0].logprobs.content] != first  # the reply reads the image

    again = ask(client, image)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same image: its blocks came back
    assert again.choices[0].message.content == reply.choices[0].message.content
    assert any("attention: the torch path" in line for line in gemma3_server.lines)
    with httpx.Client(base_url=gemma3_server.url, timeout=120) as http:
        wait_idle(http)
