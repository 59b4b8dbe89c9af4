"""What a generated token means for the caller: the one place that decides when a sample
stops and which text is final.

Both the simple loop (`labkit.engine.loop.generate`) and the serving engine
(`labkit.engine.llm_engine.LLMEngine`) hand each sampled token to an `OutputProcessor`:

    token -> EOS or a stop token id?  finish "stop", the token is not part of the output
          -> incremental detokenization (UTF-8 safe: only final text comes out)
          -> a stop string in the decoded text (it may span tokens)?  cut there, finish "stop"
          -> a response format's grammar complete (nothing but EOS may follow)?  finish "stop"
          -> max_tokens or the context's limit reached?  flush the held-back text, "length"

Text is handed out (`Delta.text`, what a stream sends) only once no stop string can claim
it: with stop strings, the last `len(longest stop) - 1` characters wait for the next token
(vLLM's stop buffer), since a stop string that spans tokens is only seen whole when its last
token comes, and a stream cannot take back what it sent. The deltas of a sample add up to
its final `text`.

`encode_prompt` is the one check of a prompt before either of them starts: text through the
tokenizer (optionally its chat template), ids checked against the vocabulary, never empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.sampling import SamplingParams
from labkit.tokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class Delta:
    """What one sampled token added to a sample's output."""

    token_id: int | None        # None: the sample finished on this token without keeping it
    text: str                   # text released with this token: final, and no stop string can take it
    finish_reason: str | None   # "stop", "length", or None while the sample goes on


class OutputProcessor:
    """One sample's stop / EOS / length / detokenization state.

    `max_new_tokens` is the most output tokens the sample may have (the request's
    `max_tokens`, or fewer where the model's context ends first). `matcher`, the sample's
    grammar matcher where its params have a response format, consumes each kept token."""

    def __init__(self, tokenizer, params: SamplingParams, max_new_tokens: int | None = None,
                 matcher=None):
        self.params, self.matcher = params, matcher
        self.max_new_tokens = params.max_tokens if max_new_tokens is None else min(max_new_tokens, params.max_tokens)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids = set(params.stop_token_ids) | ({eos} if eos is not None and not params.ignore_eos else set())
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.released = 0  # characters of `text` handed out in deltas
        # characters held back: the start of a stop string may hide there
        self.held = max((len(s) for s in params.stop), default=1) - 1

    def add(self, token: int) -> Delta:
        if self.finish_reason is not None:
            raise ValueError("this sample has already finished")
        if token in self.stop_ids:
            return self._finish(Delta(None, self._release(len(self.text)), "stop"))
        self.token_ids.append(token)
        if self.matcher is not None:
            self.matcher.consume(token)
        piece = self.detokenizer.add([token]) if self.detokenizer is not None else ""
        before = len(self.text)
        self.text += piece
        cut = stop_string_cut(self.text, self.params.stop, before) if self.params.stop else None
        if cut is not None:
            self.text = self.text[:cut]
            return self._finish(Delta(token, self._release(cut), "stop"))
        if self.matcher is not None and self.matcher.is_terminated():
            # Complete: ending here saves the step that would only sample the forced EOS.
            tail = self.detokenizer.flush() if self.detokenizer is not None else ""
            self.text += tail
            return self._finish(Delta(token, self._release(len(self.text)), "stop"))
        if len(self.token_ids) >= self.max_new_tokens:
            tail = self.detokenizer.flush() if self.detokenizer is not None else ""
            self.text += tail
            return self._finish(Delta(token, self._release(len(self.text)), "length"))
        return Delta(token, self._release(len(self.text) - self.held), None)

    def _release(self, upto: int) -> str:
        """The text from what was handed out so far up to `upto`, now handed out too."""
        upto = max(upto, self.released)
        piece, self.released = self.text[self.released:upto], upto
        return piece

    def _finish(self, delta: Delta) -> Delta:
        self.finish_reason = delta.finish_reason
        return delta


def stop_string_cut(text: str, stops: Sequence[str], search_from: int) -> int | None:
    """Index where the earliest stop string starts, looking only at text that can be new
    (a stop string may begin up to len(stop) - 1 characters before `search_from`)."""
    hits = [i for s in stops if (i := text.find(s, max(0, search_from - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def with_bos(ids: Sequence[int], tokenizer) -> list[int]:
    """A text prompt's ids with the BOS token in front where the tokenizer says the model
    expects one (`add_bos_token`: Gemma 3; SmolLM2 does not) and it is not there yet."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and list(ids[:1]) != [bos]:
        return [bos, *ids]
    return list(ids)


def encode_prompt(prompt: str | Sequence[int], tokenizer, vocab_size: int | None, *,
                  chat: bool = False) -> list[int]:
    """The prompt's token ids: a text prompt starts with the BOS token where the tokenizer
    says the model expects one (`add_bos_token`: Gemma 3; SmolLM2 does not); token ids are
    taken as given. Raises ValueError for text without a tokenizer, ids that are not integers
    or (when the vocabulary's size is known) outside [0, vocab_size), and an empty prompt
    (nothing to condition on)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
        if not chat:
            ids = with_bos(ids, tokenizer)
    else:
        if chat:
            raise ValueError("chat=True needs a text prompt")
        ids = list(prompt)
        limit = vocab_size if vocab_size is not None else float("inf")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size or 'vocab'})")
    if not ids:
        raise ValueError("the prompt is empty: at least one token is needed to condition on")
    return list(ids)
