"""What a request's images may take, and the refusals past it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ember.errors import InvalidRequest

DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_IMAGE_SIDE = 4096  # pixels
DEFAULT_MAX_IMAGE_MB = 8.0
DEFAULT_MEDIA_BUDGET_MB = 128.0  # one request's images, decoded


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_images: int = DEFAULT_MAX_IMAGES  # a request's images
    max_image_side: int = DEFAULT_MAX_IMAGE_SIDE
    max_image_bytes: int = int(DEFAULT_MAX_IMAGE_MB * 2**20)  # one image's file
    media_budget_bytes: int = int(DEFAULT_MEDIA_BUDGET_MB * 2**20)  # a request's images as 8-bit RGB pixels

    def __post_init__(self) -> None:
        for name in ("max_images", "max_image_side", "max_image_bytes", "media_budget_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def check_count(self, count: int, param: str) -> None:
        if count > self.max_images:
            raise InvalidRequest(f"the request holds {count} images; at most {self.max_images} are allowed",
                                 param=param, code="media_budget_exceeded")

    def check_budget(self, pixel_bytes: Sequence[int], param: str) -> None:
        """`pixel_bytes`: each image's decoded size so far; `param`: the part that went past."""
        total = sum(pixel_bytes)
        if total > self.media_budget_bytes:
            raise InvalidRequest(f"the request's images take {total / 2**20:.1f} MiB decoded; the media budget "
                                 f"is {self.media_budget_bytes / 2**20:g} MiB", param=param,
                                 code="media_budget_exceeded")
