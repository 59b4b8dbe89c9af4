"""The llguidance backend: labkit's grammar engine for response formats.

llguidance (Microsoft's, the engine behind Guidance and one of vLLM's structured-output
backends) compiles a JSON Schema or a Lark grammar into an Earley parser over a lexer, and
computes the next-token mask by walking the vocabulary's token trie against the lexer's
state: tens to hundreds of microseconds per token for the schemas of `tests/
test_structured.py`, where xgrammar, the other candidate, spends milliseconds compiling each
schema (`labkit bench structured` measures both; the chapter's table comes from it).

The tokenizer is built from labkit's own `tokenizers` JSON (no hub, no `transformers`), once
per tokenizer; a compiled grammar is cached per response format (LRU), and each sample's
matcher is a copy of the cached one. JSON is generated compact (`{"a": 1, "b": [2, 3]}`:
one space after ':' and ',', none elsewhere): a small model at temperature 1 otherwise pads
its output with whitespace until max_tokens runs out.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import llguidance
import torch

from labkit.structured.contract import InvalidFormat, ResponseFormat, bitmask_words, check_strict

# llguidance's JSON compile options (its JsonCompileOptions): compact separators, no free
# whitespace. A schema's own "x-guidance" options still apply on top.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


class LLGuidanceMatcher:
    """One sample's llguidance matcher (`GrammarMatcher`)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def fill_bitmask(self, out: torch.Tensor) -> None:
        words = bitmask_words(self.vocab_size)
        if out.dtype != torch.int32 or out.numel() != words or not out.is_contiguous():
            raise ValueError(f"a bitmask row is {bitmask_words(self.vocab_size)} contiguous int32 words")
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def consume(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class LLGuidanceGrammar:
    """A compiled response format (`CompiledGrammar`): a fresh matcher to copy from."""

    def __init__(self, template: llguidance.LLMatcher, vocab_size: int, compile_seconds: float):
        self.template, self.vocab_size, self.compile_seconds = template, vocab_size, compile_seconds

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy(), self.vocab_size)


def grammar_text(response_format: ResponseFormat) -> str:
    """llguidance's grammar for a response format; InvalidFormat where it cannot be one."""
    try:
        if response_format.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(response_format.grammar)
        schema = ANY_OBJECT if response_format.kind == "json_object" else response_format.schema_object
        if response_format.strict:
            check_strict(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except InvalidFormat:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the library refuses a schema with is the client's 400
        raise InvalidFormat(f"{type(error).__name__}: {error}") from None


class LLGuidanceBackend:
    """llguidance bound to one tokenizer (`GrammarBackend`). Thread-safe: a service's front
    end compiles on request threads to refuse a bad schema before the engine sees it."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int | None = None, *, cache_size: int = 64):
        if tokenizer.eos_token_id is None:
            raise ValueError("structured outputs need a tokenizer with an EOS token")
        self.vocab_size = vocab_size or tokenizer.vocab_size
        if self.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size {self.vocab_size} is smaller than the tokenizer's "
                             f"{tokenizer.vocab_size}")
        started = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                eos_token=tokenizer.eos_token_id)
        self.tokenizer_seconds = time.perf_counter() - started
        self.cache_size = cache_size
        self._cache: OrderedDict[ResponseFormat, LLGuidanceGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, response_format: ResponseFormat) -> LLGuidanceGrammar:
        with self._lock:
            found = self._cache.get(response_format)
            if found is not None:
                self._cache.move_to_end(response_format)
                return found
        started = time.perf_counter()
        grammar = grammar_text(response_format)
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        except Exception as failure:  # noqa: BLE001 - e.g. a grammar too large for its limits
            error = f"{type(failure).__name__}: {failure}"
        if error:
            raise InvalidFormat(error)
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidFormat(template.get_error())
        compiled = LLGuidanceGrammar(template, self.vocab_size, time.perf_counter() - started)
        with self._lock:
            self._cache[response_format] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


_BACKENDS: dict[int, tuple[object, LLGuidanceBackend]] = {}
_BACKENDS_LOCK = threading.Lock()


def backend_for(tokenizer, vocab_size: int | None = None) -> LLGuidanceBackend:
    """The process's one backend for this tokenizer object (building llguidance's tokenizer
    takes 0.5 s for SmolLM2's 49k tokens, 3.5 s for Gemma 3's 262k)."""
    key = id(tokenizer)
    size = vocab_size or tokenizer.vocab_size
    with _BACKENDS_LOCK:
        held = _BACKENDS.get(key)
        if held is not None and held[0] is tokenizer and held[1].vocab_size == size:
            return held[1]
        backend = LLGuidanceBackend(tokenizer, vocab_size)
        _BACKENDS[key] = (tokenizer, backend)  # the tokenizer is held, so its id stays unique
        return backend
