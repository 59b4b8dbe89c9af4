"""Text to token ids and back, built from a GGUF file's own metadata.

A GGUF file carries no ``tokenizer.json``; it stores the pieces of one under llama.cpp's key
names: the vocabulary (``tokenizer.ggml.tokens``), the BPE merges (``tokenizer.ggml.merges``),
each token's type (``tokenizer.ggml.token_type``: 1 normal, 3 control, 4 user-defined), the
special ids, the name of the pre-tokenizer (``tokenizer.ggml.pre``) and the chat template.
:func:`build_backend` puts these back together with the ``tokenizers`` library. Two kinds of
tokenizer are supported, named by ``tokenizer.ggml.model``: ``"gpt2"``, byte-level BPE (SmolLM2),
described here, and ``"llama"``, SentencePiece BPE (Gemma 3), described in
:mod:`labkit.tokenizer_spm`. For byte-level BPE:

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

Building takes seconds, mostly reading the GGUF (Gemma 3's 262,144 tokens: about 12 s to read,
2 s to build), so :meth:`Tokenizer.from_gguf` keeps the result in
``cache_root()/tokenizers/<key>/`` as a ``tokenizer.json`` and a ``meta.json``; the key is
derived from the GGUF's resolved path, size and modification time, so editing or replacing the
file gives a new key. A warm load reads those two files (tens of milliseconds; about a second
for Gemma 3).

:class:`IncrementalDetokenizer` turns a stream of generated ids into a stream of text; its
docstring describes the method.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

# Bump when the way we build the tokenizer (or what meta.json holds) changes: old caches are
# then ignored, because the key changes.
FORMAT_VERSION = 1

# GGUF token types (llama.cpp's llama_token_type, which are SentencePiece's piece types).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

SUPPORTED_MODELS = "byte-level BPE (tokenizer.ggml.model = 'gpt2') and SentencePiece BPE ('llama')"

# llama.cpp's names for pre-tokenizers whose regexes are "\p{N}" then the GPT-2 regex.
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_GPT2_ONLY = frozenset({"gpt2"})

REPLACEMENT_CHAR = "\ufffd"


class TokenizerBuildError(ValueError):
    """The GGUF describes a tokenizer we cannot (or do not yet) build."""


# --------------------------------------------------------------------------------------------
# Building from GGUF metadata
# --------------------------------------------------------------------------------------------


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


def read_gguf_tokenizer_fields(path: str | os.PathLike) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, as plain Python values."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {key: fld.contents() for key, fld in reader.fields.items() if key.startswith("tokenizer.")}


def _pre_tokenizer_for(pre: str | None) -> pre_tokenizers.PreTokenizer:
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


def build_backend(fields: Mapping[str, Any], source: str = "") -> tuple[tokenizers.Tokenizer, TokenizerMeta]:
    """A ``tokenizers.Tokenizer`` and its :class:`TokenizerMeta` from GGUF ``tokenizer.*`` fields."""
    model_type = fields.get("tokenizer.ggml.model")
    add_space_prefix = None
    if model_type == "gpt2":
        backend = _byte_level_backend(fields)
    elif model_type == "llama":
        backend, add_space_prefix = _sentencepiece_backend(fields, source)
    else:
        raise TokenizerBuildError(
            f"only {SUPPORTED_MODELS} tokenizers are supported, but {source or 'the file'} has {model_type!r}"
        )
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


def _sentencepiece_backend(fields: Mapping[str, Any], source: str) -> tuple[tokenizers.Tokenizer, bool]:
    """The ``"llama"`` (SentencePiece BPE) backend, and whether it puts a space before the text."""
    from labkit.tokenizer_spm import sentencepiece_backend  # it builds on this module's names

    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    scores = fields.get("tokenizer.ggml.scores")
    if scores is None or len(scores) == 0:
        # SentencePiece BPE ranks its merges by these; without them we cannot rebuild it.
        raise TokenizerBuildError(
            f"a SentencePiece tokenizer needs tokenizer.ggml.scores, and {source or 'the file'} has none "
            f"(supported: {SUPPORTED_MODELS})"
        )
    token_types = fields.get("tokenizer.ggml.token_type")
    if token_types is None or len(token_types) == 0:
        token_types = [TOKEN_TYPE_NORMAL] * len(tokens)
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    # llama.cpp's default for a SentencePiece vocabulary that does not say is to add the space.
    add_space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    backend = sentencepiece_backend(
        tokens,
        [float(s) for s in scores],
        [int(t) for t in token_types],
        unk_token_id=None if unk is None else int(unk),
        add_space_prefix=add_space_prefix,
    )
    return backend, add_space_prefix


def _byte_level_backend(fields: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The ``"gpt2"`` (byte-level BPE) backend described in the module docstring."""
    pre = fields.get("tokenizer.ggml.pre")
    pre_tokenizer = _pre_tokenizer_for(pre)

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
    return backend


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
        self._sentencepiece_decoder = None  # built on first decode; see labkit.tokenizer_spm
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
            # as the backend's ByteFallback decoder does (see labkit.tokenizer_spm).
            if self._sentencepiece_decoder is None:
                from labkit.tokenizer_spm import SentencePieceDecoder

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


# --------------------------------------------------------------------------------------------
# Streaming detokenization
# --------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turn a stream of token ids into a stream of text, emitting only text that is final.

    Decoding one token at a time is wrong twice over: a character outside ASCII can be split
    across byte tokens (decoding the first half alone gives U+FFFD), and some decoders change a
    token's text depending on what comes before it (a leading space). So we use the
    prefix/read-offset method of vLLM and Hugging Face's ``TextStreamer``:

    * keep a small window of ids: a *prefix* of already-emitted tokens (a few, for context), then
      the *pending* ids not emitted yet. ``read`` is where pending starts;
    * on ``add(ids)``, decode the prefix alone and the whole window; the new text is the whole
      window's decode minus the prefix's, by length;
    * emit it only if it does not end in U+FFFD (an unfinished UTF-8 character may still be
      completed by the next token). Then everything so far is final: the pending ids become the
      new prefix (the last ``context`` of them) and pending is empty;
    * otherwise emit nothing and wait for more ids.

    Each step decodes only the window, so the work per token does not grow with the stream.
    The window only grows while the text keeps ending in U+FFFD, which for a real stream lasts
    at most three bytes; but arbitrary ids can produce invalid UTF-8 without end. Once more than
    ``max_pending`` ids are pending, we release the longest part that is provably final: the
    window cut at a point ``c`` where decoding the two sides separately gives the same text as
    decoding them together, with text after the cut. UTF-8 decoding resynchronises, so such a cut
    means any unfinished character before ``c`` was settled (completed or rejected) by the bytes
    after it, and nothing that comes later can change the text before ``c``.

    The concatenation of everything ``add`` returns, plus ``flush()`` at the end, equals
    ``tokenizer.decode(all_ids)``. ``flush()`` also emits a trailing U+FFFD that was held back;
    call it when the stream ends. (Calling it mid-stream is allowed, but if a character is split
    at that point the halves decode separately.)
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = False,
        context_ids: Sequence[int] = (),
        context: int = 4,
        max_pending: int = 16,
    ):
        if context < 1:
            raise ValueError("context must be at least 1")
        self._decode_fn = tokenizer.decode
        self.skip_special_tokens = skip_special_tokens
        self.context = context
        self.max_pending = max(max_pending, 4)
        # The window: ids[:read] were emitted already (the prefix); ids[read:] are pending.
        self._ids: list[int] = [int(i) for i in context_ids][-context:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.num_tokens = 0

    @property
    def window_size(self) -> int:
        """How many ids are held (prefix plus pending); stays bounded however long the stream."""
        return len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _advance(self, read: int) -> None:
        """Everything before ``read`` is emitted: keep the last ``context`` of it as the prefix."""
        start = max(0, read - self.context)
        self._ids = self._ids[start:]
        self._read = read - start
        self._prefix_text = self._decode(self._ids[: self._read])

    def add(self, ids: int | Iterable[int]) -> str:
        """Feed one id or several; return the text that became final (often "")."""
        try:
            new = [int(i) for i in ids]  # a list, a tuple, a 1-d array or tensor
        except TypeError:  # one id: an int, a numpy integer, a 0-d tensor
            new = [int(ids)]
        if not new:
            return ""
        self.num_tokens += len(new)
        self._ids.extend(new)
        text = self._decode(self._ids)
        delta = text[len(self._prefix_text) :]
        if not delta.endswith(REPLACEMENT_CHAR):  # includes delta == "" (ids that decode to nothing)
            self._advance(len(self._ids))
            return delta
        if len(self._ids) - self._read > self.max_pending:
            return self._release(text)
        return ""

    def _release(self, text: str) -> str:
        """Emit the longest provably final part of a window stuck on U+FFFD (see the class docstring)."""
        for cut in range(len(self._ids) - 1, self._read, -1):
            before = self._decode(self._ids[:cut])
            if len(before) <= len(self._prefix_text):
                break
            after = self._decode(self._ids[cut:])
            if after and before + after == text:
                delta = before[len(self._prefix_text) :]
                self._advance(cut)
                return delta
        return ""

    def flush(self) -> str:
        """Emit whatever is held back (a trailing U+FFFD); call once the stream has ended."""
        text = self._decode(self._ids)
        delta = text[len(self._prefix_text) :]
        self._advance(len(self._ids))
        return delta


__all__ = [
    "FORMAT_VERSION",
    "IncrementalDetokenizer",
    "SUPPORTED_MODELS",
    "Tokenizer",
    "TokenizerBuildError",
    "TokenizerMeta",
    "build_backend",
    "cache_key",
    "read_gguf_tokenizer_fields",
]
