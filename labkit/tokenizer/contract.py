"""What every part of labkit's tokenizer shares: the GGUF's token types, the build error, the
metadata kept beside ``tokenizer.json``, and the two contracts a backend module fulfils.

A *backend builder* (:class:`BackendBuilder`) turns the GGUF's ``tokenizer.*`` fields into a
``tokenizers.Tokenizer``: :func:`labkit.tokenizer.byte_level.byte_level_backend` for
``tokenizer.ggml.model = "gpt2"`` and
:func:`labkit.tokenizer.sentencepiece.sentencepiece_backend_from_fields` for ``"llama"``. A
*decoder* (:class:`TextDecoder`) turns ids back into text; :class:`labkit.tokenizer.Tokenizer`
is one, and so is :class:`labkit.tokenizer.sentencepiece.SentencePieceDecoder`, which it uses
for SentencePiece files. The backend modules import only this module; the
:mod:`labkit.tokenizer.gguf_tokenizer` module imports them, never the other way round.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import tokenizers

# Bump when the way we build the tokenizer (or what meta.json holds) changes: old caches are
# then ignored, because the key changes.
FORMAT_VERSION = 1

# GGUF token types (llama.cpp's llama_token_type, which are SentencePiece's piece types).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

SUPPORTED_MODELS = "byte-level BPE (tokenizer.ggml.model = 'gpt2') and SentencePiece BPE ('llama')"

REPLACEMENT_CHAR = "\ufffd"


class TokenizerBuildError(ValueError):
    """The GGUF describes a tokenizer we cannot (or do not yet) build."""




class BackendBuilder(Protocol):
    """Builds the ``tokenizers`` backend of one kind of GGUF tokenizer from the file's
    ``tokenizer.*`` fields (`source` names the file in errors). Returns the backend and whether
    it puts a ``"▁"`` before the text (SentencePiece), or None where that does not apply.
    Raises :class:`TokenizerBuildError` for a file it cannot rebuild."""

    def __call__(self, fields: Mapping[str, Any],
                 source: str) -> tuple[tokenizers.Tokenizer, bool | None]: ...


class TextDecoder(Protocol):
    """Text of a sequence of ids; invalid UTF-8 decodes to U+FFFD."""

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True)
class TokenizerMeta:
    """What a tokenizer needs besides ``tokenizer.json``: special ids, BOS policy, chat template."""

    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None
    tokenizer_model: str = "gpt2"
    pre_tokenizer: str | None = None
    # SentencePiece only: whether a "▁" is put before the text (None for byte-level BPE). The
    # backend's normalizer adds it; Tokenizer.decode reads this to take it off. A meta.json from
    # before this field loads as None, right for the byte-level files that alone were cached
    # then, so FORMAT_VERSION did not need to change.
    add_space_prefix: bool | None = None
    source: str = ""  # where it was built from, for messages only
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TokenizerMeta:
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})
