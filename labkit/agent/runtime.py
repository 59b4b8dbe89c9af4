"""The agent loop: the model answers, its tool calls run, their results go back as tool turns,
and the model resumes; one trace id through every step.

    trace = run_agent(model, registry, [{"role": "user", "content": "What is 17 * 23?"}],
                      max_rounds=4)
    trace.answer, trace.steps   # every model call and tool run, with the trace id and timings

`ModelSide` is all the loop asks of a model. `ScriptedModel` plays back replies (tests);
`ServeModel` (labkit.agent.serve_model) asks a running `labkit serve` over loopback with the
official `openai` client. The conversation only grows at its end (the assistant's reply as
it was generated, then the tool turns), so each request's prompt starts with the last one's:
the server's prefix cache computes only the new tail (`ModelTurn.cached_tokens`).

The loop acts only on the model's own reply. A tool's output becomes a tool turn's content
and nothing else: a `<tool_call>` or a role marker inside it is not read, run or obeyed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from labkit.agent.sandbox import ErrorKind, ToolResult
from labkit.agent.tool_calls import ParsedReply, parse_reply
from labkit.agent.tools import ToolRegistry, tool_message


@dataclass
class ModelTurn:
    reply: str                      # the assistant's text as generated, tool-call blocks included
    parsed: ParsedReply
    prompt_tokens: int = 0
    cached_tokens: int = 0          # of the prompt, served from the prefix cache
    completion_tokens: int = 0
    finish_reason: str = ""
    response_id: str = ""
    server_ms: dict[str, float] = field(default_factory=dict)  # the server's stages (Server-Timing)


class ModelSide(Protocol):
    def generate(self, messages: list[dict], tools: list[dict], trace_id: str, round: int) -> ModelTurn:
        """The assistant's next turn for `messages` (OpenAI chat shape, `tool` turns included),
        given the tools (OpenAI function-tool specs). Tool-call ids are made unique by `round`."""
        ...


@dataclass
class Step:
    trace_id: str
    round: int
    kind: str                       # "model" or "tool"
    name: str                       # the model side's response id, or the tool's name
    started_s: float                # from the trace's start
    elapsed_s: float
    turn: ModelTurn | None = None
    call_id: str = ""
    arguments: dict | None = None
    result: ToolResult | None = None


@dataclass
class AgentTrace:
    trace_id: str
    messages: list[dict]
    steps: list[Step] = field(default_factory=list)
    answer: str = ""
    stopped: str = ""               # "answered" (a reply without calls) or "max_rounds"

    def model_steps(self) -> list[Step]:
        return [s for s in self.steps if s.kind == "model"]

    def tool_steps(self) -> list[Step]:
        return [s for s in self.steps if s.kind == "tool"]

    def rows(self) -> list[dict]:
        """One flat record per step, for a table: where the loop's time and tokens went."""
        rows = []
        for s in self.steps:
            row = {"trace_id": s.trace_id, "round": s.round, "kind": s.kind, "name": s.name,
                   "started_s": s.started_s, "elapsed_s": s.elapsed_s}
            if s.turn is not None:
                row |= {"prompt_tokens": s.turn.prompt_tokens, "cached_tokens": s.turn.cached_tokens,
                        "completion_tokens": s.turn.completion_tokens, "calls": len(s.turn.parsed.calls),
                        "prefill_ms": s.turn.server_ms.get("prefill"),
                        "decode_ms": s.turn.server_ms.get("decode")}
            if s.result is not None:
                row |= {"ok": s.result.ok, "error": s.result.error.value if s.result.error else None}
            rows.append(row)
        return rows


def assistant_message(turn: ModelTurn) -> dict:
    message = {"role": "assistant", "content": turn.reply}
    if turn.parsed.calls:
        message["tool_calls"] = [call.openai() for call in turn.parsed.calls]
    return message


def run_agent(model: ModelSide, registry: ToolRegistry, messages: list[dict], max_rounds: int = 4,
              trace_id: str | None = None, max_calls: int = 8) -> AgentTrace:
    """At most `max_rounds` model turns; of one turn's calls the first `max_calls` run and the
    rest are refused (a reply is not a way to start any number of processes)."""
    trace = AgentTrace(trace_id or uuid.uuid4().hex, list(messages))
    start = time.perf_counter()
    for round in range(max_rounds):
        began = time.perf_counter()
        turn = model.generate(trace.messages, registry.specs(), trace.trace_id, round)
        trace.steps.append(Step(trace.trace_id, round, "model", turn.response_id, began - start,
                                time.perf_counter() - began, turn=turn))
        trace.messages.append(assistant_message(turn))
        if not turn.parsed.calls and not turn.parsed.problems:
            trace.answer, trace.stopped = turn.parsed.text, "answered"
            return trace
        for index, call in enumerate(turn.parsed.calls):
            began = time.perf_counter()
            result = (registry.call(call.name, call.arguments) if index < max_calls else
                      ToolResult.failure(ErrorKind.REFUSED, f"more than {max_calls} calls in one turn"))
            trace.steps.append(Step(trace.trace_id, round, "tool", call.name, began - start,
                                    time.perf_counter() - began, call_id=call.id, arguments=call.arguments,
                                    result=result))
            trace.messages.append(tool_message(call.id, call.name, result))
        for problem in turn.parsed.problems:  # a malformed call is answered, never run
            result = ToolResult.failure(ErrorKind.BAD_ARGUMENTS, problem.reason)
            trace.steps.append(Step(trace.trace_id, round, "tool", "", time.perf_counter() - start, 0.0,
                                    call_id=problem.id, result=result))
            trace.messages.append(tool_message(problem.id, "", result))
    trace.stopped = "max_rounds"
    return trace


class ScriptedModel:
    """Plays back replies in order; keeps the messages it was given each time (what the
    model would have read)."""

    def __init__(self, replies: list[str]):
        self.replies = list(replies)
        self.seen: list[list[dict]] = []
        self.trace_ids: list[str] = []

    def generate(self, messages: list[dict], tools: list[dict], trace_id: str, round: int) -> ModelTurn:
        self.seen.append([dict(m) for m in messages])
        self.trace_ids.append(trace_id)
        reply = self.replies[len(self.seen) - 1]
        return ModelTurn(reply, parse_reply(reply, f"call_{round}"), response_id=f"scripted-{round}")
