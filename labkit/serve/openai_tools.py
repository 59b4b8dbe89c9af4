"""Tool calling on OpenAI's chat route: the request's `tools`, `tool_choice`,
`parallel_tool_calls` and tool turns into labkit.protocols.tool_use's terms, and the model's
reply back into `message.tool_calls` (whole) or `delta.tool_calls` (streamed).

    plan = await tool_plan(fields, tokenizer, vocab_size)    # 400s for what cannot be used
    messages = chat_messages(fields.messages, plan)          # template messages, tools described
    replies = ChatToolReplies(plan)                          # Call's reader of each choice's text

`required` and a named tool are forced by the grammar engine (`plan.forcing`, the sampler's
mask); `auto` is read from the model's Hermes-format blocks and validated with `jsonschema`.
A block that is not a valid call is never a `tool_calls` entry: its text stays in `content`
and it is listed in `invalid_tool_calls` (labkit's extension, LangChain's name:
`{id, name, arguments, error}`). Streamed, text outside blocks comes as content deltas (a
partial "<tool_call>" is held back, so no block text leaks as content) and each valid call
as one `tool_calls` delta, whole, when its block closes; the invalid calls ride on the last
chunk's delta. The finish reason is "tool_calls" when a reply that ended by itself made a
valid call.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from labkit.protocols.tool_use import (CallSplitter, InvalidToolCall, ToolCall, ToolChoice, ToolResult,
                                       ToolSpec, ToolUseError, Turn, check_choice, check_tools,
                                       forcing_format, gather, render_turns)
from labkit.serve.errors import APIError, invalid
from labkit.serve.protocol import ChatCompletionRequest, ChatTurn
from labkit.serve.tool_requests import invalid_entry
from labkit.structured.contract import InvalidFormat, ResponseFormat, check_strict

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of tool calling: the tools, the choice, the grammar that forces it."""

    specs: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    forcing: ResponseFormat | None = None

    @property
    def reads_calls(self) -> bool:
        return self.choice.mode != "none" and bool(self.specs)


def refusal(error: ToolUseError, code: str = "invalid_value") -> APIError:
    return invalid(str(error), error.where or None, code)


def choice_of(fields: ChatCompletionRequest) -> ToolChoice:
    parallel = True if fields.parallel_tool_calls is None else fields.parallel_tool_calls
    sent = fields.tool_choice
    if sent is None:
        return ToolChoice("auto" if fields.tools else "none", parallel=parallel)
    if isinstance(sent, str):
        if sent != "none" and not fields.tools:
            raise invalid(f"tool_choice {sent!r} is only allowed when tools are given", "tool_choice")
        return ToolChoice(sent, parallel=parallel)
    if not fields.tools:
        raise invalid("a named tool_choice is only allowed when tools are given", "tool_choice")
    return ToolChoice("named", sent.function.name, parallel)


async def tool_plan(fields: ChatCompletionRequest, tokenizer, vocab_size: int | None) -> ToolPlan:
    """The request's tools checked (names, schemas: jsonschema's metaschema and the grammar
    engine, strict ones OpenAI's strict rules), its choice, and the forcing grammar compiled."""
    choice = choice_of(fields)
    specs = []
    for i, tool in enumerate(fields.tools or ()):
        function = tool.function
        parameters = NO_PARAMETERS if function.parameters is None else function.parameters
        if function.strict:
            try:
                check_strict(parameters)
            except InvalidFormat as error:
                raise invalid(f"tools[{i}].function.parameters: {error}", f"tools[{i}].function.parameters",
                              "invalid_function_parameters") from None
        specs.append(ToolSpec(function.name, function.description or "", parameters))
    if not specs:
        return ToolPlan((), choice)
    from labkit.structured.llg import backend_for  # llguidance loads with the first schema

    def checked() -> tuple[tuple[ToolSpec, ...], ResponseFormat | None]:
        backend = backend_for(tokenizer, vocab_size)
        checked_specs = check_tools(specs, backend.compile)
        check_choice(checked_specs, choice)
        forcing = forcing_format(checked_specs, choice)
        if forcing is not None:
            backend.compile(forcing)
        return checked_specs, forcing

    try:
        checked_specs, forcing = await asyncio.to_thread(checked)  # compiling is CPU work
    except ToolUseError as error:
        where = (error.where or "").replace(".parameters", ".function.parameters").replace(
            ".name", ".function.name")
        code = "invalid_function_parameters" if ".parameters" in where else "invalid_value"
        raise invalid(str(error).replace(error.where, where, 1), where or None, code) from None
    except InvalidFormat as error:
        raise invalid(f"the tools cannot be forced together: {error}", "tools") from None
    if forcing is not None and fields.response_format is not None and fields.response_format.type != "text":
        raise invalid(f"tool_choice {choice.mode!r} forces the reply's format, so response_format cannot "
                      "also be given", "response_format")
    if forcing is not None and fields.ignore_eos:
        raise invalid("ignore_eos cannot be combined with a forced tool_choice: the grammar ends the reply",
                      "ignore_eos")
    return ToolPlan(checked_specs, choice, forcing)


def arguments_of(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise invalid(f"{where}: the arguments are not JSON ({error})", where) from None
    if not isinstance(value, dict):
        raise invalid(f"{where}: the arguments must be a JSON object", where)
    return value


def conversation_of(messages: list[ChatTurn]) -> list[Turn | ToolResult]:
    """The chat messages as the core's turns (developer is system)."""
    out: list[Turn | ToolResult] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m.role == "tool":
            out.append(ToolResult(m.tool_call_id, names.get(m.tool_call_id, ""), m.text))
            continue
        calls = []
        for j, call in enumerate(m.tool_calls or ()):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            calls.append(ToolCall(call.id, call.function.name, arguments_of(call.function.arguments, where)))
            names[call.id] = call.function.name
        out.append(Turn("system" if m.role == "developer" else m.role, m.text, tuple(calls)))
    return out


def chat_messages(messages: list[ChatTurn], plan: ToolPlan) -> list[dict[str, str]]:
    """The template's messages: the tools described in the system turn (unless choice none),
    past calls as the blocks the model writes, results as wrapped data (labkit.protocols.tool_use)."""
    try:
        return render_turns(conversation_of(messages), plan.specs, plan.choice)
    except ToolUseError as error:
        raise refusal(error) from None


def call_entry(call: ToolCall, index: int | None = None) -> dict:
    function = {"name": call.name, "arguments": call.arguments_json}
    entry = {"id": call.id, "type": "function", "function": function}
    return entry if index is None else {"index": index} | entry


def finish_reason(reason: str | None, calls: int) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


class ChatToolReplies:
    """Reads each choice's text for calls (`labkit.serve.calls.Call.replies`)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.splitters: dict[int, CallSplitter] = {}
        self.counts: dict[int, int] = {}
        self.invalid: dict[int, list[InvalidToolCall]] = {}

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The whole answer's message and finish reason for one choice's text."""
        if not self.plan.reads_calls:
            return {"role": "assistant", "content": text, "refusal": None}, reason
        splitter = CallSplitter(self.plan.specs, self.plan.choice.parallel)
        reading = gather(splitter.feed(text) + splitter.finish())
        message = {"role": "assistant", "content": reading.content if reading.content or not reading.calls
                   else None, "refusal": None}
        if reading.calls:
            message["tool_calls"] = [call_entry(c) for c in reading.calls]
        if reading.invalid:
            message["invalid_tool_calls"] = [invalid_entry(b) for b in reading.invalid]
        return message, finish_reason(reason, len(reading.calls))

    def deltas(self, index: int, text: str, finished: bool) -> list[dict]:
        """The deltas a streamed choice's new text gives (content, then a call as it closes);
        at the end, what was held back, and the invalid calls on an empty delta of their own."""
        if not self.plan.reads_calls:
            return [{"content": text}] if text else []
        splitter = self.splitters.setdefault(index, CallSplitter(self.plan.specs, self.plan.choice.parallel))
        pieces = splitter.feed(text) + (splitter.finish() if finished else [])
        out: list[dict] = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append({"content": piece})
            elif isinstance(piece, ToolCall):
                out.append({"tool_calls": [call_entry(piece, self.counts.get(index, 0))]})
                self.counts[index] = self.counts.get(index, 0) + 1
            else:
                self.invalid.setdefault(index, []).append(piece)
        if finished and self.invalid.get(index):
            out.append({"invalid_tool_calls": [invalid_entry(b) for b in self.invalid[index]]})
        return out

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        return finish_reason(reason, self.counts.get(index, 0)) if self.plan.reads_calls else reason
