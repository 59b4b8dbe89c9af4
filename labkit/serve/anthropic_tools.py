"""Tool use on Anthropic's Messages API, over the shared core (`labkit.protocols.tool_use`).

A request's `tools` (client tools: name, description, input_schema) and `tool_choice` (auto,
any, tool, none; `disable_parallel_tool_use`) become the core's `ToolSpec`s and `ToolChoice`
(any is required, tool is a named one); its `tool_use` and `tool_result` blocks become the
core's `Turn`s and `ToolResult`s, which it renders into the chat template's conversation (the
tools described in the system turn, results as data). A `tool_result` whose `tool_use_id`
no earlier `tool_use` has is a 400. `any` and `tool` are forced by the core's grammar.

The reply is read by the core: each valid call is a `tool_use` block (`id` "toolu_...",
`name`, `input`), each run of text between them a text block, in the reply's order (a reply
with neither is one empty text block), and `stop_reason` is `tool_use`. An invalid call
(unknown tool, input that does not match the schema, bad JSON, a second call with
`disable_parallel_tool_use`) is never a `tool_use` block: its text stays in the text, as the
model wrote it, `stop_reason` is what it would be for a text reply (`end_turn`, `max_tokens`,
`stop_sequence`), and the call is listed in labkit's extension `invalid_tool_uses`, a
top-level field of the message: `[{"id": "toolu_...", "name" (as written, null if unreadable),
"arguments" (the text as written, null if unreadable), "error" (the reason)}]`, chat's
`invalid_tool_calls` entry (absent when every call is valid). Streamed, each text run is a
text block of `text_delta`s and each call a block of its own: `content_block_start` with
`{"type": "tool_use", "id", "name", "input": {}}`, one `input_json_delta` with the whole
input's JSON as `partial_json`, `content_block_stop`; the invalid calls come in
`message_delta`'s `delta`, beside `stop_reason`. The stream itself (its order, closing frames
and errors) is `labkit.serve.anthropic_wire.message_events`, with `BlockFrames` for the blocks.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from labkit.protocols.tool_use import (CallSplitter, InvalidToolCall, ToolCall, ToolChoice, ToolResult,
                                       ToolSpec, ToolUseError, Turn, render_turns)
from labkit.serve.anthropic_protocol import CountTokensRequest, TextBlock, ToolResultBlock, ToolUseBlock
from labkit.serve.anthropic_wire import frame
from labkit.serve.errors import invalid
from labkit.serve.tool_requests import ToolUse, checked_tool_use, invalid_entry

CHOICE_MODES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
ERROR_PREFIX = "(error) "   # a tool_result with is_error: its text, marked for the model


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def uses_tools(fields: CountTokensRequest) -> bool:
    return bool(fields.tools) or fields.tool_choice is not None or \
        any(m.has_tool_blocks for m in fields.messages)


async def tool_use_of(fields: CountTokensRequest, tokenizer, vocab_size: int | None) -> ToolUse | None:
    """The checked tools (each schema compiled by the grammar engine) and choice; None when
    the request has no tools, no tool choice and no tool blocks."""
    if not uses_tools(fields):
        return None
    specs = [ToolSpec(t.name, t.description or "", t.input_schema) for t in fields.tools or ()]
    sent = fields.tool_choice
    mode = CHOICE_MODES[sent.type] if sent is not None else "auto"
    choice = ToolChoice(mode, sent.name if mode == "named" else None,
                        parallel=not (sent is not None and sent.disable_parallel_tool_use))
    try:
        return await checked_tool_use(specs, choice, tokenizer, vocab_size)
    except ToolUseError as error:
        where = error.where.replace(".parameters", ".input_schema")
        raise invalid(str(error).replace(".parameters", ".input_schema"), where) from None


def turns_of(fields: CountTokensRequest) -> list[Turn | ToolResult]:
    """The conversation as the core's turns; 400 for a tool_result no earlier tool_use called."""
    turns: list[Turn | ToolResult] = []
    if fields.system_text is not None:
        turns.append(Turn("system", fields.system_text))
    called: dict[str, str] = {}
    for i, message in enumerate(fields.messages):
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) \
            else message.content
        if message.role == "assistant":
            calls = tuple(ToolCall(b.id, b.name, b.input) for b in blocks if isinstance(b, ToolUseBlock))
            called.update((c.id, c.name) for c in calls)
            text = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
            turns.append(Turn("assistant", text, calls))
            continue
        texts: list[str] = []
        for j, block in enumerate(blocks):
            if isinstance(block, ToolResultBlock):
                if texts:
                    turns.append(Turn("user", "\n".join(texts)))
                    texts = []
                if block.tool_use_id not in called:
                    raise invalid(f"messages[{i}].content[{j}].tool_use_id: no earlier tool_use block has "
                                  f"the id {block.tool_use_id!r}", f"messages[{i}].content[{j}].tool_use_id")
                text = (ERROR_PREFIX if block.is_error else "") + block.text
                turns.append(ToolResult(block.tool_use_id, called[block.tool_use_id], text))
            else:
                texts.append(block.text)
        if texts:
            turns.append(Turn("user", "\n".join(texts)))
    return turns


def tool_messages(fields: CountTokensRequest, tool_use: ToolUse) -> list[dict[str, str]]:
    try:
        return render_turns(turns_of(fields), tool_use.specs, tool_use.choice)
    except ToolUseError as error:  # turns_of checked the results already: a 400 all the same
        raise invalid(str(error), "messages") from None


def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


class AnswerContent(NamedTuple):
    """A whole reply read for calls: its content blocks, whether one is a valid call, and the
    invalid calls' entries (labkit's `invalid_tool_uses`)."""

    blocks: list[dict]
    called: bool
    invalid: list[dict]


def answer_content(text: str, tool_use: ToolUse | None) -> AnswerContent:
    """The answer's content blocks, whether it made a valid call, and its invalid calls."""
    if tool_use is None or not tool_use.reads_calls:
        return AnswerContent([{"type": "text", "text": text}], False, [])
    splitter = CallSplitter(tool_use.specs, tool_use.choice.parallel, new_tool_use_id)
    blocks: list[dict] = []
    bad_calls: list[dict] = []
    for piece in splitter.feed(text) + splitter.finish():   # in the reply's order, as streamed
        if isinstance(piece, str):
            if blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += piece
            else:
                blocks.append({"type": "text", "text": piece})
        elif isinstance(piece, ToolCall):
            blocks.append(tool_use_block(piece))
        else:   # its text came as text pieces
            bad_calls.append(invalid_entry(piece))
    called = any(b["type"] == "tool_use" for b in blocks)
    return AnswerContent(blocks or [{"type": "text", "text": ""}], called, bad_calls)


@dataclass
class BlockFrames:
    """The content blocks of a streamed reply read for calls, as its text comes
    (a `ContentFrames` for labkit.serve.anthropic_wire.message_events)."""

    tool_use: ToolUse
    index: int = 0
    text_open: bool = False
    called: bool = False
    invalid: list[dict] = field(default_factory=list)
    frames: list[str] = field(default_factory=list)
    splitter: CallSplitter = None

    def __post_init__(self) -> None:
        self.splitter = CallSplitter(self.tool_use.specs, self.tool_use.choice.parallel, new_tool_use_id)

    def opening(self) -> list[str]:
        return []   # no block before the first ping: the first may be a tool_use

    def add(self, text: str) -> list[str]:
        return self.pieces(self.splitter.feed(text))

    def closing(self) -> list[str]:
        """The held-back rest, then the open text block closed; a reply with no block at all
        gets one empty text block."""
        out = self.pieces(self.splitter.finish())
        if self.index == 0 and not self.text_open:
            self.frames.append(frame("content_block_start", {"type": "content_block_start", "index": 0,
                                                             "content_block": {"type": "text", "text": ""}}))
            self.text_open = True
        self.close_text()
        return out + self.taken()

    def close_text(self) -> None:
        if self.text_open:
            self.frames.append(frame("content_block_stop", {"type": "content_block_stop",
                                                            "index": self.index}))
            self.text_open, self.index = False, self.index + 1

    def taken(self) -> list[str]:
        out, self.frames = self.frames, []
        return out

    def pieces(self, pieces: Sequence[str | ToolCall | InvalidToolCall]) -> list[str]:
        for piece in pieces:
            if isinstance(piece, str):
                if not self.text_open:
                    self.frames.append(frame("content_block_start", {
                        "type": "content_block_start", "index": self.index,
                        "content_block": {"type": "text", "text": ""}}))
                    self.text_open = True
                self.frames.append(frame("content_block_delta", {
                    "type": "content_block_delta", "index": self.index,
                    "delta": {"type": "text_delta", "text": piece}}))
            elif isinstance(piece, ToolCall):
                self.close_text()
                self.frames += [
                    frame("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": tool_use_block(piece) | {"input": {}}}),
                    frame("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": {"type": "input_json_delta",
                                                            "partial_json": piece.arguments_json}}),
                    frame("content_block_stop", {"type": "content_block_stop", "index": self.index})]
                self.index, self.called = self.index + 1, True
            else:   # an invalid call: its text came as text pieces
                self.invalid.append(invalid_entry(piece))
        return self.taken()
