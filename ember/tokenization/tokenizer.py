"""The model's tokenizer: a transformers fast tokenizer plus the stop ids and chat template ember needs.

Built from a Hugging Face folder, or from a GGUF file's `tokenizer.*` metadata (byte-level BPE as
used by GPT-2, Llama 3, Qwen and SmolLM, and SentencePiece-style BPE as used by Llama 2 and Mistral).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ember.errors import InvalidRequest, ModelLoadError
from ember.tokenization.vocab import TokenBytes, build_token_bytes, byte_alphabet

if TYPE_CHECKING:
    from ember.tokenization.chat_prompt import TemplateTraits

logger = logging.getLogger("ember.tokenization")

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a turn in common chat formats; a GGUF often names only one of them as EOS.
_END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>",
    "<end_of_turn>", "<|return|>", "<｜end▁of▁sentence｜>", "<EOT>",
)

# Pre-tokenizer splits, by `tokenizer.ggml.pre` (the regexes the vocabularies were trained with).
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_PRE_GPT2 = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")
_PRE_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_PRE_LLAMA3 = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3")
_PRE_QWEN2 = ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")
_PRE_TEKKEN = ("tekken",)


class Tokenizer:
    """Text <-> token ids, the chat template, and the ids that end generation."""

    def __init__(self, hf: Any, *, eos_token_ids: Iterable[int] = (),
                 chat_template: str | None = None) -> None:
        self.hf = hf  # transformers PreTrainedTokenizerFast; the incremental detokenizer uses it
        self._backend = hf.backend_tokenizer
        self.chat_template: str | None = chat_template if chat_template is not None else _template_of(hf)
        eos = set(int(i) for i in eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        self.eos_token_ids: set[int] = eos
        self.bos_token_id: int | None = hf.bos_token_id
        self.pad_token_id: int | None = hf.pad_token_id

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_pretrained_folder(cls, path: str | os.PathLike[str], *,
                               extra_eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """Load from a local folder (never the network): with PreTrainedTokenizerFast itself when
        the folder names that class (GGUF cache entries do), which needs no torch, else AutoTokenizer."""
        try:
            hf = _tokenizer_class(path).from_pretrained(os.fspath(path), local_files_only=True)
        except Exception as exc:  # transformers raises many types for a bad or missing tokenizer
            raise ModelLoadError(f"could not load the tokenizer in {path}: {_one_line(exc)}") from None
        if not getattr(hf, "is_fast", False) or not hasattr(hf, "backend_tokenizer"):
            raise ModelLoadError(f"the tokenizer in {path} is not a fast (tokenizers) tokenizer")
        return cls(hf, eos_token_ids=extra_eos_token_ids)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Build from a GGUF file's `tokenizer.ggml.*` and `tokenizer.chat_template` values."""
        from transformers import PreTrainedTokenizerFast

        tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ModelLoadError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        kind = metadata.get("tokenizer.ggml.model")
        token_types = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        if len(token_types) != len(tokens):
            raise ModelLoadError("the GGUF tokenizer's token_type and tokens lists differ in length")
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, token_types, metadata)
            default_add_bos = False
        elif kind == "llama":
            backend = _sentencepiece_bpe(tokens, token_types, metadata)
            default_add_bos = True
        else:
            raise ModelLoadError(
                f"the GGUF tokenizer type {kind!r} is not supported (supported: gpt2, llama)")
        _add_special_tokens(backend, tokens, token_types)

        def token_at(key: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

        hf = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=token_at("bos_token_id"),
            eos_token=token_at("eos_token_id"),
            unk_token=token_at("unknown_token_id"),
            pad_token=token_at("padding_token_id"),
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)),
            add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            clean_up_tokenization_spaces=False,
            model_max_length=int(1e30),
        )
        chat_template = metadata.get("tokenizer.chat_template")
        if chat_template is not None:
            hf.chat_template = chat_template
        return cls(hf, eos_token_ids=gguf_eos_token_ids(metadata), chat_template=chat_template)

    def save(self, folder: str | os.PathLike[str]) -> None:
        """Write tokenizer.json, tokenizer_config.json and the chat template into a folder."""
        self.hf.save_pretrained(os.fspath(folder))

    # ---- use ----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def token_bytes(self) -> "TokenBytes":
        """Every token's raw bytes (built on first use, about 0.1 s per 50k tokens)."""
        return build_token_bytes(self._backend, self.vocab_size)

    @functools.cached_property
    def template_traits(self) -> "TemplateTraits":
        """Whether the chat template lists tools and accepts a system message (probed once)."""
        from ember.tokenization.chat_prompt import probe_template
        return probe_template(self)

    def encode(self, text: str, add_special_tokens: bool = False, pair: str | None = None,
               max_length: int | None = None) -> list[int]:
        """`pair`: a second text, encoded with `text` as the tokenizer's pair (a cross-encoder's input).
        `max_length` (no pair): at most this many ids, the text's first ones cut to leave room for the
        special tokens, which stay (transformers' truncation=True, as sentence-transformers applies
        a model's max_seq_length)."""
        if max_length is None:
            return self._backend.encode(text, pair, add_special_tokens=add_special_tokens).ids
        if pair is not None:
            raise ValueError("max_length cuts a single text, not a pair")
        encoding = self._backend.encode(text, add_special_tokens=False)
        processor = self._backend.post_processor
        specials = processor.num_special_tokens_to_add(False) if add_special_tokens and processor is not None else 0
        encoding.truncate(max(max_length - specials, 0))
        return self._backend.post_process(encoding, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        return self.hf.convert_ids_to_tokens(ids)

    def render_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                             add_generation_prompt: bool = True, tools: Sequence[Any] | None = None,
                             **template_kwargs: Any) -> str:
        """The prompt text the model's chat template makes of a conversation."""
        if self.chat_template is None:
            raise InvalidRequest("this model has no chat template; use the completions endpoint "
                                 "with a plain prompt instead", param="messages",
                                 code="no_chat_template")
        from jinja2 import TemplateError
        try:
            text = self.hf.apply_chat_template(
                list(messages), tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt, tokenize=False,
                chat_template=self.chat_template, **template_kwargs)
        except TemplateError as exc:  # the template's own raise_exception(...) lands here
            raise InvalidRequest(f"the chat template rejected the conversation: {exc}",
                                 param="messages") from None
        return text if isinstance(text, str) else text[0]

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, tools: Sequence[Any] | None = None,
                            **template_kwargs: Any) -> list[int]:
        """Render the conversation with the model's template, then encode it (the template writes
        any BOS it wants itself, so no special tokens are added here)."""
        text = self.render_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def gguf_eos_token_ids(metadata: Mapping[str, Any]) -> list[int]:
    """The ids that end generation: EOS, EOT and EOM as the file names them, then any control token
    that ends a turn in a known chat format (llama.cpp treats these as end-of-generation too)."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    token_types = metadata.get("tokenizer.ggml.token_type") or []
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        index = metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(index, int) and 0 <= index < len(tokens) and index not in ids:
            ids.append(index)
    wanted = set(_END_OF_TURN_TOKENS)
    for index, (token, token_type) in enumerate(zip(tokens, token_types)):
        if token in wanted and token_type in (_CONTROL, _USER_DEFINED) and index not in ids:
            ids.append(index)
    return ids


# ---- GGUF vocabularies -> tokenizers.Tokenizer ---------------------------------------------------

def _byte_level_bpe(tokens: list[str], token_types: list[int], metadata: Mapping[str, Any]) -> Any:
    from tokenizers import Regex, Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers

    alphabet = byte_alphabet()
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, token_types)):
        if token_type == _NORMAL and not set(token) <= alphabet.keys():
            token = "".join(_spell_bytes(token))
        vocab.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    pre = metadata.get("tokenizer.ggml.pre") or "default"
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                 ignore_merges=pre in _PRE_LLAMA3))

    def split_then_bytes(pattern: str) -> Any:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    if pre in _PRE_DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _PRE_LLAMA3:
        backend.pre_tokenizer = split_then_bytes(_LLAMA3_SPLIT)
    elif pre in _PRE_QWEN2:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = split_then_bytes(_QWEN2_SPLIT)
    elif pre in _PRE_TEKKEN:
        backend.pre_tokenizer = split_then_bytes(_TEKKEN_SPLIT)
    else:
        if pre not in _PRE_GPT2:
            logger.warning("unknown GGUF pre-tokenizer %r: splitting text as GPT-2 does", pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], token_types: list[int],
                       metadata: Mapping[str, Any]) -> Any:
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers

    scores = list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    unk_index = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_index] if isinstance(unk_index, int) and 0 <= unk_index < len(tokens) else None
    if metadata.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(tokens, token_types, scores, vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                 byte_fallback=True))
    # Like llama.cpp: spaces become "▁", and every run of text that starts the input or follows
    # a special token gets a leading "▁" (the normalizer runs on each run between added tokens).
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], token_types: list[int], scores: list[float],
                        vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges the adjacent pair whose joined piece scores highest; as ranked
    merges, that is every split of every mergeable token, best-scoring token first."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        if token_types[index] not in (_NORMAL, _USER_DEFINED) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: Any, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special (skipped on decode); user-defined ones are matched whole."""
    from tokenizers import AddedToken
    special = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, token_types)
               if kind in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, token_types)
            if kind == _USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _spell_bytes(text: str) -> Iterable[str]:
    by_byte = {b: c for c, b in byte_alphabet().items()}
    return (by_byte[b] for b in text.encode("utf-8"))


def _template_of(hf: Any) -> str | None:
    template = getattr(hf, "chat_template", None)
    if isinstance(template, dict):
        return template.get("default")
    return template


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _tokenizer_class(path: str | os.PathLike[str]):
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            named = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    if named in ("PreTrainedTokenizerFast", "TokenizersBackend"):  # the generic fast class, by either name
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer  # imports torch through transformers' configuration module

    return AutoTokenizer
