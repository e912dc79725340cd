"""Incremental detokenizing on the default model's tokenizer: never half a UTF-8 character."""

import pytest

from ember.loaders import load_model_source
from ember.tokenization.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_source(None).tokenizer


@pytest.mark.parametrize("text", ["héllo wörld 🌍🚀 done", "世界你好，朋友们", "tab\tand  spaces\n\nnew", "naïve café ß"])
def test_deltas_join_to_the_full_text_without_replacement_characters(tokenizer, text):
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer.hf.backend_tokenizer, prompt)
    deltas = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_an_emoji_split_over_byte_tokens_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("🌍")
    assert len(ids) > 1  # byte-level BPE spells it in pieces
    detok = IncrementalDetokenizer(tokenizer.hf.backend_tokenizer, [])
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🌍"
