"""`ember bench --offline`: the same workloads sent straight to an in-process ember engine.

The engine runs in its own thread behind ember's AsyncEngine, as it does under `ember serve`, so
the difference between an offline run and an HTTP run against ember is the HTTP layer. A chunk
here is one engine step's tokens for a request; token counts come from the engine's own output.
"""

from __future__ import annotations

import asyncio

from ember.bench.config import BenchConfig, OfflineSettings
from ember.bench.limits import Bounds
from ember.bench.records import CANCELLED, OK, LevelClock, RequestRecord
from ember.bench.workload import Prompt, RequestSpec

_MIN_MAX_NUM_SEQS = 16


class EngineTransport:
    def __init__(self, config: BenchConfig) -> None:
        from ember.engine.engine import AsyncEngine, build_off_thread
        from ember.llm import LLM

        settings: OfflineSettings = config.offline
        largest = max(config.concurrency) if config.request_rates is None else _MIN_MAX_NUM_SEQS
        self.llm = build_off_thread(lambda: LLM(
            settings.model, cache_dir=settings.cache_dir, dtype=settings.dtype, device=settings.device,
            max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs or max(largest, _MIN_MAX_NUM_SEQS),
            enable_prefix_caching=settings.enable_prefix_caching, batch_invariant=settings.batch_invariant,
            quantization=settings.quantization))
        self.engine = AsyncEngine(self.llm.engine, self.llm.tokenizer)
        self.probe_limits = settings.probe_limits
        self.endpoint = config.endpoint
        self.temperature = config.temperature
        self.ignore_eos = config.ignore_eos

    @property
    def target(self) -> str:
        return f"offline engine ({self.llm.engine.dtype}, {self.llm.engine.device})"

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)

    async def model_name(self) -> str:
        return self.llm.source.name

    async def bounds(self) -> Bounds | None:
        """The machine's limits on the engine's threads, measured while the engine is idle, for
        this model's weights."""
        if not self.probe_limits or self.llm.engine.device.type != "cpu":
            return None
        from ember.bench.machine_probe import probe

        limits = await asyncio.get_running_loop().run_in_executor(None, probe)
        info = self.engine.info
        return Bounds(limits, info.weight_bytes, info.num_weights)

    async def count_prompt_tokens(self, prompt: Prompt) -> int:
        return len(self._encode(prompt))

    async def send(self, spec: RequestSpec, record: RequestRecord, clock: LevelClock) -> str | None:
        from ember.errors import EmberError
        from ember.types import SamplingParams

        record.sent = clock.now()
        reply_parts: list[str] = []
        try:
            prompt_ids = self._encode(spec.prompt)
            params = SamplingParams(max_tokens=spec.output_len, temperature=self.temperature,
                                    ignore_eos=self.ignore_eos)
            async for output in self.engine.generate(prompt_ids, params, request_id=record.request_id):
                if output.new_token_ids:
                    record.chunk_times.append(clock.now())
                reply_parts.append(output.text_delta)
                if output.finished:
                    record.prompt_tokens = len(prompt_ids)
                    record.completion_tokens = len(output.token_ids)
                    record.cached_tokens = output.num_cached_tokens
                    record.outcome, record.error = ("engine_error", output.error) if output.error else (OK, None)
        except asyncio.CancelledError:
            record.outcome = CANCELLED
            raise
        except EmberError as exc:
            record.status, record.outcome, record.error = exc.status, str(exc.status), exc.message
        finally:
            record.ended = clock.now()
        return "".join(reply_parts) if record.ok else None

    def _encode(self, prompt: Prompt) -> list[int]:
        return self.llm.encode_prompt(prompt)
