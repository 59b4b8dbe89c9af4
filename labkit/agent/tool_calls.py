"""Tool calls in a model's reply, as small models are taught to write them (Hermes / Qwen):

    Let me compute that.
    <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>

`parse_reply` returns the text around the calls, each well-formed call, and a `Problem` for
each block that is not one (bad JSON, no name, arguments not an object, an unclosed tag),
so that the runtime can tell the model instead of passing a broken call on as valid.
Only a model's own reply is parsed: never a tool's output (that is data).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict

    def openai(self) -> dict:
        """The call as an OpenAI assistant message's `tool_calls` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclass(frozen=True)
class Problem:
    id: str
    text: str      # the block as the model wrote it
    reason: str


@dataclass
class ParsedReply:
    text: str                                   # the reply less its tool-call blocks
    calls: list[ToolCall] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def parse_reply(reply: str, id_prefix: str = "call") -> ParsedReply:
    parsed = ParsedReply(BLOCK.sub("", reply).strip())
    for index, match in enumerate(BLOCK.finditer(reply)):
        call_id, body = f"{id_prefix}_{index}", match.group(1).strip()
        if not match.group(2):
            parsed.problems.append(Problem(call_id, match.group(0), f"{OPEN} without {CLOSE}"))
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            parsed.problems.append(Problem(call_id, body, f"the call is not JSON: {e}"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            parsed.problems.append(Problem(call_id, body, 'a call is {"name": ..., "arguments": {...}}'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                parsed.problems.append(Problem(call_id, body, f"arguments are not JSON: {e}"))
                continue
        if not isinstance(arguments, dict):
            parsed.problems.append(Problem(call_id, body, "arguments must be a JSON object"))
            continue
        parsed.calls.append(ToolCall(call_id, call["name"], arguments))
    return parsed
