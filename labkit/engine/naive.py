"""The naive way to generate, stop and stream, kept to be measured against the real loop.

Chapter 5 contrasts each of these with what :mod:`labkit.engine.loop` does:

* :func:`generate_naive` chooses tokens greedily with no KV cache: every step runs the model
  over the whole sequence so far (prompt plus everything generated), then keeps only the last
  position's logits. Step ``k`` therefore costs a prefill of ``len(prompt) + k`` tokens.
* :func:`check_in_one_pass` runs the model ONCE over prompt + output and reads off, at every
  position, the token the model would have chosen next. Choosing is serial; checking is not.
* :func:`stop_naive_per_token` looks for a stop string inside each token's own text, which
  misses every stop string that spans a token boundary; :func:`stop_text_level` matches on the
  decoded text, as the engine loop does.
* :func:`stream_naive` decodes each token alone and concatenates the pieces: a character split
  across byte tokens comes out as U+FFFD, and a decoder that strips a leading space loses the
  spaces between words. :func:`stream_table` sets it beside
  :class:`labkit.tokenizer.IncrementalDetokenizer`, token by token.
* :func:`pass_flops` and :func:`generation_flops` count the arithmetic of each, to set the
  measured times beside what the multiply-adds alone predict.
* :func:`sentencepiece_style_tokenizer` builds a toy tokenizer with the decoder Llama 2 and
  Mistral ship (``▁`` for a space, byte fallback, one leading space stripped), to show the
  spacing half of the problem, which byte-level BPE (SmolLM2, GPT-2) does not have.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from labkit.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer


def generate_naive(model, prompt_ids: Sequence[int], max_tokens: int, *,
                   stop_token_ids: Iterable[int] = ()) -> tuple[list[int], list[float]]:
    """Greedy generation with no cache: each step re-runs the model over the whole prefix.

    Returns ``(token_ids, per_step_seconds)``; step ``k``'s time covers its forward pass over
    ``len(prompt_ids) + k`` tokens (logits of the last position only) and the argmax. Ties go
    to the lowest id, as in :func:`labkit.sampling.sample`. Generation ends after
    ``max_tokens`` tokens, or at a token in ``stop_token_ids`` (which is not returned; by
    default there is none, so the loop always runs ``max_tokens`` steps).
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: at least one token is needed to condition on")
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    stops = {int(t) for t in stop_token_ids}
    sequence = [int(t) for t in prompt_ids]
    out: list[int] = []
    seconds: list[float] = []
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        logits = model(torch.tensor([sequence]), last_only=True)[0, -1]
        token = int(torch.argmax(logits))
        seconds.append(time.perf_counter() - t0)
        if token in stops:
            break
        out.append(token)
        sequence.append(token)
    return out, seconds


def check_in_one_pass(model, prompt_ids: Sequence[int],
                      token_ids: Sequence[int]) -> tuple[list[int], list[bool]]:
    """Check a greedy output with ONE forward pass over ``prompt_ids + token_ids``.

    The logits at position ``len(prompt_ids) - 1 + i`` are the model's scores for output
    token ``i`` given everything before it, so their argmax is the token greedy decoding
    would have chosen there. Returns ``(argmax_ids, matches)``, both of length
    ``len(token_ids)``: ``matches[i]`` is whether ``argmax_ids[i] == token_ids[i]``.

    A mismatch at ``i`` is the model disagreeing with token ``i`` given the tokens actually
    present before it; after a changed token, later positions see a different prefix, so
    they may disagree too.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: position 0 of the output has nothing to condition on")
    prompt = [int(t) for t in prompt_ids]
    tokens = [int(t) for t in token_ids]
    if not tokens:
        return [], []
    logits = model(torch.tensor([prompt + tokens]))[0]
    start = len(prompt) - 1
    argmax_ids = logits[start:start + len(tokens)].argmax(-1).tolist()
    return argmax_ids, [a == t for a, t in zip(argmax_ids, tokens)]


def _matmul_shape(config) -> tuple[int, int, int, int, int]:
    """(layers, weights multiplied per token per layer, hidden, vocab, query width) of a
    LlamaConfig or a GPT2Config."""
    if hasattr(config, "hidden_size"):  # Llama: fused q/k/v, o, gate/up, down
        h, q = config.hidden_size, config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
        return config.num_layers, per_layer, h, config.vocab_size, q
    if hasattr(config, "n_embd"):  # GPT-2: c_attn, c_proj, c_fc, mlp c_proj
        h = config.n_embd
        per_layer = h * 3 * h + h * h + 2 * h * config.n_inner
        return config.n_layer, per_layer, h, config.vocab_size, h
    raise TypeError(f"not a LlamaConfig or GPT2Config: {type(config).__name__}")


def pass_flops(config, n_tokens: int, *, past_tokens: int = 0,
               logits_positions: int | None = None) -> int:
    """Matrix-multiply FLOPs (2 per multiply-add) of one forward pass.

    The pass processes ``n_tokens`` new tokens after ``past_tokens`` already in a KV cache:
    every layer's weights once per new token, causal attention (scores and weighted values)
    from each new token to itself and every earlier one, and the LM head for
    ``logits_positions`` positions (default: all ``n_tokens``; 1 for a pass that keeps only
    the last position's logits). Norms, activations and softmax are left out: they are a
    few percent at these sizes.
    """
    if n_tokens < 1 or past_tokens < 0:
        raise ValueError("n_tokens must be >= 1 and past_tokens >= 0")
    layers, per_layer, hidden, vocab, q_width = _matmul_shape(config)
    logits_positions = n_tokens if logits_positions is None else logits_positions
    keys = sum(past_tokens + j + 1 for j in range(n_tokens))  # keys each new token attends to
    weights = 2 * n_tokens * per_layer * layers
    attention = 2 * 2 * q_width * keys * layers
    head = 2 * logits_positions * hidden * vocab
    return weights + attention + head


def generation_flops(config, prompt_len: int, new_tokens: int) -> dict[str, int]:
    """FLOPs of generating ``new_tokens`` greedily after a ``prompt_len``-token prompt, three ways.

    ``naive``: one pass per step over the whole sequence so far, last-position logits only
    (:func:`generate_naive`); ``cached``: a prefill of the prompt, then one-token passes that
    read the cache (:func:`labkit.engine.loop.generate`; the last token is never fed back);
    ``check``: one pass over prompt + output with logits at every position
    (:func:`check_in_one_pass`).
    """
    naive = sum(pass_flops(config, prompt_len + k, logits_positions=1) for k in range(new_tokens))
    cached = pass_flops(config, prompt_len, logits_positions=1) + sum(
        pass_flops(config, 1, past_tokens=prompt_len + k - 1) for k in range(1, new_tokens))
    check = pass_flops(config, prompt_len + new_tokens)
    return {"naive": naive, "cached": cached, "check": check}


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


__all__ = [
    "check_in_one_pass",
    "count_replacement",
    "generate_naive",
    "generation_flops",
    "locate_in_tokens",
    "pass_flops",
    "sentencepiece_style_tokenizer",
    "stop_naive_per_token",
    "stop_text_level",
    "stream_incremental",
    "stream_naive",
    "stream_table",
]
