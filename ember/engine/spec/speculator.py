"""Drafts for the requests about to decode: from which proposer, how many, and what they taught."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Protocol

from ember.config import BATCH_TUNED_DRAFT_TOKENS, MAX_TUNED_DRAFT_TOKENS, SpeculativeConfig
from ember.engine.request import Request
from ember.engine.spec.ngram import NgramIndex
from ember.engine.spec.tuning import DraftingGate, DraftLength, StepCost
from ember.engine.stats import EngineCounters

if TYPE_CHECKING:
    from ember.engine.runner import RunnerOutput
    from ember.engine.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger("ember.engine")

# What a drafting model's round holds until its tokens are drafted (Speculator.draft): the scheduler
# needs only the round's length.
_GRANTED = -1


class Proposer(Protocol):
    """Drafts for requests. A `free` proposer (a lookup) costs next to nothing per token, so it is
    asked, before the step is scheduled, for all the tokens a request has room for, and the
    speculator keeps what pays. Any other (a draft model runs a forward per token) drafts after the
    scheduler has granted each round its length and blocks (`Speculator.draft`), and also follows
    the step's prefill (`follow(scheduled)`, `restart(request_id)` after a preemption)."""

    name: str
    free: bool

    def propose(self, wants: list[tuple[Request, int]]) -> list[tuple[list[int], Hashable]]:
        """For each (request, n): up to n drafted tokens to follow its tokens, and the evidence they
        rest on (requests' drafts on the same evidence are held about as often; None: nothing to
        tell them apart but the request)."""
        ...

    def forget(self, request_id: str) -> None:
        ...


class NgramProposer:
    name = "ngram"
    free = True

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, wants: list[tuple[Request, int]]) -> list[tuple[list[int], Hashable]]:
        proposals = []
        for request, num_tokens in wants:
            index = self._indexes.get(request.request_id)
            if index is None:
                index = self._indexes[request.request_id] = NgramIndex(self.min_n, self.max_n)
            drafts, matched = index.propose(request.token_ids, num_tokens)
            proposals.append((drafts, self._evidence(matched)))
        return proposals

    def _evidence(self, matched: int) -> int:
        """The matched length as drafts are judged by: each looked-up length apart, longer matches
        in ranges that double (5-7, 8-15, ... for 1:4), named by their shortest length."""
        return matched if matched <= self.max_n else max(self.max_n + 1, 1 << (matched.bit_length() - 1))

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


class Lookups:
    """One request's lookups by a free proposer whose guessed tokens have not all come yet. Each
    teaches its evidence's estimate how far it held as its tokens come, whatever length was drafted
    from it: a verified round tells only whether its drafts held, not how far the lookup would have
    gone on holding, and tuned lengths would then learn too little of long copies (the positions
    past the drafted length are never seen). It teaches at each step rather than once all its
    tokens have come: a new evidence's first lookups, drafted a few tokens at a time from the prior,
    would otherwise keep that evidence drafting short for as many steps as a copy of 32 tokens takes."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        # [first token's position, tokens, estimate, how many have come and held so far]
        self._waiting: list[list] = []

    def add(self, start: int, tokens: list[int], estimate: DraftLength) -> None:
        self._waiting.append([start, tokens, estimate, 0])

    def settle(self, token_ids: list[int], ended: bool = False) -> None:
        """Teach each lookup's estimate what its tokens have shown since the last call: the positions
        that came and held, and the first that did not. A lookup leaves once it has missed, its tokens
        have all come, or the request has `ended` (it then held as far as its tokens went). Each token
        is compared once, however many steps a lookup waits."""
        waiting = []
        for lookup in self._waiting:
            start, tokens, estimate, held = lookup
            came = min(len(tokens), len(token_ids) - start)
            now = held
            while now < came and token_ids[start + now] == tokens[now]:
                now += 1
            missed = now < came
            if now > held or missed:
                estimate.learn(held, now - held, missed)
            if not (missed or ended or came == len(tokens)):
                lookup[3] = now
                waiting.append(lookup)
            elif not missed and now:
                estimate.held_whole()
        self._waiting = waiting


class Speculator:
    """Owned by the engine core, called from its one thread: `propose` before each schedule,
    `after_step` once the step's forward has run, `forget` when a request ends.

    A tuned draft's length comes from the acceptance its evidence has earned (DraftLength): for
    n-gram lookup, all requests' lookups with the same matched suffix length share one estimate (a
    long match in code being copied holds nearly always, a short one in chat seldom), each lookup
    counted by how far it held (Lookups); for a draft model, each request has its own, from its
    verified rounds."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self._lengths: dict[Hashable, DraftLength] = {}  # evidence (or request id) -> its estimate
        self._used: dict[str, DraftLength] = {}  # request id -> the estimate its pending round rests on
        self._lookups: dict[str, Lookups] = {}  # request id -> a free proposer's lookups not yet settled
        self.step_cost = StepCost()  # fitted from the engine's decode steps (observe_step)
        self.gate = DraftingGate()
        self.drafting = True  # whether the last step with requests decoding let them draft
        # a tuned draft's cap: a lone stream's verified row costs a tenth of its step, so a long
        # copy is worth a long draft; in a batch the longer cap lost more to missed rows than it
        # gained (benchmarks.md)
        self.most_alone, self.most_in_batch = MAX_TUNED_DRAFT_TOKENS, BATCH_TUNED_DRAFT_TOKENS

    @property
    def method(self) -> str:
        return self.proposer.name

    def _length(self, key: Hashable) -> DraftLength:
        length = self._lengths.get(key)
        if length is None:
            length = self._lengths[key] = DraftLength(self.config.draft_tokens)
        return length

    def propose(self, requests: list[Request]) -> None:
        """Set draft_token_ids on each running request that is about to decode and may draft."""
        decoding = [r for r in requests if r.num_tokens - r.num_computed_tokens == 1]
        for request in requests:
            request.draft_token_ids = []
        self._used.clear()
        fixed = self.config.draft_tokens
        if decoding:
            self.drafting = fixed is not None or self.gate.allows(len(decoding))
        if not decoding or not self.drafting:
            return
        cost = self.step_cost.coefficients()
        most = fixed or (self.most_alone if len(decoding) == 1 else self.most_in_batch)
        free = self.proposer.free
        wants = []
        for request in decoding:
            if not request.sampling_params.draft:
                continue
            # the step yields up to drafts + 1 tokens: never past max_tokens or the context window
            room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
            if free:
                wanted = min(most, room)
            else:
                length = self._used[request.request_id] = self._length(request.request_id)
                wanted = min(length.next(len(decoding), cost, most), room)
            if wanted > 0:
                wants.append((request, wanted))
        if not wants:
            return
        if not free:  # the lengths asked of the scheduler; the tokens come once it has granted them
            for request, wanted in wants:
                request.draft_token_ids = [_GRANTED] * wanted
            return
        began = time.perf_counter()
        for request, _ in wants:
            lookups = self._lookups.get(request.request_id)
            if lookups is not None:
                lookups.settle(request.token_ids)
        proposals = self.proposer.propose(wants)
        longest = 0
        for (request, _), (drafts, evidence) in zip(wants, proposals):
            drafts = _before_end_token(request, drafts)
            if drafts:
                length = self._length(("evidence", evidence))
                self._lookups.setdefault(request.request_id, Lookups()).add(request.num_tokens, drafts, length)
                drafts = drafts[:length.next(len(decoding), cost, len(drafts))]
            request.draft_token_ids = drafts
            longest = max(longest, len(drafts))
        self.step_cost.observe_drafting(longest, time.perf_counter() - began)

    def draft(self, plan: SchedulerOutput) -> list[ScheduledRequest]:
        """A drafting model's tokens for the rounds the scheduler granted (a free proposer's are in
        place already); returns the rounds that came out shorter than granted, whose blocks past
        their end the caller gives back."""
        granted = [item for item in plan.scheduled if item.draft_token_ids and item.draft_token_ids[0] == _GRANTED]
        if not granted:
            return []
        began = time.perf_counter()
        proposals = self.proposer.propose([(item.request, len(item.draft_token_ids)) for item in granted])
        shortened = []
        for item, (drafts, _) in zip(granted, proposals):
            drafts = _before_end_token(item.request, drafts)
            if len(drafts) < len(item.draft_token_ids):
                plan.num_scheduled_tokens -= len(item.draft_token_ids) - len(drafts)
                item.num_new_tokens = 1 + len(drafts)
                shortened.append(item)
            item.draft_token_ids = drafts
        self.step_cost.observe_drafting(max(map(len, (item.draft_token_ids for item in granted))),
                                        time.perf_counter() - began)
        return shortened

    def follow(self, plan: SchedulerOutput) -> None:
        """Once the step's forward has run: a drafting model prefills what the served model did,
        while drafting pays (when the gate has closed, a request's drafts catch up on its prompt
        if it later drafts)."""
        if not self.proposer.free and self.drafting:
            self.proposer.follow(plan.scheduled)

    def restart(self, request_id: str) -> None:
        """The request was preempted: it computes its tokens again from the start."""
        if not self.proposer.free:
            self.proposer.restart(request_id)

    def after_step(self, plan: SchedulerOutput, result: RunnerOutput, began: float, forward_began: float,
                   counters: EngineCounters) -> None:
        """What a step tells drafting, once its forward has run (`began`, `forward_began`: its
        perf_counter times): a decode-only step's cost, what drafting pays, and each verified
        round's acceptance, counted in `counters` too."""
        scheduled = plan.scheduled
        if all(item.samples and item.num_new_tokens == 1 + len(item.draft_token_ids) for item in scheduled):
            ended = time.perf_counter()
            self.observe_step(len(scheduled), plan.num_scheduled_tokens, any(item.draft_token_ids for item in scheduled),
                              sum(map(len, result.sampled.values())), ended - forward_began, ended - began)
        for item in scheduled:
            if item.draft_token_ids:
                request_id = item.request.request_id
                num_accepted = result.accepted.get(request_id, 0)
                self.record(request_id, len(item.draft_token_ids), num_accepted)
                counters.add_round(len(item.draft_token_ids), num_accepted)

    def observe_step(self, requests: int, rows: int, drafted: bool, tokens: int, forward_seconds: float,
                     step_seconds: float) -> None:
        """A step that only decoded (and verified drafts, if `drafted`): `requests` decoding, `rows`
        rows through the model in `forward_seconds`, `tokens` new tokens in `step_seconds` all told."""
        self.step_cost.observe(rows, forward_seconds)
        self.gate.observe(requests, drafted, tokens, step_seconds)

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        length = self._used.pop(request_id, None)
        if length is not None:
            length.record(proposed, accepted)

    def forget(self, request: Request) -> None:
        lookups = self._lookups.pop(request.request_id, None)
        if lookups is not None:
            lookups.settle(request.token_ids, ended=True)
        self._lengths.pop(request.request_id, None)
        self._used.pop(request.request_id, None)
        self.proposer.forget(request.request_id)


def _before_end_token(request: Request, drafts: list[int]) -> list[int]:
    """Drafts up to the first token that would end the request: an end token is never worth
    drafting (it can only be the round's last), and nothing after it may be verified."""
    ends = request.end_token_ids
    for i, token_id in enumerate(drafts):
        if token_id in ends:
            return drafts[:i]
    return drafts


def build_speculator(config: SpeculativeConfig, max_model_len: int, draft_proposer: Proposer | None = None
                     ) -> Speculator | None:
    """The engine's speculator for its config (None when off). `draft_proposer`: a loaded draft
    model's, for the draft and auto modes."""
    if not config.enabled:
        return None
    proposer = draft_proposer or NgramProposer(config.ngram_min, config.ngram_max)
    return Speculator(config, proposer, max_model_len)
