"""The work a run sends: seeded prompts of calibrated token length, single requests or conversations.

Prompts are random words from a fixed list, drawn from a generator seeded by (seed, request key),
so the same settings give the same text on every run and every server that tokenizes alike.
Each request's words are its own: no two prompts share a prefix beyond the chat template.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ember.bench.config import BenchConfig, BenchError, Level
from ember.bench.words import WORDS

Prompt = str | list[dict[str, Any]]  # completions text, or chat messages


@dataclass(slots=True, frozen=True)
class Calibration:
    """prompt_tokens ~= overhead_tokens + tokens_per_word * words, fitted on the target's tokenizer."""

    tokens_per_word: float
    overhead_tokens: float  # what the endpoint adds around one prompt: chat template, BOS

    def words_for(self, num_tokens: int, *, whole_prompt: bool = True) -> int:
        budget = num_tokens - self.overhead_tokens if whole_prompt else num_tokens
        return max(1, round(budget / self.tokens_per_word))


@dataclass(slots=True)
class RequestSpec:
    key: str  # unique within a run; names the request in the server's log
    prompt: Prompt
    input_len: int  # the prompt length aimed at (the server's usage gives the real one)
    output_len: int  # max_tokens; with ignore_eos the server generates exactly this many
    conversation: int | None = None
    turn: int | None = None  # 1-based


def seeded_words(seed: int, key: str, count: int) -> str:
    rng = random.Random(f"{seed}/{key}")
    return " ".join(rng.choice(WORDS) for _ in range(count))


def as_prompt(text: str, endpoint: str) -> Prompt:
    return [{"role": "user", "content": text}] if endpoint == "chat" else text


async def calibrate(count_prompt_tokens: Callable[[Prompt], Awaitable[int]], config: BenchConfig) -> Calibration:
    """Fit tokens per word and the endpoint's overhead from two prompts the target counts itself."""
    short_words = 8
    long_words = short_words + max(32, round(0.75 * config.input_len.high))
    short = await count_prompt_tokens(as_prompt(seeded_words(config.seed, "calibration", short_words), config.endpoint))
    long = await count_prompt_tokens(as_prompt(seeded_words(config.seed, "calibration", long_words), config.endpoint))
    tokens_per_word = (long - short) / (long_words - short_words)
    if tokens_per_word <= 0:
        raise BenchError(f"calibration failed: {short_words} words gave {short} prompt tokens and {long_words} "
                         f"words gave {long}; the server's usage.prompt_tokens looks wrong")
    return Calibration(tokens_per_word, max(0.0, short - tokens_per_word * short_words))


def single_requests(config: BenchConfig, calibration: Calibration, level_index: int, level: Level) -> list[RequestSpec]:
    """The independent requests of one closed- or open-loop level, in sending order."""
    lengths = random.Random(f"{config.seed}/lengths/{level_index}")
    specs = []
    for i in range(config.requests_for(level)):
        input_len, output_len = config.input_len.sample(lengths), config.output_len.sample(lengths)
        key = f"l{level_index}-r{i}"
        text = seeded_words(config.seed, key, calibration.words_for(input_len))
        specs.append(RequestSpec(key, as_prompt(text, config.endpoint), input_len, output_len))
    return specs


@dataclass(slots=True)
class Conversation:
    """A dialogue that grows each turn by the reply and a new user message of about --input-len tokens."""

    config: BenchConfig
    calibration: Calibration
    level_index: int
    index: int
    lengths: random.Random
    turn: int = 0
    prompt: Prompt = field(default_factory=list)

    def next_request(self) -> RequestSpec:
        self.turn += 1
        input_len, output_len = self.config.input_len.sample(self.lengths), self.config.output_len.sample(self.lengths)
        key = f"l{self.level_index}-c{self.index}-t{self.turn}"
        words = self.calibration.words_for(input_len, whole_prompt=self.turn == 1)
        text = seeded_words(self.config.seed, key, words)
        if self.config.endpoint == "chat":
            self.prompt = [*self.prompt, {"role": "user", "content": text}]
        else:
            self.prompt = text if self.turn == 1 else f"{self.prompt}\n\n{text}"
        return RequestSpec(key, self.prompt, input_len, output_len, self.index, self.turn)

    def add_reply(self, reply: str) -> None:
        if self.config.endpoint == "chat":
            self.prompt = [*self.prompt, {"role": "assistant", "content": reply}]
        else:
            self.prompt = f"{self.prompt}{reply}"


def conversations(config: BenchConfig, calibration: Calibration, level_index: int, level: Level) -> list[Conversation]:
    return [Conversation(config, calibration, level_index, i, random.Random(f"{config.seed}/lengths/{level_index}/{i}"))
            for i in range(level.concurrency)]
