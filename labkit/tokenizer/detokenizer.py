"""Streaming detokenization: a stream of generated ids into a stream of final text."""

from __future__ import annotations

from collections.abc import Sequence

from labkit.tokenizer.contract import REPLACEMENT_CHAR, TextDecoder


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
        tokenizer: TextDecoder,
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
