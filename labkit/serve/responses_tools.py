"""Function tools on the Responses API, over the shared core (`labkit.protocols.tool_use`).

A request's function `tools`, `tool_choice` ("none" | "auto" | "required" | {"type":
"function", "name"}) and `parallel_tool_calls` become the core's `ToolSpec`s and
`ToolChoice`; its `function_call` items (consecutive ones, and those right after an assistant
message, make one assistant turn) and `function_call_output` items become the core's `Turn`s
and `ToolResult`s. A `function_call_output` whose `call_id` no earlier `function_call` has is
a 400, as is a `function_call` whose `arguments` are not a JSON object.

The reply is read by the core: the answer's `output` is, in the reply's order, a `message`
for each run of text (a reply with neither text nor calls is one empty message) and one
`function_call` item per valid call (`id` "fc_...",
`call_id` "call_...", `name`, `arguments` as JSON text, `status` completed). An invalid call
is never a `function_call` item: its text stays in the message, as the model wrote it, the
`status` is what it would be for a text reply (`completed`, or `incomplete` at the token
limit), and the call is listed in labkit's extension `invalid_function_calls`, a top-level
field of the response: `[{"id": "call_...", "name" (as written, null if unreadable),
"arguments" (the text as written, null if unreadable), "error" (the reason)}]`, chat's
`invalid_tool_calls` entry (absent when every call is valid). Streamed, the message's events
are the plain answer's, and each call is `response.output_item.added` (arguments ""), one
`response.function_call_arguments.delta` with the whole arguments, `.done`, and
`response.output_item.done`; the invalid calls are on the last event's `response`
(`response.completed` or `response.incomplete`; `response.failed` has those read so far).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from labkit.engine.llm_engine import RequestOutput, TokenEvent
from labkit.protocols.tool_use import (CallSplitter, InvalidToolCall, ToolCall, ToolChoice, ToolResult,
                                       ToolSpec, ToolUseError, Turn, render_turns)
from labkit.serve.errors import APIError, invalid
from labkit.serve.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, MessageItem,
                                             ParsedResponsesRequest, ToolChoiceFunction)
from labkit.serve.responses_wire import (EventSequence, message_item, new_message_id, output_text, sse_event,
                                         status_of, usage_of_output)
from labkit.serve.tool_requests import ToolUse, checked_tool_use, invalid_entry


def new_item_id() -> str:
    return f"fc_{uuid.uuid4().hex}"


async def tool_use_of(request: ParsedResponsesRequest, tokenizer, vocab_size: int | None) -> ToolUse | None:
    """The checked tools and choice; None for a request without tools or tool items."""
    fields = request.fields
    if not request.uses_tools and fields.tool_choice in (None, "none", "auto"):
        return None
    specs = [ToolSpec(t.name, t.description or "", t.parameters if t.parameters is not None
                      else {"type": "object", "properties": {}}) for t in fields.tools or ()]
    sent = fields.tool_choice
    parallel = fields.parallel_tool_calls is not False
    choice = ToolChoice("named", sent.name, parallel) if isinstance(sent, ToolChoiceFunction) \
        else ToolChoice(sent or "auto", parallel=parallel)
    try:
        return await checked_tool_use(specs, choice, tokenizer, vocab_size)
    except ToolUseError as error:
        code = "invalid_function_parameters" if error.where.endswith(".parameters") else "invalid_value"
        raise invalid(str(error), error.where, code) from None


def turns_of(request: ParsedResponsesRequest) -> list[Turn | ToolResult]:
    turns: list[Turn | ToolResult] = []
    if request.fields.instructions is not None:
        turns.append(Turn("system", request.fields.instructions))
    called: dict[str, str] = {}
    for i, item in enumerate(request.items):
        if isinstance(item, MessageItem):
            turns.append(Turn("system" if item.role == "developer" else item.role, item.text))
        elif isinstance(item, FunctionCallItem):
            try:
                arguments = json.loads(item.arguments)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise invalid(f"input[{i}].arguments: a function call's arguments are a JSON object's text",
                              f"input[{i}].arguments")
            call = ToolCall(item.call_id, item.name, arguments)
            called[item.call_id] = item.name
            last = turns[-1] if turns else None
            if isinstance(last, Turn) and last.role == "assistant":
                turns[-1] = Turn("assistant", last.content, last.tool_calls + (call,))
            else:
                turns.append(Turn("assistant", "", (call,)))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise invalid(f"input[{i}].call_id: no earlier function_call has the call_id "
                              f"{item.call_id!r}", f"input[{i}].call_id")
            output = item.output if isinstance(item.output, str) else "\n".join(p.text for p in item.output)
            turns.append(ToolResult(item.call_id, called[item.call_id], output))
    return turns


def tool_messages(request: ParsedResponsesRequest, tool_use: ToolUse) -> list[dict[str, str]]:
    try:
        return render_turns(turns_of(request), tool_use.specs, tool_use.choice)
    except ToolUseError as error:  # turns_of checked the outputs already: a 400 all the same
        raise invalid(str(error), "input") from None


def function_call_item(item_id: str, call: ToolCall, status: str = "completed", arguments: str | None = None
                       ) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments_json if arguments is None else arguments, "status": status}


class OutputItems(NamedTuple):
    """A whole reply read for calls: its output items and the invalid calls' entries."""

    items: list[dict]
    invalid: list[dict]


def output_items(text: str, finish_reason: str | None, tool_use: ToolUse | None) -> OutputItems:
    """A whole answer's output items and invalid calls (see the module's docstring)."""
    status, _ = status_of(finish_reason)
    if tool_use is None or not tool_use.reads_calls:
        return OutputItems([message_item(new_message_id(), text, status)], [])
    splitter = CallSplitter(tool_use.specs, tool_use.choice.parallel)
    items: list[dict] = []
    bad_calls: list[dict] = []
    for piece in splitter.feed(text) + splitter.finish():   # in the reply's order, as streamed
        if isinstance(piece, str):
            if items and items[-1]["type"] == "message":
                items[-1]["content"][0]["text"] += piece
            else:
                items.append(message_item(new_message_id(), piece, "completed"))
        elif isinstance(piece, ToolCall):
            items.append(function_call_item(new_item_id(), piece))
        else:   # its text came as text pieces
            bad_calls.append(invalid_entry(piece))
    if not items:
        items.append(message_item(new_message_id(), "", status))
    if items[-1]["type"] == "message":
        items[-1]["status"] = status   # the last message is the one a token limit cut
    return OutputItems(items, bad_calls)


@dataclass
class ToolStreamWriter:
    """The frames of a streamed response whose reply is read for calls
    (`labkit.serve.calls.StreamWriter`)."""

    sequence: EventSequence
    tool_use: ToolUse
    items: list[dict] = field(default_factory=list)     # the finished output items
    invalid: list[dict] = field(default_factory=list)   # the invalid calls' entries, so far
    text: str | None = None                             # the open message's text (None: none open)
    splitter: CallSplitter = None

    def __post_init__(self) -> None:
        self.splitter = CallSplitter(self.tool_use.specs, self.tool_use.choice.parallel)

    def opening(self) -> list[str]:
        s = self.sequence
        return [sse_event(s.event("response.created", response=s.response("in_progress", []))),
                sse_event(s.event("response.in_progress", response=s.response("in_progress", [])))]

    def event(self, index: int, event: TokenEvent) -> list[str]:
        return self.pieces(self.splitter.feed(event.text)) if event.text else []

    def pieces(self, pieces: Sequence[str | ToolCall | InvalidToolCall]) -> list[str]:
        s, out = self.sequence, []
        for piece in pieces:
            if isinstance(piece, str):
                if self.text is None:
                    out += self.open_message()
                self.text += piece
                out.append(sse_event(s.event("response.output_text.delta", item_id=s.item_id,
                                             output_index=len(self.items), content_index=0, delta=piece,
                                             logprobs=[])))
            elif isinstance(piece, ToolCall):
                out += self.close_message("completed")
                item_id, index = new_item_id(), len(self.items)
                done = function_call_item(item_id, piece)
                out += [sse_event(e) for e in (
                    s.event("response.output_item.added", output_index=index,
                            item=function_call_item(item_id, piece, "in_progress", "")),
                    s.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                            delta=done["arguments"]),
                    s.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            name=piece.name, arguments=done["arguments"]),
                    s.event("response.output_item.done", output_index=index, item=done))]
                self.items.append(done)
            else:   # an invalid call: its text came as text pieces
                self.invalid.append(invalid_entry(piece))
        return out

    def open_message(self) -> list[str]:
        s = self.sequence
        s.item_id, self.text = new_message_id(), ""
        return [sse_event(s.event("response.output_item.added", output_index=len(self.items),
                                  item=message_item(s.item_id, None, "in_progress"))),
                sse_event(s.event("response.content_part.added", item_id=s.item_id,
                                  output_index=len(self.items), content_index=0, part=output_text("")))]

    def close_message(self, status: str) -> list[str]:
        if self.text is None:
            return []
        s, index, text = self.sequence, len(self.items), self.text
        item = message_item(s.item_id, text, status)
        self.items.append(item)
        self.text = None
        return [sse_event(e) for e in (
            s.event("response.output_text.done", item_id=s.item_id, output_index=index, content_index=0,
                    text=text, logprobs=[]),
            s.event("response.content_part.done", item_id=s.item_id, output_index=index, content_index=0,
                    part=output_text(text)),
            s.event("response.output_item.done", output_index=index, item=item))]

    def closing(self, outputs: list[RequestOutput]) -> list[str]:
        sample = outputs[0].samples[0]
        status, reason = status_of(sample.finish_reason)
        out = self.pieces(self.splitter.finish())
        if not self.items and self.text is None:
            out += self.open_message()
        out += self.close_message(status)
        final = "response.completed" if status == "completed" else "response.incomplete"
        s = self.sequence
        return out + [sse_event(s.event(final, response=s.response(
            status, self.items, usage=usage_of_output(outputs[0]), incomplete_reason=reason,
            invalid_calls=self.invalid)))]

    def failure(self, error: APIError) -> list[str]:
        s = self.sequence
        items = self.items + ([message_item(s.item_id, self.text, "incomplete")]
                              if self.text is not None else [])
        return [sse_event(s.event("error", code=error.code, message=error.message, param=None)),
                sse_event(s.event("response.failed", response=s.response(
                    "failed", items, error={"code": "server_error", "message": error.message},
                    invalid_calls=self.invalid)))]

    def ending(self) -> list[str]:
        return []
