"""Images from every dialect into a vision model's prompt: the parsed ImageRefs read into checked
images (server.media_input), then laid out by encode_prompt with a tiny SmolVLM folder's image
preparation and the default model's tokenizer carrying SmolVLM's tokens and chat template
(tests/vision_fixtures.py). No model weights: only the prompt is built."""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from ember.errors import InvalidRequest
from ember.media.limits import MediaLimits
from ember.media.sources import ImageFetching
from ember.parsers.events import ThinkMarkers
from ember.parsers.hermes import HERMES
from ember.protocols.anthropic_messages import parse_count_tokens, parse_messages
from ember.protocols.chat_reply import ChatFeatures
from ember.protocols.native_generate import parse_generate
from ember.protocols.neutral import ModelInfo, encode_prompt
from ember.protocols.openai_chat import parse_chat
from ember.protocols.openai_responses import parse_responses
from ember.protocols.reasoning_seal import ReasoningSeal
from ember.server.media_input import read_prompt_images
from ember.server.keys import DEFAULT_TENANT
from ember.server.response_store import MemoryResponseStore, StoredResponse, record_size
from ember.server.responses_routes import make_context
from ember.types import CachePin
from vision_fixtures import data_url, image_bytes, load_vision, write_smolvlm_folder

MODEL = ModelInfo(name="served", max_model_len=4096, vocab_size=49192, chat=ChatFeatures(ThinkMarkers(), HERMES),
                  image_marker="<image>")
SQUARE = image_bytes(64, 64)  # brought up to 128 pixels: 2x2 tiles and the whole image, 20 image tokens
WIDE = image_bytes(300, 100, (20, 90, 200))  # 1x2 tiles and the whole image, 12 image tokens
EXPLICIT = {"mode": "explicit"}


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    return load_vision(write_smolvlm_folder(tmp_path_factory.mktemp("vision") / "smolvlm"))


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def read_images(prompt, pool, reads_images: bool = True) -> None:
    asyncio.run(read_prompt_images(prompt, reads_images, MediaLimits(), ImageFetching(), pool))


def encoded(prompt, smolvlm, pool) -> list[int]:
    tokenizer, vision = smolvlm
    read_images(prompt, pool)
    return encode_prompt(prompt, tokenizer, HERMES, vision)


def layout(smolvlm, data: bytes) -> str:
    width, height = (64, 64) if data == SQUARE else (300, 100)
    return smolvlm[1].layout(width, height).text


def image_url(data: bytes, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}, **extra}


def test_chat_images_are_laid_out_where_their_parts_are(smolvlm, pool):
    tokenizer, vision = smolvlm
    prompt = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, image_url(SQUARE), {"type": "text", "text": " with"}, image_url(WIDE),
        {"type": "text", "text": "."}]}]}, MODEL).prompt
    ids = encoded(prompt, smolvlm, pool)
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        f"<|im_start|>User: Compare{layout(smolvlm, SQUARE)} with{layout(smolvlm, WIDE)}."
        "<end_of_utterance>\nAssistant:")
    square, wide = prompt.media
    assert (square.image.width, square.image.height, wide.image.width) == (64, 64, 300)
    assert square.image.sha256 == hashlib.sha256(SQUARE).digest()
    assert square.stop < wide.start
    for span, tokens in ((square, 20), (wide, 12)):
        assert ids[span.start] == ids[span.stop - 1] == vision.image_token_id
        assert ids[span.start:span.stop].count(vision.image_token_id) == tokens
    assert ids.count(vision.image_token_id) == 32


def test_a_tool_result_image_reaches_a_template_that_lists_no_tools(smolvlm, pool):
    tokenizer, _ = smolvlm
    items = [{"role": "user", "content": "Draw a sky."},
             {"type": "function_call", "call_id": "c1", "name": "draw", "arguments": "{\"what\": \"sky\"}"},
             {"type": "function_call_output", "call_id": "c1", "output": [
                 {"type": "input_text", "text": "done:"}, {"type": "input_image", "image_url": data_url(WIDE)}]}]
    context = make_context(MemoryResponseStore(), ReasoningSeal(b"k" * 32))
    prompt = parse_responses({"input": items}, MODEL, context).prompt
    text = tokenizer.decode(encoded(prompt, smolvlm, pool), skip_special_tokens=False)
    # the template cannot list tools: the result is a user turn of text around the image
    assert f"User: <tool_response>\ndone:{layout(smolvlm, WIDE)}\n</tool_response><end_of_utterance>" in text
    assert len(prompt.media) == 1


def test_a_stored_conversation_replays_its_images_and_keeps_its_items(smolvlm, pool):
    store = MemoryResponseStore()
    context = make_context(store, ReasoningSeal(b"k" * 32))
    first = parse_responses({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(SQUARE)}, {"type": "input_text", "text": "What is it?"}]}]},
        MODEL, context)
    encoded(first.prompt, smolvlm, pool)
    reply = {"id": "msg_r", "type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "A red square.", "annotations": []}]}
    history = (*first.spec.input_items, reply)
    store.put(StoredResponse({"id": "resp_1"}, tuple(first.spec.input_items), history,
                             record_size({"id": "resp_1"}, history)), DEFAULT_TENANT)
    again = parse_responses({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(WIDE)}]}], "previous_response_id": "resp_1"}, MODEL, context)
    encoded(again.prompt, smolvlm, pool)
    assert [span.image.sha256 for span in again.prompt.media] == [hashlib.sha256(SQUARE).digest(),
                                                                    hashlib.sha256(WIDE).digest()]
    assert store.get("resp_1", DEFAULT_TENANT).history[0]["content"][0] == {"type": "input_image", "image_url": data_url(SQUARE),
                                                            "detail": "auto"}


def test_anthropic_count_tokens_counts_the_image_tokens(smolvlm, pool):
    _, vision = smolvlm
    body = {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": data_url(SQUARE).split(",", 1)[1]}},
        {"type": "text", "text": "What is it?"}]}]}
    counted = encoded(parse_count_tokens(body, MODEL).prompt, smolvlm, pool)
    created = encoded(parse_messages({"max_tokens": 16, **body}, MODEL).prompt, smolvlm, pool)
    assert counted == created and counted.count(vision.image_token_id) == 20


def test_a_generate_prompt_takes_its_images_at_its_markers(smolvlm, pool):
    tokenizer, _ = smolvlm
    job = parse_generate({"text": "<image>Name it, then <image>", "image_data": [
        data_url(WIDE), data_url(SQUARE).split(",", 1)[1]]}, MODEL)
    ids = encoded(job.prompt, smolvlm, pool)
    assert ids == tokenizer.encode(f"{layout(smolvlm, WIDE)}Name it, then {layout(smolvlm, SQUARE)}",
                                   add_special_tokens=True)
    assert [span.image.width for span in job.prompt.media] == [300, 64]


def test_cache_breakpoints_fall_before_or_after_an_image(smolvlm, pool):
    tokenizer, _ = smolvlm
    prompt = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare", "prompt_cache_breakpoint": EXPLICIT},
        image_url(SQUARE, prompt_cache_breakpoint=EXPLICIT), {"type": "text", "text": " and this"}]}]}, MODEL).prompt
    encoded(prompt, smolvlm, pool)
    before = "<|im_start|>User: Compare"
    assert prompt.cache_pins == [CachePin(len(tokenizer.encode(before)), 1800.0),
                                 CachePin(len(tokenizer.encode(before + layout(smolvlm, SQUARE))), 1800.0)]
    [span] = prompt.media
    assert prompt.cache_pins[0].num_tokens < span.start and prompt.cache_pins[1].num_tokens > span.stop


def test_reading_refusals_name_the_dialects_part(pool):
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, image_url(SQUARE)]}]},
                      MODEL).prompt
    with pytest.raises(InvalidRequest) as caught:
        read_images(chat, pool, reads_images=False)
    assert (caught.value.param, caught.value.code) == ("messages[0].content[1].image_url.url", "vision_disabled")
    jpeg_said = parse_messages({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                     "data": data_url(SQUARE).split(",", 1)[1]}}]}]}, MODEL).prompt
    with pytest.raises(InvalidRequest) as caught:
        read_images(jpeg_said, pool)
    assert (caught.value.param, caught.value.code) == ("messages[0].content[0].source.data", "invalid_media")
