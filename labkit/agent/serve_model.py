"""`ServeModel`: the agent loop's model side, a running `labkit serve` asked over loopback with
the official `openai` client.

The chat route takes system, user and assistant turns, and the small models' templates have
no tool role, so the conversation goes on the wire as the Hermes / Qwen templates render it:

    system     the caller's system text, then the tools (their JSON specs in <tools>) and how
               to call one: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    assistant  the reply exactly as generated, tool-call blocks included (so the next prompt
               starts with this one's tokens and the prefix cache serves them)
    tool       a user turn: <tool_response>{"name": ..., "content": ...}</tool_response>, the
               content a JSON string with every "</" written "<\\/" (valid JSON), so a tool's
               output cannot close the wrapper early and pass text off as the user's

The trace id goes with every request: as X-Request-Id (the server's access log) and in
`metadata` (with the round). With `cache_salt` every request goes in that prefix-cache scope
(a fresh salt per run: a resume finds only its own run's prefix; chapter 34 measures a resume
without the cache this way). Each turn keeps the server's `Server-Timing` stages (milliseconds:
`prefill`, `decode`, ...), so a trace shows where a round's time went on the server.
"""

from __future__ import annotations

import json
import re

from labkit.agent.runtime import ModelTurn
from labkit.agent.tool_calls import parse_reply

TOOL_PROMPT = """You can call tools. To call one, reply with only this, on one line:
<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call>
The tools:
<tools>
{tools}
</tools>
Each result comes back as <tool_response>{{"name": ..., "content": ...}}</tool_response>. Use it to answer."""


SERVER_TIMING = re.compile(r"([A-Za-z][\w-]*);dur=([0-9.]+)")


def server_timing(header: str | None) -> dict[str, float]:
    """`Server-Timing: read;dur=0.1, prefill;dur=52.3, ...` -> {"read": 0.1, "prefill": 52.3, ...}"""
    return {name: float(ms) for name, ms in SERVER_TIMING.findall(header or "")}


def tool_response(message: dict) -> str:
    body = json.dumps({"name": message.get("name", ""), "content": message["content"]})
    return "<tool_response>" + body.replace("</", "<\\/") + "</tool_response>"


def wire_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation as the chat route takes it (see the module's docstring)."""
    wire: list[dict] = []
    system = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    if tools:
        system.append(TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools)))
    if system:
        wire.append({"role": "system", "content": "\n\n".join(system)})
    for message in messages:
        if message["role"] in ("user", "assistant"):
            wire.append({"role": message["role"], "content": message["content"]})
        elif message["role"] == "tool":
            wire.append({"role": "user", "content": tool_response(message)})
    return wire


class ServeModel:
    def __init__(self, base_url: str, model: str, api_key: str = "none", max_tokens: int = 128,
                 temperature: float = 0.0, timeout: float = 120.0, cache_salt: str | None = None):
        from openai import OpenAI  # the official client; in labkit's `test` extra

        self.client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, timeout=timeout,
                             max_retries=0)
        self.model, self.max_tokens, self.temperature = model, max_tokens, temperature
        self.cache_salt = cache_salt

    def generate(self, messages: list[dict], tools: list[dict], trace_id: str, round: int) -> ModelTurn:
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.model, messages=wire_messages(messages, tools), max_tokens=self.max_tokens,
            temperature=self.temperature, metadata={"trace_id": trace_id, "round": str(round)},
            extra_headers={"X-Request-Id": trace_id},
            extra_body={"cache_salt": self.cache_salt} if self.cache_salt else None)
        answer = raw.parse()
        choice, usage = answer.choices[0], answer.usage
        details = usage.prompt_tokens_details
        reply = choice.message.content or ""
        return ModelTurn(reply, parse_reply(reply, f"call_{round}"), prompt_tokens=usage.prompt_tokens,
                         cached_tokens=(details.cached_tokens or 0) if details else 0,
                         completion_tokens=usage.completion_tokens, finish_reason=choice.finish_reason,
                         response_id=answer.id, server_ms=server_timing(raw.headers.get("server-timing")))
