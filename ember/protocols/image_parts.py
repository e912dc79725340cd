"""Image parts as the dialects write them, read into ImageRefs with cheap checks of their form only
(the bytes are read later, by the server's media_input, naming the same `param`).

- OpenAI Chat: {"type": "image_url", "image_url": {"url": ..., "detail": ...}} or "image_url": "...";
- OpenAI Responses: {"type": "input_image", "image_url": ..., "detail": ...} (no file_id);
- Anthropic: {"type": "image", "source": {"type": "base64", "media_type": ..., "data": ...}} or
  {"type": "url", "url": ...} (no file source).
An image's `detail` may be left out or "auto": ember lays every image out at its model's own
resolution, so "low" and "high" are refused by name rather than ignored.
"""

from __future__ import annotations

from collections.abc import Mapping

from ember.errors import InvalidRequest
from ember.media.image import FORMATS
from ember.media.sources import BASE64, ImageRef, image_ref
from ember.protocols.errors import unsupported
from ember.protocols.fields import Fields, json_type

DETAILS = ("auto", "low", "high")
ANTHROPIC_MEDIA_TYPES = tuple(sorted(FORMATS.values()))
ANTHROPIC_SOURCES = ("base64", "url")


def read_detail(holder: Fields) -> str:
    """`detail`: absent or auto (what it is then); low and high refused by name."""
    detail = holder.string("detail", "auto", choices=DETAILS)
    if detail != "auto":
        raise unsupported(holder.path_of("detail"), f"{holder.path_of('detail')} is '{detail}'; ember lays every "
                                                    "image out at its model's own resolution, so detail must be "
                                                    "auto or left out")
    return detail


def read_chat_image(part: Fields) -> ImageRef:
    """A Chat Completions image_url part: `image_url` an object {url, detail} or the URL itself."""
    raw = part.raw("image_url")
    path = part.path_of("image_url")
    if isinstance(raw, str):
        return image_ref(raw, path)
    if raw is None:
        raise InvalidRequest(f"{path} is required: an object {{url, detail}} or a URL string", param=path)
    if not isinstance(raw, Mapping):
        raise InvalidRequest(f"{path} must be an object {{url, detail}} or a URL string, not {json_type(raw)}",
                             param=path)
    image = Fields(raw, path)
    read_detail(image)
    return image_ref(_required(image, "url"), image.path_of("url"))


def read_responses_image(part: Fields) -> tuple[str, str]:
    """A Responses input_image part: (its image_url, its detail), checked; file_id is refused."""
    if part.has("file_id"):
        raise InvalidRequest(f"{part.path_of('file_id')}: ember has no Files API to read an image from; send it "
                             "as image_url (a data URL, or an http(s) URL)", param=part.path_of("file_id"),
                             code="unsupported_content")
    url = _required(part, "image_url")
    detail = read_detail(part)
    image_ref(url, part.path_of("image_url"))
    return url, detail


def read_anthropic_image(block: Fields) -> ImageRef:
    """An Anthropic image block's source: base64 with its declared media type, or a URL."""
    source = block.object("source")
    if source is None:
        raise InvalidRequest(f"{block.path_of('source')} is required", param=block.path_of("source"))
    kind = source.string("type")
    if kind == "file":
        raise InvalidRequest(f"{source.path_of('type')}: ember has no Files API to read an image from; send it as "
                             "a base64 or url source", param=source.path_of("type"), code="unsupported_content")
    if kind not in ANTHROPIC_SOURCES:
        raise InvalidRequest(f"{source.path_of('type')} must be one of {', '.join(ANTHROPIC_SOURCES)}"
                             + (f"; got '{kind}'" if kind is not None else ""), param=source.path_of("type"))
    if kind == "url":
        return image_ref(_required(source, "url"), source.path_of("url"))
    media_type = source.string("media_type", choices=ANTHROPIC_MEDIA_TYPES)
    if media_type is None:
        raise InvalidRequest(f"{source.path_of('media_type')} is required: one of "
                             f"{', '.join(ANTHROPIC_MEDIA_TYPES)}", param=source.path_of("media_type"))
    return ImageRef(BASE64, _required(source, "data"), source.path_of("data"), media_type)


def misplaced_image(path: str, role: str) -> InvalidRequest:
    """An image where no chat template can show it: images go in user turns and tool results."""
    return InvalidRequest(f"{path}: a {role} message cannot hold an image; images go in user messages and "
                          "tool results", param=path, code="unsupported_content")


def _required(holder: Fields, name: str) -> str:
    value = holder.string(name, non_empty=True)
    if value is None:
        raise InvalidRequest(f"{holder.path_of(name)} is required", param=holder.path_of(name))
    return value
