"""The engine as the server sees it: one contract, whatever runs the model behind it.

Three engines keep it: EngineClient (a supervised worker process: engine.client), EngineRouter
(several of those behind a prefix-aware router: engine.router) and AsyncEngine (a thread of this
process: engine.engine). The server holds one of them and calls nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import AsyncIterator, Callable, Protocol

from ember.constraint_spec import ConstraintSpec
from ember.engine.messages import EngineInfo, MediaSpan
from ember.engine.stats import EngineStats
from ember.types import GenerationOutput, SamplingParams


class Engine(Protocol):
    info: EngineInfo | None  # what the loaded engine resolved; None until it has loaded
    status: str  # "loading" (first start or a restart), "ok", or "unavailable" (failed, with the reason)
    failed: str | None  # why the engine is unavailable

    @property
    def latest_stats(self) -> EngineStats | None:
        """The statistics as of the last step, read without waiting for one."""

    def launch(self) -> EngineInfo:
        """Load the model and get ready to serve (blocks; a loading thread calls it). A load
        failure raises ModelLoadError with the reason."""

    def start(self) -> None:
        """Attach to the running event loop (call from inside it, after `launch`)."""

    async def wait_ready(self, timeout: float | None) -> bool:
        """True once the engine serves; False when it is not back within `timeout` (None: no
        limit) or has given up."""

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                 cache_salt: str | None = None, constraint: ConstraintSpec | None = None,
                 report_progress: bool = False, may_retry: Callable[[], bool] | None = None,
                 media: Sequence[MediaSpan] = (), session: str | None = None) -> AsyncIterator[GenerationOutput]:
        """Run one request and yield its outputs until it finishes (engine.streams.RequestStreams.follow).
        Refusals (context length, cache size) raise before the first output. With `report_progress`,
        prefill chunks that produce no token yield an output too, with `num_computed_prompt_tokens`.
        `may_retry()` says, should the engine's worker die, whether the request may run again from
        the start (None: always, once). `media`: the prompt's images (messages.MediaSpan). `session`:
        the client's session key; several workers keep a session's requests on one (engine.router)."""

    def abort(self, request_id: str) -> None:
        """End a live request (its final output says `abort`); an unknown id is ignored."""

    async def check_constraint(self, spec: ConstraintSpec) -> None:
        """Raise InvalidRequest (naming the field) unless the spec's grammar compiles."""

    def health(self) -> dict:
        """What /health adds for this engine (worker pid and restarts; per-worker state)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop: live requests are aborted and their blocks returned."""
