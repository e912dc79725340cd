"""The engine's images: each prepared (media.processing) and encoded by the model's tower once,
kept by the SHA-256 of its bytes, and spliced into prefill where its image tokens are.

An image is encoded when a request that needs it is in the engine and the image's tokens are not
all in the prefix cache already (an image wholly inside a cached prefix is never encoded). Its
work goes in small pieces (preparing its pixels, then the model's encode_image_steps: some patches
through one stage of one tower layer at a time), a bounded time per step while other requests
decode (`advance`), so running streams keep their pace; until an image is ready, its request's
prefill stops before the image's first token (Request.unready_spans: the scheduler only knows that
some positions cannot be computed yet). Two requests that bring the same image share its one
encoding. An image stays cached while any request holds it, and afterwards while the cache's byte
budget allows, the least recently used going first.

A model whose image tokens attend to each other both ways in prefill (Gemma 3:
`images_attend_both_ways`) gets each request's runs of consecutive image-token positions as its
Request.bidirectional_spans (transformers' groups: each image and each pan-and-scan crop is its own
run); the scheduler and the attention masks then see spans of positions only.

Shapes: an image's embeddings are (its image tokens, hidden), one row per image-token position of
its span, in order.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ember.engine.messages import MediaSpan
from ember.engine.request import Request
from ember.engine.scheduler import ScheduledRequest
from ember.media.processing import ImageProcessing

logger = logging.getLogger("ember.engine")

DEFAULT_CACHE_MB = 256.0
_PIECE_DECAY = 0.9  # how fast the slowest recent piece's seconds are forgotten, a piece at a time


@dataclass(slots=True, eq=False)
class _Image:
    sha256: bytes
    data: bytes  # the image file, until its pixels are prepared
    users: set[str] = field(default_factory=set)  # ids of the requests that hold it
    steps: Iterator[None] | None = None  # its encoding under way (the model's encode_image_steps)
    embeddings: torch.Tensor | None = None  # (image tokens, hidden) once ready
    error: str | None = None  # why it cannot be used

    @property
    def ready(self) -> bool:
        return self.embeddings is not None

    @property
    def num_bytes(self) -> int:
        return 0 if self.embeddings is None else self.embeddings.numel() * self.embeddings.element_size()


@dataclass(slots=True)
class _Span:
    image: _Image
    positions: np.ndarray  # the prompt positions of its image tokens, ascending: row k takes embeddings[k]


class ImageEncoder:
    """Not thread-safe: the engine's one thread calls everything."""

    def __init__(self, model: torch.nn.Module, processing: ImageProcessing, device: torch.device,
                 cache_bytes: int) -> None:
        self.model = model
        self.processing = processing
        self.device = device
        self.cache_bytes = cache_bytes
        self.bidirectional = images_attend_both_ways(model)
        self._images: dict[bytes, _Image] = {}  # every image a live request holds, or the cache keeps
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # ready images no request holds, least recent first
        self._spans: dict[str, list[_Span]] = {}  # request id -> its images' spans
        self.num_encoded = 0  # images encoded (each once)
        self.num_reused = 0  # images a request found already encoded or under way
        # the slowest recent piece of work's seconds (decaying): a piece starts only when one as slow
        # would end within the step's allowance (the first piece of a step aside)
        self._piece_seconds = 0.0

    # ---- requests ---------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Hold the request's images; each span's image-token positions are found in its prompt."""
        token_id = self.processing.image_token_id
        tokens = np.asarray(request.token_ids[:request.num_prompt_tokens])
        spans = []
        for span in request.media:
            image = self._images.get(span.sha256)
            if image is None:
                image = self._images[span.sha256] = _Image(span.sha256, span.data)
            else:
                self.num_reused += 1
                self._idle.pop(span.sha256, None)
            image.users.add(request.request_id)
            positions = span.start + np.flatnonzero(tokens[span.start:span.stop] == token_id)
            spans.append(_Span(image, positions))
        self._spans[request.request_id] = spans
        if self.bidirectional and spans:
            request.bidirectional_spans = consecutive_runs(np.concatenate([span.positions for span in spans]))
        self._mark_unready(request)

    def remove(self, request_id: str) -> None:
        """The request ended: its images are kept only while the cache's budget allows."""
        for span in self._spans.pop(request_id, ()):
            image = span.image
            image.users.discard(request_id)
            if not image.users:
                if image.ready:
                    self._idle[image.sha256] = None
                else:  # nobody waits for it: its work so far is dropped
                    del self._images[image.sha256]
        self._evict()

    def failed(self, request: Request) -> str | None:
        """Why the request cannot run (an image that could not be prepared or encoded), if so."""
        for span in self._spans.get(request.request_id, ()):
            if span.image.error is not None:
                return span.image.error
        return None

    # ---- the work ---------------------------------------------------------------------------------

    def advance(self, requests: list[Request], seconds: float | None, kv_hits) -> None:
        """Prepare and encode the images `requests` need (in their order), for about `seconds`
        (None: all of them; at least one unit when any is needed), then mark what each request
        cannot compute yet. `kv_hits(request)`: the prompt tokens its prefix cache already holds."""
        deadline = None if seconds is None else time.perf_counter() + seconds
        worked = False
        for request in requests:
            spans = self._spans.get(request.request_id)
            if not spans or all(span.image.ready or span.image.error for span in spans):
                continue
            computed = request.num_computed_tokens or kv_hits(request)
            for span in spans:
                image = span.image
                if image.ready or image.error or not len(span.positions) or span.positions[-1] < computed:
                    continue
                while not image.ready and image.error is None:
                    began = time.perf_counter()
                    if worked and deadline is not None and began + self._piece_seconds >= deadline:
                        break
                    self._work_on(image, len(span.positions))
                    self._piece_seconds = max(time.perf_counter() - began, self._piece_seconds * _PIECE_DECAY)
                    worked = True
        for request in requests:
            self._mark_unready(request)

    def _work_on(self, image: _Image, num_tokens: int) -> None:
        """One piece of work: prepare the image's pixels, or take its encoding one piece further."""
        try:
            if image.steps is None:
                inputs = {name: torch.from_numpy(array).to(self.device)
                          for name, array in self.processing.prepare(image.data).items()}
                image.steps = self.model.encode_image_steps(**inputs)
                image.data = b""  # the file's bytes are not needed past its pixels
                return
            with torch.inference_mode():
                next(image.steps)
        except StopIteration as done:
            image.steps = None
            embeddings = done.value
            if embeddings.shape[0] != num_tokens:
                self._fail(image, ValueError(f"the image gives {embeddings.shape[0]} embeddings for {num_tokens} "
                                             "image tokens in the prompt"))
                return
            image.embeddings = embeddings
            self.num_encoded += 1
        except Exception as exc:  # a bad image fails the requests that hold it, not the engine
            self._fail(image, exc)

    @staticmethod
    def _fail(image: _Image, exc: Exception) -> None:
        logger.warning("an image could not be used: %s: %s", type(exc).__name__, exc)
        image.steps = None
        image.error = f"an image could not be prepared or encoded: {exc}"

    def _mark_unready(self, request: Request) -> None:
        request.unready_spans = [(int(span.positions[0]), int(span.positions[-1]) + 1)
                                 for span in self._spans.get(request.request_id, ())
                                 if not span.image.ready and len(span.positions)]

    # ---- the step -----------------------------------------------------------------------------------

    def embeddings_for(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step's flattened tokens (R,), their embeddings (R, hidden)) for the image
        tokens the step computes; None when it computes none."""
        rows: list[np.ndarray] = []
        values: list[torch.Tensor] = []
        offset = 0
        for item in scheduled:
            start, stop = item.start, item.start + item.num_new_tokens
            for span in self._spans.get(item.request.request_id, ()):
                positions = span.positions
                first, last = np.searchsorted(positions, start), np.searchsorted(positions, stop)
                if first < last:
                    rows.append(positions[first:last] - start + offset)
                    values.append(span.image.embeddings[first:last])
            offset += item.num_new_tokens
        if not rows:
            return None
        return torch.from_numpy(np.concatenate(rows)).to(self.device), torch.cat(values)

    def _evict(self) -> None:
        held = sum(image.num_bytes for image in self._images.values())
        while held > self.cache_bytes and self._idle:
            sha256, _ = self._idle.popitem(last=False)
            held -= self._images.pop(sha256).num_bytes

    def stats(self) -> dict[str, int]:
        return {"images_cached": sum(1 for image in self._images.values() if image.ready),
                "image_cache_bytes": sum(image.num_bytes for image in self._images.values()),
                "images_encoded": self.num_encoded, "images_reused": self.num_reused}


def images_attend_both_ways(model: torch.nn.Module) -> bool:
    """Whether one image's tokens attend to each other both ways in the model's prefill (Gemma 3)."""
    return bool(getattr(model, "images_attend_bidirectionally", False))


def consecutive_runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """The maximal runs [start, stop) of consecutive positions in ascending `positions`."""
    if not len(positions):
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1  # where a run begins, the first one aside
    starts = positions[np.concatenate(([0], breaks))]
    stops = positions[np.concatenate((breaks - 1, [len(positions) - 1]))] + 1
    return list(zip(starts.tolist(), stops.tolist()))


def check_spans(media: list[MediaSpan], num_prompt_tokens: int) -> str | None:
    """Why a request's spans cannot be right (outside the prompt, overlapping, out of order), if so."""
    previous = 0
    for span in media:
        if not previous <= span.start < span.stop <= num_prompt_tokens:
            return f"an image's tokens [{span.start}, {span.stop}) are not within the prompt in order"
        previous = span.stop
    return None
