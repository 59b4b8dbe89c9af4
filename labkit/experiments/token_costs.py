"""What text costs in tokens: characters, bytes and words per token, and how a text is cut.

A model's context window, its price per request and its time per request are counted in
tokens, not characters. How many tokens a text needs depends on the tokenizer's vocabulary:
byte-level BPE (GPT-2, SmolLM2, Llama 3) has a token for every byte, so nothing is ever
unknown, but text the vocabulary saw rarely in training is cut into short pieces, down to
single bytes of one UTF-8 character.

* :func:`token_cost_table` counts characters (Unicode code points), UTF-8 bytes, tokens and,
  where it means something, whitespace-separated words for a set of sample texts;
* :func:`token_pieces` shows how one text is cut: each token's id and its text, or its bytes
  where the token alone is not valid UTF-8 (part of a character).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

__all__ = ["token_cost_table", "token_pieces", "token_bytes"]


def token_cost_table(tokenizer, samples: Mapping[str, str], *, words_for: Collection[str] | None = None,
                     relative_to: str | None = None) -> list[dict]:
    """One row per sample: characters, bytes and tokens, and the ratios between them.

    ``tokenizer`` needs only ``encode(text) -> list[int]`` (no special tokens are added).
    Characters are Unicode code points (``len(text)``), so an emoji built from several code
    points counts as several. Words are ``len(text.split())`` and are counted only for the
    samples named in ``words_for`` (all samples when None): for text written without spaces
    (Chinese) or without words (emoji, code) a word count means little, and those rows get
    None. With ``relative_to`` naming a sample, ``tokens_vs_<name>`` gives each sample's
    token count divided by that sample's (meaningful for the same content in several languages).
    """
    if relative_to is not None and relative_to not in samples:
        raise ValueError(f"relative_to={relative_to!r} is not one of the samples")
    rows = []
    for name, text in samples.items():
        tokens = len(tokenizer.encode(text))
        characters, nbytes = len(text), len(text.encode("utf-8"))
        counted = words_for is None or name in words_for
        words = len(text.split()) if counted else None
        rows.append({
            "sample": name,
            "characters": characters,
            "bytes": nbytes,
            "tokens": tokens,
            "chars_per_token": characters / tokens if tokens else None,
            "bytes_per_token": nbytes / tokens if tokens else None,
            "words": words,
            "tokens_per_word": tokens / words if words else None,
        })
    if relative_to is not None:
        base = next(r["tokens"] for r in rows if r["sample"] == relative_to)
        for row in rows:
            row[f"tokens_vs_{relative_to}"] = row["tokens"] / base if base else None
    return rows


def _byte_decoder() -> dict[str, int]:
    from labkit.tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for (byte-level BPE: its spelling mapped back through GPT-2's table).

    Added tokens spelled outside the byte alphabet (``<|im_start|>``) give their UTF-8 text.
    """
    spelling = tokenizer.id_to_token(int(token_id))
    if spelling is None:
        raise ValueError(f"unknown token id {token_id}")
    table = _byte_decoder()
    if all(ch in table for ch in spelling):
        return bytes(table[ch] for ch in spelling)
    return spelling.encode("utf-8")


def token_pieces(tokenizer, text: str) -> list[tuple[int, str]]:
    """How ``text`` is cut: ``(token id, piece)`` for every token.

    A piece is the token's text when its bytes are valid UTF-8 on their own (``" Paris"``),
    else its bytes in hex between angle brackets (``"<f0 9f>"``): the token is part of one
    multi-byte character and means nothing alone.
    """
    pieces = []
    for token_id in tokenizer.encode(text):
        raw = token_bytes(tokenizer, token_id)
        try:
            piece = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = "<" + raw.hex(" ") + ">"
        pieces.append((int(token_id), piece))
    return pieces
