"""A request's images read before its prompt is encoded: fetched (http(s) URLs, when allowed),
decoded and checked against the limits, off the event loop; the prompt's ImageRefs become the
ImageInputs the encoder lays out. Nothing that fails here reaches the engine."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from ember.errors import InvalidRequest
from ember.media.limits import MediaLimits
from ember.media.sources import URL, ImageFetching, ImageRef, fetch_bytes, read_ref
from ember.protocols.neutral import ChatPrompt, Prompt, TextPrompt, prompt_images


async def read_prompt_images(prompt: Prompt, reads_images: bool, limits: MediaLimits, fetching: ImageFetching,
                             pool: Executor) -> None:
    """Replace the prompt's image references with checked images (InvalidRequest naming the part)."""
    refs = [ref for ref in prompt_images(prompt) if isinstance(ref, ImageRef)]
    if not refs:
        return
    if not reads_images:
        raise InvalidRequest(f"{refs[0].param} is an image, and this server reads no images (a text-only model, "
                             "or --no-vision)", param=refs[0].param, code="vision_disabled")
    limits.check_count(len(refs), refs[limits.max_images].param if len(refs) > limits.max_images else refs[0].param)
    fetched = await asyncio.gather(*(fetch_bytes(ref, limits, fetching) if ref.kind == URL else _nothing()
                                     for ref in refs))
    loop = asyncio.get_running_loop()
    images = await asyncio.gather(*(loop.run_in_executor(pool, read_ref, ref, limits, data)
                                    for ref, data in zip(refs, fetched)))
    sizes = []
    for ref, image in zip(refs, images):
        sizes.append(image.pixel_bytes)
        limits.check_budget(sizes, ref.param)
    read = dict(zip(map(id, refs), images))
    if isinstance(prompt, TextPrompt):
        prompt.images = [read.get(id(image), image) for image in prompt.images]
    elif isinstance(prompt, ChatPrompt):
        for message in prompt.messages:
            for part in message["content"] if isinstance(message.get("content"), list) else ():
                if part.get("type") == "image":
                    part["image"] = read.get(id(part["image"]), part["image"])


async def _nothing() -> None:
    return None
