"""Text to token ids and back, built from a GGUF file's own metadata.

A GGUF file carries no ``tokenizer.json``; it stores the pieces of one under llama.cpp's key
names: the vocabulary (``tokenizer.ggml.tokens``), the BPE merges (``tokenizer.ggml.merges``),
each token's type (``tokenizer.ggml.token_type``: 1 normal, 3 control, 4 user-defined), the
special ids, the name of the pre-tokenizer (``tokenizer.ggml.pre``) and the chat template.
:func:`build_backend` puts these back together with the ``tokenizers`` library through the
builder of the file's kind (``tokenizer.ggml.model``): ``"gpt2"``, byte-level BPE (SmolLM2), in
:mod:`labkit.tokenizer.byte_level`, and ``"llama"``, SentencePiece BPE (Gemma 3), in
:mod:`labkit.tokenizer.sentencepiece`.

Building takes seconds, mostly reading the GGUF (Gemma 3's 262,144 tokens: about 12 s to read,
2 s to build), so :meth:`Tokenizer.from_gguf` keeps the result in
``cache_root()/tokenizers/<key>/`` as a ``tokenizer.json`` and a ``meta.json``; the key is
derived from the GGUF's resolved path, size and modification time, so editing or replacing the
file gives a new key. A warm load reads those two files (tens of milliseconds; about a second
for Gemma 3).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import tokenizers

from labkit.tokenizer.byte_level import byte_level_backend
from labkit.tokenizer.contract import (FORMAT_VERSION, SUPPORTED_MODELS, BackendBuilder, TokenizerBuildError,
                                       TokenizerMeta)
from labkit.tokenizer.detokenizer import IncrementalDetokenizer
from labkit.tokenizer.sentencepiece import SentencePieceDecoder, sentencepiece_backend_from_fields

# The builder of each kind of tokenizer, by the file's tokenizer.ggml.model.
BUILDERS: dict[str, BackendBuilder] = {"gpt2": byte_level_backend, "llama": sentencepiece_backend_from_fields}


# --------------------------------------------------------------------------------------------
# Building from GGUF metadata
# --------------------------------------------------------------------------------------------


def read_gguf_tokenizer_fields(path: str | os.PathLike) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, as plain Python values."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {key: fld.contents() for key, fld in reader.fields.items() if key.startswith("tokenizer.")}


def build_backend(fields: Mapping[str, Any], source: str = "") -> tuple[tokenizers.Tokenizer, TokenizerMeta]:
    """A ``tokenizers.Tokenizer`` and its :class:`TokenizerMeta` from GGUF ``tokenizer.*`` fields."""
    model_type = fields.get("tokenizer.ggml.model")
    if model_type not in BUILDERS:
        raise TokenizerBuildError(
            f"only {SUPPORTED_MODELS} tokenizers are supported, but {source or 'the file'} has {model_type!r}"
        )
    backend, add_space_prefix = BUILDERS[model_type](fields, source)
    if backend.get_vocab_size(with_added_tokens=True) != len(fields["tokenizer.ggml.tokens"]):
        raise TokenizerBuildError(
            f"built a vocabulary of {backend.get_vocab_size(with_added_tokens=True)} tokens, "
            f"but the file lists {len(fields['tokenizer.ggml.tokens'])}"
        )

    def opt_int(key: str) -> int | None:
        value = fields.get(key)
        return None if value is None else int(value)

    # A SentencePiece file that does not say adds BOS: llama.cpp and transformers both default to it.
    add_bos_default = model_type == "llama"
    meta = TokenizerMeta(
        bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
        unk_token_id=opt_int("tokenizer.ggml.unknown_token_id"),
        pad_token_id=opt_int("tokenizer.ggml.padding_token_id"),
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=fields.get("tokenizer.chat_template"),
        tokenizer_model=model_type,
        pre_tokenizer=fields.get("tokenizer.ggml.pre"),
        add_space_prefix=add_space_prefix,
        source=source,
    )
    return backend, meta


def cache_key(path: str | os.PathLike) -> str:
    """Key of a GGUF's cached tokenizer: its resolved path, size and mtime, and FORMAT_VERSION."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    ident = f"{FORMAT_VERSION}\0{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode("utf-8")).hexdigest()[:24]


def default_cache_dir() -> Path:
    from labkit.util.paths import cache_root

    return cache_root() / "tokenizers"


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """A tokenizer built from a GGUF file: byte-level BPE or SentencePiece BPE (see the module docstring).

    ``encode`` adds no BOS unless ``add_special_tokens=True`` is passed *and* the file asks for
    one: SmolLM2's does not, Gemma 3's does, so ``encode(text, add_special_tokens=True)`` starts
    with ``<bos>`` there (as transformers and llama.cpp do) and plain ``encode(text)`` never does.
    Special-token strings that appear in text, such as ``"<|im_end|>"`` or
    ``"<start_of_turn>"``, are matched as the special token, as transformers does, unless
    ``parse_special=False`` is passed: then they are plain text, cut into ordinary pieces.
    ``encode_chat`` encodes a conversation so that only the chat template can write a special
    token (:mod:`labkit.protocols.templates`).
    """

    #: Roles a chat message may have.
    CHAT_ROLES = ("system", "user", "assistant", "tool")

    def __init__(self, backend: tokenizers.Tokenizer, meta: TokenizerMeta):
        self._backend = backend
        self.meta = meta
        self._template = None
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._sentencepiece_decoder = None  # built on first decode; see labkit.tokenizer.sentencepiece
        self._plain_backend = None  # built on first parse_special=False; see _backend_for

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike,
        *,
        cache_dir: str | os.PathLike | None = None,
        use_cache: bool = True,
    ) -> Tokenizer:
        """The tokenizer a GGUF file describes, from the cache when it has been built before.

        ``cache_dir`` defaults to ``labkit.util.paths.cache_root() / "tokenizers"``;
        ``use_cache=False`` builds from the file and writes nothing.
        """
        path = Path(path)
        if not use_cache:
            return cls(*build_backend(read_gguf_tokenizer_fields(path), source=str(path)))
        entry = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        entry = entry / cache_key(path)
        tokenizer_json, meta_json = entry / "tokenizer.json", entry / "meta.json"
        if tokenizer_json.is_file() and meta_json.is_file():
            try:
                return cls.from_file(tokenizer_json, meta_json)
            except Exception:  # an unreadable or corrupt cache entry is rebuilt
                shutil.rmtree(entry, ignore_errors=True)
        tok = cls(*build_backend(read_gguf_tokenizer_fields(path), source=str(path)))
        tok._save_atomically(entry)
        return tok

    @classmethod
    def from_file(
        cls, tokenizer_json: str | os.PathLike, meta: TokenizerMeta | Mapping[str, Any] | str | os.PathLike
    ) -> Tokenizer:
        """Load a saved ``tokenizer.json`` plus its metadata (a TokenizerMeta, a dict, or a meta.json path)."""
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        if isinstance(meta, TokenizerMeta):
            pass
        elif isinstance(meta, Mapping):
            meta = TokenizerMeta.from_json(json.dumps(dict(meta)))
        else:
            meta = TokenizerMeta.from_json(Path(meta).read_text(encoding="utf-8"))
        return cls(backend, meta)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` and ``meta.json`` into ``directory``; returns the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"), pretty=False)
        (directory / "meta.json").write_text(self.meta.to_json(), encoding="utf-8")
        return directory

    def _save_atomically(self, entry: Path) -> None:
        """Write into a temporary folder, then rename it into place (a reader never sees half a cache)."""
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        except OSError:
            return  # a read-only cache is not an error: we just rebuild next time
        try:
            self.save(tmp)
            try:
                os.rename(tmp, entry)
            except OSError:  # someone else got there first
                pass
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    # -- basic properties ---------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self.meta.bos_token_id

    @property
    def add_bos_token(self) -> bool:
        """Whether the model expects its BOS token before a prompt (the file says: Gemma's
        does, SmolLM2's does not). `encode` adds it only with add_special_tokens=True."""
        return self.meta.add_bos_token

    @property
    def eos_token_id(self) -> int | None:
        return self.meta.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.meta.pad_token_id

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the control tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ...)."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        return self.meta.chat_template

    def id_to_token(self, token_id: int) -> str | None:
        """The token as the vocabulary spells it (``"Ġthe"``, ``"▁the"``), or None for an unknown id."""
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, pre={self.meta.pre_tokenizer!r}, "
            f"bos={self.bos_token_id}, eos={self.eos_token_id}, source={self.meta.source!r})"
        )

    # -- encode / decode ----------------------------------------------------------------------

    def _wrap(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens:
            if self.meta.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self.meta.add_eos_token and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def _backend_for(self, parse_special: bool) -> tokenizers.Tokenizer:
        """The backend, or a copy of it that reads special-token spellings as plain text.

        The copy is made once (seconds for Gemma's vocabulary) rather than flipping the flag on
        the shared backend, which other threads may be encoding with at the same moment."""
        if parse_special:
            return self._backend
        if self._plain_backend is None:
            plain = tokenizers.Tokenizer.from_str(self._backend.to_str())
            plain.encode_special_tokens = True  # special added tokens are not matched in text
            self._plain_backend = plain
        return self._plain_backend

    def encode(self, text: str, add_special_tokens: bool = False, *, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` adds BOS/EOS only where the file asks for them;
        ``parse_special=False`` reads special-token spellings in the text as plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        ids = self._backend_for(parse_special).encode(text, add_special_tokens=False).ids
        return self._wrap(ids, add_special_tokens)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False, *,
                     parse_special: bool = True) -> list[list[int]]:
        encodings = self._backend_for(parse_special).encode_batch(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids, add_special_tokens) for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (possible for arbitrary ids) decodes to U+FFFD."""
        ids = [int(i) for i in ids]
        if self.meta.tokenizer_model == "llama":
            # SentencePiece's byte pieces: decode as SentencePiece does, not all-or-nothing per run
            # as the backend's ByteFallback decoder does (see labkit.tokenizer.sentencepiece).
            if self._sentencepiece_decoder is None:
                self._sentencepiece_decoder = SentencePieceDecoder(
                    self._backend, self._special_ids, strip_prefix_space=bool(self.meta.add_space_prefix)
                )
            return self._sentencepiece_decoder(ids, skip_special_tokens)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------------

    def _check_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise ValueError(
                f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
            )
        checked = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}")
            role = message.get("role")
            if role not in self.CHAT_ROLES:
                raise ValueError(f"message {i} has unknown role {role!r}; expected one of {', '.join(self.CHAT_ROLES)}")
            content = message.get("content")
            if not isinstance(content, str):
                raise ValueError(
                    f"message {i} ({role}) must have str content, got {type(content).__name__}"
                    + (" (missing 'content')" if "content" not in message else "")
                )
            checked.append(dict(message))
        return checked

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render a conversation with the GGUF's Jinja chat template (as transformers does)."""
        if not self.meta.chat_template:
            # The message reaches API clients: the file's name, not where it lives on the server.
            source = Path(self.meta.source).name if self.meta.source else "this tokenizer"
            raise ValueError(f"{source} has no chat template; send a plain prompt instead "
                             "(a server can be given one: labkit serve --chat-template)")
        checked = self._check_messages(messages)
        if self._template is None:
            from labkit.protocols.templates import compile_chat_template

            self._template = compile_chat_template(self.meta.chat_template)
        context: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": None if self.meta.unk_token_id is None else self.id_to_token(self.meta.unk_token_id),
            "pad_token": None if self.pad_token_id is None else self.id_to_token(self.pad_token_id),
        }
        context.update(template_kwargs)
        return self._template.render(messages=checked, add_generation_prompt=add_generation_prompt, **context)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered conversation (the template writes any BOS itself). Only the
        template's own text can give a special token: one spelled out in a message is plain text
        (see :mod:`labkit.protocols.templates`)."""
        from labkit.protocols.templates import encode_conversation

        return encode_conversation(self, messages, add_generation_prompt, **template_kwargs)

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer with another chat template (for a file that carries none, or a
        published one), sharing the backend."""
        other = Tokenizer(self._backend, replace(self.meta, chat_template=template))
        other._plain_backend = self._plain_backend  # the same backend: share its plain-text copy
        return other

    def detokenizer(self, *, skip_special_tokens: bool = False, context_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, context_ids=context_ids)


__all__ = ["BUILDERS", "Tokenizer", "build_backend", "cache_key", "default_cache_dir",
           "read_gguf_tokenizer_fields"]
