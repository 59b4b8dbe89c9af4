"""Tool calls in a model's reply, as small models are taught to write them (Hermes / Qwen):

    Let me compute that.
    <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>

The reading is labkit.protocols.tool_use's (the one the service uses); here it is shaped for
the agent loop: `parse_reply` returns the text around the calls, each well-formed call, and a
`Problem` for each block that is not one (bad JSON, no name, arguments not an object, an
unclosed tag), so that the runtime can tell the model instead of passing a broken call on as
valid. Names and arguments are the registry's to check (it refuses what is not on its list).
Only a model's own reply is parsed: never a tool's output (that is data).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from labkit.protocols.tool_use import read_tool_calls


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict

    def openai(self) -> dict:
        """The call as an OpenAI assistant message's `tool_calls` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


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
    """Ids are `<id_prefix>_<i>`, i counting every block, well-formed or not, in order."""
    counter = iter(range(len(reply) + 1))
    reading = read_tool_calls(reply, None, make_id=lambda: f"{id_prefix}_{next(counter)}")
    text = reading.content
    for bad in reading.invalid:
        text = text.replace(bad.text, "", 1)
    return ParsedReply(text.strip(), [ToolCall(c.id, c.name, c.arguments) for c in reading.calls],
                       [Problem(b.id, b.text, b.error) for b in reading.invalid])
