"""Compiling grammars for one served model, cached by their text.

xgrammar is optional: `load_grammars` returns None without it, and a request that needs a grammar
is then refused with the command that installs it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from ember.constraint_spec import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, LARK, REGEX, STRUCTURAL_TAG, GrammarSpec
from ember.errors import InvalidRequest

logger = logging.getLogger("ember.grammar")

INSTALL_COMMAND = "pip install xgrammar"
MAX_JSON_WHITESPACE = 32  # blank characters allowed in a row inside JSON (pretty-printing fits)
_CACHE_ENTRIES = 512
_LOG_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")  # "[12:54:33] /project/cpp/x.cc:94: "


def xgrammar_installed() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def grammar_unavailable(param: str) -> InvalidRequest:
    return InvalidRequest(f"{param} needs constrained decoding, which needs the xgrammar package on the server; "
                          f"install it with `{INSTALL_COMMAND}` and restart ember", param=param,
                          code="grammar_unavailable")


class Grammars:
    """The served model's grammar compiler. Thread-safe; compiled grammars are kept by text (LRU)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=self.stop_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and logs

    def compile(self, spec: GrammarSpec) -> Any:
        """A CompiledGrammar for the spec; a spec xgrammar refuses is a 400 naming its field."""
        return self._cached((spec.kind, spec.text), spec.param, lambda: self._compile_spec(spec))

    def compile_structural_tag(self, tag: dict[str, Any], param: str) -> Any:
        """A CompiledGrammar for an xgrammar structural tag (tool calls, alone or beside a grammar)."""
        return self.compile_structural_tag_text(structural_tag_text(tag), param)

    def compile_structural_tag_text(self, text: str, param: str) -> Any:
        return self._cached((STRUCTURAL_TAG, text), param, lambda: self.compiler.compile_structural_tag(text))

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def _compile_spec(self, spec: GrammarSpec) -> Any:
        compiler = self.compiler
        if spec.kind == JSON_SCHEMA:
            return compiler.compile_json_schema(spec.text, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if spec.kind == JSON_OBJECT:
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=True,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if spec.kind == REGEX:
            return compiler.compile_regex(spec.text)
        if spec.kind == CHOICE:
            return compiler.compile_grammar(choice_ebnf(json.loads(spec.text)))
        if spec.kind == GRAMMAR:
            return compiler.compile_grammar(spec.text)
        if spec.kind == LARK:
            return compiler.compile_lark(spec.text)
        raise ValueError(spec.kind)

    def _cached(self, key: tuple[str, str], param: str, build) -> Any:
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            try:
                compiled = build()
            except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
                raise InvalidRequest(f"{param} could not be compiled: {compiler_reason(exc)}", param=param,
                                     code="invalid_grammar") from None
            self.num_compiled += 1
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return compiled


def load_grammars(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> Grammars | None:
    """The compiler for a loaded model, or None when xgrammar is not installed."""
    if not xgrammar_installed():
        logger.info("xgrammar is not installed: structured outputs and strict tools are off (%s)", INSTALL_COMMAND)
        return None
    try:
        return Grammars(tokenizer.hf, vocab_size, stop_token_ids)
    except Exception as exc:  # a tokenizer xgrammar cannot read: serve without grammars rather than not at all
        logger.warning("xgrammar cannot read this model's tokenizer (%s: %s); structured outputs are off",
                       type(exc).__name__, exc)
        return None


def structural_tag_text(tag: dict[str, Any]) -> str:
    return json.dumps(tag, ensure_ascii=False, sort_keys=False)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compiler_reason(exc: BaseException) -> str:
    """xgrammar's message without its log prefix (time, source file and line)."""
    text = str(exc).strip() or type(exc).__name__
    lines = [_LOG_PREFIX.sub("", line).strip() for line in text.splitlines()]
    return " ".join(line for line in lines if line)
