"""What drives an EngineCore: the front end's messages applied to it, and its steps.

The engine worker process (engine.worker), AsyncEngine's thread (engine.engine) and the offline
LLM (ember.llm) all drive their core through this one object, so a request is admitted, refused,
aborted and asked about the same way whichever of them serves it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ember.engine.messages import Abort, Add, Answer, Pause, Query, QueryKind, Resume
from ember.errors import EmberError
from ember.types import FinishReason, StepOutput

if TYPE_CHECKING:
    from ember.engine.core import EngineCore


class EngineDriver:
    """Not thread-safe: the thread that steps the core calls everything."""

    def __init__(self, core: EngineCore, tokenizer) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self._constraints = None  # a grammar.realize.ConstraintBuilder, built when first needed
        self._handlers: dict[type, Callable[[Any], list[StepOutput]]] = {
            Add: self.add, Abort: self.abort, Pause: self.pause, Resume: self.resume}
        self._answers: dict[QueryKind, Callable[[Query], Any]] = {
            QueryKind.STATS: lambda query: core.stats(),
            QueryKind.CHECK_INVARIANTS: self._check_invariants,
            QueryKind.CHECK_CONSTRAINT: self._check_constraint,
        }

    @property
    def constraints(self):
        """Builds each request's live constraint from its ConstraintSpec (and checks specs)."""
        if self._constraints is None:
            from ember.grammar.realize import load_constraint_builder

            core = self.core
            self._constraints = load_constraint_builder(self.tokenizer, core.model_config.vocab_size,
                                                        core.eos_token_ids)
        return self._constraints

    def handle(self, message: Add | Abort | Pause | Resume) -> list[StepOutput]:
        return self._handlers[type(message)](message)

    def admit(self, message: Add) -> None:
        """Add the request to the core; an EmberError (naming the field) when it cannot run."""
        constraint = self.constraints.build(message.constraint) if message.constraint is not None else None
        self.core.add_request(message.request_id, message.prompt_token_ids, message.params, message.cache_salt,
                              message.arrival_time or None, constraint, message.report_progress, message.media)

    def add(self, message: Add) -> list[StepOutput]:
        """`admit`, with a refusal given back as the request's final output."""
        try:
            self.admit(message)
        except EmberError as exc:
            return [StepOutput(message.request_id, [], None, FinishReason.ERROR, len(message.prompt_token_ids), 0,
                               error=exc.message)]
        return []

    def abort(self, message: Abort) -> list[StepOutput]:
        """Final outputs of the live requests among `message.request_ids` (unknown ids are ignored)."""
        return self.core.abort(message.request_ids)

    def pause(self, message: Pause) -> list[StepOutput]:
        self.core.scheduler.pause(message.request_ids)
        return []

    def resume(self, message: Resume) -> list[StepOutput]:
        self.core.scheduler.resume(message.request_ids)
        return []

    def abort_all(self) -> list[StepOutput]:
        return self.core.abort(list(self.core.scheduler.requests))

    def step(self) -> list[StepOutput]:
        return self.core.step() if self.core.has_unfinished() else []

    def answer(self, query: Query) -> Answer:
        try:
            return Answer(query.query_id, self._answers[query.kind](query))
        except AssertionError as exc:
            return Answer(query.query_id, error=f"AssertionError: {exc}")
        except EmberError as exc:
            return Answer(query.query_id, error=exc.message, param=exc.param, code=exc.code)

    def _check_invariants(self, query: Query) -> bool:
        self.core.check_invariants()
        return True

    def _check_constraint(self, query: Query) -> bool:
        self.constraints.compile(query.constraint)  # kept in the builder's cache for the request that follows
        return True
