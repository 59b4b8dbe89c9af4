"""The xgrammar backend: the cross-check of the llguidance one, and its rival in the bench.

xgrammar (the MLC project's; vLLM's `auto` structured-output setting tries it first) compiles a grammar to
a pushdown automaton and precomputes, per automaton state, which tokens are decided without
looking at the stack: compiling costs more, masks can cost less. It is an optional test
dependency (`pip install --no-deps xgrammar apache-tvm-ffi`: its declared dependencies pull
in triton), so this module is imported only where it is asked for: tests skip, and
`labkit bench structured` reports it as not run, where it is missing.

JSON is generated as the llguidance backend generates it (compact, one space after ':'
and ','), so the two accept the same texts of a schema both support.
"""

from __future__ import annotations

import time

import torch
import xgrammar

from labkit.structured.contract import (InvalidFormat, ResponseFormat, bitmask_words, check_strict,
                                        unpack_bitmask)
from labkit.structured.json_fsm import token_bytes

SEPARATORS = (", ", ": ")


class XGrammarMatcher:
    """One sample's xgrammar matcher (`GrammarMatcher`)."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def fill_bitmask(self, out: torch.Tensor) -> None:
        if out.dtype != torch.int32 or out.numel() != bitmask_words(self.vocab_size):
            raise ValueError(f"a bitmask row is {bitmask_words(self.vocab_size)} int32 words")
        self.matcher.fill_next_token_bitmask(out.view(1, -1), 0)

    def consume(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_accepting(self) -> bool:
        return self.matcher.is_completed()

    def is_terminated(self) -> bool:
        # xgrammar's own is_terminated turns true only once EOS is consumed; the contract's
        # "nothing but EOS may come" is a complete text whose mask holds no other token.
        if not self.matcher.is_completed():
            return False
        out = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
        self.fill_bitmask(out)
        stops = set(self.matcher.stop_token_ids)
        return all(t in stops for t in torch.nonzero(unpack_bitmask(out, self.vocab_size)).flatten().tolist())

    def accepts_text(self, text: str) -> bool:
        """Whether the text, read byte by byte, leaves the grammar complete."""
        return self.matcher.accept_string(text) and self.matcher.is_completed()


class XGrammarGrammar:
    def __init__(self, compiled: xgrammar.CompiledGrammar, vocab_size: int, compile_seconds: float):
        self.compiled, self.vocab_size, self.compile_seconds = compiled, vocab_size, compile_seconds

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(self.compiled), self.vocab_size)


class XGrammarBackend:
    """xgrammar bound to one tokenizer (`GrammarBackend`); no cache: the bench times compiles."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int | None = None, max_threads: int = 8):
        self.vocab_size = vocab_size or tokenizer.vocab_size
        pieces = [piece if piece is not None else b"" for piece in token_bytes(tokenizer)]
        info = xgrammar.TokenizerInfo(pieces, xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
                                      stop_token_ids=[tokenizer.eos_token_id])
        # max_threads: xgrammar compiles a grammar's per-state masks in parallel; a timing says how many
        self.max_threads = max_threads
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, response_format: ResponseFormat) -> XGrammarGrammar:
        started = time.perf_counter()
        try:
            if response_format.kind == "grammar":
                raise InvalidFormat("the xgrammar backend here takes JSON formats only")
            if response_format.kind == "json_object":
                compiled = self.compiler.compile_builtin_json_grammar()
            else:
                if response_format.strict:
                    check_strict(response_format.schema_object)
                # strict_mode=False: JSON Schema's meaning (unlisted properties allowed unless
                # additionalProperties says no); xgrammar's default forbids them
                compiled = self.compiler.compile_json_schema(response_format.schema, any_whitespace=False,
                                                             separators=SEPARATORS, strict_mode=False)
        except InvalidFormat:
            raise
        except Exception as error:  # xgrammar raises RuntimeError and its own types alike
            raise InvalidFormat(f"xgrammar: {error}") from None
        return XGrammarGrammar(compiled, self.vocab_size, time.perf_counter() - started)
