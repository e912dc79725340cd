"""Images laid into a rendered prompt: the template writes the architecture's marker where each
image goes; each marker becomes that image's layout (media.processing), and each image's span is
found again in the token ids by its image tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember.errors import InvalidRequest
from ember.media.image import ImageInput

if TYPE_CHECKING:
    from ember.media.processing import ImageProcessing


@dataclass(frozen=True, slots=True)
class PromptImage:
    """An image of an encoded prompt: the positions [start, stop) from its first image token to its last."""

    image: ImageInput
    start: int
    stop: int


def lay_out_images(text: str, images: Sequence[ImageInput], vision: ImageProcessing,
                   encode: Callable[[str], list[int]], param: str) -> tuple[list[int], list[PromptImage]]:
    """(token ids, each image's span) of `text`, whose markers stand for `images` in order."""
    pieces = text.split(vision.marker)
    if len(pieces) - 1 != len(images):
        raise InvalidRequest(f"the prompt holds {len(pieces) - 1} image markers ({vision.marker}) for "
                             f"{len(images)} images; its text may not hold the marker itself", param=param)
    layouts = [vision.layout(image.width, image.height) for image in images]
    expanded = pieces[0] + "".join(layout.text + piece for layout, piece in zip(layouts, pieces[1:]))
    ids = encode(expanded)
    positions = [i for i, token in enumerate(ids) if token == vision.image_token_id]
    if len(positions) != sum(layout.num_image_tokens for layout in layouts):
        raise InvalidRequest(f"the prompt's text holds the image token {vision.image_token} itself", param=param)
    spans, first = [], 0
    for image, layout in zip(images, layouts):
        last = first + layout.num_image_tokens - 1
        spans.append(PromptImage(image, positions[first], positions[last] + 1))
        first = last + 1
    return ids, spans
