"""Reply parsers on plain text: reasoning, content and tool calls, whole and streamed."""

import json
import random

import pytest

from ember.errors import EmberError
from ember.parsers import HERMES, QWEN3_XML, resolve_reasoning, resolve_tool_format
from ember.parsers.events import (
    TEXT_EVENTS, ContentText, ReasoningText, ThinkMarkers, ToolCall, ToolCallDelta, ToolCallStart, ToolSpec,
)
from ember.parsers.qwen3_xml import schema_types, typed_value
from ember.parsers.reply import ReplyFormat, ReplyParser, partial_suffix
from ember.parsers.tool_prompt import tool_system_prompt
from reply_helpers import parse_reply

SEEDS = range(40)

WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}})
TIME = ToolSpec("get_time", {"type": "object", "properties": {"zone": {"type": "string"}}})
TYPED = ToolSpec("typed", {"type": "object", "properties": {
    "i": {"type": "integer"},
    "n": {"type": "number"},
    "b": {"type": "boolean"},
    "z": {"type": "null"},
    "o": {"type": "object"},
    "a": {"type": "array"},
    "s": {"type": "string"},
    "u": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "t": {"type": ["number", "null"]},
    "si": {"type": ["integer", "string"]},
}})
TOOLS = {tool.name: tool for tool in (WEATHER, TIME, TYPED)}
THINKING = dict(think=ThinkMarkers(), starts_in_reasoning=True)
MAY_OPEN = dict(think=ThinkMarkers(), may_open_reasoning=True)


def fmt_for(tool_format, **kwargs):
    return ReplyFormat(tool_format=tool_format, tools=TOOLS, **kwargs)


def hermes_call(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def xml_call(name, params):
    """params: [(name, raw value)]; each value gets the format's framing newlines."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def stream(fmt, text, seed, sizes=(1, 7)):
    """Feed `text` in random pieces; returns (reply, events)."""
    rng = random.Random(seed)
    parser = ReplyParser(fmt)
    events, pos = [], 0
    while pos < len(text):
        size = rng.randint(*sizes)
        events += parser.feed(text[pos:pos + size])
        pos += size
    events += parser.finish()
    return parser.reply, events


def calls_of(reply):
    return [(call.name, json.loads(call.arguments)) for call in reply.tool_calls]


def joined(events, kind):
    return "".join(event.text for event in events if isinstance(event, kind))


def check_calls(events):
    """Indices run 0, 1, ...; each call appears once with its own id, as a start, its argument
    pieces and an end that holds the joined pieces, with nothing between them."""
    calls = [event for event in events if isinstance(event, ToolCall)]
    open_call, pieces = None, ""
    for event in events:
        if isinstance(event, ToolCallStart):
            assert open_call is None
            open_call, pieces = event, ""
        elif isinstance(event, ToolCallDelta):
            assert open_call is not None and event.index == open_call.index and event.arguments
            pieces += event.arguments
        elif isinstance(event, ToolCall):
            assert open_call is not None and (event.index, event.id, event.name) == (
                open_call.index, open_call.id, open_call.name)
            assert event.arguments == pieces
            open_call = None
        else:
            assert open_call is None, "no text inside a call"
    assert open_call is None
    assert [call.index for call in calls] == list(range(len(calls)))
    ids = [call.id for call in calls]
    assert len(set(ids)) == len(ids)
    assert all(call_id.startswith("call_") and len(call_id) > 5 for call_id in ids)
    return calls


def assert_stream_matches_whole(fmt, text, seeds=SEEDS):
    whole = parse_reply(fmt, text)
    for seed in seeds:
        reply, events = stream(fmt, text, seed)
        assert joined(events, ContentText) == reply.content == whole.content, seed
        assert joined(events, ReasoningText) == reply.reasoning == whole.reasoning, seed
        calls = check_calls(events)
        assert [(c.name, c.arguments, c.complete) for c in calls] == [
            (c.name, c.arguments, c.complete) for c in whole.tool_calls]
        assert reply.tool_calls == calls
        assert reply.num_dropped_calls == whole.num_dropped_calls
        assert all(event.text for event in events if isinstance(event, TEXT_EVENTS))
    return whole


# ---- complete replies ---------------------------------------------------------------------------

H_CALL = hermes_call("get_weather", {"city": "Paris", "days": 3})
H_CALL2 = hermes_call("get_time", {"zone": "UTC"})
X_CALL = xml_call("get_weather", [("city", "Paris"), ("days", "3")])
X_CALL2 = xml_call("get_time", [("zone", "UTC")])

COMPLETE = {
    "hermes": (HERMES, [
        ("The sky is blue. <b>bold</b> and a < sign.", "The sky is blue. <b>bold</b> and a < sign.", []),
        (H_CALL, "", [("get_weather", {"city": "Paris", "days": 3})]),
        (H_CALL + "\n" + H_CALL2 + "\n\n" + H_CALL,
         "", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"}),
              ("get_weather", {"city": "Paris", "days": 3})]),
        ("Let me check.\n" + H_CALL + "\n" + H_CALL2 + "\nDone, see above.",
         "Let me check.\n\nDone, see above.",
         [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]),
        ('<tool_call>{"name": "get_time", "parameters": {"zone": "CET"}}</tool_call>',
         "", [("get_time", {"zone": "CET"})]),
        ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>',
         "", [("get_time", {"zone": "CET"})]),
        ('<tool_call>{"name": "get_time"}</tool_call>', "", [("get_time", {})]),
        ("résumé 😀 " + H_CALL2 + " café", "résumé 😀  café", [("get_time", {"zone": "UTC"})]),
    ]),
    "qwen3_xml": (QWEN3_XML, [
        ("Plain text with <function=x> and </parameter> in it.",
         "Plain text with <function=x> and </parameter> in it.", []),
        (X_CALL, "", [("get_weather", {"city": "Paris", "days": 3})]),
        (X_CALL + "\n" + X_CALL2 + X_CALL,
         "", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"}),
              ("get_weather", {"city": "Paris", "days": 3})]),
        ("Let me check.\n" + X_CALL + "\n" + X_CALL2 + "\nDone, see above.",
         "Let me check.\n\nDone, see above.",
         [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]),
        ("<tool_call><function=get_time></function></tool_call>", "", [("get_time", {})]),
        ("<tool_call>\n  <function= get_time >\n  <parameter= zone >UTC</parameter>\n</function>\n\n</tool_call>",
         "", [("get_time", {"zone": "UTC"})]),
        ("résumé 😀 " + X_CALL2 + " café", "résumé 😀  café", [("get_time", {"zone": "UTC"})]),
    ]),
}
COMPLETE_CASES = [(name, i) for name, (_, cases) in COMPLETE.items() for i in range(len(cases))]


@pytest.mark.parametrize("name,case", COMPLETE_CASES)
def test_complete_reply(name, case):
    tool_format, cases = COMPLETE[name]
    text, content, calls = cases[case]
    fmt = fmt_for(tool_format)
    whole = assert_stream_matches_whole(fmt, text)
    assert whole.content == content
    assert whole.reasoning == ""
    assert calls_of(whole) == calls
    assert whole.num_dropped_calls == 0


@pytest.mark.parametrize("tool_format", [HERMES, QWEN3_XML])
def test_no_declared_tools_means_markup_is_content(tool_format):
    text = (H_CALL if tool_format is HERMES else X_CALL) + " after"
    for fmt in (ReplyFormat(tool_format=tool_format), ReplyFormat(tools=TOOLS)):
        reply = assert_stream_matches_whole(fmt, text)
        assert (reply.content, reply.tool_calls) == (text, [])


def test_call_ids_differ_between_parses():
    first, second = parse_reply(fmt_for(HERMES), H_CALL), parse_reply(fmt_for(HERMES), H_CALL)
    assert first.tool_calls[0].id != second.tool_calls[0].id


def test_content_is_given_out_at_once_and_only_a_possible_opener_is_held():
    parser = ReplyParser(fmt_for(HERMES))
    assert parser.feed("Hello <b>") == [ContentText("Hello <b>")]
    assert parser.feed(" x <tool") == [ContentText(" x ")]
    assert parser.feed("box>") == [ContentText("<toolbox>")]
    assert parser.feed("<tool_call>\n{\"name\"") == []
    start, delta, end = parser.feed(': "get_time", "arguments": {}}\n</tool_call>')
    assert (start.index, start.name, delta.arguments, end.arguments, end.complete) == (0, "get_time", "{}", "{}", True)
    assert parser.finish() == []
    assert parser.finish() == []


# ---- calls stream as they are written ------------------------------------------------------------

def feed_each(parser, pieces):
    """The events of each piece, in order."""
    return [parser.feed(piece) for piece in pieces]


def test_hermes_call_streams_its_name_then_its_arguments_as_written():
    parser = ReplyParser(fmt_for(HERMES))
    steps = feed_each(parser, ["Sure. <tool_call>\n{\"name\": \"get_wea", "ther\"", ", \"arguments\": {\"ci",
                               "ty\": \"Pa", "ris\", \"days\": 3}", "}\n</tool_", "call> ok"])
    assert steps[0] == [ContentText("Sure. ")]
    [start] = steps[1]  # the name is whole
    assert (start.index, start.name) == (0, "get_weather") and start.id.startswith("call_")
    assert steps[2] == [ToolCallDelta(0, '{"ci')]
    assert steps[3] == [ToolCallDelta(0, 'ty": "Pa')]
    assert steps[4] == [ToolCallDelta(0, 'ris", "days": 3}')]
    assert steps[5] == []  # the closing brace of the call and a tag that may be the closing tag
    [end, after] = steps[6]
    assert end == ToolCall(0, start.id, "get_weather", '{"city": "Paris", "days": 3}', True)
    assert after == ContentText(" ok")
    assert parser.finish() == []


def test_hermes_arguments_keep_the_models_own_spacing_and_member_order():
    text = '<tool_call>{"name":"get_weather","arguments":{"days":3,"city":"Paris"}}</tool_call>'
    [call] = assert_stream_matches_whole(fmt_for(HERMES), text).tool_calls
    assert call.arguments == '{"days":3,"city":"Paris"}'


def test_hermes_layout_that_cannot_stream_is_read_whole_when_it_closes():
    parser = ReplyParser(fmt_for(HERMES))
    assert parser.feed('<tool_call>{"arguments": {"zone": "UTC"}, ') == []
    assert parser.feed('"name": "get_time"}') == []
    start, delta, end = parser.feed("</tool_call>")
    assert (start.name, delta.arguments, end.arguments, end.complete) == ("get_time", '{"zone": "UTC"}',
                                                                          '{"zone": "UTC"}', True)


def test_xml_call_streams_its_name_then_one_parameter_at_a_time():
    parser = ReplyParser(fmt_for(QWEN3_XML))
    steps = feed_each(parser, ["<tool_call>\n<function=get_wea", "ther>\n<parameter=city>\nPar",
                               "is\n</parameter>\n", "<parameter=days>\n3\n</parameter>\n</func",
                               "tion>\n</tool_call>"])
    assert steps[0] == []
    [start, opening] = steps[1]
    assert (start.index, start.name, opening) == (0, "get_weather", ToolCallDelta(0, "{"))
    assert steps[2] == [ToolCallDelta(0, '"city": "Paris"')]
    assert steps[3] == [ToolCallDelta(0, ', "days": 3')]
    closing, end = steps[4]
    assert closing == ToolCallDelta(0, "}")
    assert end == ToolCall(0, start.id, "get_weather", '{"city": "Paris", "days": 3}', True)
    assert json.loads(end.arguments) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("tool_format", [HERMES, QWEN3_XML])
def test_every_prefix_of_a_call_streams_like_the_whole(tool_format):
    """Cut after any character, the reply's call (or text) is the same streamed and whole, and the
    name is out from the moment the format shows it whole."""
    text = "Let me look. " + (H_CALL if tool_format is HERMES else X_CALL)
    named = text.index('get_weather"') + 12 if tool_format is HERMES else text.index("<function=get_weather>") + 22
    arguments_at = text.find('{"city"')
    whole = text.index("3}") + 2 if tool_format is HERMES else text.index("</function>") + 11
    for cut in range(len(text) + 1):
        reply = assert_stream_matches_whole(fmt_for(tool_format), text[:cut], seeds=range(2))
        if cut < named:
            assert (reply.tool_calls, reply.content) == ([], text[:cut])
            continue
        [call] = reply.tool_calls
        assert call.name == "get_weather" and reply.content == "Let me look. "
        assert call.complete == (cut >= whole)
        if tool_format is HERMES:
            assert call.arguments == text[arguments_at:max(min(cut, whole), arguments_at)]


@pytest.mark.parametrize("tool_format", [HERMES, QWEN3_XML])
def test_parallel_off_streams_nothing_of_a_second_call(tool_format):
    first, second = (H_CALL, H_CALL2) if tool_format is HERMES else (X_CALL, X_CALL2)
    parser = ReplyParser(fmt_for(tool_format, parallel_tool_calls=False))
    events = parser.feed(first) + parser.feed(second[:len(second) // 2])
    assert [type(e) for e in events if not isinstance(e, ToolCallDelta)] == [ToolCallStart, ToolCall]
    assert parser.feed(second[len(second) // 2:]) + parser.finish() == []
    assert parser.reply.num_dropped_calls == 1


# Fragments without whitespace of their own.
FRAGMENTS = ["Hello", " ", "\n", "<", "</", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_", "</thi",
             '"', "{", "}", "x"]
FORMAT_FRAGMENTS = {
    "hermes": [H_CALL, H_CALL2, '{"name":"get_time","arguments":{}}', '"a</tool_call>b"'],
    "qwen3_xml": [X_CALL, X_CALL2, "<function=get_time>", "</function>", "<parameter=zone>", "</parameter>"],
}


@pytest.mark.parametrize("name", ["hermes", "qwen3_xml"])
@pytest.mark.parametrize("mode", [{}, THINKING, MAY_OPEN])
@pytest.mark.parametrize("parallel", [True, False])
def test_random_fragments_stream_like_the_whole(name, mode, parallel):
    tool_format = COMPLETE[name][0]
    fmt = fmt_for(tool_format, parallel_tool_calls=parallel, **mode)
    rng = random.Random(f"{name}{sorted(mode)}{parallel}")
    pieces = FRAGMENTS + FORMAT_FRAGMENTS[name]
    for _ in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        reply = assert_stream_matches_whole(fmt, text, seeds=range(4))
        if not mode and not reply.tool_calls:
            assert reply.content == text


# ---- fallbacks: no byte lost --------------------------------------------------------------------

# Blocks that never show a declared tool's name in a layout that streams: read whole, content as written.
FALLBACKS = {
    "hermes": (HERMES, [
        '<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c"}}\n</tool_call>',  # undeclared
        '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
        '<tool_call>\n["get_weather", {}]\n</tool_call>',
        '<tool_call></tool_call>',
        'Sure: <tool_call>\n{"name": "get_wea',  # cut before the name is whole
        'Text then <tool_c',
        'Text then <tool_call>',
    ]),
    "qwen3_xml": (QWEN3_XML, [
        "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",  # no <function=
        "<tool_call>\n<function=send_email>\n<parameter=to>\na@b.c\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\njunk<function=get_weather>\n</function>\n</tool_call>",
        "Sure: <tool_call>\n<function=get_wea",  # cut before the name is whole
        "Text then <tool_call>",
    ]),
}
FALLBACK_CASES = [(name, i) for name, (_, cases) in FALLBACKS.items() for i in range(len(cases))]

# Blocks whose call had started (its name was given out) when the markup broke or the reply ended:
# (text, content, arguments, complete). The call stays a call, with its arguments as far as they
# were written; what cannot be part of it goes out as content after it, as written.
STARTED = {
    "hermes": (HERMES, [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # brace missing
         "", '{"city": "Paris"}', True),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}} trailing\n</tool_call>',
         '} trailing\n', '{"city": "Paris"}', True),
        ('<tool_call>\n{"name": "get_weather", "arguments": {}}{}\n</tool_call>', "}{}\n", "{}", True),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
         "", '{"city": Paris}', False),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
         "", '{"city": "Paris"\n', False),
        ('Sure: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off
         "Sure: ", '{"city": "Par', False),
        ('Sure: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_',
         "Sure: ", '{"city": "Paris"}', True),
        ('<tool_call>\n{"name": "get_weather", "arguments": {',  # cut as the arguments open
         "", "{", False),
        ('<tool_call>\n{"name": "get_weather", "argu', "", "", False),  # cut right after the name
        ('<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',
         ', "arguments": [1, 2]}\n', "", False),
        ('<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>',
         ', "arguments": "not json"}\n', "", False),
        ('<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>',
         "", '{"city": "Paris"}', True),  # a string of JSON: read whole at the end
    ]),
    "qwen3_xml": (QWEN3_XML, [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
         "", '{"city": "Paris"}', True),  # </function> left out: nothing is missing
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\njunk\n"
         "</tool_call>", "\njunk\n", '{"city": "Paris"}', True),
        ("<tool_call>\n<function=get_weather>\nstray <parameter=city>\nParis\n</parameter>\n</function>\n"
         "</tool_call>", "\nstray <parameter=city>\nParis\n</parameter>\n</function>\n", "{", False),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nstray\n</function>\n"
         "</tool_call>", "\nstray\n</function>\n", '{"city": "Paris"', False),
        ("<tool_call>\n<function=get_weather>\n<parameter=>\nParis\n</parameter>\n</function>\n</tool_call>",
         "\n<parameter=>\nParis\n</parameter>\n</function>\n", "{", False),
        # the parameter never closes, so neither does the block: its value runs to the end of the reply
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
         "", '{"city": "Paris\\n</function>\\n</tool_call>', False),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"  # duplicate
         "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
         "\n<parameter=city>\nRome\n</parameter>\n</function>\n", '{"city": "Paris"', False),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\na </parameter> b\n</parameter>\n"
         "</function>\n</tool_call>", " b\n</parameter>\n</function>\n", '{"city": "a "', False),
        ("Sure: <tool_call>\n<function=get_weather>\n<parameter=city>\nPar",  # cut off
         "Sure: ", '{"city": "Par', False),
        ("Sure: <tool_call>\n<function=get_weather>\n<parameter=days>\n12",  # cut off, not a string
         "Sure: ", '{"days": 12', False),
        ("Sure: <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</func",
         "Sure: ", '{"city": "Paris"', False),
    ]),
}
STARTED_CASES = [(name, i) for name, (_, cases) in STARTED.items() for i in range(len(cases))]


@pytest.mark.parametrize("name,case", STARTED_CASES)
def test_a_started_call_stays_a_call_with_its_arguments_as_written(name, case):
    tool_format, cases = STARTED[name]
    text, content, arguments, complete = cases[case]
    reply = assert_stream_matches_whole(fmt_for(tool_format), text)
    assert reply.content == content
    [call] = reply.tool_calls
    assert (call.name, call.arguments, call.complete) == ("get_weather", arguments, complete)
    assert reply.calls_complete == complete


@pytest.mark.parametrize("name,case", FALLBACK_CASES)
def test_fallback_keeps_every_byte(name, case):
    tool_format, cases = FALLBACKS[name]
    text = cases[case]
    reply = assert_stream_matches_whole(fmt_for(tool_format), text)
    assert reply.content == text
    assert reply.tool_calls == []


@pytest.mark.parametrize("tool_format", [HERMES, QWEN3_XML])
def test_fallback_between_calls_keeps_its_bytes(tool_format):
    if tool_format is HERMES:
        good, bad = H_CALL2, '<tool_call>{"name": "nope"}</tool_call>'
    else:
        good, bad = X_CALL2, "<tool_call><function=nope></function></tool_call>"
    text = "A " + good + "\n" + bad + " B." + good
    reply = assert_stream_matches_whole(fmt_for(tool_format), text)
    assert reply.content == "A \n" + bad + " B."
    assert calls_of(reply) == [("get_time", {"zone": "UTC"})] * 2


@pytest.mark.parametrize("tool_format", [HERMES, QWEN3_XML])
def test_unclosed_block_at_the_end_is_read_leniently(tool_format):
    if tool_format is HERMES:
        text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    else:
        text = "Sure. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    reply = assert_stream_matches_whole(fmt_for(tool_format), text)
    assert reply.content == "Sure. "
    assert calls_of(reply) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("tool_format", [HERMES, QWEN3_XML])
@pytest.mark.parametrize("then_call", [False, True])
def test_whitespace_ending_content_after_a_call_is_the_same_streamed(tool_format, then_call):
    call = H_CALL if tool_format is HERMES else X_CALL
    tail = call if then_call else ""
    text = call + " Done. \n" + tail
    fmt = fmt_for(tool_format)
    assert parse_reply(fmt, text).content == " Done. \n"
    parser = ReplyParser(fmt)
    split = len(call) + len(" Done.")
    events = parser.feed(text[:split]) + parser.feed(" \n") + parser.feed(tail) + parser.finish()
    assert joined(events, ContentText) == " Done. \n"


def test_whitespace_only_after_the_last_call_is_dropped():
    for tool_format, call in ((HERMES, H_CALL), (QWEN3_XML, X_CALL)):
        reply = assert_stream_matches_whole(fmt_for(tool_format), "\n" + call + "\n \n")
        assert reply.content == "\n"
        assert len(reply.tool_calls) == 1


# ---- nested tag text inside values --------------------------------------------------------------

def test_hermes_string_may_hold_the_closing_tag():
    arguments = {"city": 'a</tool_call>b "q" \\ <tool_call>', "days": 2}
    text = "x " + hermes_call("get_weather", arguments) + " y"
    reply = assert_stream_matches_whole(fmt_for(HERMES), text)
    assert calls_of(reply) == [("get_weather", arguments)]
    assert reply.content == "x  y"


def test_hermes_closing_tag_after_an_escaped_quote_is_still_inside_the_string():
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": "\\"</tool_call>"}}</tool_call>'
    reply = assert_stream_matches_whole(fmt_for(HERMES), text)
    assert calls_of(reply) == [("get_time", {"zone": '"</tool_call>'})]


def test_xml_string_may_hold_call_markers_and_balanced_parameters():
    value = "x </tool_call> y <parameter=k>\ninner\n</parameter> </function> z"
    text = "before " + xml_call("get_weather", [("city", value), ("days", "1")]) + " after"
    reply = assert_stream_matches_whole(fmt_for(QWEN3_XML), text)
    assert calls_of(reply) == [("get_weather", {"city": value, "days": 1})]
    assert reply.content == "before  after"


def test_xml_unbalanced_nested_parameter_makes_an_incomplete_call():
    text = xml_call("get_weather", [("city", "a <parameter=k> b")]) + " tail"
    reply = assert_stream_matches_whole(fmt_for(QWEN3_XML), text)
    [call] = reply.tool_calls  # the value never closes, so neither does the block
    assert (call.arguments, call.complete) == ('{"city": ' + json.dumps(text[text.index("a <"):])[:-1], False)
    assert reply.content == ""


# ---- qwen3_xml typing by schema -----------------------------------------------------------------

def typed_args(params):
    reply = assert_stream_matches_whole(fmt_for(QWEN3_XML), xml_call("typed", params), seeds=range(5))
    assert reply.content == ""
    [(name, arguments)] = calls_of(reply)
    assert name == "typed"
    return arguments


@pytest.mark.parametrize("key,raw,expected", [
    ("i", "42", 42), ("i", " -7 ", -7), ("i", "4.0", 4), ("i", "4.5", "4.5"), ("i", "twelve", "twelve"),
    ("i", "true", "true"), ("i", '"3"', '"3"'),
    ("n", "3.25", 3.25), ("n", "2", 2), ("n", "-1e2", -100.0), ("n", "abc", "abc"),
    ("b", "true", True), ("b", "False", False), ("b", " TRUE ", True), ("b", "yes", "yes"), ("b", "1", "1"),
    ("z", "null", None), ("z", "nothing", "nothing"),
    ("o", '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}), ("o", "[1]", "[1]"), ("o", "{bad", "{bad"),
    ("a", '[1, "x", true]', [1, "x", True]), ("a", '{"a": 1}', '{"a": 1}'),
    ("s", "42", "42"), ("s", "true", "true"), ("s", "  two  spaces\n\tand tab  ", "  two  spaces\n\tand tab  "),
    ("s", "\nextra newlines\n", "\nextra newlines\n"), ("s", "", ""),
    ("u", "5", 5), ("u", "null", None), ("u", "x", "x"), ("u", "2.5", "2.5"),
    ("t", "1.5", 1.5), ("t", "null", None),
    ("si", "5", "5"),
    ("undeclared", '{"k": [1]}', {"k": [1]}), ("undeclared", "12", 12), ("undeclared", "true", True),
    ("undeclared", "hello world", "hello world"), ("undeclared", "True", "True"), ("undeclared", "", ""),
])
def test_xml_value_typed_by_schema(key, raw, expected):
    arguments = typed_args([(key, raw)])
    assert arguments == {key: expected}
    assert type(arguments[key]) is type(expected)


@pytest.mark.parametrize("key", ["i", "n", "b", "z", "o", "a", "u", "t"])
@pytest.mark.parametrize("raw", ["", "  ", "\n"])
def test_xml_empty_non_string_value_is_left_out(key, raw):
    assert typed_args([(key, raw), ("s", raw)]) == {"s": raw}


def test_xml_exactly_one_framing_newline_is_stripped_each_side():
    text = "<tool_call>\n<function=typed>\n<parameter=s>\n\n  body  \n\n</parameter>\n" \
           "<parameter=i>7</parameter>\n</function>\n</tool_call>"
    reply = assert_stream_matches_whole(fmt_for(QWEN3_XML), text)
    assert calls_of(reply) == [("typed", {"s": "\n  body  \n", "i": 7})]


def test_xml_several_parameters_keep_their_order():
    arguments = typed_args([("s", "x"), ("i", "1"), ("b", "true"), ("a", "[]")])
    assert list(arguments.items()) == [("s", "x"), ("i", 1), ("b", True), ("a", [])]


def test_schema_types_and_typed_value_directly():
    assert schema_types(None) is None
    assert schema_types({}) is None
    assert schema_types({"type": "integer"}) == {"integer"}
    assert schema_types({"type": ["string", "null"]}) == {"string", "null"}
    assert schema_types({"oneOf": [{"type": "number"}, {"type": "boolean"}]}) == {"number", "boolean"}
    assert schema_types({"anyOf": [{"type": "number"}, {"$ref": "#/x"}]}) is None
    assert schema_types({"description": "no type"}) is None
    assert typed_value("[1]", {"description": "no type"}) == [1]
    assert typed_value("7", {"oneOf": [{"type": "number"}, {"type": "boolean"}]}) == 7
    assert typed_value("fAlSe", {"oneOf": [{"type": "number"}, {"type": "boolean"}]}) is False


@pytest.mark.parametrize("key,raw", [("n", "NaN"), ("n", "Infinity"), ("n", "1e999"), ("undeclared", "-Infinity")])
def test_xml_number_that_is_not_json_stays_a_string(key, raw):
    reply = parse_reply(fmt_for(QWEN3_XML), xml_call("typed", [(key, raw)]))
    [call] = reply.tool_calls
    assert json.loads(call.arguments, parse_constant=_reject) == {key: raw}


def test_hermes_nan_is_not_valid_json():
    text = '<tool_call>{"name": "get_weather", "arguments": {"days": NaN}}</tool_call>'
    [call] = parse_reply(fmt_for(HERMES), text).tool_calls
    assert (call.arguments, call.complete) == ('{"days": NaN}', False)


def _reject(name):
    raise ValueError(f"{name} is not JSON")


# ---- parallel_tool_calls=False ------------------------------------------------------------------

@pytest.mark.parametrize("tool_format", [HERMES, QWEN3_XML])
def test_only_the_first_call_when_parallel_calls_are_off(tool_format):
    first, second = (H_CALL, H_CALL2) if tool_format is HERMES else (X_CALL, X_CALL2)
    text = "Checking.\n" + first + "\n" + second + "\n" + first + "\nok"
    reply = assert_stream_matches_whole(fmt_for(tool_format, parallel_tool_calls=False), text)
    assert calls_of(reply) == [("get_weather", {"city": "Paris", "days": 3})]
    assert reply.tool_calls[0].index == 0
    assert reply.num_dropped_calls == 2
    assert reply.content == "Checking.\n\nok"


def test_parallel_off_counts_nothing_for_a_single_call_or_fallbacks():
    text = H_CALL + '<tool_call>{"name": "nope"}</tool_call>'
    reply = assert_stream_matches_whole(fmt_for(HERMES, parallel_tool_calls=False), text)
    assert len(reply.tool_calls) == 1
    assert reply.num_dropped_calls == 0
    assert reply.content == '<tool_call>{"name": "nope"}</tool_call>'


# ---- reasoning ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tool_format", [None, HERMES, QWEN3_XML])
def test_reasoning_splits_at_the_closing_marker(tool_format):
    fmt = ReplyFormat(tool_format=tool_format, tools=TOOLS, **THINKING)
    reply = assert_stream_matches_whole(fmt, "Let me think: 2+2 <i>is</i> 4.\n</think>\n\n \tThe answer is 4.\n")
    assert reply.reasoning == "Let me think: 2+2 <i>is</i> 4.\n"
    assert reply.content == "The answer is 4.\n"


def test_whitespace_after_the_closing_marker_is_dropped_even_when_it_arrives_alone():
    parser = ReplyParser(ReplyFormat(**THINKING))
    events = []
    for piece in ["abc", "</think>", "\n", "\n", "  ", "Answer"]:
        events += parser.feed(piece)
    events += parser.finish()
    assert events == [ReasoningText("abc"), ContentText("Answer")]


def test_reply_without_a_closing_marker_is_all_reasoning():
    reply = assert_stream_matches_whole(ReplyFormat(**THINKING), "still thinking </thin")
    assert (reply.reasoning, reply.content) == ("still thinking </thin", "")


def test_without_a_reasoning_parser_markers_are_content():
    text = "<think>a</think>b"
    assert parse_reply(ReplyFormat(), text).content == text
    assert parse_reply(ReplyFormat(starts_in_reasoning=True), text).content == text


@pytest.mark.parametrize("text,reasoning,content", [
    ("<think>hmm, 3 > 2</think>\nAnswer", "hmm, 3 > 2", "Answer"),
    ("\n  <think>\nhmm\n</think>\n\nAnswer", "\nhmm\n", "Answer"),
    ("Just an answer.", "", "Just an answer."),
    ("\n\nJust an answer.", "", "\n\nJust an answer."),
    ("<b>bold</b> answer", "", "<b>bold</b> answer"),
    ("<thin", "", "<thin"),
    ("Answer with <think>late</think> markers", "", "Answer with <think>late</think> markers"),
    ("<think>never closed", "never closed", ""),
])
def test_reply_may_open_reasoning_itself(text, reasoning, content):
    reply = assert_stream_matches_whole(ReplyFormat(**MAY_OPEN), text)
    assert (reply.reasoning, reply.content) == (reasoning, content)


def test_partial_closing_marker_never_leaks_into_reasoning_deltas():
    parser = ReplyParser(ReplyFormat(**THINKING))
    assert parser.feed("abc</thi") == [ReasoningText("abc")]
    assert parser.feed("nk") == []
    assert parser.feed(">ok") == [ContentText("ok")]
    parser = ReplyParser(ReplyFormat(**THINKING))
    assert parser.feed("abc</thi") == [ReasoningText("abc")]
    assert parser.feed("s is not it") == [ReasoningText("</this is not it")]
    for seed in SEEDS:
        _, events = stream(ReplyFormat(**THINKING), "x < y </ z </think>done", seed)
        deltas = [event.text for event in events if isinstance(event, ReasoningText)]
        assert "".join(deltas) == "x < y </ z "
        assert not any("</t" in delta for delta in deltas)


def test_partial_opener_held_in_reasoning_when_tools_parse():
    parser = ReplyParser(fmt_for(HERMES, **THINKING))
    assert parser.feed("plan <tool_") == [ReasoningText("plan ")]
    assert parser.feed("box> more") == [ReasoningText("<tool_box> more")]


def test_partial_think_opener_held_at_the_start():
    parser = ReplyParser(ReplyFormat(**MAY_OPEN))
    assert parser.feed("  <th") == []
    assert parser.feed("ink>x") == [ReasoningText("x")]


@pytest.mark.parametrize("tool_format,call", [(HERMES, H_CALL), (QWEN3_XML, X_CALL)])
def test_call_inside_an_unclosed_think_block_is_the_reply_call(tool_format, call):
    text = "I need the weather.\n" + call
    reply = assert_stream_matches_whole(fmt_for(tool_format, **THINKING), text)
    assert reply.reasoning == "I need the weather.\n"
    assert reply.content == ""
    assert calls_of(reply) == [("get_weather", {"city": "Paris", "days": 3})]
    # The reply opened the block itself.
    reply = assert_stream_matches_whole(fmt_for(tool_format, **MAY_OPEN), "<think>I need the weather.\n" + call)
    assert reply.reasoning == "I need the weather.\n"
    assert len(reply.tool_calls) == 1


@pytest.mark.parametrize("tool_format,call", [(HERMES, H_CALL), (QWEN3_XML, X_CALL)])
def test_several_calls_inside_an_unclosed_think_block(tool_format, call):
    second = H_CALL2 if tool_format is HERMES else X_CALL2
    text = "Two calls.\n" + call + "\n" + second
    reply = assert_stream_matches_whole(fmt_for(tool_format, **THINKING), text)
    assert reply.reasoning == "Two calls.\n"
    assert [name for name, _ in calls_of(reply)] == ["get_weather", "get_time"]
    reply = assert_stream_matches_whole(fmt_for(tool_format, parallel_tool_calls=False, **THINKING), text)
    assert [name for name, _ in calls_of(reply)] == ["get_weather"]
    assert reply.num_dropped_calls == 1


@pytest.mark.parametrize("tool_format", [HERMES, QWEN3_XML])
def test_unusable_call_inside_an_unclosed_think_block_stays_reasoning(tool_format):
    if tool_format is HERMES:
        bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    else:
        bad = "<tool_call><function=nope></function></tool_call>"
    text = "Maybe " + bad + " then"
    reply = assert_stream_matches_whole(fmt_for(tool_format, **THINKING), text)
    assert (reply.reasoning, reply.content, reply.tool_calls) == (text, "", [])


@pytest.mark.parametrize("tool_format,call", [(HERMES, H_CALL), (QWEN3_XML, X_CALL)])
def test_call_mentioned_in_closed_reasoning_stays_reasoning(tool_format, call):
    text = "I could write " + call + " but no.</think>\nNo call needed."
    reply = assert_stream_matches_whole(fmt_for(tool_format, **THINKING), text)
    assert reply.reasoning == "I could write " + call + " but no."
    assert reply.content == "No call needed."
    assert reply.tool_calls == []


@pytest.mark.parametrize("tool_format,call", [(HERMES, H_CALL), (QWEN3_XML, X_CALL)])
def test_call_after_closed_reasoning_is_a_call(tool_format, call):
    text = "Need weather.\n</think>\n\n" + call
    reply = assert_stream_matches_whole(fmt_for(tool_format, **THINKING), text)
    assert (reply.reasoning, reply.content) == ("Need weather.\n", "")
    assert calls_of(reply) == [("get_weather", {"city": "Paris", "days": 3})]
    reply = assert_stream_matches_whole(fmt_for(tool_format, **MAY_OPEN), "<think>Need weather.</think>" + call)
    assert (reply.reasoning, reply.content) == ("Need weather.", "")
    assert len(reply.tool_calls) == 1


# ---- round trips and choosing a parser ----------------------------------------------------------

@pytest.mark.parametrize("tool_format", [HERMES, QWEN3_XML])
def test_rendered_call_parses_back(tool_format):
    arguments = {"s": "line one\nline two ", "i": 3, "n": 1.5, "b": False, "o": {"k": [1]}, "a": ["x"], "z": None}
    reply = assert_stream_matches_whole(fmt_for(tool_format), tool_format.render_call("typed", arguments))
    assert calls_of(reply) == [("typed", arguments)]


@pytest.mark.parametrize("tool_format", [HERMES, QWEN3_XML])
def test_system_prompt_example_call_parses(tool_format):
    prompt = tool_system_prompt([WEATHER, TIME], tool_format)
    assert '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    example = prompt[prompt.rindex("<tool_call>"):]
    reply = parse_reply(fmt_for(tool_format), example)
    assert calls_of(reply) == [("get_weather", {"city": "...", "days": 1})]


def test_partial_suffix():
    assert partial_suffix("abc<tool", "<tool_call>") == 5
    assert partial_suffix("abc<tool_call>", "<tool_call>") == 0
    assert partial_suffix("abc", "<tool_call>") == 0
    assert partial_suffix("<", "<tool_call>") == 1


def test_resolve_parsers():
    assert resolve_reasoning("none", "<think>") is None
    assert resolve_reasoning("auto", "{{ '<think>' }}") == ThinkMarkers()
    assert resolve_reasoning("auto", "plain") is None
    assert resolve_reasoning("auto", None) is None
    assert resolve_reasoning("think", None) == ThinkMarkers()
    assert resolve_tool_format("auto", "<function={{ name }}>") is QWEN3_XML
    assert resolve_tool_format("auto", None) is HERMES
    assert resolve_tool_format("hermes", "<function=") is HERMES
    assert resolve_tool_format("none", "<function=") is None
    with pytest.raises(EmberError) as error:
        resolve_tool_format("mistral", None)
    assert error.value.param == "tool_call_parser"
    with pytest.raises(EmberError) as error:
        resolve_reasoning("deepseek", None)
    assert error.value.param == "reasoning_parser"
