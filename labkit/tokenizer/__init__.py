"""Text to token ids and back, rebuilt from a GGUF file's own metadata.

The package, in the order its modules depend on each other (each imports only those above):

- :mod:`~labkit.tokenizer.contract`: the GGUF's token types, :class:`TokenizerBuildError`,
  :class:`TokenizerMeta` (what is kept beside ``tokenizer.json``), and the two contracts:
  a ``BackendBuilder`` (GGUF fields -> ``tokenizers`` backend) and a ``TextDecoder``;
- :mod:`~labkit.tokenizer.byte_level`: byte-level BPE (``"gpt2"``, SmolLM2's);
- :mod:`~labkit.tokenizer.sentencepiece`: SentencePiece BPE (``"llama"``, Gemma 3's) and its
  byte-exact decoder;
- :mod:`~labkit.tokenizer.detokenizer`: :class:`IncrementalDetokenizer`, ids streamed to text;
- :mod:`~labkit.tokenizer.gguf_tokenizer`: :class:`Tokenizer`, which reads a GGUF, picks the
  builder of its kind, caches the result and encodes, decodes and renders chats.
"""

from labkit.tokenizer.byte_level import bytes_to_unicode
from labkit.tokenizer.contract import (FORMAT_VERSION, REPLACEMENT_CHAR, SUPPORTED_MODELS,
                                       TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED,
                                       BackendBuilder, TextDecoder, TokenizerBuildError, TokenizerMeta)
from labkit.tokenizer.detokenizer import IncrementalDetokenizer
from labkit.tokenizer.gguf_tokenizer import (Tokenizer, build_backend, cache_key, default_cache_dir,
                                             read_gguf_tokenizer_fields)

__all__ = [
    "FORMAT_VERSION", "REPLACEMENT_CHAR", "SUPPORTED_MODELS", "TOKEN_TYPE_CONTROL", "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_USER_DEFINED", "BackendBuilder", "IncrementalDetokenizer", "TextDecoder", "Tokenizer",
    "TokenizerBuildError", "TokenizerMeta", "build_backend", "bytes_to_unicode", "cache_key",
    "default_cache_dir", "read_gguf_tokenizer_fields",
]
