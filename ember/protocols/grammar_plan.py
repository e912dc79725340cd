"""From a validated request to the grammar its replies are held to (as a ConstraintSpec the engine
compiles).

What the answer must match:
- a structured-output field alone: that grammar;
- tool_choice required or a named function: one call or more (one with parallel_tool_calls false)
  to the offered tools, each call's arguments held to that tool's schema, and nothing else;
- tool_choice auto with a `strict` tool or a custom tool with a grammar: free text, but a call the
  reply opens is held to the offered tools, a strict tool's arguments to its schema, a custom
  tool's input to its grammar (another tool's arguments to a JSON object);
- a structured-output field beside tools under auto: the grammar's answer, or calls as above.
The structural tag that holds the calls is written by ember.grammar.structural_tag.
"""

from __future__ import annotations

from ember.constraint_spec import ConstraintSpec
from ember.grammar.compiler import grammar_unavailable
from ember.grammar.structural_tag import calls_constraint
from ember.parsers.events import ToolSpec
from ember.protocols.chat_reply import FUNCTION, REQUIRED, ReplyPlan
from ember.protocols.neutral import GenerationRequest


def build_constraints(job: GenerationRequest, plan: ReplyPlan | None, grammars: bool) -> ConstraintSpec | None:
    """The grammar every choice's reply is held to, as a spec the engine compiles (`grammars`:
    whether it can, with xgrammar); None when no grammar applies (the reply plan's own steering,
    if any, applies). The engine checks that the spec compiles before the request is admitted."""
    tools, forced = _constrained_tools(job, plan)
    if job.grammar is None and tools is None:
        return None
    if not grammars:
        if job.grammar is not None:
            raise grammar_unavailable(job.grammar.param)
        if any(t.strict for t in tools):
            raise grammar_unavailable("tools")
        for tool in tools:
            if tool.input_grammar is not None:
                raise grammar_unavailable(tool.input_grammar.param)
        return None  # a forced call without xgrammar: the reply plan forces opener and name, as before
    steering = plan.steering(reasoning_only=True) if plan is not None else None
    if tools is None:
        return ConstraintSpec(steering, job.grammar.kind, job.grammar.text, job.grammar.param)
    return calls_constraint(steering, plan.fmt.tool_format, tools, forced=forced,
                            parallel=plan.fmt.parallel_tool_calls, answer=job.grammar)


def _constrained_tools(job: GenerationRequest, plan: ReplyPlan | None) -> tuple[list[ToolSpec] | None, bool]:
    """(the tools whose calls a grammar must shape, or None; whether a call is forced)."""
    options = job.chat
    if options is None or plan is None or plan.fmt.tool_format is None or not options.calls_tools:
        return None, False
    forced = options.tool_choice in (REQUIRED, FUNCTION)
    if job.grammar is None and not forced and not any(t.strict or t.input_grammar for t in options.tools):
        return None, False
    return list(options.tools), forced
