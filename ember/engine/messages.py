"""The messages between the front end and an engine worker, and their one encoding.

Every message is a typed msgspec Struct, tagged by its class name, sent as msgpack over ZeroMQ
sockets (ember.engine.client, ember.engine.worker). Nothing here is a live object: tcp:// reaches
a worker on another host as well as ipc:// one on this host.

    front end -> worker   Add, Abort, Pause, Resume, Query, Shutdown (AsyncEngine's thread takes
                          the same Add, Abort, Pause, Resume and Shutdown through a queue, and
                          applies them the same way: engine.driver)
    worker -> front end   Ready (once loaded), Outputs (after each step, with the statistics
                          and, for a data-parallel router, the changes to its prefix cache),
                          Answer (to a Query), Heartbeat (while it has nothing to step: the
                          front end's watchdog counts it as progress), Fatal (the worker cannot
                          go on; it exits after it)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec

from ember.config import EngineConfig
from ember.constraint_spec import ConstraintSpec
from ember.engine.stats import EngineStats
from ember.types import SamplingParams, StepOutput


class MediaSpan(msgspec.Struct, array_like=True, frozen=True):
    """An image in a prompt: its file's bytes, their SHA-256, and the prompt positions [start, stop)
    that hold its tokens. The model's image-token ids in that range take the image's embeddings,
    in order; the other tokens of the span (row and tile markers) stay text."""

    sha256: bytes
    data: bytes
    start: int
    stop: int


def media_key(media: Sequence[MediaSpan], start: int, stop: int) -> bytes | None:
    """The SHA-256s of the images whose spans overlap positions [start, stop), for the prefix
    cache's block hashes (the same tokens beside another image are other KV); None if none."""
    keys = [span.sha256 for span in media if span.start < stop and start < span.stop]
    return b"".join(keys) if keys else None


class Add(msgspec.Struct, tag=True):
    """A request for the engine: the one message that adds one, whichever engine runs it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # its priority included
    cache_salt: str | None = None
    arrival_time: float = 0.0
    constraint: ConstraintSpec | None = None
    report_progress: bool = False
    media: list[MediaSpan] = []  # its images, in prompt order


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Pause(msgspec.Struct, tag=True):
    """Stop stepping these requests (their consumers have too much unread: engine.backlog); they
    keep their blocks, and may be preempted like any other request."""

    request_ids: list[str]


class Resume(msgspec.Struct, tag=True):
    request_ids: list[str]


class QueryKind(enum.Enum):
    STATS = "stats"  # the engine's statistics (EngineStats)
    CHECK_INVARIANTS = "check_invariants"  # an error naming a leaked block, else True
    CHECK_CONSTRAINT = "check_constraint"  # whether `constraint` compiles (an error naming the field), else True


class Query(msgspec.Struct, tag=True):
    """A question answered between steps (engine.driver answers each kind through its table)."""

    query_id: int
    kind: QueryKind
    constraint: ConstraintSpec | None = None


class Shutdown(msgspec.Struct, tag=True):
    pass


class EngineInfo(msgspec.Struct):
    """What the loaded engine resolved, for health, model cards and the log."""

    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int
    dtype: str
    device: str
    max_num_batched_tokens: int
    attention_cost_tokens: int | None
    kv_cache_blocks: int
    block_size: int
    kv_cache_bytes: int
    eos_token_ids: list[int]
    batch_invariance: dict[str, Any]
    tensor_parallel_size: int  # the ranks the model is split over (1: one process)
    cache_ram_bytes: int  # the most the host tier behind the pool holds (0: off)
    weight_bytes: int = 0  # the loaded weights in memory (engine.weight_footprint; this rank's share)
    num_weights: int = 0  # the weights as the checkpoint counts them (this rank's share)
    weight_formats: dict[str, int] = msgspec.field(default_factory=dict)  # linear layers per format
    routed_experts: dict[str, int] | None = None  # a mixture-of-experts model's routing; None: dense


class Ready(msgspec.Struct, tag=True):
    pid: int
    info: EngineInfo
    stats: EngineStats


class CacheChanges(msgspec.Struct, array_like=True):
    """How the worker's set of cached prefix blocks changed since its last Outputs (only when
    WorkerSettings.report_cache_changes): empty the copy if `cleared`, drop `removed`, add `stored`."""

    cleared: bool
    stored: list[bytes]
    removed: list[bytes]


class Outputs(msgspec.Struct, tag=True):
    outputs: list[StepOutput]
    stats: EngineStats
    cache: CacheChanges | None = None


class Heartbeat(msgspec.Struct, tag=True):
    """The worker waits for messages with nothing to step: it is alive (engine.watchdog)."""


class Answer(msgspec.Struct, tag=True):
    query_id: int
    value: Any = None
    error: str | None = None
    param: str | None = None  # a refused constraint's field, and the refusal's code
    code: str | None = None


class Fatal(msgspec.Struct, tag=True):
    """The worker cannot go on: loading failed (`loading`), or a step raised. It exits next."""

    message: str
    loading: bool = False
    code: str | None = None
    param: str | None = None


class WorkerSettings(msgspec.Struct):
    """Everything a worker needs to load the model: sent once, as its first message."""

    model: str | None
    cache_dir: str | None
    revision: str | None
    ollama_models: str | None
    chat_template: str | None
    engine: EngineConfig
    log_level: int = 20  # the front end's (logging.INFO)
    fault: str | None = None  # fault injection for tests (ember.engine.faults)
    report_cache_changes: bool = False  # send CacheChanges with each Outputs (a data-parallel router)


ToWorker = Add | Abort | Pause | Resume | Query | Shutdown
FromWorker = Ready | Outputs | Answer | Heartbeat | Fatal

_encoder = msgspec.msgpack.Encoder()
to_worker = msgspec.msgpack.Decoder(ToWorker)
from_worker = msgspec.msgpack.Decoder(FromWorker)
settings_decoder = msgspec.msgpack.Decoder(WorkerSettings)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def engine_info(core) -> EngineInfo:
    """The EngineInfo of a built EngineCore."""
    kv = core.kv_manager
    host_tier = core.tiers.host if core.tiers is not None else None
    weights = core.weights
    return EngineInfo(
        max_model_len=core.max_model_len, vocab_size=core.model_config.vocab_size,
        kv_capacity_tokens=core.kv_capacity_tokens, dtype=str(core.dtype).replace("torch.", ""),
        device=str(core.device), max_num_batched_tokens=core.max_num_batched_tokens,
        attention_cost_tokens=core.scheduler.config.attention_cost_tokens, kv_cache_blocks=kv.num_blocks - 1,
        block_size=kv.block_size, kv_cache_bytes=core.kv_cache_bytes, eos_token_ids=sorted(core.eos_token_ids),
        batch_invariance=core.invariance.as_dict(), tensor_parallel_size=core.config.tensor_parallel_size,
        cache_ram_bytes=host_tier.capacity_bytes if host_tier is not None else 0,
        weight_bytes=weights.num_bytes, num_weights=weights.num_weights, weight_formats=weights.formats,
        routed_experts=core.routed_experts)
