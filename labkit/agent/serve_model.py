"""`ServeModel`: the agent loop's model side, a running `labkit serve` asked over loopback with
the official `openai` client, through the chat route's own tool calling.

The tools go as `tools=` (OpenAI function tools) and the calls come back as
`message.tool_calls`; blocks the server could not read as valid calls come back in
`message.invalid_tool_calls` (labkit's extension) and become `Problem`s the loop answers. The
server renders the conversation (labkit.protocols.tool_use): the tools in the system turn,
each past call as the block the model wrote, each result as wrapped data in a user turn. A
tool turn answering a call the server never returned as valid (a Problem's) has no call to
answer on the wire, so it goes as a user turn wrapped the same way.

Each request's prompt starts with the last one's: the assistant turn re-rendered from its
calls is the text a forced reply was, and a reply that wrote its blocks in the compact form
(", " and ": ") is re-rendered byte for byte too, so the prefix cache serves it
(`ModelTurn.cached_tokens`). The trace id goes with every request: as X-Request-Id (the
server's access log) and in `metadata` (with the round). With `cache_salt` every request goes
in that prefix-cache scope (a fresh salt per run: a resume finds only its own run's prefix;
chapter 34 measures a resume without the cache this way). Each turn keeps the server's
`Server-Timing` stages (milliseconds: `prefill`, `decode`, ...), so a trace shows where a
round's time went on the server.
"""

from __future__ import annotations

import json
import re

from labkit.agent.runtime import ModelTurn
from labkit.agent.tool_calls import ParsedReply, Problem, ToolCall
from labkit.protocols.tool_use import ToolResult, result_text


SERVER_TIMING = re.compile(r"([A-Za-z][\w-]*);dur=([0-9.]+)")


def server_timing(header: str | None) -> dict[str, float]:
    """`Server-Timing: read;dur=0.1, prefill;dur=52.3, ...` -> {"read": 0.1, "prefill": 52.3, ...}"""
    return {name: float(ms) for name, ms in SERVER_TIMING.findall(header or "")}


def wire_messages(messages: list[dict]) -> list[dict]:
    """The conversation as the chat route takes it (see the module's docstring)."""
    wire: list[dict] = []
    answered: set[str] = set()
    for message in messages:
        role = message["role"]
        if role == "assistant":
            calls = message.get("tool_calls") or []
            answered.update(call["id"] for call in calls)
            wire.append({"role": "assistant", "content": message.get("content") or None, "tool_calls": calls}
                        if calls else {"role": "assistant", "content": message.get("content") or ""})
        elif role == "tool" and message["tool_call_id"] in answered:
            wire.append({"role": "tool", "tool_call_id": message["tool_call_id"],
                         "content": message["content"]})
        elif role == "tool":
            result = ToolResult(message["tool_call_id"], message.get("name", ""), message["content"])
            wire.append({"role": "user", "content": result_text(result)})
        else:
            wire.append({"role": role, "content": message["content"]})
    return wire


class ServeModel:
    def __init__(self, base_url: str, model: str, api_key: str = "none", max_tokens: int = 128,
                 temperature: float = 0.0, timeout: float = 120.0, tool_choice: str | dict = "auto",
                 cache_salt: str | None = None):
        from openai import OpenAI  # the official client; in labkit's `test` extra

        self.client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, timeout=timeout,
                             max_retries=0)
        self.model, self.max_tokens, self.temperature = model, max_tokens, temperature
        self.tool_choice, self.cache_salt = tool_choice, cache_salt

    def generate(self, messages: list[dict], tools: list[dict], trace_id: str, round: int) -> ModelTurn:
        tooling = {"tools": tools, "tool_choice": self.tool_choice} if tools else {}
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.model, messages=wire_messages(messages), max_tokens=self.max_tokens,
            temperature=self.temperature, metadata={"trace_id": trace_id, "round": str(round)},
            extra_headers={"X-Request-Id": trace_id},
            extra_body={"cache_salt": self.cache_salt} if self.cache_salt else None, **tooling)
        answer = raw.parse()
        choice, usage = answer.choices[0], answer.usage
        details = usage.prompt_tokens_details
        message = choice.message
        calls = [ToolCall(c.id, c.function.name, json.loads(c.function.arguments))
                 for c in message.tool_calls or ()]
        invalid = (message.model_extra or {}).get("invalid_tool_calls") or []
        problems = [Problem(bad["id"], bad.get("arguments") or "", bad["error"]) for bad in invalid]
        reply = message.content or ""
        return ModelTurn(reply, ParsedReply(reply, calls, problems), prompt_tokens=usage.prompt_tokens,
                         cached_tokens=(details.cached_tokens or 0) if details else 0,
                         completion_tokens=usage.completion_tokens, finish_reason=choice.finish_reason,
                         response_id=answer.id, server_ms=server_timing(raw.headers.get("server-timing")))
