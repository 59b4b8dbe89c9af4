"""Anthropic's Messages API on the wire: its answers, its stream's events and its errors.

An answer is `{"id": "msg_...", "type": "message", "role": "assistant", "content": [{"type":
"text", "text": ...}], "model", "stop_reason", "stop_sequence", "usage"}`. `stop_reason` is
`end_turn` (the model ended its turn), `max_tokens`, or `stop_sequence` with the one that
matched in `stop_sequence`. `usage` splits the prompt three ways, which add up to its length:
`cache_read_input_tokens` came from the engine's prefix cache (what OpenAI's routes report as
`cached_tokens`), `cache_creation_input_tokens` are the other tokens up to the last
`cache_control` breakpoint (written to the cache now), `input_tokens` the rest.

A stream is Server-Sent Events, each with an `event:` line naming it, in Anthropic's order:
message_start, content_block_start, ping, content_block_delta (text_delta)...,
content_block_stop, message_delta (stop_reason, stop_sequence, the cumulative usage),
message_stop; `ping` also keeps a silent stream open. A failure after the stream started is
one `error` event, and the stream ends. `message_start` counts the whole prompt as
`input_tokens`: the engine tells the cache's share when the request ends, so the final split
is the one in `message_delta` (Anthropic's counts there are cumulative; its clients take them).
A reply read for tool calls (labkit.serve.anthropic_tools) streams its blocks through the same
function (`message_events` with its `BlockFrames`): one writer of the stream's frame order,
closing frames and error handling for both.

labkit's extension, `invalid_tool_uses`: a reply read for tool calls whose blocks are not
valid calls lists each, `{"id", "name", "arguments", "error"}` (chat's `invalid_tool_calls`
entry, labkit.serve.tool_requests), as a top-level field of the message and, streamed, in
`message_delta`'s `delta` beside `stop_reason`; absent when there are none. The official
client keeps it: `message.model_extra["invalid_tool_uses"]`, `event.delta.model_extra[...]`.

Errors are Anthropic's documented shape, `{"type": "error", "error": {"type", "message"}}`,
with its status mapping (https://docs.claude.com/en/api/errors): 400 invalid_request_error
(also for the other 4xx it does not list: 405, 415), 401 authentication_error,
403 permission_error, 404 not_found_error, 413 request_too_large, 429 rate_limit_error,
500 api_error, 529 overloaded_error. labkit's 503s that mean "too busy now, retry"
(a full queue, an unreachable deadline, an engine that is starting or restarting, a server
that drains) are sent as 529 overloaded_error; any other 503 (an engine failure) as
500 api_error. Retry-After stays on both.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from labkit.engine.llm_engine import RequestOutput, SampleOutput
from labkit.serve.calls import Call, failure_error, outcome_of
from labkit.serve.engine_client import EngineFailure
from labkit.serve.errors import APIError

ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 529: "overloaded_error"}
OVERLOADED_CODES = frozenset({"queue_full", "deadline_unreachable", "engine_unavailable", "server_draining"})


class AnthropicErrors:
    """labkit's `APIError` in Anthropic's shape (an `ErrorShape`, labkit.serve.errors)."""

    def status(self, error: APIError) -> int:
        if error.status == 503:
            return 529 if error.code in OVERLOADED_CODES else 500
        return error.status if error.status in ANTHROPIC_ERROR_TYPES else 400

    def body(self, error: APIError) -> dict:
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES[self.status(error)],
                                           "message": error.message}}


ANTHROPIC_ERRORS = AnthropicErrors()


# -- answers -------------------------------------------------------------------------------

def stop_reason(sample: SampleOutput, stops: Sequence[str], decode) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for an engine sample. The engine says "stop"
    for an end-of-turn token and for a stop string alike; the stop string is the one that
    starts where the sample's text was cut, in the text of all its tokens."""
    if sample.finish_reason == "length":
        return "max_tokens", None
    if sample.finish_reason == "stop" and stops:
        text, cut = decode(sample.token_ids), len(sample.text)
        found = [(at, -len(s), s) for s in stops if (at := text.find(s, max(0, cut - len(s) + 1))) >= 0]
        if found:
            return "stop_sequence", min(found)[2]
    return "end_turn", None


def usage(output: RequestOutput | None, prompt_tokens: int, breakpoint_tokens: int) -> dict:
    """The prompt split three ways (see the module's docstring), and the output tokens."""
    cached = output.cached_prompt_tokens if output is not None else 0
    created = max(0, breakpoint_tokens - cached)
    generated = sum(len(s.token_ids) for s in output.samples) if output is not None else 0
    return {"input_tokens": prompt_tokens - cached - created, "output_tokens": generated,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": cached}


def final_stop(sample: SampleOutput, stops: Sequence[str], decode, called: bool) -> tuple[str, str | None]:
    """`stop_reason` as the answer says it: `tool_use` for a reply with a valid tool call that
    ended by itself (one cut by max_tokens or a stop sequence says so instead)."""
    reason, sequence = stop_reason(sample, stops, decode)
    return ("tool_use" if called and reason == "end_turn" else reason), sequence


def message_body(message_id: str, model: str, output: RequestOutput, stops: Sequence[str], decode,
                 breakpoint_tokens: int, content: list[dict] | None = None, called: bool = False,
                 invalid: Sequence[dict] = ()) -> dict:
    """The whole message; `content` the blocks read from the reply (default: its text as one
    text block), `called` whether they hold a valid tool call (`final_stop`), `invalid` the
    reply's invalid calls (labkit's `invalid_tool_uses`, absent when there are none)."""
    sample = output.samples[0]
    reason, sequence = final_stop(sample, stops, decode, called)
    body = {"id": message_id, "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": sample.text}] if content is None else content,
            "model": model,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(output, len(output.prompt_token_ids), breakpoint_tokens)}
    if invalid:
        body["invalid_tool_uses"] = list(invalid)
    return body


# -- streams -------------------------------------------------------------------------------

def frame(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


PING = frame("ping", {"type": "ping"})


class ContentFrames(Protocol):
    """The content blocks' frames of a streamed reply, made from its text as it comes:
    `opening` before the first ping, `add` for each new text, `closing` at the end; then
    whether the blocks hold a valid tool call (`called`) and the invalid calls' entries."""

    called: bool
    invalid: Sequence[dict]

    def opening(self) -> list[str]: ...

    def add(self, text: str) -> list[str]: ...

    def closing(self) -> list[str]: ...


class TextFrames:
    """A reply not read for tool calls: one text block, opened before the first ping."""

    called = False
    invalid: Sequence[dict] = ()

    def opening(self) -> list[str]:
        return [frame("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}})]

    def add(self, text: str) -> list[str]:
        return [frame("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": text}})]

    def closing(self) -> list[str]:
        return [frame("content_block_stop", {"type": "content_block_stop", "index": 0})]


async def message_events(call: Call, prompt_tokens: int, stops: Sequence[str], decode,
                         breakpoint_tokens: int, blocks: ContentFrames | None = None):
    """The stream of one message (one engine request, one sample), in Anthropic's events;
    `blocks` makes the content's frames (default `TextFrames`; a reply read for tool calls:
    labkit.serve.anthropic_tools.BlockFrames). `message_delta`'s delta carries the invalid
    calls, if any, as `invalid_tool_uses`, beside `stop_reason` (as the whole message has them)."""
    blocks = TextFrames() if blocks is None else blocks
    outcome, failure = "cancelled", None
    try:
        start = {"id": call.response_id, "type": "message", "role": "assistant", "content": [],
                 "model": call.model, "stop_reason": None, "stop_sequence": None,
                 "usage": usage(None, prompt_tokens, 0)}
        yield frame("message_start", {"type": "message_start", "message": start})
        for text in blocks.opening():
            yield text
        yield PING
        async for item in call.events(call.keepalive_s):
            if item is None:
                yield PING
            elif item[1].text:
                for text in blocks.add(item[1].text):
                    yield text
        for text in blocks.closing():
            yield text
        output = call.streams[0].output
        reason, sequence = final_stop(output.samples[0], stops, decode, blocks.called)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        if blocks.invalid:
            delta["invalid_tool_uses"] = list(blocks.invalid)
        yield frame("message_delta", {"type": "message_delta", "delta": delta,
                                      "usage": usage(output, prompt_tokens, breakpoint_tokens)})
        yield frame("message_stop", {"type": "message_stop"})
        outcome = "ok"
    except (EngineFailure, ValueError) as error:
        outcome, failure = outcome_of(error), error
        yield frame("error", ANTHROPIC_ERRORS.body(failure_error(error)))
    finally:
        call.abort_all()
        call.finish(outcome, failure)
