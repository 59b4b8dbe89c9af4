"""A request's response format, checked where it arrives: every route that takes one (chat and
completions' `response_format`, the Responses API's `text.format`, Anthropic's
`output_config.format`) builds a `ResponseFormat` and compiles it here, once, before any work,
so that a schema the grammar engine refuses is a 400 in the route's own shape, naming the
route's own field. The engine's compile of the same format then hits the cache of its own
process (`labkit.structured.llg`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from labkit.serve.errors import invalid
from labkit.structured.contract import InvalidFormat, ResponseFormat

INVALID_SCHEMA_CODE = "invalid_json_schema"  # OpenAI's code for a schema it cannot take


async def checked_format(build: Callable[[], ResponseFormat], tokenizer, vocab_size: int | None,
                         param: str, field: str) -> ResponseFormat:
    """The format `build` makes, compiled for this tokenizer; 400 `invalid_json_schema` with
    `param` if it cannot be built or compiled (`field` names the request field in the message)."""
    try:
        fmt = build()
        from labkit.structured.llg import backend_for  # llguidance loads with the first format

        # off the event loop: the first call builds llguidance's tokenizer (0.5-3.5 s)
        await asyncio.to_thread(lambda: backend_for(tokenizer, vocab_size).compile(fmt))
    except InvalidFormat as error:
        raise invalid(f"invalid schema for {field}: {error}", param, INVALID_SCHEMA_CODE) from None
    return fmt
