"""Where a request's image comes from, as the dialects read it, and turning that into a checked
image: a base64 data URL or bare base64 (with its declared media type), or an http(s) URL that the
server fetches only when its operator allows it (`--image-urls`), within a timeout and the size
limit."""

from __future__ import annotations

from dataclasses import dataclass

from ember.errors import EmberError, InvalidRequest
from ember.media.image import ImageInput, decode_base64, invalid_media, parse_data_url, read_image
from ember.media.limits import MediaLimits

DATA, BASE64, URL = "data_url", "base64", "url"
DEFAULT_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image part as the request wrote it, not yet read: `value` is a data URL, base64 text
    or an http(s) URL (`kind`); `param` names the part for any refusal."""

    kind: str
    value: str
    param: str
    media_type: str | None = None  # what the request declares it to be (Anthropic's media_type)


def image_ref(url: str, param: str) -> ImageRef:
    """An OpenAI-style image URL: a data URL or an http(s) URL (anything else is refused here)."""
    lowered = url[:8].lower()
    if lowered.startswith("data:"):
        return ImageRef(DATA, url, param)
    if lowered.startswith(("http://", "https://")):
        return ImageRef(URL, url, param)
    raise invalid_media(f"{param} must be a data URL (data:image/png;base64,...) or an http(s) URL", param)


@dataclass(frozen=True, slots=True)
class ImageFetching:
    """Whether, and how, the server fetches images by URL."""

    allowed: bool = False
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S


async def fetch_bytes(ref: ImageRef, limits: MediaLimits, fetching: ImageFetching) -> bytes:
    """An http(s) image's bytes, read no further than the size limit."""
    if not fetching.allowed:
        raise InvalidRequest(f"{ref.param} is an http(s) URL, and this server fetches none (it was started without "
                             "--image-urls); send the image as a base64 data URL", param=ref.param,
                             code="invalid_media")
    import httpx

    try:
        async with httpx.AsyncClient(timeout=fetching.timeout_s, follow_redirects=True) as client:
            async with client.stream("GET", ref.value) as reply:
                if reply.status_code != 200:
                    raise invalid_media(f"{ref.param}: fetching the image gave HTTP {reply.status_code}", ref.param)
                data = bytearray()
                async for chunk in reply.aiter_bytes():
                    data += chunk
                    if len(data) > limits.max_image_bytes:
                        raise invalid_media(f"{ref.param}: the image is larger than {limits.max_image_bytes} bytes",
                                            ref.param)
                return bytes(data)
    except httpx.TimeoutException:
        raise EmberError(f"{ref.param}: fetching the image took longer than {fetching.timeout_s:g} s",
                         param=ref.param, code="media_fetch_timeout", status=504) from None
    except httpx.HTTPError as exc:
        raise EmberError(f"{ref.param}: the image could not be fetched ({type(exc).__name__})", param=ref.param,
                         code="media_fetch_failed", status=502) from None


def read_ref(ref: ImageRef, limits: MediaLimits, fetched: bytes | None = None) -> ImageInput:
    """The checked image of a reference (`fetched`: a URL's bytes, read already)."""
    if ref.kind == DATA:
        data, declared = parse_data_url(ref.value, ref.param, limits)
    elif ref.kind == BASE64:
        data, declared = decode_base64(ref.value, ref.param, limits), ref.media_type
    else:
        data, declared = fetched, ref.media_type
    return read_image(data, ref.param, limits, declared)
