"""Batched sampling: penalties, bias, temperature, top-k/top-p/min-p, per-request seeds, logprobs.

Each row is processed independently, so a request samples the same token alone or in any batch.
A seeded request draws its noise from a generator reseeded from (seed, output position), which
keeps it reproducible across batches, preemptions and restarts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ember.grammar.bitmask import unpack_bitmask
from ember.types import ConstraintFailed, SamplingParams, TokenConstraint, TokenLogprob

_SEED_STRIDE = 1_000_003  # mixes the output position into a request's seed


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs of one request this step."""

    params: SamplingParams
    token_ids: list[int]  # the request's prompt then output tokens (not copied)
    num_prompt_tokens: int
    suppressed_token_ids: frozenset[int]  # end tokens held back until min_tokens is reached
    constraint: TokenConstraint | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    failed: dict[int, str] = field(default_factory=dict)  # row -> why its constraint gave up (ConstraintFailed)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0, cpu_kernel: bool = False) -> None:
        """`cpu_kernel`: take each row's argmax with ember's CPU kernel (torch.argmax's answers, ten
        times faster on a vocabulary's worth of float32)."""
        self.vocab_size = vocab_size
        self.device = device
        self._argmax = torch.ops.ember.argmax_rows if cpu_kernel else functools.partial(torch.argmax, dim=-1)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._row_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: (N, V) float32, one row per request in `rows`."""
        logits = logits[:, : self.vocab_size]
        want_logprobs = [row.params.logprobs for row in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_logprobs) else None
        failed: dict[int, str] = {}
        logits = self._adjust(logits, rows, failed)
        token_ids = self._choose(logits, rows)
        chosen = token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, token_ids, want_logprobs,
                                        [row.params.logprob_token_ids for row in rows])
        return SamplerOutput(chosen, logprobs, failed)

    @staticmethod
    def draws_argmax(params: SamplingParams) -> bool:
        """Whether a row with these params, no constraint and no suppressed tokens, draws its
        argmax of the logits as they are (argmax below)."""
        return params.greedy and not params.uses_penalties and not params.logit_bias and params.logprobs is None

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each row's most likely token: what __call__ draws for a row that draws_argmax."""
        return self._argmax(logits[:, : self.vocab_size]).tolist()

    def _adjust(self, logits: torch.Tensor, rows: list[SamplingRow], failed: dict[int, str]) -> torch.Tensor:
        """Penalties, logit bias, suppressed end tokens, then constraints; returns a new tensor if
        anything applies. A row whose constraint fails is noted in `failed` and left unconstrained."""
        bitmask, masked_rows = self._fill_bitmasks(rows, failed)
        allowed = [None if i in masked_rows or i in failed else _allowed_ids(row, i, failed)
                   for i, row in enumerate(rows)]
        needs_copy = any(r.params.uses_penalties or r.params.logit_bias or r.suppressed_token_ids for r in rows)
        if not needs_copy and not masked_rows and all(a is None for a in allowed):
            return logits
        logits = logits.clone()
        if any(r.params.uses_penalties for r in rows):
            _apply_penalties(logits, rows)
        for i, row in enumerate(rows):
            if row.params.logit_bias:
                ids = torch.tensor(list(row.params.logit_bias), device=logits.device)
                keep = ids < self.vocab_size
                bias = torch.tensor(list(row.params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                logits[i].index_add_(0, ids[keep], bias[keep])
            if row.suppressed_token_ids:
                ids = [t for t in row.suppressed_token_ids if t < self.vocab_size]
                logits[i, ids] = float("-inf")
        for i, ids in enumerate(allowed):
            if ids is not None:
                _keep_only(logits, i, ids)
        if masked_rows:
            _apply_bitmask(logits, bitmask, masked_rows, [i for i in masked_rows if rows[i].suppressed_token_ids])
        return logits

    def _fill_bitmasks(self, rows: list[SamplingRow], failed: dict[int, str]) -> tuple[torch.Tensor | None, list[int]]:
        """One packed bitmask for every row whose constraint masks this step; (bitmask, those rows)."""
        masking = [i for i, row in enumerate(rows) if hasattr(row.constraint, "fill_token_bitmask")]
        if not masking:
            return None, []
        bitmask = torch.full((len(rows), -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        filled = []
        for i in masking:
            row = rows[i]
            try:
                if row.constraint.fill_token_bitmask(row.token_ids[row.num_prompt_tokens:], bitmask, i):
                    filled.append(i)
            except ConstraintFailed as exc:
                failed[i] = str(exc)
        return bitmask, filled

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = self._argmax(logits)
        sampled_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not sampled_rows:
            return greedy
        index = torch.tensor(sampled_rows, device=logits.device)
        params = [rows[i].params for i in sampled_rows]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        scaled = logits[index] / temperature[:, None]
        scaled = _filter_top_k(scaled, [p.top_k for p in params])
        scaled = _filter_top_p_min_p(scaled, [p.top_p for p in params], [p.min_p for p in params])
        probs = torch.softmax(scaled, dim=-1)
        noise = self._exponential_noise(probs.shape, [rows[i] for i in sampled_rows])
        # Dividing by Exp(1) noise and taking the argmax draws exactly from `probs`.
        choice = self._argmax(probs / noise)
        greedy[index] = choice
        return greedy

    def _exponential_noise(self, shape: torch.Size, rows: list[SamplingRow]) -> torch.Tensor:
        """Exp(1) noise, each row drawn once: a seeded row from its own generator, keyed by (seed,
        output position); a row without a seed (only the Sampler's direct callers: the engine
        seeds every sampled request) from the sampler's shared generator."""
        noise = torch.empty(shape, device=self.device)
        for i, row in enumerate(rows):
            seed = row.params.seed
            if seed is None:
                noise[i].exponential_(generator=self.generator)
            else:
                self._row_generator.manual_seed((seed * _SEED_STRIDE + row.num_output_tokens) % (1 << 63))
                noise[i].exponential_(generator=self._row_generator)
        return noise


def _allowed_ids(row: SamplingRow, index: int, failed: dict[int, str]) -> list[int] | None:
    if row.constraint is None:
        return None
    try:
        ids = row.constraint.allowed_token_ids(row.token_ids[row.num_prompt_tokens:])
    except ConstraintFailed as exc:
        failed[index] = str(exc)
        return None
    return None if ids is None else list(ids)


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], suppressed_rows: list[int]) -> None:
    """Mask `rows` of logits to their bitmask rows, all in one call. As in _keep_only, a row whose
    allowed ids were all at -inf (only end tokens, held back by min_tokens) gets them equally
    likely: the constraint wins."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    kernel = _bitmask_kernel()
    if kernel is not None:
        kernel(logits, bitmask, indices=rows)
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~unpack_bitmask(bitmask[rows], logits.shape[1]), float("-inf"))
    for i in suppressed_rows:
        if not torch.isfinite(logits[i]).any():
            allowed = unpack_bitmask(bitmask[i:i + 1], logits.shape[1])[0]
            logits[i] = torch.zeros_like(logits[i]).masked_fill(~allowed, float("-inf"))


@functools.cache
def _bitmask_kernel():
    """xgrammar's apply_token_bitmask_inplace (a native kernel, ~4x the torch ops here) when installed."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        return None
    return apply_token_bitmask_inplace


def _keep_only(logits: torch.Tensor, row: int, ids: list[int]) -> None:
    """Mask row to `ids`. If every allowed id was already at -inf (a penalty or suppression), the
    constraint still wins: the allowed ids are made equally likely."""
    index = torch.tensor(ids, dtype=torch.long, device=logits.device)
    kept = logits[row, index]
    if not torch.isfinite(kept).any():
        kept = torch.zeros_like(kept)
    logits[row] = float("-inf")
    logits[row, index] = kept


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (prompt and output), presence and frequency (output only), as vLLM defines them."""
    vocab = logits.shape[1]
    device = logits.device
    for i, row in enumerate(rows):
        p = row.params
        if not p.uses_penalties:
            continue
        output = torch.tensor(row.token_ids[row.num_prompt_tokens:], dtype=torch.long, device=device)
        counts = torch.zeros(vocab, device=device)
        if len(output):
            counts.index_add_(0, output.clamp_(max=vocab - 1), torch.ones(len(output), device=device))
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if row.num_prompt_tokens:
                prompt = torch.tensor(row.token_ids[: row.num_prompt_tokens], dtype=torch.long, device=device)
                seen[prompt.clamp_(max=vocab - 1)] = True
            penalised = torch.where(logits[i] > 0, logits[i] / p.repetition_penalty, logits[i] * p.repetition_penalty)
            logits[i] = torch.where(seen, penalised, logits[i])
        if p.frequency_penalty:
            logits[i] -= p.frequency_penalty * counts
        if p.presence_penalty:
            logits[i] -= p.presence_penalty * (counts > 0).float()


def _filter_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if all(k == vocab for k in ks):
        return logits
    k_tensor = torch.tensor(ks, device=logits.device)
    kth = torch.topk(logits, max(ks), dim=-1).values.gather(1, (k_tensor - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p_min_p(logits: torch.Tensor, top_ps: list[float], min_ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_ps) and all(m <= 0.0 for m in min_ps):
        return logits
    probs = torch.softmax(logits, dim=-1)
    if any(m > 0.0 for m in min_ps):
        min_p = torch.tensor(min_ps, device=logits.device)[:, None]
        floor = probs.max(dim=-1, keepdim=True).values * min_p
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if any(p < 1.0 for p in top_ps):
        top_p = torch.tensor(top_ps, device=logits.device)[:, None]
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token once the tokens strictly more likely than it already reach top_p.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, counts: list[int | None],
                     requested: list[list[int] | None]) -> list[TokenLogprob | None]:
    """logprobs: (N, V), the model's own distribution (before penalties, bias, temperature, masks)."""
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    chosen_ids = token_ids.tolist()
    most = max(k for k in counts if k is not None)
    top_values, top_ids = (torch.topk(logprobs, most, dim=-1) if most else (None, None))
    result: list[TokenLogprob | None] = []
    for i, k in enumerate(counts):
        if k is None:
            result.append(None)
            continue
        top = _top_entries(top_ids[i].tolist(), top_values[i].tolist(), chosen_ids[i], chosen[i], k) if k else []
        result.append(TokenLogprob(chosen_ids[i], chosen[i], top, _requested(logprobs[i], requested[i])))
    return result


def _top_entries(ids: list[int], values: list[float], chosen_id: int, chosen_logprob: float,
                 k: int) -> list[tuple[int, float]]:
    """The k most likely (id, logprob), best first. torch.topk orders ties as it likes; here equal
    log probabilities list the chosen token first, then the lower id (the one argmax takes), so a
    tie for the top lists the token greedy decoding chose first, in every batch and on every device.
    The chosen token joins a tie at the cut even where topk left it out."""
    entries = list(zip(ids, values))
    if chosen_id not in ids and chosen_logprob in values:
        entries.append((chosen_id, chosen_logprob))
    entries.sort(key=lambda entry: (-entry[1], entry[0] != chosen_id, entry[0]))
    return entries[:k]


def _requested(row_logprobs: torch.Tensor, token_ids: list[int] | None) -> list[tuple[int, float]]:
    """The log probabilities of the ids a request named; an id past the vocabulary has none (-inf)."""
    if not token_ids:
        return []
    vocab = row_logprobs.shape[0]
    inside = [t for t in token_ids if t < vocab]
    values = dict(zip(inside, row_logprobs[inside].tolist())) if inside else {}
    return [(t, values.get(t, float("-inf"))) for t in token_ids]
