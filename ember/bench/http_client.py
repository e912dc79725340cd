"""Streaming requests to an OpenAI-compatible server over HTTP, timed chunk by chunk on the client."""

from __future__ import annotations

import asyncio
import json

import httpx

from ember.bench.config import BenchConfig, BenchError
from ember.bench.records import CANCELLED, OK, LevelClock, RequestRecord
from ember.bench.workload import Prompt, RequestSpec


def api_root(base_url: str) -> str:
    """The /v1 root; `http://host:8000` and `http://host:8000/v1/` both give `http://host:8000/v1`."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class HttpTransport:
    def __init__(self, config: BenchConfig) -> None:
        self.root = api_root(config.base_url)
        self.endpoint = config.endpoint
        self.path = "/chat/completions" if config.endpoint == "chat" else "/completions"
        self.model = config.model
        self.temperature = config.temperature
        self.ignore_eos = config.ignore_eos
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        # No pool limit: the workload decides how many requests are in flight, not the client.
        self.client = httpx.AsyncClient(
            base_url=self.root, headers=headers, timeout=httpx.Timeout(config.request_timeout, connect=30),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    @property
    def target(self) -> str:
        return self.root

    async def close(self) -> None:
        await self.client.aclose()

    async def model_name(self) -> str:
        if self.model is None:
            try:
                reply = await self.client.get("/models")
            except httpx.HTTPError as exc:
                raise BenchError(f"cannot reach the server at {self.root}: {str(exc) or type(exc).__name__}") from None
            models = _json_or_none(reply)
            data = models.get("data") if isinstance(models, dict) else None
            first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
            if reply.status_code != 200 or not first.get("id"):
                raise BenchError(f"GET {self.root}/models answered {reply.status_code} without a model; "
                                 f"name one with --model")
            self.model = str(first["id"])
        return self.model

    async def bounds(self) -> None:
        """The server's machine may be another: its limits are not probed from here."""
        return None

    async def count_prompt_tokens(self, prompt: Prompt) -> int:
        body = self._body(prompt, 1)
        body["stream"] = False
        del body["stream_options"]  # only valid with streaming; some servers refuse it otherwise
        try:
            reply = await self.client.post(self.path, json=body)
        except httpx.HTTPError as exc:
            raise BenchError(f"the calibration request to {self.root}{self.path} failed: "
                             f"{str(exc) or type(exc).__name__}") from None
        if reply.status_code != 200:
            raise BenchError(f"the calibration request to {self.root}{self.path} got {reply.status_code}: "
                             f"{_error_message(reply)}")
        usage = (_json_or_none(reply) or {}).get("usage") or {}
        if not isinstance(usage.get("prompt_tokens"), int):
            raise BenchError("the server reports no usage.prompt_tokens; ember bench sizes prompts and counts "
                             "tokens from the server's usage")
        return usage["prompt_tokens"]

    async def send(self, spec: RequestSpec, record: RequestRecord, clock: LevelClock) -> str | None:
        """Stream one request into `record`; the reply text when it succeeded, else None."""
        body = self._body(spec.prompt, spec.output_len)
        reply_parts: list[str] = []
        record.sent = clock.now()
        try:
            async with self.client.stream("POST", self.path, json=body,
                                          headers={"x-request-id": record.request_id}) as response:
                record.status = response.status_code
                if response.status_code != 200:
                    await response.aread()
                    record.outcome, record.error = str(response.status_code), _error_message(response)
                else:
                    record.outcome = await self._read_stream(response, record, clock, reply_parts)
        except asyncio.CancelledError:
            record.outcome = CANCELLED
            raise
        except httpx.TimeoutException as exc:
            record.outcome, record.error = "timeout", str(exc) or type(exc).__name__
        except httpx.HTTPError as exc:
            record.outcome, record.error = "connection_error", str(exc) or type(exc).__name__
        finally:
            record.ended = clock.now()
        return "".join(reply_parts) if record.ok else None

    async def _read_stream(self, response: httpx.Response, record: RequestRecord, clock: LevelClock,
                           reply_parts: list[str]) -> str:
        async for line in response.aiter_lines():
            arrived = clock.now()
            if not line.startswith("data:"):  # blank separators, ': keep-alive' comments, event names
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return OK
            try:
                event = json.loads(data)
            except ValueError:
                record.error = f"an event that is not JSON: {data[:200]}"
                return "bad_response"
            if not isinstance(event, dict):
                record.error = f"an event that is not a JSON object: {data[:200]}"
                return "bad_response"
            if event.get("error"):
                record.error = _message_of(event["error"])
                return "stream_error"
            text = self._output_text(event)
            if text:
                record.chunk_times.append(arrived)
                reply_parts.append(text)
            usage = event.get("usage")
            if isinstance(usage, dict):
                record.prompt_tokens = usage.get("prompt_tokens")
                record.completion_tokens = usage.get("completion_tokens")
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        record.error = "the stream closed before data: [DONE]"
        return "incomplete"

    def _output_text(self, event: dict) -> str:
        choices = event.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return ""
        if self.endpoint == "completions":
            return choices[0].get("text") or ""
        delta = choices[0].get("delta") or {}
        # Reasoning models stream their thinking apart from the answer; both are output tokens.
        return (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")

    def _body(self, prompt: Prompt, max_tokens: int) -> dict:
        body: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": self.temperature,
                      "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        body["messages" if self.endpoint == "chat" else "prompt"] = prompt
        return body


def _json_or_none(response: httpx.Response):
    try:
        return response.json()
    except ValueError:
        return None


def _message_of(error) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _error_message(response: httpx.Response) -> str:
    body = _json_or_none(response)
    if isinstance(body, dict) and body.get("error"):
        return _message_of(body["error"])
    return response.text[:200] or response.reason_phrase
