"""Reading and checking images before anything runs (ember.media), and the server's gate on images
being encoded: every refusal names its part and its code."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import Image

from ember.errors import InvalidRequest
from ember.media.image import parse_data_url, read_image
from ember.media.limits import MediaLimits
from ember.media.sources import image_ref, read_ref
from ember.protocols.errors import ImagesBusy
from ember.server.state import ImagesEncoding

LIMITS = MediaLimits()


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def refusal(data: bytes, limits: MediaLimits = LIMITS, declared: str | None = None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        read_image(data, "part", limits, declared)
    assert caught.value.param == "part"
    return caught.value


def huge_png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims a size, with next to no pixel data behind it."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + \
        chunk(b"IEND", b"")


@pytest.mark.parametrize("fmt, media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                             ("GIF", "image/gif")])
def test_each_format_is_read_with_its_size_and_hash(fmt, media_type):
    data = encoded(Image.new("RGB", (30, 20), (10, 200, 30)), fmt)
    image = read_image(data, "part", LIMITS, media_type)
    assert (image.width, image.height, image.media_type) == (30, 20, media_type)
    assert image.pixel_bytes == 30 * 20 * 3 and len(image.sha256) == 32
    assert read_image(data, "part", LIMITS, None).sha256 == image.sha256


def test_what_is_not_one_still_readable_image_is_invalid_media():
    assert refusal(b"").code == "invalid_media"
    assert "not a readable image" in refusal(b"hello, not an image").message
    assert "BMP" in refusal(encoded(Image.new("RGB", (4, 4)), "BMP")).message
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    animated = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert "animated" in refusal(animated).message
    png = encoded(Image.new("RGB", (64, 64)), "PNG")
    assert refusal(png[:len(png) // 2]).code == "invalid_media"  # cut short
    assert "holds image/png" in refusal(png, declared="image/jpeg").message


def test_limits_are_checked_before_an_image_is_decoded():
    assert "pixels a side" in refusal(huge_png_header(100_000, 100_000)).message
    small = MediaLimits(max_image_side=16, max_image_bytes=200)
    assert "pixels a side" in refusal(encoded(Image.new("RGB", (17, 4)), "PNG"), small).message
    assert "bytes" in refusal(bytes(201), small).message


def test_data_urls_and_references():
    png = encoded(Image.new("RGB", (4, 4)), "PNG")
    import base64

    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert parse_data_url(url, "p", LIMITS) == (png, "image/png")
    assert read_ref(image_ref(url, "p"), LIMITS).width == 4
    for bad in ("data:image/png,rawbytes", "data:image/png;base64,@@@@", "data:;base64,"):
        with pytest.raises(InvalidRequest) as caught:
            read_ref(image_ref(bad, "p"), LIMITS)
        assert (caught.value.param, caught.value.code) == ("p", "invalid_media")
    with pytest.raises(InvalidRequest) as caught:
        image_ref("file:///etc/passwd", "p")
    assert caught.value.code == "invalid_media"
    assert image_ref("https://example.com/a.png", "p").kind == "url"


def test_a_request_s_images_are_counted_and_budgeted():
    limits = MediaLimits(max_images=2, media_budget_bytes=100)
    limits.check_count(2, "p")
    with pytest.raises(InvalidRequest) as caught:
        limits.check_count(3, "third")
    assert (caught.value.param, caught.value.code) == ("third", "media_budget_exceeded")
    limits.check_budget([60, 40], "second")
    with pytest.raises(InvalidRequest) as caught:
        limits.check_budget([60, 41], "second")
    assert caught.value.code == "media_budget_exceeded"


def test_images_being_encoded_are_bounded_and_given_back_once():
    gate = ImagesEncoding(limit=3)
    first = gate.take(2)
    with pytest.raises(ImagesBusy) as caught:
        gate.take(2)
    assert caught.value.status == 429 and caught.value.retry_after > 0
    first()
    first()  # given back once, however often called
    assert gate.count == 0
    oversized = gate.take(5)  # one request larger than the limit still runs, alone
    assert gate.count == 5
    oversized()
