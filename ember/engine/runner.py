"""Turns a scheduled batch into tensors, runs the model over it and samples the next tokens."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import msgspec
import torch

from ember.engine.attention import (LONG_DECODE_CHUNK, DecodeGroup, KVCache, LongDecode, PagedAttention, PrefillSeq,
                                    long_decode, long_decode_available, prefill_seq)
from ember.engine.kernel_attention import kernel_attention
from ember.engine.pooling import step_parts
from ember.engine.sampler import Sampler, SamplingRow
from ember.engine.scheduler import ScheduledRequest
from ember.types import TokenLogprob

# Decode block tables are padded up to a multiple of this many blocks, so shapes repeat from step
# to step (fewer distinct shapes for torch's kernels and its allocator).
_BLOCK_TABLE_BUCKET = 4


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, list[int]]  # request id -> tokens sampled this step
    logprobs: dict[str, list[TokenLogprob]]
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its constraint failed (no token)
    accepted: dict[str, int] = field(default_factory=dict)  # request id -> drafted tokens kept (drafted rows only)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> its pooling part (engine.pooling)


class StepItem(msgspec.Struct, array_like=True):
    """One request's share of a step, all that the model's run needs of it: the same on every
    tensor-parallel rank (rank 0 sends them, engine.parallel), so every rank builds the same tensors."""

    token_ids: list[int]  # the tokens this step feeds the model: positions [start, start + len)
    start: int
    block_ids: list[int]  # the blocks holding positions [0, start + len)
    samples: bool
    num_drafted: int = 0  # the last num_drafted of token_ids are drafts (speculative decoding)
    # the request's bidirectional spans (Request.bidirectional_spans) cut to these positions, where
    # they hold two tokens or more: within each, the tokens attend to each other both ways
    bidirectional_spans: list[tuple[int, int]] = []
    pooling: str | None = None  # a pooling request's method (engine.pooling)
    ends_prompt: bool = False  # these tokens end the request's prompt


def step_items(scheduled: list[ScheduledRequest], block_size: int) -> list[StepItem]:
    items = []
    for item in scheduled:
        start, end = item.start, item.start + item.num_new_tokens
        spans = [(max(a, start), min(b, end)) for a, b in item.request.bidirectional_spans
                 if min(b, end) - max(a, start) > 1]
        request = item.request
        items.append(StepItem(item.input_token_ids, start, request.block_ids[:-(-end // block_size)],
                              item.samples, len(item.draft_token_ids), spans, request.sampling_params.pooling,
                              end == request.num_prompt_tokens))
    return items


class ModelRunner:
    """Attention through ember's CPU kernel when the cache has its layout (engine.kernel_attention),
    else through the torch backend (engine.attention), where `exact` keeps attention shapes
    independent of a sequence's neighbours."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, sampler: Sampler, device: torch.device,
                 exact: bool) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = device
        self.exact = exact
        self.block_size = cache.block_size

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], items: list[StepItem] | None = None,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> RunnerOutput:
        """Run the step and sample; `items`: step_items(scheduled) where the caller has them already;
        `embeds`: (rows (R,), values (R, hidden)) that replace those rows' token embeddings (images)."""
        logits, parts = self.forward(step_items(scheduled, self.block_size) if items is None else items, embeds)
        pooled = {scheduled[index].request.request_id: part for index, part in parts.items()}
        if logits is None:
            return RunnerOutput({}, {}, pooled=pooled)
        output = self._sample(logits, [s for s in scheduled if s.samples])
        output.pooled = pooled
        return output

    @torch.inference_mode()
    def forward(self, items: list[StepItem], embeds: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """The model over the items' tokens: the logits of their sampled rows, in item order, or
        None when no item samples (and on a tensor-parallel rank other than 0); and the pooling
        items' parts by item index (engine.pooling.step_parts)."""
        input_ids, positions, sample_rows, attn = self.prepare(items)
        if embeds is None:
            hidden = self.model(input_ids, positions, attn)
        else:
            hidden = self.model(input_ids, positions, attn, embeds=embeds)
        parts = step_parts(hidden, items, self.model.compute_logits) if any(item.pooling for item in items) else {}
        if not sample_rows:
            return None, parts
        return self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)]), parts

    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledRequest]) -> RunnerOutput:
        """Sample position by position. A drafted request has one logits row per drafted token plus
        one: at each position its token is drawn exactly as plain decoding would draw it there (its
        own keyed noise, penalties and constraint, given the tokens before it), and the round goes on
        only while the drawn token equals the draft. So drafting changes how many tokens a step
        yields, never which ones, and a constraint only ever sees tokens that are kept."""
        first_rows = list(itertools.accumulate((len(s.draft_token_ids) + 1 for s in sampling), initial=0))[:-1]
        if all(_takes_argmax(s) for s in sampling):
            return _argmax_rounds(self.sampler.argmax(logits), sampling, first_rows)
        drawn: list[list[int]] = [[] for _ in sampling]
        drawn_logprobs: list[list[TokenLogprob]] = [[] for _ in sampling]
        failed: dict[str, str] = {}
        accepted: dict[str, int] = {s.request.request_id: 0 for s in sampling if s.draft_token_ids}
        alive = list(range(len(sampling)))
        for position in range(max(len(s.draft_token_ids) for s in sampling) + 1):
            rows = [_sampling_row(sampling[i], drawn[i]) for i in alive]
            rows_logits = logits if position == 0 and len(logits) == len(alive) else \
                logits[torch.tensor([first_rows[i] + position for i in alive], device=logits.device)]
            result = self.sampler(rows_logits, rows)
            still = []
            for slot, i in enumerate(alive):
                request_id = sampling[i].request.request_id
                if slot in result.failed:
                    failed[request_id] = result.failed[slot]
                    continue
                token_id = result.token_ids[slot]
                drawn[i].append(token_id)
                if result.logprobs[slot] is not None:
                    drawn_logprobs[i].append(result.logprobs[slot])
                drafts = sampling[i].draft_token_ids
                if position < len(drafts) and token_id == drafts[position]:
                    accepted[request_id] += 1
                    still.append(i)
            alive = still
            if not alive:
                break
        sampled = {s.request.request_id: tokens for s, tokens in zip(sampling, drawn) if tokens}
        logprobs = {s.request.request_id: lps for s, lps in zip(sampling, drawn_logprobs) if lps}
        return RunnerOutput(sampled, logprobs, failed, accepted)

    def prepare(self, items: list[StepItem]):
        """(input ids (T,), positions (T,), the rows to sample in item order, the attention metadata)."""
        if self.cache.kernel_layout:
            return self._prepare_for_kernel(items)
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lengths: list[int] = []
        prefills: list[PrefillSeq] = []
        long_decodes: list[LongDecode] = []
        # On CPU, long sequences decode alone, reading the cache in place (see engine.attention)
        long_from = (LONG_DECODE_CHUNK if self.device.type == "cpu" and long_decode_available()
                     and not any(self.cache.layer_windows) else None)
        for item in items:
            block_ids, start, count = item.block_ids, item.start, len(item.token_ids)
            begin = len(token_ids)
            token_ids.extend(item.token_ids)
            positions.extend(range(start, start + count))
            if count > 1:
                seq_slots = _slots_of(block_ids, start + count, block_size)
                slots.extend(seq_slots[start:].tolist())
                prefills.append(prefill_seq(begin, start, seq_slots, self.cache.dtype, self.device, self.exact,
                                            item.bidirectional_spans))
            else:
                slots.append(block_ids[start // block_size] * block_size + start % block_size)
                if long_from is not None and start >= long_from:
                    long_decodes.append(long_decode(begin, block_ids, start + 1, block_size, self.device,
                                                    exact=self.exact))
                else:
                    decode_rows.append(begin)
                    decode_tables.append(block_ids[: start // block_size + 1])
                    decode_lengths.append(start + 1)
            if item.samples:
                sample_rows.extend(range(begin + count - 1 - item.num_drafted, begin + count))
        to_device = lambda values: torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
        decodes = self._decode_groups(decode_rows, decode_tables, decode_lengths)
        attn = PagedAttention(self.cache, to_device(slots), decodes, prefills, long_decodes)
        return to_device(token_ids), to_device(positions), sample_rows, attn

    def _prepare_for_kernel(self, items: list[StepItem]):
        if any(item.bidirectional_spans for item in items):  # engine.pool gives such models the torch layout
            raise RuntimeError("ember's attention kernel is causal only: it cannot open bidirectional spans")
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for item in items:
            start, count = item.start, len(item.token_ids)
            token_ids.extend(item.token_ids)
            positions.extend(range(start, start + count))
            slots.extend(item.block_ids[p // block_size] * block_size + p % block_size
                         for p in range(start, start + count))
            if item.samples:
                sample_rows.extend(range(len(token_ids) - 1 - item.num_drafted, len(token_ids)))
        rows = [(item.block_ids, item.start, len(item.token_ids)) for item in items]
        as_long = lambda values: torch.tensor(values, dtype=torch.long)
        return as_long(token_ids), as_long(positions), sample_rows, kernel_attention(self.cache, rows, as_long(slots))

    def _decode_groups(self, rows: list[int], tables: list[list[int]], lengths: list[int]) -> list[DecodeGroup]:
        """Exact: one group per padded width, so a sequence's keys are padded by its own length
        alone; else one group padded to the longest."""
        widths = [-(-len(t) // _BLOCK_TABLE_BUCKET) * _BLOCK_TABLE_BUCKET for t in tables]
        if not self.exact:
            widths = [max(widths, default=0)] * len(widths)
        groups = []
        for width in sorted(set(widths)):
            members = [i for i, w in enumerate(widths) if w == width]
            groups.append(self._decode_group([rows[i] for i in members], [tables[i] for i in members],
                                             [lengths[i] for i in members], width))
        return groups

    def _decode_group(self, rows: list[int], tables: list[list[int]], lengths: list[int], width: int) -> DecodeGroup:
        padded = [t + [0] * (width - len(t)) for t in tables]
        block_table = torch.tensor(padded, dtype=torch.long)
        key_mask = torch.arange(width * self.block_size)[None, :] < torch.tensor(lengths)[:, None]
        return DecodeGroup(
            token_index=torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True),
            block_table=block_table.to(self.device, non_blocking=True),
            key_mask=key_mask[None, :, None, :].to(self.device, non_blocking=True),
            lengths=torch.tensor(lengths, dtype=torch.long).to(self.device, non_blocking=True),
        )


def _slots_of(block_ids: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slots of a sequence's first num_tokens tokens: (num_tokens,)."""
    blocks = torch.tensor(block_ids[: -(-num_tokens // block_size)], dtype=torch.long)
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:num_tokens]


def _takes_argmax(item: ScheduledRequest) -> bool:
    """Whether every token of the item's round is the argmax of its logits row as they are: greedy,
    nothing that adjusts the logits or depends on the tokens drawn before it in the round."""
    request = item.request
    params = request.sampling_params
    return (Sampler.draws_argmax(params) and request.constraint is None
            and request.num_output_tokens >= params.min_tokens)


def _argmax_rounds(chosen: list[int], sampling: list[ScheduledRequest], first_rows: list[int]) -> RunnerOutput:
    """_sample's result when every row takes its argmax (`chosen`, one per logits row): the same
    tokens, found in one pass instead of one sampler call per position."""
    sampled: dict[str, list[int]] = {}
    accepted: dict[str, int] = {}
    for item, first in zip(sampling, first_rows):
        drafts = item.draft_token_ids
        kept = 0
        while kept < len(drafts) and chosen[first + kept] == drafts[kept]:
            kept += 1
        sampled[item.request.request_id] = chosen[first:first + kept + 1]
        if drafts:
            accepted[item.request.request_id] = kept
    return RunnerOutput(sampled, {}, {}, accepted)


def _sampling_row(item: ScheduledRequest, drawn: list[int]) -> SamplingRow:
    """The row for the next token after the request's tokens and `drawn` (this step's tokens before it)."""
    request = item.request
    params = request.sampling_params
    suppressed: frozenset[int] = frozenset()
    if request.num_output_tokens + len(drawn) < params.min_tokens:
        suppressed = request.end_token_ids
    token_ids = request.token_ids + drawn if drawn else request.token_ids
    return SamplingRow(params, token_ids, request.num_prompt_tokens, suppressed, request.constraint)
