"""Drafts from a smaller model that shares the served model's tokenizer.

The draft model runs in its own engine core (its own KV cache, scheduler and prefix cache). Each
round, every drafting request is sent to it as a fresh greedy request of its current tokens with
max_tokens set to the draft length, and all of them step together. Its prefix cache keeps the
sequence's KV from round to round (full blocks, the accepted drafts included, since they are the
sequence's tokens now), so a round recomputes at most the last partial block and then decodes
the drafts; nothing has to be rolled back by hand.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import replace

from ember.config import EngineConfig, SpeculativeConfig
from ember.errors import EmberError, ModelLoadError
from ember.engine.request import Request
from ember.types import SamplingParams

logger = logging.getLogger("ember.engine")


class DraftModelProposer:
    name = "draft"
    free = False

    def __init__(self, engine) -> None:
        self.engine = engine  # an EngineCore over the draft model
        self._ids = itertools.count()

    def propose(self, wants: list[tuple[Request, int]]) -> list[tuple[list[int], None]]:
        engine = self.engine
        index: dict[str, int] = {}
        for i, (request, num_tokens) in enumerate(wants):
            draft_id = f"draft-{next(self._ids)}"
            try:
                engine.add_request(draft_id, request.token_ids,
                                   SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True))
            except EmberError:  # beyond the draft model's window or vocabulary: no drafts for this one
                continue
            index[draft_id] = i
        drafts: list[list[int]] = [[] for _ in wants]
        while engine.has_unfinished():
            for output in engine.step():
                drafts[index[output.request_id]].extend(output.new_token_ids)
        return [(tokens, None) for tokens in drafts]

    def forget(self, request_id: str) -> None:
        pass  # the draft engine keeps nothing per request between rounds but its prefix cache


def load_draft_proposer(config: EngineConfig, target_source, open_source: Callable[[str], object],
                        build_engine: Callable) -> DraftModelProposer | None:
    """The draft model's proposer for --speculate draft or auto with --draft; None otherwise.
    `build_engine(source, config)` makes its engine core (EngineCore.from_source). Under auto, a
    draft model that fails to load gives way to n-gram lookup (None) with a warning; under draft,
    the failure stops the start."""
    spec: SpeculativeConfig = config.speculative
    if spec.mode not in ("draft", "auto") or not spec.draft_model:
        return None
    try:
        return _load(config, spec.draft_model, target_source, open_source, build_engine)
    except (ModelLoadError, OSError, ValueError) as exc:
        if spec.mode == "draft":
            raise
        logger.warning("the draft model %s did not load (%s); drafting by n-gram lookup instead", spec.draft_model, exc)
        return None


def _load(config: EngineConfig, name: str, target_source, open_source, build_engine) -> DraftModelProposer:
    source = open_source(name)
    if source.tokenizer.hf.get_vocab() != target_source.tokenizer.hf.get_vocab():
        raise ModelLoadError(f"the draft model {name} does not share the served model's tokenizer; "
                             f"a draft must write the same token ids", param="draft")
    # its cache sized by the served model's rules (a smaller model's tokens take less memory), its
    # weights in its own file's format (a quantized copy of the served model is a fair draft), and
    # its bits need not be batch-invariant: a draft only proposes, the served model decides
    draft_config = replace(config, speculative=SpeculativeConfig(), batch_invariant=False, quantization="auto",
                           tensor_parallel_size=1, nnodes=1, dist_init_addr=None,  # unsharded, beside rank 0
                           cache_ram_mb=0, cache_disk_dir=None)  # its prefixes are cheap to compute again
    engine = build_engine(source, draft_config)
    logger.info("draft model: %s", name)
    return DraftModelProposer(engine)
