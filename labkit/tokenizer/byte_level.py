"""Byte-level BPE (``tokenizer.ggml.model = "gpt2"``, SmolLM2's) rebuilt from a GGUF's metadata.

* model: byte-level BPE (``models.BPE``) with the file's vocabulary and merges, no unknown
  token (every byte has a token, so nothing is ever unknown);
* pre-tokenizer: for ``"smollm"`` the one in SmolLM2's own ``tokenizer.json``, a
  ``Sequence`` of ``Digits(individual_digits=True)`` then
  ``ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)``. llama.cpp does the
  same for ``"smollm"`` (``\\p{N}`` isolated, then the GPT-2 regex). For ``"gpt2"`` it is the
  ``ByteLevel`` pre-tokenizer alone;
* decoder: ``ByteLevel`` (token characters back to bytes, then UTF-8 with U+FFFD for invalid
  bytes);
* added tokens: every control token (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ...)
  as a *special* added token and every user-defined one as a plain added token, so that they are
  matched whole in text instead of being cut into pieces, and ``skip_special_tokens`` drops them.

This matches what ``transformers`` builds from the same file, except in one place, on purpose:
transformers (5.x) gives a ``"smollm"`` file the plain ``ByteLevel`` pre-tokenizer, without the
``Digits`` step. The vocabulary has no token with a digit in it besides the ten digits, so the
two agree except where a run of two or more whitespace characters comes right before a digit
(``"x  1"``, ``"\\n\\n2"``): SmolLM2's own tokenizer, and llama.cpp, keep the whole run together
(``"ĠĠ"``, ``"ĊĊ"``) while transformers' GGUF tokenizer splits off its last character. We
follow the model's own tokenizer. ``tests/test_tokenizer.py`` pins both facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from labkit.tokenizer.contract import (TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED,
                                       TokenizerBuildError)

# llama.cpp's names for pre-tokenizers whose regexes are "\p{N}" then the GPT-2 regex.
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_GPT2_ONLY = frozenset({"gpt2"})

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from bytes to the printable characters byte-level BPE spells them with."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def pre_tokenizer_for(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_ONLY:
        return byte_level
    supported = ", ".join(sorted(_DIGITS_THEN_GPT2 | _GPT2_ONLY))
    raise TokenizerBuildError(
        f"GGUF pre-tokenizer {pre!r} is not supported (its split regex is not implemented here); "
        f"supported: {supported}"
    )


def byte_level_backend(fields: Mapping[str, Any], source: str = "") -> tuple[tokenizers.Tokenizer, None]:
    """The ``"gpt2"`` (byte-level BPE) backend described in the module docstring (a
    :class:`~labkit.tokenizer.contract.BackendBuilder`: it puts no space before the text)."""
    pre = fields.get("tokenizer.ggml.pre")
    pre_tokenizer = pre_tokenizer_for(pre)

    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    token_types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
    if len(token_types) != len(tokens):
        raise TokenizerBuildError(f"{len(tokens)} tokens but {len(token_types)} token types")
    raw_merges = fields.get("tokenizer.ggml.merges")
    if not raw_merges:
        raise TokenizerBuildError("byte-level BPE needs tokenizer.ggml.merges, and the file has none")

    # Every real token is spelled in the byte alphabet. One that is not (llama.cpp writes a few
    # as plain text) is re-spelled from its UTF-8 bytes, as transformers does.
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(spelled(token), index)
    merges = []
    for merge in raw_merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise TokenizerBuildError(f"malformed merge {merge!r}")
        merges.append((parts[0], parts[1]))

    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()

    # Control tokens become special added tokens (matched whole, skippable); a control token not
    # spelled in the byte alphabet is a llama.cpp mislabel and is left alone (as transformers does).
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_CONTROL and set(tok) <= alphabet
    ]
    if control:
        backend.add_special_tokens(control)
    user_defined = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_USER_DEFINED and tok in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)
    return backend, None
