"""Several models behind one server: each configured model's ModelState, routed to by name before
admission, loaded on its first request (the first model at start), and unloaded when it has been
idle past its keep-alive, when a request asks (Ollama's keep_alive 0), or when the loaded-model cap
or the memory budget needs room for another (the least recently used idle model first).

A model is never unloaded under running requests: an unload waits until none is routed to it,
waits for a seat or runs, and a request that arrives while it waits calls the unload off. A model
that fails to load answers its requests with a 503 naming it (a later request tries again after
RETRY_FAILED_AFTER_S); the others keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from ember.protocols.errors import ModelLoading, ModelNotFound, ServerUnavailable
from ember.protocols.ollama_common import LATEST
from ember.server.config import ServerConfig
from ember.server.keys import KeyRing
from ember.server.state import ImagesEncoding, LoadedModel, ModelState, load_model

logger = logging.getLogger("ember.server")

RETRY_FAILED_AFTER_S = 30.0
_POLL_S = 0.05  # how often an unload or a load waiting for room looks again
# ModelState.status -> the state /health and /v1/models show
_STATES = {"unloaded": "unloaded", "loading": "loading", "ok": "ready", "unloading": "unloading",
           "unavailable": "failed"}


def public_state(state: ModelState) -> str:
    """A model's state as the server shows it: unloaded, loading, ready, unloading or failed."""
    return _STATES[state.status]


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    max_loaded: int | None = None  # models loaded at once; None: no cap
    memory_mib: float | None = None  # what the loaded models' processes may take together; None: no budget
    idle_unload_s: float | None = None  # unload a model idle this long; None: keep it


class ModelPool:
    """The server's models. `config`: the first model's settings, whose server-wide fields (address,
    keys, limits) every model shares."""

    def __init__(self, configs: list[ServerConfig], loader: Callable[[ServerConfig], LoadedModel] = load_model,
                 policy: PoolPolicy = PoolPolicy()) -> None:
        if not configs:
            raise ValueError("a server needs at least one model")
        self.config = configs[0]
        self.policy = policy
        self.keys = KeyRing(self.config.api_key, self.config.api_key_file)
        self.ready_hooks: list[Callable[[ModelState], None]] = []
        self.load_failed_hooks: list[Callable[[str], None]] = []
        self.unload_hooks: list[Callable[[ModelState, str], None]] = []
        images = ImagesEncoding(self.config.max_images_encoding)
        self.states = [ModelState(config, loader, keys=self.keys, images_encoding=images,
                                  ready_hooks=self.ready_hooks, load_failed_hooks=self.load_failed_hooks)
                       for config in configs]
        names = [name for state in self.states for name in state.names]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"two models are served as '{name}'")
        self._unloads: dict[int, asyncio.Task] = {}  # id(state) -> its unload, while it waits or stops
        self._stopping: set[int] = set()  # ids of states whose engine is being shut down
        self._load_locks = {id(state): asyncio.Lock() for state in self.states}
        self._reaper: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def default(self) -> ModelState:
        """The first model: requests that name none go to it, and it loads at start."""
        return self.states[0]

    @property
    def several(self) -> bool:
        return len(self.states) > 1

    # ---- routing ------------------------------------------------------------------------------

    def resolve(self, name: str | None) -> ModelState:
        """The model `name` stands for (an id or alias; Ollama's `:latest` tag allowed); None or ''
        the first. A server of one model routes every name to it: the dialect's own check answers
        404 once the model is ready (so a request while it loads or restarts is told to wait)."""
        if not name or not self.several:
            return self.default
        for candidate in (name, name.removesuffix(LATEST)):
            for state in self.states:
                if candidate in state.names:
                    return state
        raise ModelNotFound(name, "', '".join(self.public_names()))

    def public_names(self) -> list[str]:
        return [state.names[0] for state in self.states if state.names]

    @contextlib.asynccontextmanager
    async def using(self, name: str | None) -> AsyncIterator[ModelState]:
        """The model a request names, loaded and taking requests, held (never unloaded) until the
        block ends; a pending unload of it is called off."""
        state = self.resolve(name)
        state.users += 1
        state.last_used = time.monotonic()
        try:
            await self._ready(state)
            yield state
        finally:
            state.users -= 1
            state.last_used = time.monotonic()

    async def _ready(self, state: ModelState) -> None:
        timeout = state.config.pending_timeout or None
        deadline = None if timeout is None else time.monotonic() + timeout
        self._call_off_unload(state)
        if state is self.default and state.status == "loading" and state.model is None:
            raise ModelLoading()  # the server is starting: its first model's requests are told to come back
        async with self._load_locks[id(state)]:
            task = self._unloads.get(id(state))
            if task is not None:  # its engine is stopping: that ends first, then it loads again
                await asyncio.shield(task)
            if state.status == "unavailable" and state.loaded is None:
                if time.monotonic() - state.failed_at < RETRY_FAILED_AFTER_S:
                    raise self._load_failed(state)
                state.status = "unloaded"
            if state.status == "unloaded":
                await self._make_room(state, deadline)
                state.start_loading()
            load = state.load_task
        if state.status == "loading" and load is not None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(asyncio.shield(load), remaining)
            except asyncio.TimeoutError:
                raise ModelLoading() from None
        if state.status == "unavailable" and state.loaded is None:
            raise self._load_failed(state)
        await state.require_engine()

    def _load_failed(self, state: ModelState) -> ServerUnavailable:
        failure = state.failure.removeprefix("the model ") if state.failure else "is not available"
        return ServerUnavailable(f"the model '{self.label(state)}' {failure}")

    def label(self, state: ModelState) -> str:
        return state.names[0] if state.names else (state.config.model or "the default model")

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """At server start: load the first model; watch for idle ones."""
        self.loop = asyncio.get_running_loop()
        self.default.start_loading()
        self._reaper = self.loop.create_task(self._reap_idle())

    def request_unload(self, state: ModelState, reason: str) -> asyncio.Task | None:
        """Unload `state` once nothing runs on it (None: it is not loaded; one loading now is
        unloaded once it is loaded and idle)."""
        if state.status == "loading":
            state.keep_alive = 0.0
        if state.status != "ok":
            return self._unloads.get(id(state))
        state.status = "unloading"
        task = self._unloads[id(state)] = self.loop.create_task(self._unload(state, reason))
        return task

    async def _unload(self, state: ModelState, reason: str) -> None:
        key = id(state)
        try:
            while state.busy:
                await asyncio.sleep(_POLL_S)
            self._stopping.add(key)
            state.last_resident = resident_bytes(state)
            logger.info("unloading model %s: %s", self.label(state), reason)
            await state.unload()
            for hook in self.unload_hooks:
                hook(state, reason)
        finally:
            self._stopping.discard(key)
            if self._unloads.get(key) is asyncio.current_task():
                del self._unloads[key]

    def _call_off_unload(self, state: ModelState) -> None:
        """A request for a model whose unload still waits for its requests: it serves on."""
        task = self._unloads.get(id(state))
        if task is not None and id(state) not in self._stopping:
            task.cancel()
            self._unloads.pop(id(state), None)
            state.status = "ok"

    async def _make_room(self, state: ModelState, deadline: float | None) -> None:
        """Unload least recently used idle models until `state` fits the cap and the budget; wait
        (to the request's deadline) while every other loaded model is busy."""
        while self._needs_room(state):
            idle = [other for other in self.states
                    if other is not state and other.status == "ok" and not other.busy]
            if idle:
                victim = min(idle, key=lambda other: other.last_used)
                unload = self.request_unload(victim, f"making room for {self.label(state)}")
                try:
                    await asyncio.shield(unload)
                except asyncio.CancelledError:
                    if not unload.cancelled():  # this request itself was cancelled
                        raise
                continue  # done, or called off by a request for it: look again
            if deadline is not None and time.monotonic() >= deadline:
                raise ServerUnavailable(f"the model '{self.label(state)}' cannot be loaded: the models loaded "
                                        f"now are all busy ({self._limits_text()})")
            await asyncio.sleep(_POLL_S)

    def _needs_room(self, state: ModelState) -> bool:
        held = [other for other in self.states if other is not state and other.status in ("loading", "ok", "unloading")]
        if not held:
            return False
        if self.policy.max_loaded is not None and len(held) >= self.policy.max_loaded:
            return True
        if self.policy.memory_mib is not None:
            used = sum(resident_bytes(other) for other in held)
            return used + expected_bytes(state) > self.policy.memory_mib * 2**20
        return False

    def _limits_text(self) -> str:
        limits = []
        if self.policy.max_loaded is not None:
            limits.append(f"--max-loaded-models {self.policy.max_loaded}")
        if self.policy.memory_mib is not None:
            limits.append(f"--models-memory-mib {self.policy.memory_mib:g}")
        return ", ".join(limits)

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for state in self.states:
                if state.status != "ok":
                    continue
                if state.busy:
                    state.last_used = now
                    continue
                keep = state.keep_alive if state.keep_alive is not None else self.policy.idle_unload_s
                if keep is not None and keep >= 0 and now - state.last_used >= keep:
                    self.request_unload(state, f"idle for {now - state.last_used:.0f} s")

    # ---- the server's health and ending --------------------------------------------------------

    def health(self) -> tuple[int, str]:
        """With one model, its own; with several, ok while any model can serve (unavailable once every
        one has failed), and loading while the first one loads for the first time."""
        if not self.several:
            if self.default.status == "unloaded" and self.default.model is not None:
                return 200, "ok"  # unloaded when idle: the next request loads it again
            return self.default.health()
        for state in self.states:
            state.health()  # notices engines that stopped after a fault
        if self.default.status == "loading" and self.default.model is None:
            return 503, "loading"
        if all(state.status == "unavailable" for state in self.states):
            return 503, "unavailable"
        return 200, "ok"

    def model_states(self) -> list[dict]:
        """Each model's name, state and (failed) reason, for /health."""
        entries = []
        for state in self.states:
            entry = {"model": self.label(state), "state": public_state(state),
                     "aliases": state.names[1:]}
            if state.status == "unavailable" and state.failure:
                entry["reason"] = state.failure
            if state.loaded is not None:
                entry.update(state.loaded.engine.health())
                entry["resident_mib"] = round(resident_bytes(state) / 2**20, 1)
            entries.append(entry)
        return entries

    def begin_drain(self, timeout: float) -> None:
        """Stop admitting; the running requests are cancelled only if they outlast `timeout`."""
        for state in self.states:
            state.admission.close(ServerUnavailable("the server is shutting down"))
        self.loop.call_later(timeout, self.begin_shutdown)

    def begin_shutdown(self) -> None:
        for state in self.states:
            state.begin_shutdown()

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._unloads.values()):
            task.cancel()
        await asyncio.gather(*(state.shutdown() for state in self.states), return_exceptions=True)


def resident_bytes(state: ModelState) -> int:
    """The resident memory of a loaded model's worker processes (its engine thread's weights and KV
    pool when it runs in this process); 0 when it is not loaded."""
    loaded = state.loaded
    if loaded is None:
        return 0
    import psutil

    health = loaded.engine.health()
    pids = [worker.get("worker_pid") for worker in health.get("workers", ())] or [health.get("worker_pid")]
    total = 0
    for pid in pids:
        if not pid:
            continue
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    if total == 0 and loaded.engine.info is not None:
        info = loaded.engine.info
        total = info.weight_bytes + (info.kv_cache_bytes or 0)
    return total


def expected_bytes(state: ModelState) -> int:
    """What a model about to load is expected to take: what it held when last unloaded, else its
    files' size (nothing for a name that is not a local path: the budget then holds from its next
    load on)."""
    return state.last_resident or file_bytes(state.config.model)


def file_bytes(model: str | None) -> int:
    """The size of a local model's weights: a file's, or a folder's weight files'; 0 for other names."""
    path = Path(model) if model else None
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(item.stat().st_size for item in path.iterdir() if item.suffix in (".safetensors", ".gguf", ".bin"))
