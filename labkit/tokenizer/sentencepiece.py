"""SentencePiece BPE tokenizers (``tokenizer.ggml.model = "llama"``) rebuilt from a GGUF's metadata.

A SentencePiece vocabulary in a GGUF is a list of pieces with a score and a type each (the types
are SentencePiece's own: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte) and, for BPE
models like Gemma's, no merges. SentencePiece's BPE encoder works on the whole text with spaces
written as ``"▁"``: it starts from single characters and repeatedly joins the adjacent pair whose
join is the normal piece with the highest score (the leftmost pair on a tie); a character with no
piece of its own is spelled with its UTF-8 byte pieces ``<0x..>``. llama.cpp's SPM tokenizer does
the same. :func:`sentencepiece_backend` expresses this with the ``tokenizers`` library:

* model: ``models.BPE`` over the whole vocabulary, ``byte_fallback=True``, and merges derived from
  the vocabulary: every split of a normal piece into two pieces of the vocabulary, ranked by the
  piece's score. Ranking pairs by the score of what they produce is exactly the rule above;
* normalizer: ``" "`` to ``"▁"``; no pre-tokenizer, so the text is one BPE word, as in
  SentencePiece;
* decoder: ``"▁"`` back to ``" "``, byte pieces back to bytes (``ByteFallback``), ``Fuse``. That
  is transformers' decoder, and it is what ``tokenizer.json`` holds, but :meth:`Tokenizer.decode`
  uses :class:`SentencePieceDecoder` instead (see below);
* added tokens: control pieces (``<bos>``, ``<start_of_turn>``, ``<unused0>``, ...) as *special*
  tokens matched in the raw text; user-defined pieces (``"\n"``, ``"\t\t"``, ``"<table>"``, runs
  of 2 to 31 spaces) as plain added tokens matched, longest first, in the normalized text, where
  SentencePiece matches them.

With ``tokenizer.ggml.add_space_prefix`` (Gemma's file says false, so this is checked only on a
copy of Gemma's vocabulary with the flag set) we follow llama.cpp: a ``"▁"`` is put before every
stretch of text between added tokens (``Prepend`` in the normalizer, all added tokens matched in
the raw text) and the decoder strips one leading space.

Where the references disagree. For Gemma 3 this is SentencePiece's behaviour, checked against the
``sentencepiece`` library on a model proto rebuilt from the GGUF. transformers' GGUF loader and
llama.cpp each differ from it in one narrow place, in opposite directions:

* runs of more than 31 spaces (Gemma's longest space piece). SentencePiece matches user-defined
  pieces greedily (31 spaces, then the rest), as llama.cpp and we do. transformers does not make
  the space-run pieces added tokens; it reaches them with BPE merges, which split a run of 32
  spaces into 16 + 16;
* a literal ``"▁"`` (U+2581) next to a space or another ``"▁"``. SentencePiece turns spaces into
  ``"▁"`` before it matches anything, so ``"▁ "`` is the two-space piece, as in transformers and
  here. llama.cpp stores the space-run pieces with real spaces and matches them before that, so
  it gives two ``"▁"`` tokens.

Decoding differs only for invalid UTF-8, which arbitrary ids (a model's stray byte token) can
produce. ``ByteFallback`` decodes a run of byte pieces all or nothing: one invalid byte turns every
byte of the run into U+FFFD, valid characters included, so text already streamed out can change
when a later byte arrives. SentencePiece and llama.cpp join the bytes and replace only the invalid
ones: ``"䅫"`` spelled in bytes, then a stray ``<0xB3>``, is ``"䅫"`` and one U+FFFD, not four
U+FFFD (llama.cpp returns the bytes; SentencePiece writes one U+FFFD per invalid byte). We decode
that way, with :class:`SentencePieceDecoder`: it is the model's own tokenizer's answer, and it
keeps the guarantee :class:`labkit.tokenizer.detokenizer.IncrementalDetokenizer` relies on, that later ids
never change the text of earlier ones except to complete a character. For valid text all agree.

Our merges are transformers' (``gemma_tokenizer`` in ``transformers/integrations/gguf``), in the
same order, less the ones into control and user-defined pieces: transformers ranks Gemma's merges
by position in the file rather than by score, but the scores of Gemma's normal pieces fall
strictly with position, so the two orders are one; and merges into pieces that are matched whole
before BPE runs can never apply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

from labkit.tokenizer.contract import (SUPPORTED_MODELS, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL,
                                       TOKEN_TYPE_USER_DEFINED, TokenizerBuildError)

SPACE_MARK = "\u2581"  # "▁", SentencePiece's spelling of a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def derive_merges(pieces: Sequence[str], scores: Sequence[float], token_types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges, best first, that reproduce SentencePiece's highest-score-first joining.

    Every way of cutting a normal piece into two pieces of the vocabulary is a merge, ranked by
    the piece's score. Ties (equal scores, or two cuts of one piece) are broken the way
    transformers' ``generate_merges`` breaks them: the longer left part first, then the longer
    right part, then file order.
    """
    index = {piece: i for i, piece in enumerate(pieces)}
    candidates = []
    for i, (piece, kind) in enumerate(zip(pieces, token_types)):
        if kind != TOKEN_TYPE_NORMAL:
            continue
        negated_score = -float(scores[i])
        for cut in range(1, len(piece)):
            left = piece[:cut]
            if left in index:
                right = piece[cut:]
                if right in index:
                    candidates.append((negated_score, -cut, cut - len(piece), i, left, right))
    candidates.sort()
    return [(left, right) for *_, left, right in candidates]


def sentencepiece_backend(
    pieces: Sequence[str],
    scores: Sequence[float],
    token_types: Sequence[int],
    *,
    unk_token_id: int | None,
    add_space_prefix: bool,
) -> tokenizers.Tokenizer:
    """A ``tokenizers.Tokenizer`` that encodes like SentencePiece BPE (see the module docstring)."""
    if not (len(pieces) == len(scores) == len(token_types)):
        raise TokenizerBuildError(f"{len(pieces)} tokens but {len(scores)} scores and {len(token_types)} token types")
    space_to_mark = normalizers.Replace(" ", SPACE_MARK)
    if add_space_prefix:
        # llama.cpp's rule: a "▁" starts every stretch of text between added tokens. Prepend
        # runs on each stretch left once the raw-text added tokens are cut out, so every added
        # token is matched in the raw text, user-defined ones spelled as the file has them.
        normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), space_to_mark])
        match_user_defined_normalized = False
    else:
        # SentencePiece's rule: user-defined pieces are matched in the normalized text, where a
        # space is already "▁". Converters store them with real spaces for llama.cpp (Gemma's
        # runs of 2 to 31 spaces), so we spell them back. (Not with a Prepend normalizer: the
        # tokenizers library normalizes a normalized added token's own text too, so each would
        # gain a "▁".)
        normalizer = space_to_mark
        match_user_defined_normalized = True
    spelled = [
        piece.replace(" ", SPACE_MARK) if kind == TOKEN_TYPE_USER_DEFINED and match_user_defined_normalized else piece
        for piece, kind in zip(pieces, token_types)
    ]
    vocab: dict[str, int] = {}
    for i, piece in enumerate(spelled):
        vocab.setdefault(piece, i)  # a clash shows up in build_backend as a vocabulary too small

    unk_token = spelled[unk_token_id] if unk_token_id is not None and 0 <= unk_token_id < len(spelled) else None
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=derive_merges(spelled, scores, token_types),
            dropout=None,
            unk_token=unk_token,
            # A character without a piece of its own is spelled with its <0x..> byte pieces; <unk>
            # (one for a run, as transformers' LlamaTokenizer does) only if some byte piece is missing.
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizer
    backend.pre_tokenizer = None  # the whole text is one word: SentencePiece does not pre-split
    steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)

    control = [
        AddedToken(piece, normalized=False, special=True)
        for piece, kind in zip(spelled, token_types)
        if kind == TOKEN_TYPE_CONTROL
    ]
    if control:
        backend.add_special_tokens(control)
    user_defined = [
        AddedToken(piece, normalized=match_user_defined_normalized, special=False)
        for piece, kind in zip(spelled, token_types)
        if kind == TOKEN_TYPE_USER_DEFINED
    ]
    if user_defined:
        backend.add_tokens(user_defined)
    return backend


def sentencepiece_backend_from_fields(fields: Mapping[str, Any], source: str = "") -> tuple[tokenizers.Tokenizer, bool]:
    """The ``"llama"`` (SentencePiece BPE) backend from the GGUF's fields, and whether it puts a
    space before the text (a :class:`~labkit.tokenizer.contract.BackendBuilder`)."""

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


class SentencePieceDecoder:
    """Ids to text as SentencePiece and llama.cpp do it: join every token's bytes, then decode.

    Byte pieces (``<0xE4>``) are their byte, other tokens their UTF-8 with ``"▁"`` read as a
    space; each byte that is not part of valid UTF-8 becomes one U+FFFD, as in SentencePiece
    (Python's ``"replace"`` would give one per maximal invalid part). The table of bytes is built
    from the backend's vocabulary, so a cached ``tokenizer.json`` is all it needs.
    """

    # "surrogateescape" turns each undecodable byte (always 0x80 or above) into U+DC80 + byte.
    _ESCAPED_BYTE_TO_REPLACEMENT = {0xDC00 + byte: "\ufffd" for byte in range(0x80, 0x100)}

    def __init__(self, backend: tokenizers.Tokenizer, special_ids: frozenset[int], strip_prefix_space: bool):
        self._special_ids = special_ids
        self._strip_prefix_space = strip_prefix_space
        id_to_piece = {i: piece for piece, i in backend.get_vocab(with_added_tokens=True).items()}
        self._bytes = [self._piece_bytes(id_to_piece.get(i, "")) for i in range(max(id_to_piece, default=-1) + 1)]

    @staticmethod
    def _piece_bytes(piece: str) -> bytes:
        byte = _BYTE_PIECE.fullmatch(piece)  # the pieces the ByteFallback decoder reads as bytes
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.replace(SPACE_MARK, " ").encode("utf-8")

    def __call__(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        table, special = self._bytes, self._special_ids
        data = b"".join(
            table[i] for i in ids if 0 <= i < len(table) and not (skip_special_tokens and i in special)
        )
        text = data.decode("utf-8", errors="surrogateescape").translate(self._ESCAPED_BYTE_TO_REPLACEMENT)
        if self._strip_prefix_space and text.startswith(" "):
            text = text[1:]  # the "▁" that add_space_prefix put before the text
        return text


__all__ = ["SPACE_MARK", "SentencePieceDecoder", "derive_merges", "sentencepiece_backend"]
