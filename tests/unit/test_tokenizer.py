"""Tokenizer: the default model's GGUF tokenizer against transformers' reading of the same file,
chat templates, stop ids, save/reload, and the other GGUF vocabulary kinds."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest

from ember.errors import InvalidRequest, ModelLoadError
from ember.tokenization.tokenizer import Tokenizer, gguf_eos_token_ids
from gguf_helpers import CHAT_TEMPLATE, byte_level_vocab
from gguf_models import default_gguf_model

VARIED = [
    "Hello, world!", "The year 2024 had 366 days; pi is 3.14159.",
    "def square(x):\n    return x ** 2  # power\n\n\tif a != b: pass",
    "Emoji 😀👍🏽 and a flag 🇫🇷", "Accents: café, naïve, Ångström, façade, ÀÉÎÕÜ",
    "中文测试，日本語のテキスト、한국어", "   leading and trailing   ", "tabs\t\tand\nnew\r\n\r\nlines",
    "multiple     spaces    here", "don't I'll we've", "\u00a0nbsp and\u2003em space", "", " ",
    "\n\n\n", "version 1.2.3-rc4 costs $100,000.00", "<|im_start|>user\nhi<|im_end|>",
    "<reponame>x<file_sep>y", "snake_case camelCase kebab-case ALLCAPS", "https://example.com/a?b=c&d=e",
]
# A whitespace run before a digit: SmolLM2's own tokenizer (and llama.cpp's "smollm" pre-tokenizer)
# split digits off first, so "a  1" is a | "  " | 1; transformers' GGUF reader skips that step.
DIGIT_AFTER_SPACES = {"a  1": ["a", "ĠĠ", "1"], "x = 10  20": ["x", "Ġ=", "Ġ", "1", "0", "ĠĠ", "2", "0"]}


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(default_gguf_model().metadata)


@pytest.fixture(scope="module")
def transformers_smollm():
    from transformers import AutoTokenizer
    path = default_gguf_model().path
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                         local_files_only=True)


def test_encodes_like_transformers_gguf_tokenizer(smollm, transformers_smollm):
    for text in VARIED:
        assert smollm.encode(text) == transformers_smollm.encode(text, add_special_tokens=False), text


def test_digits_are_split_off_first_as_smollm_was_trained(smollm, transformers_smollm):
    for text, pieces in DIGIT_AFTER_SPACES.items():
        assert smollm.convert_ids_to_tokens(smollm.encode(text)) == pieces
        assert transformers_smollm.encode(text, add_special_tokens=False) != smollm.encode(text)
    assert smollm.convert_ids_to_tokens(smollm.encode("12345")) == ["1", "2", "3", "4", "5"]


def test_decode_round_trips(smollm):
    for text in VARIED:
        assert smollm.decode(smollm.encode(text), skip_special_tokens=False) == text
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm.decode(ids) == "user\nhi"


def test_default_tokenizer_facts(smollm):
    assert smollm.vocab_size == 49152
    assert smollm.bos_token_id == 1
    assert smollm.eos_token_ids == {2, 0}
    assert smollm.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert smollm.encode("hi", add_special_tokens=True) == smollm.encode("hi")  # the file adds no BOS
    assert smollm.hf.backend_tokenizer is not None


def test_chat_template_renders_a_conversation(smollm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    text = smollm.render_chat_template(messages)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = smollm.apply_chat_template(messages)
    assert ids == smollm.encode(text) and ids.count(2) == 4
    without = smollm.render_chat_template(messages, add_generation_prompt=False)
    assert not without.endswith("assistant\n")
    # SmolLM2's template adds its default system prompt when none is given
    assert "You are a helpful AI assistant named SmolLM" in smollm.render_chat_template(messages[1:])


def test_save_and_reload_gives_the_same_tokenizer(smollm, tmp_path):
    smollm.save(tmp_path)
    reloaded = Tokenizer.from_pretrained_folder(tmp_path, extra_eos_token_ids=[0])
    for text in VARIED + list(DIGIT_AFTER_SPACES):
        assert reloaded.encode(text) == smollm.encode(text), text
        assert reloaded.encode(text, add_special_tokens=True) == smollm.encode(text, add_special_tokens=True)
    assert reloaded.chat_template == smollm.chat_template
    assert reloaded.eos_token_ids == smollm.eos_token_ids
    assert reloaded.bos_token_id == smollm.bos_token_id


# ---- templates that refuse ---------------------------------------------------------------------

def _tiny(template: str | None = CHAT_TEMPLATE, **extra) -> Tokenizer:
    tokens, types, merges = byte_level_vocab(300)
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **extra}
    if template is not None:
        metadata["tokenizer.chat_template"] = template
    return Tokenizer.from_gguf_metadata(metadata)


def test_no_chat_template_is_an_invalid_request():
    with pytest.raises(InvalidRequest, match="no chat template") as caught:
        _tiny(None).apply_chat_template([{"role": "user", "content": "hi"}])
    assert caught.value.param == "messages"


def test_a_template_raising_an_exception_is_an_invalid_request():
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        _tiny(template).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_gets_tools_and_extra_kwargs():
    template = ("{% if tools %}TOOLS:{{ tools | length }};{% endif %}"
                "{% if enable_thinking %}THINK;{% endif %}{{ messages[0]['content'] }}")
    tokenizer = _tiny(template)
    text = tokenizer.render_chat_template([{"role": "user", "content": "x"}],
                                          tools=[{"type": "function", "function": {"name": "f"}}],
                                          enable_thinking=True)
    assert text == "TOOLS:1;THINK;x"


# ---- other GGUF vocabularies ---------------------------------------------------------------------

def test_eos_ids_include_end_of_turn_tokens_the_file_marks_control():
    tokens, types, _ = byte_level_vocab(300)
    metadata = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.eot_token_id": 2}
    assert gguf_eos_token_ids(metadata) == [0, 2]
    assert gguf_eos_token_ids({**metadata, "tokenizer.ggml.eot_token_id": None,
                               "tokenizer.ggml.eos_token_id": 1}) == [1, 0, 2]


@pytest.mark.parametrize("pre, text, pieces", [
    ("llama-bpe", "12345 ok", ["123", "45", " ok"]),
    ("qwen2", "12345 ok", ["1", "2", "3", "4", "5", " ok"]),
    ("default", "12345 ok", ["12345", " ok"]),
    ("smollm", "12345 ok", ["1", "2", "3", "4", "5", " ok"]),
])
def test_pre_tokenizer_follows_the_file(pre, text, pieces):
    backend = _tiny(**{"tokenizer.ggml.pre": pre}).hf.backend_tokenizer
    split = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    assert [p.replace("Ġ", " ") for p in split] == pieces


def _write_sentencepiece_gguf(path: pathlib.Path) -> None:
    pieces = ["▁", "e", "h", "l", "o", "w", "r", "d", "a", "t", "▁h", "ll", "he", "hel", "hell",
              "hello", "▁hello", "▁w", "or", "ld", "orld", "▁world", "▁wor", "▁the", "th", "▁t",
              "at", "▁a", "▁▁", "er"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_vocabulary(tmp_path):
    from transformers import AutoTokenizer
    path = tmp_path / "spm.gguf"
    _write_sentencepiece_gguf(path)
    reader = gguf.GGUFReader(path)
    tokenizer = Tokenizer.from_gguf_metadata({k: f.contents() for k, f in reader.fields.items()})
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name,
                                              local_files_only=True)
    # Where text does not start with a space or follow a special token, transformers agrees.
    for text in ["hello world", "hello\nworld", "héllo the", "the hat", "", "hello</s>", "at at  at"]:
        ids = tokenizer.encode(text, add_special_tokens=True)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == text.replace("</s>", "")
    assert tokenizer.encode("héllo")[:3] == [269, 0xC3 + 3, 0xA9 + 3]  # ▁h, then UTF-8 byte pieces
    # Like llama.cpp, every run of text gets the "▁" prefix, also after a special token, and
    # leading spaces are kept: "  hello" is "▁▁▁hello" (transformers' converter drops one).
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("<s>hello")) == ["<s>", "▁h", "e", "ll", "o"]
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("  hello")) == ["▁▁", "▁h", "e", "ll", "o"]
    assert tokenizer.decode(tokenizer.encode("  hello")) == "  hello"
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == {2}


def test_unsupported_vocabulary_kind_is_refused():
    with pytest.raises(ModelLoadError, match="tokenizer type 'bert' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
