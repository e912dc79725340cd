"""From a ConstraintSpec (plain data) to the live constraint the engine's sampler calls.

Runs where the model runs (the engine worker, or the engine thread in process): grammars compile
there, cached by their text, and every request gets fresh constraint state of its own.
"""

from __future__ import annotations

from typing import Any

from ember.constraint_spec import STRUCTURAL_TAG, ConstraintSpec, GrammarSpec, SteeringSpec
from ember.errors import InvalidRequest
from ember.grammar.compiler import Grammars, grammar_unavailable
from ember.grammar.constraint import GrammarConstraint
from ember.parsers import TOOL_PARSERS
from ember.parsers.constraint import ForcedCall, ReplyConstraint
from ember.parsers.events import ThinkMarkers
from ember.tokenization.vocab import TokenBytes
from ember.types import TokenConstraint


class ConstraintBuilder:
    """Builds one request's constraint from its spec, for one served model."""

    def __init__(self, token_bytes: TokenBytes, grammars: Grammars | None) -> None:
        self.token_bytes = token_bytes
        self.grammars = grammars

    def build(self, spec: ConstraintSpec | None) -> TokenConstraint | None:
        if spec is None:
            return None
        steering = self._steering(spec.steering) if spec.steering is not None else None
        if spec.grammar_kind is None:
            return steering
        compiled = self.compile(spec)
        grammars = self.grammars
        return GrammarConstraint(grammars.matcher(compiled), grammars.vocab_size, self.token_bytes,
                                 grammars.stop_token_ids, reply=steering)

    def compile(self, spec: ConstraintSpec) -> Any:
        """The spec's compiled grammar (cached by its text); a grammar that does not compile is an
        InvalidRequest naming its field."""
        grammars = self.grammars
        if grammars is None:
            raise grammar_unavailable(spec.grammar_param)
        for kind, text, param in spec.checks:
            grammars.compile(GrammarSpec(kind, text, param))
        if spec.grammar_kind == STRUCTURAL_TAG:
            return grammars.compile_structural_tag_text(spec.grammar_text, spec.grammar_param)
        return grammars.compile(GrammarSpec(spec.grammar_kind, spec.grammar_text, spec.grammar_param))

    def _steering(self, spec: SteeringSpec) -> ReplyConstraint:
        think = ThinkMarkers(spec.think_start, spec.think_end) if spec.think_start is not None else None
        forced = None
        if spec.forced_tool_format is not None:
            tool_format = TOOL_PARSERS.get(spec.forced_tool_format)
            if tool_format is None:
                raise InvalidRequest(f"unknown tool-call format {spec.forced_tool_format!r}", param="tools")
            forced = ForcedCall(tool_format, tuple(spec.forced_names))
        return ReplyConstraint(self.token_bytes, think=think, in_block=spec.in_block, may_open=spec.may_open,
                               budget=spec.budget, forced_call=forced)


def load_constraint_builder(tokenizer: Any, vocab_size: int, stop_token_ids) -> ConstraintBuilder:
    from ember.grammar.compiler import load_grammars

    return ConstraintBuilder(tokenizer.token_bytes, load_grammars(tokenizer, vocab_size, stop_token_ids))
