"""A Lark or regex grammar rewritten to hold the body of a JSON string (a custom tool's input in a
hermes call): the body of `json.dumps(text)` is accepted exactly when the grammar accepts `text`,
and the raw text itself is not (where it differs from its escaped form). Checked with xgrammar's
own matcher on the rewritten EBNF."""

from __future__ import annotations

import json
import random
import re

import pytest

xgrammar = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

from ember.constraint_spec import LARK, REGEX  # noqa: E402
from ember.grammar.json_string import json_string_ebnf  # noqa: E402

PATCH_GRAMMAR = r'''
start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
%import common.LF
'''


def body(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def accepts(ebnf: str, text: str) -> bool:
    return _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(ebnf), text)


@pytest.mark.parametrize("pattern", [r'[^"\n]+\s\d\w.é[\x00-\x20\\]*(ab|c"d)?\\', r'a\nb"c\\d', r'[a-z]{2,4}\t?',
                                     r'(.|\n)*x', r'(ls|pwd)( -l)?'])
def test_a_regex_holds_exactly_the_escaped_bodies_of_its_matches(pattern):
    ebnf = json_string_ebnf(REGEX, pattern)
    rng = random.Random(pattern)
    alphabet = 'ab"\\\n\t\x01 é5_xcdl\u2028'
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        assert accepts(ebnf, body(text)) == (re.fullmatch(pattern, text, re.DOTALL) is not None), text


@pytest.mark.parametrize("pattern, text", [(r'[^"\n]+\s\d\w.é[\x00-\x20\\]*(ab|c"d)?\\', 'ab 5_"é\x01\\ c"d\\'),
                                           (r'a\nb"c\\d', 'a\nb"c\\d'), (r'(.|\n)*x', 'q"\n\\x')])
def test_a_match_with_characters_json_escapes_is_held_in_its_escaped_form_only(pattern, text):
    assert re.fullmatch(pattern, text, re.DOTALL)
    ebnf = json_string_ebnf(REGEX, pattern)
    assert accepts(ebnf, body(text)) and not accepts(ebnf, text)


def test_a_lark_patch_grammar_holds_an_escaped_patch():
    ebnf = json_string_ebnf(LARK, PATCH_GRAMMAR)
    patch = '*** Begin Patch\n*** Add File: a "b".txt\n+hello\t"x" \\ y\n+\n*** End Patch\n'
    assert accepts(ebnf, body(patch))
    assert not accepts(ebnf, patch)
    assert not accepts(ebnf, body(patch.replace("+hello", "hello")))
    assert not accepts(ebnf, body(patch.replace("*** End Patch\n", "")))


def test_a_grammar_xgrammar_cannot_read_raises():
    with pytest.raises(Exception):
        json_string_ebnf(LARK, "start: ???")
