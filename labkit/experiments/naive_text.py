"""The naive way to stop and to stream, kept to be measured against the real loop (chapter 5).

* :func:`stop_naive_per_token` looks for a stop string inside each token's own text, which
  misses every stop string that spans a token boundary; :func:`stop_text_level` matches on the
  decoded text, as the engine's output processor does.
* :func:`stream_naive` decodes each token alone and concatenates the pieces: a character split
  across byte tokens comes out as U+FFFD, and a decoder that strips a leading space loses the
  spaces between words. :func:`stream_table` sets it beside
  :class:`labkit.tokenizer.IncrementalDetokenizer`, token by token.
* :func:`sentencepiece_style_tokenizer` builds a toy tokenizer with the decoder Llama 2 and
  Mistral ship (``▁`` for a space, byte fallback, one leading space stripped), to show the
  spacing half of the problem, which byte-level BPE (SmolLM2, GPT-2) does not have.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from labkit.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

# ---------------------------------------------------------------------------------------------
# Stopping
# ---------------------------------------------------------------------------------------------


def stop_naive_per_token(tokenizer, token_ids: Sequence[int], stops: Sequence[str]) -> int | None:
    """The naive stop check: the index of the first token whose OWN text contains a stop string.

    This is what a loop does when it tests ``stop in tokenizer.decode([token])`` after each
    token. It never sees a stop string whose characters are split across tokens.
    Returns ``None`` when no token's text contains one.
    """
    for index, token in enumerate(token_ids):
        piece = tokenizer.decode([int(token)])
        if any(stop in piece for stop in stops):
            return index
    return None


def stop_text_level(tokenizer, token_ids: Sequence[int],
                    stops: Sequence[str]) -> tuple[int, str] | None:
    """The text-level stop check over a finished token list, as the engine loop applies it.

    Tokens are fed one at a time to an :class:`IncrementalDetokenizer`; after each one the
    text so far is searched for every stop string. Returns ``(tokens_consumed, text)`` at the
    first hit, where ``text`` ends just before the earliest stop string, or ``None``.
    """
    detok = IncrementalDetokenizer(tokenizer)
    text = ""
    for index, token in enumerate(token_ids):
        text += detok.add([int(token)])
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return index + 1, text[: min(hits)]
    return None


def locate_in_tokens(tokenizer, token_ids: Sequence[int], substring: str) -> dict | None:
    """Where ``substring`` falls in the text of ``token_ids``, token by token.

    Returns a dict with the character offset of its first occurrence (``start``), the index
    of the token holding its first character (``first_token``) and last character
    (``last_token``), and whether it starts or ends strictly inside a token's text
    (``starts_inside``, ``ends_inside``), or ``None`` if it does not occur. Each token's
    text is its own decode, so this is meant for text without split multi-byte characters.
    """
    pieces = [tokenizer.decode([int(t)]) for t in token_ids]
    text = "".join(pieces)
    start = text.find(substring)
    if start < 0 or not substring:
        return None
    end = start + len(substring)  # one past the last character
    bounds, offset = [], 0
    for piece in pieces:
        bounds.append((offset, offset + len(piece)))
        offset += len(piece)

    def owner(char: int) -> int:
        return next(i for i, (lo, hi) in enumerate(bounds) if lo <= char < hi)

    first, last = owner(start), owner(end - 1)
    return {
        "start": start,
        "first_token": first,
        "last_token": last,
        "starts_inside": start > bounds[first][0],
        "ends_inside": end < bounds[last][1],
        "tokens_spanned": last - first + 1,
    }


# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------


def stream_naive(tokenizer, ids: Iterable[int]) -> list[str]:
    """Naive streaming: each token decoded on its own (``tokenizer.decode([id])``).

    Concatenated, the pieces are what a client would display. They differ from
    ``tokenizer.decode(ids)`` wherever a character's UTF-8 bytes are split across tokens
    (each fragment decodes to U+FFFD) or the decoder treats the first token specially.
    """
    return [tokenizer.decode([int(i)]) for i in ids]


def stream_incremental(tokenizer, ids: Iterable[int]) -> list[str]:
    """What :class:`IncrementalDetokenizer` emits per token; the final flush is added to the
    last piece, so the list has one entry per id and joins to ``tokenizer.decode(ids)``."""
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([int(i)]) for i in ids]
    tail = detok.flush()
    if pieces:
        pieces[-1] += tail
    return pieces


def stream_table(tokenizer, ids: Sequence[int]) -> list[dict]:
    """One row per token: its id, its spelling in the vocabulary, what naive streaming emits
    and what the incremental detokenizer emits at that step (``repr`` of each, so that
    spaces, newlines and U+FFFD stay visible)."""
    naive = stream_naive(tokenizer, ids)
    incremental = stream_incremental(tokenizer, ids)
    spell = getattr(tokenizer, "id_to_token", None)
    rows = []
    for step, (token, a, b) in enumerate(zip(ids, naive, incremental)):
        rows.append({
            "step": step,
            "id": int(token),
            "token": spell(int(token)) if spell else None,
            "naive": repr(a),
            "incremental": repr(b),
        })
    return rows


def count_replacement(text: str) -> int:
    """How many U+FFFD replacement characters ``text`` holds."""
    return text.count(REPLACEMENT_CHAR)


def sentencepiece_style_tokenizer(pieces: Sequence[str]):
    """A toy tokenizer over ``pieces`` (id = position) with Llama 2's decoder.

    The decoder is the sequence Llama 2 and Mistral ship in their ``tokenizer.json``:
    ``▁`` becomes a space, ``<0xNN>`` pieces become raw bytes (byte fallback), the pieces
    are fused, and ONE leading space is stripped from the result. Decoding a word alone
    therefore drops its space, which is what breaks per-token streaming with such
    tokenizers. It only decodes (its ``encode`` maps whole pieces, nothing more); the
    result has the ``decode(ids, skip_special_tokens=...)`` method the detokenizers need.
    """
    import tokenizers
    from tokenizers import decoders, models

    vocab = {piece: index for index, piece in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise ValueError("pieces must be distinct")
    unk = "<unk>" if "<unk>" in vocab else pieces[0]
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    return tok


__all__ = ["count_replacement", "locate_in_tokens", "sentencepiece_style_tokenizer", "stop_naive_per_token",
           "stop_text_level", "stream_incremental", "stream_naive", "stream_table"]
