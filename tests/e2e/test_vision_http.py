"""Images under a real `ember serve` of a tiny random SmolVLM folder (transformers' config, image
processor and model; the default model's tokenizer with SmolVLM's image tokens), through the
openai and anthropic client libraries and Responses: the same image gives the same reply in every
dialect, usage and count_tokens count its tokens, the refusals name the part, nothing leaks."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from conftest import ServerProcess, wait_idle
from vision_fixtures import add_random_weights, data_url, image_bytes, picture, write_smolvlm_folder

QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    folder = add_random_weights(write_smolvlm_folder(tmp_path_factory.mktemp("smolvlm") / "tiny-smolvlm"))
    process = ServerProcess(str(folder), "--max-model-len", "1024", "--max-images", "2",
                            "--media-budget-mb", "0.5").start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(vision_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=vision_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(vision_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=vision_server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(vision_server):
    with httpx.Client(base_url=vision_server.url, timeout=120) as session:
        yield session


def chat(client, image: bytes, **fields):
    return client.chat.completions.create(
        model="tiny-smolvlm", max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                               {"type": "text", "text": QUESTION}]}], **fields)


def test_every_dialect_reads_the_image_and_gives_the_same_reply(client, claude, http):
    image = picture(150, 90, seed=1)
    reply = chat(client, image)
    text, prompt_tokens = reply.choices[0].message.content, reply.usage.prompt_tokens
    assert prompt_tokens > 20  # 2x2 tiles and the whole image, 4 tokens each, and their markers

    other = chat(client, picture(150, 90, seed=2))
    assert other.choices[0].message.content != text  # the reply depends on the image

    message = claude.messages.create(
        model="tiny-smolvlm", max_tokens=6, extra_body={"ignore_eos": True, "temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}},
            {"type": "text", "text": QUESTION}]}])
    usage = message.usage  # Anthropic counts the prompt's cached tokens apart
    assert message.content[0].text == text and usage.input_tokens + usage.cache_read_input_tokens == prompt_tokens
    assert usage.cache_read_input_tokens > 0  # the same image and text: its blocks came back

    counted = http.post("/v1/messages/count_tokens", json={"model": "tiny-smolvlm", "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": base64.b64encode(image).decode()}},
                                     {"type": "text", "text": QUESTION}]}]}).json()
    assert counted["input_tokens"] == prompt_tokens

    response = client.responses.create(
        model="tiny-smolvlm", max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(image)},
                                            {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == text and response.usage.input_tokens == prompt_tokens

    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chat(client, image, stream=True)
                       if chunk.choices)
    assert streamed == text
    wait_idle(http)


def test_an_image_inside_a_tool_result_is_read(claude):
    image = picture(40, 40, seed=5)
    message = claude.messages.create(
        model="tiny-smolvlm", max_tokens=4, extra_body={"ignore_eos": True, "temperature": 0},
        tools=[{"name": "camera", "description": "Takes a picture", "input_schema": {"type": "object"}}],
        messages=[{"role": "user", "content": "Take a picture."},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "camera",
                                                     "input": {}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                      {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                   "data": base64.b64encode(image).decode()}}]}]}])
    assert message.usage.input_tokens > 20 and message.stop_reason == "max_tokens"


def test_generate_takes_image_data_at_its_markers(http, client):
    image = picture(150, 90, seed=1)
    reply = http.post("/generate", json={"text": "<image>What is this?", "image_data": data_url(image),
                                         "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert reply["meta_info"]["prompt_tokens"] > 20 and reply["meta_info"]["completion_tokens"] == 4


@pytest.mark.parametrize("content, code, param", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,not base64!"}}], "invalid_media",
     "messages[0].content[0].image_url.url"),
    ([{"type": "image_url", "image_url": {"url": data_url(b"GIF89a not really")}}], "invalid_media",
     "messages[0].content[0].image_url.url"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}], "invalid_media",
     "messages[0].content[0].image_url.url"),  # the server was started without --image-urls
    ([{"type": "image_url", "image_url": {"url": data_url(image_bytes(8, 8)), "detail": "high"}}], None,
     "messages[0].content[0].image_url.detail"),
    ([{"type": "image_url", "image_url": {"url": data_url(image_bytes(8, 8))}}] * 3, "media_budget_exceeded",
     "messages[0].content[2].image_url.url"),  # --max-images 2
    ([{"type": "image_url", "image_url": {"url": data_url(image_bytes(300, 300))}},
      {"type": "image_url", "image_url": {"url": data_url(image_bytes(400, 400))}}], "media_budget_exceeded",
     "messages[0].content[1].image_url.url"),  # --media-budget-mb 0.5
])
def test_bad_images_are_refused_naming_the_part(http, content, code, param):
    reply = http.post("/v1/chat/completions", json={"model": "tiny-smolvlm", "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": content}]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and (code is None or error["code"] == code), error
    body = wait_idle(http)
    assert body["engine"]["kv_blocks_used"] == 0


def test_an_animated_image_is_refused(http):
    frames = [Image.new("RGB", (16, 16), color) for color in ((255, 0, 0), (0, 255, 0))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    reply = http.post("/v1/chat/completions", json={"model": "tiny-smolvlm", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(out.getvalue(),
                                                                                         "image/gif")}}]}]})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_media"
    assert "animated" in reply.json()["error"]["message"]


def test_a_text_model_refuses_images_with_vision_disabled(server):
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={"max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image_bytes(8, 8))}}]}]})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "vision_disabled"
    assert reply.json()["error"]["param"] == "messages[0].content[0].image_url.url"
