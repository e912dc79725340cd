"""What one benchmark run does: the target, the workload, its levels and its limits."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

ENDPOINTS = ("chat", "completions")
WORKLOADS = ("single", "multiturn")


class BenchError(Exception):
    """A problem the user can fix (a bad setting, an unreachable server); printed without a traceback."""


@dataclass(slots=True, frozen=True)
class LengthRange:
    """A token length: fixed (`128`) or drawn uniformly per request from a range (`64:256`)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str | int) -> "LengthRange":
        if isinstance(text, int):
            return cls(text, text)
        low_text, _, high_text = str(text).partition(":")
        try:
            low = int(low_text)
            high = int(high_text) if high_text else low
        except ValueError:
            raise BenchError(f"a length is a number (128) or a range (64:256), got {text!r}") from None
        if low < 1 or high < low:
            raise BenchError(f"a length range needs 1 <= low <= high, got {text!r}")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(slots=True)
class OfflineSettings:
    """The in-process engine that `--offline` measures instead of a server."""

    model: str | None = None  # a Hugging Face folder or .gguf file; None: the default model
    cache_dir: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: the largest concurrency of the run, at least 16
    enable_prefix_caching: bool = True
    batch_invariant: bool = True
    quantization: str = "auto"
    probe_limits: bool = True  # measure the machine's limits after the run (bench.limits), a few seconds


@dataclass(slots=True, frozen=True)
class Level:
    """One measured stage of a run: closed loop at a concurrency, or open loop at a request rate."""

    concurrency: int | None = None
    request_rate: float | None = None  # requests per second, Poisson arrivals

    @property
    def label(self) -> str:
        if self.request_rate is not None:
            return f"rate {self.request_rate:g}/s"
        return f"concurrency {self.concurrency}"

    @property
    def x_value(self) -> float:
        return self.request_rate if self.request_rate is not None else float(self.concurrency)


@dataclass(slots=True)
class BenchConfig:
    base_url: str | None = None  # the server, with or without /v1; None with `offline`
    model: str | None = None  # the model id to send; None: the first one /v1/models lists
    endpoint: str = "chat"
    api_key: str | None = None
    workload: str = "single"
    concurrency: list[int] = field(default_factory=lambda: [1])
    request_rates: list[float] | None = None  # open loop when set (the concurrency list is then unused)
    num_requests: int | None = None  # per level; None: max(4 * concurrency, 16), or 10 s of arrivals
    input_len: LengthRange = field(default_factory=lambda: LengthRange(128, 128))
    output_len: LengthRange = field(default_factory=lambda: LengthRange(128, 128))
    turns: int = 4  # multiturn only
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    max_seconds: float | None = 600.0  # per level
    request_timeout: float = 300.0  # longest silence while reading one response
    quiet: bool = False
    offline: OfflineSettings | None = None

    def __post_init__(self) -> None:
        if isinstance(self.input_len, (str, int)):
            self.input_len = LengthRange.parse(self.input_len)
        if isinstance(self.output_len, (str, int)):
            self.output_len = LengthRange.parse(self.output_len)
        if (self.base_url is None) == (self.offline is None):
            raise BenchError("give a server with --base-url, or --offline to measure the engine in-process")
        if self.endpoint not in ENDPOINTS:
            raise BenchError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.workload not in WORKLOADS:
            raise BenchError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if not self.concurrency or any(not isinstance(c, int) or c < 1 for c in self.concurrency):
            raise BenchError(f"--concurrency needs positive integers, got {self.concurrency!r}")
        if self.request_rates is not None:
            if not self.request_rates or any(not math.isfinite(r) or r <= 0 for r in self.request_rates):
                raise BenchError(f"--request-rate needs positive numbers, got {self.request_rates!r}")
            if self.workload == "multiturn":
                raise BenchError("the multiturn workload runs closed loop only: use --concurrency, "
                                 "not --request-rate")
        if self.num_requests is not None and self.num_requests < 1:
            raise BenchError("--num-requests must be at least 1")
        if self.turns < 1:
            raise BenchError("--turns must be at least 1")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise BenchError("--max-seconds must be positive")
        if self.request_timeout <= 0:
            raise BenchError("--request-timeout must be positive")
        if not 0 <= self.temperature <= 2:
            raise BenchError("--temperature must be between 0 and 2")

    @property
    def levels(self) -> list[Level]:
        if self.request_rates is not None:
            return [Level(request_rate=rate) for rate in self.request_rates]
        return [Level(concurrency=c) for c in self.concurrency]

    def requests_for(self, level: Level) -> int:
        """How many requests a level sends (multiturn: conversations times turns)."""
        if self.workload == "multiturn":
            return level.concurrency * self.turns
        if self.num_requests is not None:
            return self.num_requests
        if level.request_rate is not None:
            return max(16, math.ceil(10 * level.request_rate))
        return max(4 * level.concurrency, 16)
