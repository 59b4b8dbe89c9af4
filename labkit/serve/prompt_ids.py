"""A request's prompt as token ids, computed off the event loop.

Tokenizing runs in a worker thread (`asyncio.to_thread`), through the `tokenizers` library's
`encode_batch`, which releases the GIL while it works; its `encode` does not, so in a thread
it would still stop the event loop, and every other client's stream with it, for as long as
a long prompt takes (about 0.5 s for 200,000 tokens here). The ids are those of
`labkit.engine.output.encode_prompt` (the same text gives the same ids, with the BOS token
where the model expects one), and its checks apply: ids inside the vocabulary, no empty
prompt (ValueError).
"""

from __future__ import annotations

import asyncio
from typing import Mapping, Sequence

from labkit.engine.output import encode_prompt, with_bos
from labkit.protocols.templates import encode_conversation


async def completion_ids(prompts: Sequence[str | Sequence[int]], tokenizer,
                         vocab_size: int | None) -> list[list[int]]:
    """Each prompt's ids: texts encoded together in one thread, id lists checked as given."""
    texts = [p for p in prompts if isinstance(p, str)]
    if texts and tokenizer is None:
        raise ValueError("this model has no tokenizer: pass token ids")
    encoded = iter(await asyncio.to_thread(tokenizer.encode_batch, texts) if texts else ())
    return [encode_prompt(with_bos(next(encoded), tokenizer) if isinstance(p, str) else p, tokenizer, vocab_size)
            for p in prompts]


async def chat_ids(messages: Sequence[Mapping[str, str]], tokenizer, vocab_size: int | None) -> list[int]:
    """The conversation rendered with the model's chat template (the template writes any BOS
    itself) and encoded, in one thread. A special-token spelling in a message is encoded as
    plain text: only the template writes role boundaries (labkit.protocols.templates)."""
    def render_and_encode() -> list[int]:
        return encode_conversation(tokenizer, messages, True)

    return encode_prompt(await asyncio.to_thread(render_and_encode), tokenizer, vocab_size)
