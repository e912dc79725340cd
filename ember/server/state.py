"""What one configured model holds: its settings and, once loaded, its engine, admission and live
runs (server.model_pool keeps one for each model a server serves and moves it between states)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import hashlib
import logging
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import ember
from ember.constraint_spec import ConstraintSpec
from ember.engine.contract import Engine
from ember.errors import EmberError
from ember.freed_heap import release_freed_heap
from ember.loaders.serving_task import GENERATE, ServingTask, resolve_serving_task
from ember.media.processing import ImageProcessing, source_image_processing
from ember.protocols.errors import ImagesBusy, ModelLoading, ServerUnavailable
from ember.parsers.constraint import budget_close_text
from ember.protocols.chat_reply import ChatFeatures, ReplyPlan, plan_reply
from ember.protocols.neutral import GenerationRequest, ModelInfo, Prompt, encode_prompt
from ember.grammar.compiler import xgrammar_installed
from ember.protocols.grammar_plan import build_constraints
from ember.server.admission import Admission
from ember.server.chat_defaults import chat_features
from ember.server.config import ServerConfig
from ember.server.keys import KeyRing
from ember.server.media_input import read_prompt_images
from ember.server.model_card import component_set_sha
from ember.server.sampling_defaults import mode_sampling_defaults, sampling_defaults

logger = logging.getLogger("ember.server")

_PROMPT_TAIL_TOKENS = 16  # enough to see whether the prompt leaves a think block open


@dataclass(slots=True)
class LoadedModel:
    """A model ready to serve: its engine (engine.contract: a supervised worker process, several
    behind a router, or a thread of this process) and what requests need to know of it."""

    engine: Engine
    tokenizer: Any
    name: str
    max_model_len: int
    vocab_size: int
    path: str = ""  # what was loaded: a folder or a GGUF file (a named model's, once resolved)
    kv_capacity_tokens: int | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    mode_sampling_defaults: dict[bool, dict[str, Any]] = field(default_factory=dict)  # thinking on / off -> defaults
    dtype: str = ""
    chat: ChatFeatures = field(default_factory=ChatFeatures)
    batch_invariance: dict[str, Any] = field(default_factory=dict)  # the engine's InvarianceReport.as_dict()
    vision: ImageProcessing | None = None  # how its images are laid into prompts; None: it reads none
    task: ServingTask = ServingTask(GENERATE)  # generating, embeddings or reranking


def load_model(config: ServerConfig) -> LoadedModel:
    """Open the model's tokenizer and settings here and start its engine: a supervised worker
    process, or with `engine_worker` off a thread of this process (runs in a loading thread)."""
    from ember.loaders import source_opener

    source = source_opener(config.cache_dir, config.ollama_models)(config.model, config.revision, config.engine.mmproj)
    tokenizer = source.tokenizer
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    task = resolve_serving_task(source, embeddings=config.embeddings, rerank=config.rerank, pooling=config.pooling)
    chat = chat_features(config, tokenizer)
    _ = tokenizer.token_bytes, tokenizer.template_traits  # built now rather than on the first request
    vision = source_image_processing(source, config.engine.vision)
    engine = _start_engine(config, source)
    info = engine.info
    generation_config = getattr(source, "generation_config", None) or {}
    layers = (generation_config, config.override_generation_config, config.sampling_flags)
    defaults, mode_defaults = sampling_defaults(*layers), mode_sampling_defaults(*layers)
    _release_unreachable()  # reading a GGUF file's metadata (a large vocabulary's tokens) freed hundreds of MB
    return LoadedModel(
        engine=engine, tokenizer=tokenizer, name=source.name, path=source.path,
        max_model_len=info.max_model_len, vocab_size=info.vocab_size, kv_capacity_tokens=info.kv_capacity_tokens,
        sampling_defaults=defaults, mode_sampling_defaults=mode_defaults, dtype=info.dtype, chat=chat,
        batch_invariance=info.batch_invariance, vision=vision, task=task)


def _start_engine(config: ServerConfig, source) -> Engine:
    engine = _make_engine(config, source)
    engine.launch()
    return engine


def _make_engine(config: ServerConfig, source) -> Engine:
    if not config.engine_worker:
        from ember.engine.core import EngineCore
        from ember.engine.engine import AsyncEngine
        from ember.engine.worker import warm_up
        from ember.loaders import source_opener

        core = EngineCore.from_source(source, config.engine, source_opener(config.cache_dir, config.ollama_models))
        warm_up(core, source.tokenizer)
        return AsyncEngine(core, source.tokenizer)
    from ember.engine.client import EngineClient
    from ember.engine.messages import WorkerSettings

    settings = WorkerSettings(config.model, config.cache_dir, config.revision, config.ollama_models,
                              config.chat_template, config.engine, logging.getLogger().getEffectiveLevel(),
                              config.inject_fault)
    if config.data_parallel_size == 1:
        return EngineClient(settings, source.tokenizer, stall_timeout=config.worker_stall_timeout)
    from ember.engine.router import EngineRouter, replica_launches

    return EngineRouter([EngineClient(replica, source.tokenizer, env, config.worker_stall_timeout)
                         for replica, env in replica_launches(settings, config.data_parallel_size)])


def _shut_down(holder: list[Engine]) -> None:
    """Stop the engine that `holder` holds and let go of it before returning: the executor's thread
    keeps its task (here the list, not the engine) a moment after the caller resumes, and an engine
    held there would miss the collection that follows an unload."""
    holder.pop().shutdown()


def _release_unreachable() -> None:
    """Free what an unloaded model left (its engine client sits in reference cycles, which only the
    collector frees) and hand the pages back: the loading thread's arena would keep them resident."""
    gc.collect()
    release_freed_heap()


def _single_token_id(tokenizer, vocab_size: int, text: str) -> int | None:
    """The id `text` encodes to when it is one token of its own inside the model's vocabulary."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1 or ids[0] >= vocab_size or tokenizer.decode(ids, skip_special_tokens=False) != text:
        return None
    return ids[0]


class ImagesEncoding:
    """The images of requests whose prefill has not ended: at most `limit` at once, past it 429."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def take(self, count: int) -> Callable[[], None]:
        """Count a request's images (ImagesBusy past the limit); returns what gives them back."""
        if self.count + count > self.limit and self.count:
            raise ImagesBusy(self.count, self.limit)
        self.count += count
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self.count -= count

        return give_back


class ModelState:
    """One model of the server. `status`: unloaded -> loading -> ok -> unloading -> unloaded, or
    unavailable (a failed load, or an engine that stopped after a fault; `failure` says why)."""

    def __init__(self, config: ServerConfig, loader: Callable[[ServerConfig], LoadedModel] = load_model, *,
                 keys: KeyRing | None = None, images_encoding: ImagesEncoding | None = None,
                 ready_hooks: list | None = None, load_failed_hooks: list | None = None) -> None:
        self.config = config
        self.loader = loader
        self.status = "unloaded"
        self.failure: str | None = None
        self.failed_at = 0.0  # time.monotonic() of the last failed load
        self.loaded: LoadedModel | None = None
        self.model: ModelInfo | None = None  # kept after an unload: what the model was when last loaded
        self.fingerprint = ""
        self.component_set_sha = ""  # server.model_card.component_set_sha, once loaded
        self.started = int(time.time())
        self.admission = Admission(config.max_running, config.max_pending, config.pending_timeout,
                                   config.max_pending_per_tenant)
        self.keys = keys if keys is not None else KeyRing(config.api_key, config.api_key_file)
        self.images_encoding = images_encoding or ImagesEncoding(config.max_images_encoding)
        self.runs: set = set()  # live ChoiceRuns, stopped when the server stops
        # observers of the model becoming ready (given this state) and of a failed load (given the reason)
        self.ready_hooks: list[Callable[[ModelState], None]] = ready_hooks if ready_hooks is not None else []
        self.load_failed_hooks: list[Callable[[str], None]] = load_failed_hooks if load_failed_hooks is not None else []
        self.users = 0  # requests between routing and admission (server.model_pool.ModelPool.using)
        self.last_used = time.monotonic()
        self.keep_alive: float | None = None  # seconds to stay loaded when idle, as the last request asked
        self.load_seconds = 0.0  # how long the last load took
        self.last_resident = 0  # bytes its processes held when it was last unloaded
        self._prompt_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ember-prompt")
        self.load_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def names(self) -> list[str]:
        """The public id and aliases: as configured, else (once loaded) the model's own name."""
        if self.config.served_model_names:
            return list(self.config.served_model_names)
        return [self.model.name, *self.model.aliases] if self.model is not None else []

    @property
    def busy(self) -> bool:
        """Whether a request is routed to it, waits for a seat or runs (it is not unloaded then)."""
        return bool(self.users or self.admission.num_running or self.admission.num_waiting)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start_loading(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.status, self.failure = "loading", None
        self.load_task = self.loop.create_task(self._load())

    async def _load(self) -> None:
        began = time.monotonic()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work() -> None:  # a daemon thread: Ctrl-C during loading does not wait for it
            try:
                future.set_result(self.loader(self.config))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=work, name="ember-load", daemon=True).start()
        try:
            loaded = await asyncio.wrap_future(future)
        except Exception as exc:
            # An EmberError's message says what is wrong; anything else is a fault worth its traceback.
            logger.error("loading %s failed: %s", self.config.model or "the default model", exc,
                         exc_info=not isinstance(exc, EmberError))
            self.status, self.failure = "unavailable", f"the model failed to load: {exc}"
            self.failed_at = time.monotonic()
            for hook in self.load_failed_hooks:
                hook(str(exc))
            return
        self.load_seconds = time.monotonic() - began
        self._install(loaded)

    def _install(self, loaded: LoadedModel) -> None:
        names = self.config.served_model_names or [loaded.name]
        self.loaded = loaded
        self.model = ModelInfo(
            name=names[0], aliases=tuple(names[1:]), max_model_len=loaded.max_model_len,
            vocab_size=loaded.vocab_size, default_max_tokens=self.config.default_max_tokens,
            max_messages=self.config.max_messages, max_total_input_tokens=self.config.max_total_input_tokens,
            default_seed=self.config.engine.seed,
            kv_capacity_tokens=loaded.kv_capacity_tokens, sampling_defaults=loaded.sampling_defaults,
            mode_sampling_defaults=loaded.mode_sampling_defaults,
            chat=loaded.chat, has_chat_template=loaded.tokenizer.chat_template is not None,
            single_token_id=functools.partial(_single_token_id, loaded.tokenizer, loaded.vocab_size),
            image_marker=loaded.vision.marker if loaded.vision is not None else None, task=loaded.task)
        digest = hashlib.sha256(f"{ember.__version__}|{loaded.name}|{loaded.dtype}|{loaded.max_model_len}".encode())
        self.fingerprint = f"fp_{digest.hexdigest()[:10]}"
        self.component_set_sha = component_set_sha(loaded, self.config)
        loaded.engine.start()
        self.status = "ok"
        self.last_used = time.monotonic()
        for hook in self.ready_hooks:
            try:
                hook(self)
            except Exception:  # an observer's fault must not stop serving
                logger.exception("a ready hook failed")

    def begin_shutdown(self) -> None:
        """Stop taking requests and end the running ones (their KV blocks go back to the pool)."""
        stopping = ServerUnavailable("the server is shutting down")
        self.admission.close(stopping)
        for run in list(self.runs):
            run.stop(stopping)

    async def unload(self) -> None:
        """Stop the engine and let go of what it held, its tokenizer included (what the model was,
        `model`, stays for listings, less the tokenizer its single_token_id holds); the settings stay
        for a later load."""
        self.status = "unloading"
        if self.loaded is not None:
            await asyncio.to_thread(_shut_down, [self.loaded.engine])
        self.loaded, self.status, self.keep_alive = None, "unloaded", None
        if self.model is not None:
            self.model = replace(self.model, single_token_id=lambda text: None)
        await asyncio.to_thread(_release_unreachable)

    async def shutdown(self) -> None:
        self.begin_shutdown()
        if self.load_task is not None and not self.load_task.done():
            self.load_task.cancel()
        if self.loaded is not None:
            await asyncio.to_thread(self.loaded.engine.shutdown)
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)

    # ---- readiness ---------------------------------------------------------------------------

    def health(self) -> tuple[int, str]:
        """(status code, status): loading while the model loads or its engine worker starts again."""
        if self.status in ("ok", "unloading") and self.loaded is not None:
            engine = self.loaded.engine
            if engine.status == "unavailable":
                self.status, self.failure = "unavailable", f"the engine stopped after a fault: {engine.failed}"
            elif engine.status == "loading":
                return 503, "loading"
        return (200 if self.status in ("ok", "unloading") else 503), self.status

    def require_ready(self) -> None:
        """Raise unless the model is loaded here (routes that only tokenize need no more)."""
        self.health()
        if self.status in ("loading", "unloaded"):
            raise ModelLoading()
        if self.status not in ("ok", "unloading"):
            raise ServerUnavailable(self.failure or "the engine is not running")

    async def require_engine(self) -> None:
        """Raise unless the engine takes requests. While its worker starts again, a request waits
        for it (within the pending timeout) rather than failing at once."""
        self.require_ready()
        engine = self.loaded.engine
        if not await engine.wait_ready(self.config.pending_timeout or None):
            self.require_ready()  # the engine gave up: unavailable
            raise ModelLoading()

    # ---- work --------------------------------------------------------------------------------

    @property
    def engine(self):
        return self.loaded.engine

    async def encode(self, prompt: Prompt) -> list[int]:
        """Prompt token ids, rendered and tokenized off the event loop; its images read first (their
        spans are then in `prompt.media`)."""
        config, loaded = self.config, self.loaded
        await read_prompt_images(prompt, loaded.vision is not None, config.media_limits, config.image_fetching,
                                 self._prompt_pool)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prompt_pool, encode_prompt, prompt, loaded.tokenizer,
                                          self.model.chat.tool_format, loaded.vision)

    def reply_plan(self, job: GenerationRequest, prompt_token_ids: list[int]) -> ReplyPlan | None:
        """How a chat request's replies are parsed and steered (None: plain text)."""
        if job.chat is None:
            return None
        tokenizer = self.loaded.tokenizer
        tail = tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        plan = plan_reply(job.chat, self.model.chat, tail, tokenizer.token_bytes)
        if plan is not None and plan.budget is not None:
            plan.budget_close_tokens = len(tokenizer.encode(budget_close_text(plan.fmt.think)))
        return plan

    async def constraint(self, job: GenerationRequest, plan: ReplyPlan | None) -> ConstraintSpec | None:
        """How every choice's tokens are held: a grammar (compiled by the engine, which checks it
        here first) or the reply plan's steering; None for free text."""
        if job.grammar is None and (job.chat is None or not job.chat.tools):
            return plan.constraint() if plan is not None else None
        spec = build_constraints(job, plan, xgrammar_installed())
        if spec is None:
            return plan.constraint() if plan is not None else None
        await self.engine.check_constraint(spec)  # a grammar that does not compile is a 400 here
        return spec

    def decode(self, token_ids: list[int]) -> str:
        return self.loaded.tokenizer.decode(token_ids)

    async def engine_stats(self) -> dict[str, Any] | None:
        """The engine's counters as of its last step: answered at once, even while a step runs."""
        if self.status not in ("ok", "unloading") or self.engine.latest_stats is None:
            return None
        return asdict(self.engine.latest_stats)
