"""An image as a request brings it: bytes from a data URL, base64 or a fetched URL, checked to be
one still image within the limits before it is decoded whole."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from ember.errors import InvalidRequest
from ember.media.limits import MediaLimits

# Pillow's format name -> the media type a request may declare for it
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
_ALIASES = {"image/jpg": "image/jpeg"}
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One checked image: its file's bytes as received and what was read of them."""

    data: bytes
    sha256: bytes  # of `data`: the media cache's key, and part of the prefix cache's block hashes
    width: int
    height: int
    media_type: str  # image/png, image/jpeg, image/webp or image/gif

    @property
    def pixel_bytes(self) -> int:
        """What its pixels take decoded (8-bit RGB): what a request's media budget counts."""
        return self.width * self.height * 3


def invalid_media(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="invalid_media")


def decode_base64(text: str, param: str, limits: MediaLimits) -> bytes:
    """Base64 text (padding required, no other characters) -> its bytes, within the size limit."""
    if len(text) * 3 // 4 > limits.max_image_bytes + 2:  # refused before decoding
        raise _too_large(len(text) * 3 // 4, param, limits)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise invalid_media(f"{param} is not valid base64", param) from None


def parse_data_url(url: str, param: str, limits: MediaLimits) -> tuple[bytes, str | None]:
    """A data URL -> (its bytes, the media type it declares); only base64 data URLs carry images."""
    found = _DATA_URL.match(url)
    if found is None or not found.group("b64"):
        raise invalid_media(f"{param} is not a base64 data URL (data:image/png;base64,...)", param)
    declared = found.group("type")
    return decode_base64(url[found.end():], param, limits), declared.lower() if declared else None


def read_image(data: bytes, param: str, limits: MediaLimits, declared_type: str | None = None) -> ImageInput:
    """Check that `data` is one still image of a supported format within the limits, and that it
    decodes whole. Its size is read from the header first, so a huge image is refused undecoded."""
    if len(data) > limits.max_image_bytes:
        raise _too_large(len(data), param, limits)
    if not data:
        raise invalid_media(f"{param} is empty", param)
    try:
        with Image.open(io.BytesIO(data)) as image:
            media_type = FORMATS.get(image.format or "")
            if media_type is None:
                raise invalid_media(f"{param} is a {image.format or 'file'} image; ember reads "
                                    f"{', '.join(sorted(FORMATS.values()))}", param)
            if declared_type is not None and _ALIASES.get(declared_type, declared_type) != media_type:
                raise invalid_media(f"{param} says it is {declared_type} but holds {media_type}", param)
            if getattr(image, "n_frames", 1) > 1:
                raise invalid_media(f"{param} is animated ({image.n_frames} frames); send one still image", param)
            width, height = image.size
            side = limits.max_image_side
            if width > side or height > side:
                raise invalid_media(f"{param} is {width}x{height} pixels; at most {side} pixels a side are allowed",
                                    param)
            if width < 1 or height < 1:
                raise invalid_media(f"{param} has no pixels", param)
            image.load()
    except InvalidRequest:
        raise
    except Image.DecompressionBombError:  # Pillow's own bound, met before ours on a huge header
        raise invalid_media(f"{param} is larger than {limits.max_image_side} pixels a side", param) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise invalid_media(f"{param} is not a readable image ({type(exc).__name__})", param) from None
    return ImageInput(data, hashlib.sha256(data).digest(), width, height, media_type)


def _too_large(size: int, param: str, limits: MediaLimits) -> InvalidRequest:
    return invalid_media(f"{param} is {size} bytes; an image may take at most {limits.max_image_bytes} bytes "
                         f"({limits.max_image_bytes / 2**20:g} MiB)", param)
