"""Drafts from a smaller model that shares the served model's tokenizer, run inside the served
model's steps.

The draft model keeps no pool, scheduler or requests of its own: its KV cache has as many blocks
as the served model's pool and is addressed by the same block ids, so a request's blocks hold both
models' entries for its tokens. Within one engine step:

- `follow`: the prompt chunks the served model prefills, the draft model prefills too, into the
  same blocks, in one forward over all of them;
- `propose` (after the scheduler has granted each drafting request its round and the blocks for
  it): the draft model catches up on what it has not seen of each request (usually the last
  round's bonus token, or that and its last kept draft), then drafts, one forward for all requests
  per drafted position.

What a request's blocks hold for the draft model is told apart by position: `_Sequence.valid`
counts the leading positions whose entries the draft computed for the request's own tokens. A
round's drafts are written past them; the ones the served model kept become valid at the next
round, as far as they match what it kept (the rest are written over, like the served model's
rejected entries). A block shared through the prefix cache is trusted only where the draft model
completed that block for the same tokens: `_blocks` holds, for each block id, the prefix hash of
the tokens its draft entries were computed for, and any write to a block removes it. A block
restored from a cache tier or filled while drafting was off is computed again when a request
first drafts over it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ember.config import EngineConfig, SpeculativeConfig
from ember.engine.loading import BuiltModel, load_model
from ember.engine.request import Request
from ember.engine.runner import ModelRunner, StepItem
from ember.engine.scheduler import ScheduledRequest
from ember.errors import ModelLoadError

logger = logging.getLogger("ember.engine")


@dataclass(slots=True)
class _Sequence:
    valid: int  # positions [0, valid) hold the draft model's entries for the request's tokens
    drafts: list[int] = field(default_factory=list)  # entries at positions [valid, valid + len) for these drafts
    recorded: int = 0  # the request's blocks [0, recorded) are entered in DraftModelProposer._blocks


class DraftModelProposer:
    name = "draft"
    free = False

    def __init__(self, model: torch.nn.Module, cache, device: torch.device, max_positions: int,
                 target_vocab_size: int) -> None:
        """`cache`: an engine.attention.KVCache with the pool's block count and block size;
        `max_positions`: the positions the draft model reads (its rotary table); drafts past the
        served model's vocabulary (a padded embedding's ids) are never proposed."""
        self.runner = ModelRunner(model, cache, None, device, exact=False)
        self.block_size = cache.block_size
        self.max_positions = max_positions
        self.target_vocab_size = target_vocab_size
        self._sequences: dict[str, _Sequence] = {}
        self._blocks: dict[int, bytes] = {}  # block id -> prefix hash its draft entries were computed for

    # ---- what the cache holds ------------------------------------------------------------------

    def _sequence(self, request: Request) -> _Sequence:
        """The request's state, its last round's kept drafts counted valid."""
        sequence = self._sequences.get(request.request_id)
        if sequence is None:
            valid = 0
            for block_id, block_hash in zip(request.block_ids, request.block_hashes):
                if self._blocks.get(block_id) != block_hash:
                    break
                valid += self.block_size
            sequence = self._sequences[request.request_id] = _Sequence(valid, recorded=valid // self.block_size)
        elif sequence.drafts:
            tokens = request.token_ids
            kept = 0
            for token_id in sequence.drafts:
                if sequence.valid + kept >= len(tokens) or tokens[sequence.valid + kept] != token_id:
                    break
                kept += 1
            sequence.valid += kept
            sequence.drafts = []
        return sequence

    def _record(self, request: Request, sequence: _Sequence) -> None:
        """Enter the request's blocks the draft has completed since the last call (those that are
        full and hashed: the served model caches them too)."""
        end = min(sequence.valid // self.block_size, len(request.block_hashes))
        for index in range(sequence.recorded, end):
            if request.block_ids[index]:  # 0: released behind a sliding window
                self._blocks[request.block_ids[index]] = request.block_hashes[index]
        sequence.recorded = max(sequence.recorded, end)

    def _item(self, request: Request, sequence: _Sequence, start: int, token_ids: list[int], samples: bool) -> StepItem:
        """The draft model's input for positions [start, start + len(token_ids)): their blocks lose
        their entry in _blocks, as the draft writes them."""
        size, end = self.block_size, start + len(token_ids)
        blocks = request.block_ids[:-(-end // size)]
        for index in range(start // size, len(blocks)):
            self._blocks.pop(blocks[index], None)
        sequence.recorded = min(sequence.recorded, start // size)
        return StepItem(token_ids, start, blocks, samples)

    # ---- the two calls of a step ---------------------------------------------------------------

    def follow(self, scheduled: list[ScheduledRequest]) -> None:
        """Prefill what the served model prefilled this step (its prompt chunks, or a preempted
        request's tokens again) for the requests that may draft, from where the draft's own entries
        end. Decoding rows are caught up on when a request next drafts."""
        items = []
        for entry in scheduled:
            request = entry.request
            end = entry.start + entry.num_new_tokens
            if entry.draft_token_ids or not self._may_draft(request):
                continue
            if entry.num_new_tokens == 1 and entry.start >= request.num_prompt_tokens:
                continue  # a plain decoding row
            sequence = self._sequence(request)
            if sequence.valid < end <= self.max_positions:
                items.append(self._item(request, sequence, sequence.valid, request.token_ids[sequence.valid:end], False))
                sequence.valid = end
        if items:
            self.runner.forward(items)
        for entry in scheduled:
            sequence = self._sequences.get(entry.request.request_id)
            if sequence is not None:
                self._record(entry.request, sequence)

    def propose(self, wants: list[tuple[Request, int]]) -> list[tuple[list[int], None]]:
        """Up to n drafted tokens for each (request, n). The scheduler has given each request the
        blocks for its round (its last token and n drafts), which the draft's entries for its last
        token and first n - 1 drafts fill."""
        drafts: list[list[int]] = [[] for _ in wants]
        sequences: dict[int, _Sequence] = {}
        items = []
        for index, (request, num_tokens) in enumerate(wants):
            last = request.num_tokens - 1
            if last + num_tokens > self.max_positions:  # past the draft model's positions: no drafts
                continue
            sequence = sequences[index] = self._sequence(request)
            start = min(sequence.valid, last)  # the last token is always fed: its logits give the first draft
            items.append(self._item(request, sequence, start, request.token_ids[start:], True))
            sequence.valid = last + 1
            self._record(request, sequence)
        drafting = list(sequences)
        while drafting:
            chosen = self.runner.forward(items)[0].argmax(dim=-1).tolist()
            items, going = [], []
            for index, token_id in zip(drafting, chosen):
                request, wanted = wants[index]
                if token_id >= self.target_vocab_size:
                    continue
                drafts[index].append(token_id)
                if len(drafts[index]) < wanted:
                    position = request.num_tokens - 1 + len(drafts[index])
                    items.append(self._item(request, sequences[index], position, [token_id], True))
                    going.append(index)
            drafting = going
        for index, sequence in sequences.items():
            sequence.drafts = drafts[index][:-1]  # the last draft's entry is never written
        return [(tokens, None) for tokens in drafts]

    @staticmethod
    def _may_draft(request: Request) -> bool:
        params = request.sampling_params
        return params.draft and request.max_tokens > 0 and params.pooling is None

    def restart(self, request_id: str) -> None:
        """The request was preempted: its blocks are gone, and with them what the draft knew of it."""
        self._sequences.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)


def load_draft_model(config: EngineConfig, target_source, open_source: Callable[[str], object]) -> BuiltModel | None:
    """The draft model for --speculate draft or auto with --draft; None otherwise. Under auto, a
    draft model that fails to load gives way to n-gram lookup (None) with a warning; under draft,
    the failure stops the start."""
    spec: SpeculativeConfig = config.speculative
    if spec.mode not in ("draft", "auto") or not spec.draft_model:
        return None
    try:
        return _load(config, spec.draft_model, target_source, open_source)
    except (ModelLoadError, OSError, ValueError) as exc:
        if spec.mode == "draft":
            raise
        logger.warning("the draft model %s did not load (%s); drafting by n-gram lookup instead", spec.draft_model, exc)
        return None


def _load(config: EngineConfig, name: str, target_source, open_source) -> BuiltModel:
    source = open_source(name)
    if source.tokenizer.hf.get_vocab() != target_source.tokenizer.hf.get_vocab():
        raise ModelLoadError(f"the draft model {name} does not share the served model's tokenizer; "
                             f"a draft must write the same token ids", param="draft")
    # its weights in its own file's format (a quantized copy of the served model is a fair draft),
    # unsharded beside rank 0 under tensor parallelism
    built = load_model(source, replace(config, quantization="auto", tensor_parallel_size=1, nnodes=1,
                                       dist_init_addr=None))
    logger.info("draft model: %s", name)
    return built
