"""A request's tools, checked where it arrives, for every protocol's adapter: each tool's
schema is checked by the core (`labkit.protocols.tool_use.check_tools`) and compiled by the
grammar engine, the choice is checked against the tools, and a forcing choice (required /
named) gets its grammar compiled, all before any work. The adapters turn `ToolUseError` into
their own 400, naming their own fields.

Every adapter reports a block that is not a valid call the same way, in an extension field of
its answer (chat's `invalid_tool_calls`, Anthropic's `invalid_tool_uses`, the Responses API's
`invalid_function_calls`), one `invalid_entry` per call: `{"id", "name" (as written, null if
unreadable), "arguments" (the text as written, null if unreadable), "error" (the reason)}`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from labkit.protocols.tool_use import (InvalidToolCall, ToolChoice, ToolSpec, check_choice, check_tools,
                                       forcing_format)
from labkit.structured.contract import ResponseFormat


@dataclass(frozen=True)
class ToolUse:
    """The request's tools and choice, checked; `forced` the grammar of a forcing choice."""

    specs: tuple[ToolSpec, ...]
    choice: ToolChoice
    forced: ResponseFormat | None = None

    @property
    def reads_calls(self) -> bool:
        """Whether the reply is read for calls (choice none, or no tools: plain text)."""
        return self.choice.mode != "none" and bool(self.specs)


async def checked_tool_use(specs: list[ToolSpec], choice: ToolChoice, tokenizer, vocab_size: int | None
                           ) -> ToolUse:
    """The checked tools and choice; `ToolUseError` (labkit.protocols.tool_use) otherwise."""
    from labkit.structured.llg import backend_for  # llguidance loads with the first format

    backend = await asyncio.to_thread(backend_for, tokenizer, vocab_size)
    checked = await asyncio.to_thread(check_tools, specs, backend.compile)
    check_choice(checked, choice)
    forced = forcing_format(checked, choice)
    if forced is not None:
        await asyncio.to_thread(backend.compile, forced)
    return ToolUse(checked, choice, forced)


def invalid_entry(bad: InvalidToolCall) -> dict:
    """An invalid call as every route reports it (LangChain's shape for the same thing)."""
    return {"id": bad.id, "name": bad.name, "arguments": bad.arguments, "error": bad.error}
