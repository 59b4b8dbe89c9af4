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
model wrote it. Streamed, each text run is a text block of `text_delta`s and each call a block of
its own: `content_block_start` with `{"type": "tool_use", "id", "name", "input": {}}`, one
`input_json_delta` with the whole input's JSON as `partial_json`, `content_block_stop`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from labkit.protocols.tool_use import (CallSplitter, InvalidToolCall, ToolCall, ToolChoice, ToolResult,
                                       ToolSpec, ToolUseError, Turn, render_turns)
from labkit.serve.anthropic_protocol import CountTokensRequest, TextBlock, ToolResultBlock, ToolUseBlock
from labkit.serve.anthropic_wire import ANTHROPIC_ERRORS, PING, frame, stop_reason, usage
from labkit.serve.calls import Call, failure_error, outcome_of
from labkit.serve.engine_client import EngineFailure
from labkit.serve.errors import invalid
from labkit.serve.tool_requests import ToolUse, checked_tool_use

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


def answer_content(text: str, tool_use: ToolUse | None) -> tuple[list[dict], bool]:
    """The answer's content blocks, and whether it made a valid call."""
    if tool_use is None or not tool_use.reads_calls:
        return [{"type": "text", "text": text}], False
    splitter = CallSplitter(tool_use.specs, tool_use.choice.parallel, new_tool_use_id)
    blocks: list[dict] = []
    for piece in splitter.feed(text) + splitter.finish():   # in the reply's order, as streamed
        if isinstance(piece, str):
            if blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += piece
            else:
                blocks.append({"type": "text", "text": piece})
        elif isinstance(piece, ToolCall):
            blocks.append(tool_use_block(piece))
    called = any(b["type"] == "tool_use" for b in blocks)
    return blocks or [{"type": "text", "text": ""}], called


@dataclass
class BlockFrames:
    """The content blocks of a streamed reply with tools, as they are read."""

    index: int = 0
    text_open: bool = False
    called: bool = False
    frames: list[str] = field(default_factory=list)

    def close_text(self) -> None:
        if self.text_open:
            self.frames.append(frame("content_block_stop", {"type": "content_block_stop",
                                                            "index": self.index}))
            self.text_open, self.index = False, self.index + 1

    def add(self, pieces: Sequence[str | ToolCall | InvalidToolCall]) -> list[str]:
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
            # an invalid call: its text came as text pieces
        out, self.frames = self.frames, []
        return out

    def end(self) -> list[str]:
        """Close the open text block; a reply with no block at all gets one empty text block."""
        if self.index == 0 and not self.text_open:
            self.frames.append(frame("content_block_start", {"type": "content_block_start", "index": 0,
                                                             "content_block": {"type": "text", "text": ""}}))
            self.text_open = True
        self.close_text()
        out, self.frames = self.frames, []
        return out


async def tool_message_events(call: Call, prompt_tokens: int, stops: Sequence[str], decode,
                              tool_use: ToolUse):
    """The stream of one message whose reply is read for tool calls (see the module's docstring)."""
    outcome, failure = "cancelled", None
    splitter = CallSplitter(tool_use.specs, tool_use.choice.parallel, new_tool_use_id)
    blocks = BlockFrames()
    try:
        start = {"id": call.response_id, "type": "message", "role": "assistant", "content": [],
                 "model": call.model, "stop_reason": None, "stop_sequence": None,
                 "usage": usage(None, prompt_tokens, 0)}
        yield frame("message_start", {"type": "message_start", "message": start})
        yield PING
        async for item in call.events(call.keepalive_s):
            if item is None:
                yield PING
            elif item[1].text:
                for text in blocks.add(splitter.feed(item[1].text)):
                    yield text
        for text in blocks.add(splitter.finish()) + blocks.end():
            yield text
        output = call.streams[0].output
        reason, sequence = stop_reason(output.samples[0], stops, decode)
        if blocks.called and reason == "end_turn":
            reason = "tool_use"
        yield frame("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(output, prompt_tokens, 0)})
        yield frame("message_stop", {"type": "message_stop"})
        outcome = "ok"
    except (EngineFailure, ValueError) as error:
        outcome, failure = outcome_of(error), error
        yield frame("error", ANTHROPIC_ERRORS.body(failure_error(error)))
    finally:
        call.abort_all()
        call.finish(outcome, failure)
