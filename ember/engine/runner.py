"""Turns a scheduled batch into tensors, runs the model over it and samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ember.engine.attention import (LONG_DECODE_CHUNK, DecodeGroup, KVCache, LongDecode, PagedAttention, PrefillSeq,
                                    long_decode, long_decode_available, prefill_seq)
from ember.engine.kernel_attention import kernel_attention
from ember.engine.sampler import Sampler, SamplingRow
from ember.engine.scheduler import ScheduledRequest
from ember.types import TokenLogprob

# Decode block tables are padded up to a multiple of this many blocks, so shapes repeat
# from step to step (fewer distinct shapes for kernels, graph capture and allocators).
_BLOCK_TABLE_BUCKET = 4


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, list[int]]  # request id -> tokens sampled this step
    logprobs: dict[str, list[TokenLogprob]]
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its constraint failed (no token)


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
    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        input_ids, positions, sample_rows, attn = self._prepare(scheduled)
        hidden = self.model(input_ids, positions, attn)
        sampling = [s for s in scheduled if s.samples]
        if not sampling:
            return RunnerOutput({}, {})
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        rows = [_sampling_row(s) for s in sampling]
        result = self.sampler(logits, rows)
        failed = {sampling[i].request.request_id: reason for i, reason in result.failed.items()}
        sampled = {s.request.request_id: [t] for s, t in zip(sampling, result.token_ids)
                   if s.request.request_id not in failed}
        logprobs = {s.request.request_id: [lp] for s, lp in zip(sampling, result.logprobs)
                    if lp is not None and s.request.request_id not in failed}
        return RunnerOutput(sampled, logprobs, failed)

    def _prepare(self, scheduled: list[ScheduledRequest]):
        if self.cache.kernel_layout:
            return self._prepare_for_kernel(scheduled)
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
        for item in scheduled:
            request, start, count = item.request, item.start, item.num_new_tokens
            begin = len(token_ids)
            token_ids.extend(request.token_ids[start:start + count])
            positions.extend(range(start, start + count))
            if count > 1:
                seq_slots = _slots_of(request.block_ids, start + count, block_size)
                slots.extend(seq_slots[start:].tolist())
                prefills.append(prefill_seq(begin, start, seq_slots, self.cache.tensor.dtype, self.device, self.exact))
            else:
                slots.append(request.block_ids[start // block_size] * block_size + start % block_size)
                if long_from is not None and start >= long_from:
                    long_decodes.append(long_decode(begin, request.block_ids, start + 1, block_size, self.device,
                                                    exact=self.exact))
                else:
                    decode_rows.append(begin)
                    decode_tables.append(request.block_ids[: start // block_size + 1])
                    decode_lengths.append(start + 1)
            if item.samples:
                sample_rows.append(begin + count - 1)
        to_device = lambda values: torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
        decodes = self._decode_groups(decode_rows, decode_tables, decode_lengths)
        attn = PagedAttention(self.cache, to_device(slots), decodes, prefills, long_decodes)
        return to_device(token_ids), to_device(positions), sample_rows, attn

    def _prepare_for_kernel(self, scheduled: list[ScheduledRequest]):
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for item in scheduled:
            request, start, count = item.request, item.start, item.num_new_tokens
            token_ids.extend(request.token_ids[start:start + count])
            positions.extend(range(start, start + count))
            slots.extend(request.block_ids[p // block_size] * block_size + p % block_size
                         for p in range(start, start + count))
            if item.samples:
                sample_rows.append(len(token_ids) - 1)
        rows = [(item.request.block_ids, item.start, item.num_new_tokens) for item in scheduled]
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


def _sampling_row(item: ScheduledRequest) -> SamplingRow:
    request = item.request
    params = request.sampling_params
    suppressed: frozenset[int] = frozenset()
    if request.num_output_tokens < params.min_tokens:
        ends = set(params.stop_token_ids)
        if not params.ignore_eos:
            ends |= request.eos_token_ids
        suppressed = frozenset(ends)
    return SamplingRow(params, request.token_ids, request.num_prompt_tokens, suppressed, request.constraint)
