"""The server's settings, built once by the command line and passed in explicitly."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from ember.config import EngineConfig
from ember.engine.watchdog import DEFAULT_STALL_TIMEOUT_S
from ember.media.limits import MediaLimits
from ember.media.sources import ImageFetching
from ember.protocols.neutral import DEFAULT_MAX_MESSAGES, DEFAULT_MAX_TOTAL_INPUT_TOKENS


@dataclass(slots=True)
class ServerConfig:
    model: str | None = None  # a model folder, GGUF file, repo id or ollama: name; None: the default model
    cache_dir: str | None = None
    revision: str | None = None  # of a Hugging Face repo id (--revision)
    ollama_models: str | None = None  # Ollama's store ($OLLAMA_MODELS; None: ~/.ollama/models)
    host: str = "127.0.0.1"
    port: int = 8000
    ollama_port: int | None = None  # a second listener for Ollama's clients (None: off)
    served_model_names: list[str] = field(default_factory=list)  # first: the public id; others: aliases
    api_key: str | None = None
    api_key_file: str | None = None  # keys, one a line, optionally "tenant: key" (server.keys)
    max_pending_per_tenant: int = 0  # one tenant's share of the waiting requests; 0: no share
    max_pending: int = 128  # requests allowed to wait for a slot
    pending_timeout: float = 120.0  # seconds a request may wait for a slot; 0: no limit
    max_request_bytes: int = 16 << 20
    cors_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)  # host names requests may use besides the address
    default_max_tokens: int | None = None
    max_messages: int | None = DEFAULT_MAX_MESSAGES  # messages per request; None: no cap
    # prompt tokens of one embeddings, rerank or score request, its inputs together; None: no cap
    max_total_input_tokens: int | None = DEFAULT_MAX_TOTAL_INPUT_TOKENS
    chat_template: str | None = None  # template text replacing the model's own
    embeddings: bool = False  # serve the model for embeddings (loaders.serving_task)
    rerank: bool = False  # serve the model as a yes/no reranker (loaders.serving_task)
    pooling: str | None = None  # embeddings' pooling method instead of the model's own (ember.types.POOLING_METHODS)
    reasoning_parser: str = "auto"  # auto | none | think
    tool_call_parser: str = "auto"  # auto | none | hermes | qwen3_xml
    default_thinking_budget: int | None = None  # reasoning tokens before ember closes the block
    no_thinking: bool = False  # requests that do not choose get thinking off
    reasoning_effort: str | None = None  # the effort of requests that name none
    preserve_thinking: bool = False  # closed assistant turns keep their reasoning unless a request says otherwise
    sampling_flags: dict = field(default_factory=dict)  # --temperature ... (--greedy: temperature 0)
    override_generation_config: dict = field(default_factory=dict)  # merged over the model's generation config
    strict_fields: bool = False  # refuse unknown top-level request fields (400 unknown_parameter)
    sse_keepalive: float = 5.0  # seconds without an event before a keep-alive comment
    request_log: str | None = None  # a JSON-lines file of server and request events, appended
    log_stats_interval: float = 10.0  # seconds between throughput lines on stderr; 0: none
    response_store: str | None = None  # a SQLite file, or "memory"; None: responses.db in ember's state folder
    response_store_max_records: int = 1024  # stored Responses kept (least recently used go first)
    response_store_max_mb: float = 256.0  # MiB the stored Responses may take
    reasoning_key_file: str | None = None  # the key of encrypted reasoning (64 hex digits); None: one per process
    ui: bool = False  # serve the chat page at / (otherwise / answers as /health)
    engine_worker: bool = True  # the engine in a supervised worker process; False: a thread of this one
    drain_timeout: float = 30.0  # seconds running requests may finish after SIGTERM / Ctrl-C
    stalled_client_timeout: float = 30.0  # seconds a stream may wait for its client to read; 0: no limit
    # seconds an engine worker holding work may send nothing before it is killed and restarted; 0: never
    worker_stall_timeout: float = DEFAULT_STALL_TIMEOUT_S
    inject_fault: str | None = None  # tests only: ember.engine.faults (from EMBER_INJECT_FAULT)
    data_parallel_size: int = 1  # engine workers behind a prefix-aware router (ember.engine.router)
    media_limits: MediaLimits = field(default_factory=MediaLimits)  # what a request's images may take
    image_fetching: ImageFetching = field(default_factory=ImageFetching)  # images by http(s) URL: off by default
    max_images_encoding: int = 16  # images in requests whose prefill has not ended; one past it: 429
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be 1 or more, got {self.data_parallel_size!r}")
        if self.data_parallel_size > 1 and self.engine.nnodes > 1:
            raise ValueError("--data-parallel-size runs its replicas on this host: it does not combine with --nnodes")
        if self.data_parallel_size > 1 and not self.engine_worker:
            raise ValueError("--data-parallel-size needs engine worker processes: drop --no-engine-worker")
        if self.max_pending < 0:
            raise ValueError(f"max_pending must be 0 or more, got {self.max_pending}")
        if self.pending_timeout < 0:
            raise ValueError(f"pending_timeout must be 0 or more seconds, got {self.pending_timeout}")
        if self.max_request_bytes < 1:
            raise ValueError("the request size limit must be positive")
        if self.max_messages is not None and self.max_messages < 1:
            raise ValueError(f"--max-messages must be at least 1 (0: no cap), got {self.max_messages}")
        if self.max_total_input_tokens is not None and self.max_total_input_tokens < 1:
            raise ValueError(f"--max-total-input-tokens must be at least 1 (0: no cap), got {self.max_total_input_tokens}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be positive, got {self.default_max_tokens}")
        if self.default_thinking_budget is not None and self.default_thinking_budget < 1:
            raise ValueError(f"--default-thinking-budget must be at least 1, got {self.default_thinking_budget}")
        if self.sse_keepalive <= 0:
            raise ValueError(f"the keep-alive interval must be positive, got {self.sse_keepalive}")
        if self.response_store_max_records < 1:
            raise ValueError(f"--response-store-max-records must be at least 1, got {self.response_store_max_records}")
        if self.response_store_max_mb <= 0:
            raise ValueError(f"--response-store-max-mb must be positive, got {self.response_store_max_mb}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be 0 or more seconds, got {self.drain_timeout}")
        if self.stalled_client_timeout < 0:
            raise ValueError(f"--stalled-client-timeout must be 0 (off) or more seconds, got "
                             f"{self.stalled_client_timeout}")
        if self.worker_stall_timeout < 0:
            raise ValueError(f"--worker-stall-timeout must be 0 (off) or more seconds, got {self.worker_stall_timeout}")
        if self.max_images_encoding < 1:
            raise ValueError(f"--max-images-encoding must be at least 1, got {self.max_images_encoding}")
        if self.log_stats_interval < 0:
            raise ValueError(f"--log-stats-interval must be 0 (off) or more seconds, got {self.log_stats_interval}")

    @property
    def max_running(self) -> int:
        """Requests admitted to run at once: the seats of every data-parallel replica."""
        return self.engine.max_num_seqs * self.data_parallel_size


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
