"""ReplyConstraint driven by a scripted fake model over the default model's real vocabulary."""

import json
import random

import pytest

from ember.loaders import load_model_source
from ember.parsers import HERMES, QWEN3_XML
from ember.parsers.constraint import ForcedCall, ReplyConstraint
from ember.parsers.events import ThinkMarkers, ToolSpec
from ember.parsers.reasoning import ThinkTracker
from ember.parsers.reply import ReplyFormat
from reply_helpers import parse_reply

TOKENIZER = load_model_source(None).tokenizer
TB = TOKENIZER.token_bytes

THINK = ThinkMarkers()
CLOSE = b"\n</think>\n\n"
NAMES = ("get_weather", "get_time", "get")
TOOLS = {name: ToolSpec(name, {"type": "object", "properties": {"city": {"type": "string"}}}) for name in NAMES}
REASONING = "Let me think about the weather in Paris and what the user wants to know. " * 3
HERMES_ARGS = '"city": "Paris"}'
XML_ARGS = "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def encode(text):
    return TOKENIZER.encode(text)


def smallest(allowed):
    return min(allowed)


def longest(allowed):
    return max(allowed, key=lambda token_id: (len(TB[token_id]), -token_id))


class Prefer:
    """Picks tokens that write `text` while it is allowed to, then falls back to another chooser."""

    def __init__(self, text, fallback=smallest):
        self.text = text.encode()
        self.done = 0
        self.fallback = fallback

    def __call__(self, allowed):
        rest = self.text[self.done:]
        fitting = [t for t in allowed if rest and rest.startswith(TB[t])]
        if not fitting:
            return self.fallback(allowed)
        choice = max(fitting, key=lambda token_id: (len(TB[token_id]), -token_id))
        self.done += len(TB[choice])
        return choice


class RandomChoice:
    def __init__(self, seed):
        self.rng = random.Random(seed)

    def __call__(self, allowed):
        return self.rng.choice(sorted(set(allowed)))


def drive(constraint, segments, choose, max_steps=400):
    """The fake model: scripted tokens while the constraint lets it, a chosen allowed id otherwise.
    Returns (output ids, indices of the forced tokens)."""
    script = [token_id for segment in segments for token_id in encode(segment)]
    output, forced, pos = [], [], 0
    for _ in range(max_steps):
        allowed = constraint.allowed_token_ids(output)
        if allowed is None:
            if pos == len(script):
                return output, forced
            output.append(script[pos])
            pos += 1
        else:
            assert allowed, "an empty allow-list would stall the model"
            forced.append(len(output))
            output.append(choose(allowed))
    raise AssertionError("the fake model never finished")


def text_of(token_ids):
    return TB.join(token_ids).decode()


def count_reasoning(token_ids, *, in_block=True, may_open=False):
    tracker = ThinkTracker(THINK, TB, in_block=in_block, may_open=may_open)
    for token_id in token_ids:
        tracker.feed(token_id)
    return tracker


# ---- thinking budget ----------------------------------------------------------------------------

@pytest.mark.parametrize("choose", [smallest, longest])
@pytest.mark.parametrize("budget", [0, 1, 5, 17])
def test_budget_forces_the_close_then_lets_go(budget, choose):
    constraint = ReplyConstraint(TB, think=THINK, in_block=True, budget=budget)
    output, forced = drive(constraint, [REASONING, "The answer is 4."], choose)
    # Exactly the tokens right after the budget are forced, and they write the close.
    assert forced == list(range(budget, budget + len(forced)))
    assert TB.join(output[budget:budget + len(forced)]) == CLOSE
    assert constraint.num_budget_closes == 1
    script = encode(REASONING) + encode("The answer is 4.")
    assert output[:budget] == script[:budget]
    assert output[budget + len(forced):] == script[budget:]
    tracker = count_reasoning(output)
    assert tracker.closed
    assert budget < tracker.num_tokens <= budget + len(forced)
    assert constraint.tracker.num_tokens == tracker.num_tokens
    # The parser splits at the forced close; the reasoning is what the model wrote before it.
    fmt = ReplyFormat(think=THINK, starts_in_reasoning=True)
    reply = parse_reply(fmt, text_of(output), output, TB)
    assert reply.reasoning == text_of(script[:budget]) + "\n"
    assert reply.content == text_of(script[budget:]).lstrip()
    assert reply.content.endswith("The answer is 4.")
    assert reply.num_reasoning_tokens == tracker.num_tokens


def test_forced_close_smallest_and_longest_choices_differ():
    ways = set()
    for choose in (smallest, longest):
        constraint = ReplyConstraint(TB, think=THINK, in_block=True, budget=2)
        output, forced = drive(constraint, [REASONING], choose)
        assert TB.join(output[2:2 + len(forced)]) == CLOSE
        ways.add(tuple(output[2:2 + len(forced)]))
    assert len(ways) == 2


@pytest.mark.parametrize("budget", [None, 50, "exact"])
def test_reply_that_closes_in_time_is_never_forced(budget):
    thought = "Short thought.</think>"
    num_thought = len(encode(thought))
    if budget == "exact":
        budget = num_thought  # the token that completes the marker is the budget's last
    constraint = ReplyConstraint(TB, think=THINK, in_block=True, budget=budget)
    output, forced = drive(constraint, [thought, "\n\nAnswer."], smallest)
    assert forced == []
    assert constraint.num_budget_closes == 0
    assert text_of(output) == thought + "\n\nAnswer."
    assert count_reasoning(output).num_tokens == num_thought


def test_budget_one_short_of_a_natural_close_forces_it():
    thought = "Short thought.</think>"
    budget = len(encode(thought)) - 1
    constraint = ReplyConstraint(TB, think=THINK, in_block=True, budget=budget)
    output, forced = drive(constraint, [thought, "Answer."], smallest)
    assert forced and forced[0] == budget
    assert TB.join(output[forced[0]:forced[-1] + 1]) == CLOSE
    assert count_reasoning(output).num_tokens <= budget + len(forced)


def test_budget_counts_a_block_the_reply_opens_itself():
    constraint = ReplyConstraint(TB, think=THINK, may_open=True, budget=6)
    output, forced = drive(constraint, ["<think>", REASONING], longest)
    assert len(encode("<think>")) == 3  # the opener's tokens count toward the budget
    assert forced[0] == 6
    assert TB.join(output[6:6 + len(forced)]) == CLOSE
    tracker = count_reasoning(output, in_block=False, may_open=True)
    assert 6 < tracker.num_tokens <= 6 + len(forced)
    reply = parse_reply(ReplyFormat(think=THINK, may_open_reasoning=True), text_of(output), output, TB)
    assert reply.reasoning == text_of(output[3:6]) + "\n"
    assert reply.num_reasoning_tokens == tracker.num_tokens


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_budget_leaves_a_reply_without_reasoning_alone(budget):
    constraint = ReplyConstraint(TB, think=THINK, may_open=True, budget=budget)
    output, forced = drive(constraint, ["Hello there, no thinking today."], smallest)
    assert forced == []
    assert text_of(output) == "Hello there, no thinking today."
    assert count_reasoning(output, in_block=False, may_open=True).num_tokens == 0


def test_no_constraint_without_budget_or_call():
    constraint = ReplyConstraint(TB, think=THINK, in_block=True)
    output, forced = drive(constraint, [REASONING], smallest)
    assert forced == []
    assert constraint.allowed_token_ids(output) is None


# ---- forced call --------------------------------------------------------------------------------

def split_forced_call(text, tool_format, names):
    """The call's name, checking the forced head: prefix, a declared name, suffix, after_name."""
    assert text.startswith(tool_format.call_prefix)
    rest = text[len(tool_format.call_prefix):]
    named = [name for name in names if rest.startswith(name + tool_format.name_suffix)]
    assert len(named) == 1, rest
    name = named[0]
    assert rest[len(name + tool_format.name_suffix):].startswith(tool_format.after_name)
    return name


HEAD_CASES = [(names, choose) for names in (NAMES, ("get_time",), ("get", "get_time"))
              for choose in (smallest, longest)]


@pytest.mark.parametrize("names,choose", HEAD_CASES)
def test_forced_hermes_call(names, choose):
    constraint = ReplyConstraint(TB, forced_call=ForcedCall(HERMES, names))
    output, forced = drive(constraint, [HERMES_ARGS], choose)
    text = text_of(output)
    name = split_forced_call(text, HERMES, names)
    head = HERMES.call_prefix + name + HERMES.name_suffix + HERMES.after_name
    # The head is forced, the arguments are the model's own tokens, the ending is forced again.
    free = [i for i in range(len(output)) if i not in forced]
    assert free == list(range(free[0], free[-1] + 1))
    assert text_of(output[:free[0]]) == head
    assert output[free[0]:free[-1] + 1] == encode(HERMES_ARGS)
    assert TB.join(output[free[-1] + 1:]) == b"}\n</tool_call>"
    assert text == head + HERMES_ARGS + "}\n</tool_call>"
    assert constraint.allowed_token_ids(output) is None
    reply = parse_reply(ReplyFormat(tool_format=HERMES, tools=TOOLS), text)
    assert [(call.name, json.loads(call.arguments)) for call in reply.tool_calls] == [(name, {"city": "Paris"})]
    assert reply.content == ""


def test_forced_name_choices_vary_with_the_model():
    chosen = set()
    for choose in (smallest, longest, Prefer(HERMES.call_prefix + "get_time"), Prefer(HERMES.call_prefix + 'get"')):
        constraint = ReplyConstraint(TB, forced_call=ForcedCall(HERMES, NAMES))
        output, _ = drive(constraint, [HERMES_ARGS], choose)
        chosen.add(split_forced_call(text_of(output), HERMES, NAMES))
    assert {"get_time", "get"} <= chosen


@pytest.mark.parametrize("tool_format,arguments", [(HERMES, HERMES_ARGS), (QWEN3_XML, XML_ARGS)])
def test_forced_name_is_always_declared(tool_format, arguments):
    for seed in range(25):
        constraint = ReplyConstraint(TB, forced_call=ForcedCall(tool_format, NAMES))
        output, _ = drive(constraint, [arguments], RandomChoice(seed))
        text = text_of(output)
        name = split_forced_call(text, tool_format, NAMES)
        reply = parse_reply(ReplyFormat(tool_format=tool_format, tools=TOOLS), text)
        assert [(call.name, json.loads(call.arguments)) for call in reply.tool_calls] == [(name, {"city": "Paris"})]


@pytest.mark.parametrize("arguments,ending,expected,extra", [
    ('"q": {"a": [1, "}"]}}', "}\n</tool_call>", {"q": {"a": [1, "}"]}}, ""),
    ('"city": "Pa\\"ris}"}', "}\n</tool_call>", {"city": 'Pa"ris}'}, ""),
    ("}", "}\n</tool_call>", {}, ""),
    ('"city": "Paris"}}', "\n</tool_call>", {"city": "Paris"}, ""),  # "}}" is one token: ember ends the rest
    (HERMES_ARGS, "}\n</tool_call>", {"city": "Paris"}, "Done."),
])
def test_forced_hermes_call_ends_after_the_arguments(arguments, ending, expected, extra):
    constraint = ReplyConstraint(TB, forced_call=ForcedCall(HERMES, ("get_weather",)))
    output, forced = drive(constraint, [arguments, extra], longest)
    text = text_of(output)
    head = HERMES.call_prefix + 'get_weather"' + HERMES.after_name
    assert text == head + arguments + ending + extra
    assert text_of([output[i] for i in forced]) == head + ending
    reply = parse_reply(ReplyFormat(tool_format=HERMES, tools=TOOLS), text)
    assert [(call.name, json.loads(call.arguments)) for call in reply.tool_calls] == [("get_weather", expected)]
    assert reply.content == extra


@pytest.mark.parametrize("names,choose", HEAD_CASES)
def test_forced_qwen3_xml_call(names, choose):
    constraint = ReplyConstraint(TB, forced_call=ForcedCall(QWEN3_XML, names))
    output, forced = drive(constraint, [XML_ARGS], choose)
    text = text_of(output)
    name = split_forced_call(text, QWEN3_XML, names)
    head = QWEN3_XML.call_prefix + name + QWEN3_XML.name_suffix + QWEN3_XML.after_name
    assert forced == list(range(len(forced)))
    assert text_of(output[:len(forced)]) == head
    assert text == head + XML_ARGS
    reply = parse_reply(ReplyFormat(tool_format=QWEN3_XML, tools=TOOLS), text)
    assert [(call.name, json.loads(call.arguments)) for call in reply.tool_calls] == [(name, {"city": "Paris"})]


@pytest.mark.parametrize("tool_format,arguments", [(HERMES, HERMES_ARGS), (QWEN3_XML, XML_ARGS)])
def test_forced_call_waits_for_the_prompt_opened_block_to_close(tool_format, arguments):
    constraint = ReplyConstraint(TB, think=THINK, in_block=True, forced_call=ForcedCall(tool_format, NAMES))
    output, forced = drive(constraint, ["I need the weather.</think>", arguments], longest)
    num_thought = len(encode("I need the weather.</think>"))
    assert forced[0] == num_thought
    text = text_of(output)
    fmt = ReplyFormat(think=THINK, starts_in_reasoning=True, tool_format=tool_format, tools=TOOLS)
    reply = parse_reply(fmt, text)
    assert reply.reasoning == "I need the weather."
    assert len(reply.tool_calls) == 1 and reply.tool_calls[0].name in NAMES
    assert json.loads(reply.tool_calls[0].arguments) == {"city": "Paris"}


@pytest.mark.parametrize("tool_format,arguments", [(HERMES, HERMES_ARGS), (QWEN3_XML, XML_ARGS)])
def test_budget_close_then_forced_call(tool_format, arguments):
    thought = "Weather for Paris, so"
    budget = len(encode(thought))  # the budget runs out right after the thought
    constraint = ReplyConstraint(TB, think=THINK, in_block=True, budget=budget,
                                 forced_call=ForcedCall(tool_format, ("get_weather",)))
    output, forced = drive(constraint, [thought, arguments], smallest)
    text = text_of(output)
    head = tool_format.call_prefix + "get_weather" + tool_format.name_suffix + tool_format.after_name
    assert text.startswith(thought + CLOSE.decode() + head + arguments)
    num_close = next(k for k in range(len(output)) if TB.join(output[budget:budget + k]) == CLOSE)
    # The close and the call's head are forced back to back.
    first_free = min(i for i in range(budget, len(output)) if i not in forced)
    assert forced[:first_free - budget] == list(range(budget, first_free))
    assert text_of(output[budget:first_free]) == CLOSE.decode() + head
    fmt = ReplyFormat(think=THINK, starts_in_reasoning=True, tool_format=tool_format, tools=TOOLS)
    reply = parse_reply(fmt, text, output, TB)
    assert reply.reasoning == thought + "\n"
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert budget < reply.num_reasoning_tokens <= budget + num_close
    assert constraint.num_budget_closes == 1


def test_may_open_first_choice_allows_the_opener_and_think():
    constraint = ReplyConstraint(TB, think=THINK, may_open=True, forced_call=ForcedCall(HERMES, NAMES))
    first = set(constraint.allowed_token_ids([]))
    assert first == set(TB.ids_starting(HERMES.call_prefix.encode())) | set(TB.ids_starting(b"<think>"))
    [lt] = TB.ids_by_bytes[b"<"]
    second = {TB[t] for t in constraint.allowed_token_ids([lt])}
    assert {b"tool", b"think"} <= second
    assert all(b"tool_call>".startswith(piece) or b"think>".startswith(piece) for piece in second)


@pytest.mark.parametrize("tool_format,arguments", [(HERMES, HERMES_ARGS), (QWEN3_XML, XML_ARGS)])
def test_may_open_the_model_thinks_then_the_call_is_forced(tool_format, arguments):
    constraint = ReplyConstraint(TB, think=THINK, may_open=True, forced_call=ForcedCall(tool_format, NAMES))
    thought = "I will call get_weather for Paris.</think>"
    output, forced = drive(constraint, [thought, arguments], Prefer("<think>", fallback=longest))
    text = text_of(output)
    assert text.startswith("<think>" + thought)
    # "<", "think", ">": forced choices; then nothing is forced until the block closes.
    assert forced[:3] == [0, 1, 2] and text_of(output[:3]) == "<think>"
    assert forced[3] == 3 + len(encode(thought))
    name = split_forced_call(text[len("<think>" + thought):], tool_format, NAMES)
    fmt = ReplyFormat(think=THINK, may_open_reasoning=True, tool_format=tool_format, tools=TOOLS)
    reply = parse_reply(fmt, text, output, TB)
    assert reply.reasoning == thought[:-len("</think>")]
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [(name, {"city": "Paris"})]
    assert reply.num_reasoning_tokens == 3 + len(encode(thought))


@pytest.mark.parametrize("tool_format,arguments", [(HERMES, HERMES_ARGS), (QWEN3_XML, XML_ARGS)])
def test_may_open_the_model_calls_at_once(tool_format, arguments):
    constraint = ReplyConstraint(TB, think=THINK, may_open=True, forced_call=ForcedCall(tool_format, NAMES))
    output, forced = drive(constraint, [arguments], Prefer(tool_format.call_prefix + "get_time"))
    text = text_of(output)
    assert split_forced_call(text, tool_format, NAMES) == "get_time"
    fmt = ReplyFormat(think=THINK, may_open_reasoning=True, tool_format=tool_format, tools=TOOLS)
    reply = parse_reply(fmt, text, output, TB)
    assert reply.reasoning == "" and reply.num_reasoning_tokens == 0
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("get_time", {"city": "Paris"})]


def test_forced_call_with_thinking_off_opens_at_once():
    constraint = ReplyConstraint(TB, think=THINK, forced_call=ForcedCall(HERMES, NAMES))
    first = constraint.allowed_token_ids([])
    assert set(first) == set(TB.ids_starting(HERMES.call_prefix.encode()))
    assert b"think" not in {TB[t] for t in constraint.allowed_token_ids(encode("<"))}


@pytest.mark.parametrize("tool_format,arguments", [(HERMES, HERMES_ARGS), (QWEN3_XML, XML_ARGS)])
@pytest.mark.parametrize("wanted", ["météo", "mét"])
def test_forced_name_outside_ascii(tool_format, arguments, wanted):
    names = ("météo", "mét", "get")
    constraint = ReplyConstraint(TB, forced_call=ForcedCall(tool_format, names))
    output, _ = drive(constraint, [arguments], Prefer(tool_format.call_prefix + wanted + tool_format.name_suffix))
    text = text_of(output)
    assert split_forced_call(text, tool_format, names) == wanted
    reply = parse_reply(ReplyFormat(tool_format=tool_format, tools={n: ToolSpec(n) for n in names}), text)
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [(wanted, {"city": "Paris"})]


def test_random_models_always_give_one_declared_call():
    """Random settings and random choices among the allowed ids: the reply always parses to one
    call to a declared tool, and the reasoning never runs past the budget plus the forced tokens."""
    for seed in range(40):
        rng = random.Random(seed)
        tool_format, arguments = rng.choice([(HERMES, HERMES_ARGS), (QWEN3_XML, XML_ARGS)])
        in_block = rng.random() < 0.5
        may_open = not in_block
        budget = rng.choice([None, 0, 2, 6, 30])
        names = tuple(rng.sample(NAMES + ("get_weather_v2",), rng.randint(1, 4)))
        thinks = in_block or rng.random() < 0.5
        choose = Prefer("<think>" if thinks else tool_format.call_prefix, fallback=RandomChoice(seed))
        constraint = ReplyConstraint(TB, think=THINK, in_block=in_block, may_open=may_open, budget=budget,
                                     forced_call=ForcedCall(tool_format, names))
        thought = encode("Let me think about which tool fits best.</think>") if thinks else []
        script = encode(arguments)
        output, forced = [], []
        for _ in range(400):
            allowed = constraint.allowed_token_ids(output)
            if allowed is None:
                if not thought and not script:
                    break
                output.append((thought or script).pop(0))
                continue
            if not constraint.tracker.undecided:
                thought = []  # a forced close or call ends the model's own thought
            forced.append(len(output))
            output.append(choose(allowed))
        assert not thought and not script
        fmt = ReplyFormat(think=THINK, starts_in_reasoning=in_block, may_open_reasoning=may_open,
                          tool_format=tool_format, tools={n: ToolSpec(n) for n in names})
        reply = parse_reply(fmt, text_of(output), output, TB)
        assert len(reply.tool_calls) == 1 and reply.tool_calls[0].name in names, seed
        assert json.loads(reply.tool_calls[0].arguments) == {"city": "Paris"}
        if budget is not None and thinks:
            closed_at = next(k for k in range(len(output) + 1) if b"</think>" in TB.join(output[:k]))
            assert reply.num_reasoning_tokens <= budget + sum(i < closed_at for i in forced), seed


# ---- the engine's calling pattern ---------------------------------------------------------------

THOUGHT = "thinking hard"


def scenario():
    """May open a block, whose budget runs out right after THOUGHT; then a forced hermes call."""
    return ReplyConstraint(TB, think=THINK, may_open=True, budget=3 + len(encode(THOUGHT)),
                           forced_call=ForcedCall(HERMES, NAMES))


def recorded_run():
    """Each step's allow-list, from a constraint asked twice at every step."""
    constraint = scenario()
    script = encode(THOUGHT) + encode(HERMES_ARGS)
    choose = Prefer("<think>", fallback=longest)
    output, answers, pos = [], [], 0
    for _ in range(400):
        allowed = constraint.allowed_token_ids(output)
        again = constraint.allowed_token_ids(list(output))
        assert again == allowed
        answers.append(allowed)
        if allowed is None:
            if pos == len(script):
                return output, answers
            output.append(script[pos])
            pos += 1
        else:
            output.append(choose(allowed))
    raise AssertionError("the fake model never finished")


def test_allowed_ids_are_idempotent_and_the_run_covers_every_stage():
    output, answers = recorded_run()
    text = text_of(output)
    name = split_forced_call(text[len("<think>" + THOUGHT + CLOSE.decode()):], HERMES, NAMES)
    assert text == ("<think>" + THOUGHT + CLOSE.decode() + HERMES.call_prefix + name + HERMES.name_suffix
                    + HERMES.after_name + HERMES_ARGS + "}\n</tool_call>")
    assert sum(a is None for a in answers) > 0 and sum(a is not None for a in answers) > 10


@pytest.mark.parametrize("seed", range(6))
def test_catch_up_after_skipped_calls(seed):
    output, answers = recorded_run()
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(len(output) + 1), k=max(3, len(output) // 4)))
    constraint = scenario()
    for step in steps:
        assert constraint.allowed_token_ids(output[:step]) == answers[step], step
    assert constraint.allowed_token_ids(output) is None


def test_catch_up_in_one_call():
    output, answers = recorded_run()
    for step in (len(output) // 3, len(output) // 2, len(output)):
        assert scenario().allowed_token_ids(output[:step]) == answers[step]


# ---- reasoning token counts ---------------------------------------------------------------------

@pytest.mark.parametrize("text,in_block,may_open,counted", [
    ("Thinking.</think>\n\nAnswer.", True, False, "Thinking.</think>"),
    ("<think>Thinking.</think>\n\nAnswer.", False, True, "<think>Thinking.</think>"),
    ("Answer only.", False, True, ""),
    ("<b>Answer</b>", False, True, ""),
    ("<think>Not a block.</think>", False, False, ""),
    ("Still thinking", True, False, "Still thinking"),
])
def test_think_tracker_counts_block_tokens(text, in_block, may_open, counted):
    ids = encode(text)
    num_counted = next(k for k in range(len(ids) + 1) if text_of(ids[:k]) == counted)
    tracker = count_reasoning(ids, in_block=in_block, may_open=may_open)
    assert tracker.num_tokens == num_counted
    assert tracker.closed == counted.endswith("</think>")
    assert tracker.in_block == (counted == text)
    reply = parse_reply(ReplyFormat(think=THINK, starts_in_reasoning=in_block, may_open_reasoning=may_open),
                        text, ids, TB)
    assert reply.num_reasoning_tokens == num_counted
