"""The Responses API's answers: the `response` object and its stream of `response.*` events.

A whole answer is one `response` object (`id` "resp_...", `status` `completed`, or
`incomplete` with `incomplete_details.reason` `max_output_tokens` when the output stopped at
its limit) whose `output` is one assistant `message` item with one `output_text` part. A
stream is OpenAI's event sequence, each event with its `sequence_number` (0, 1, 2, ...) and
sent as `event: <type>` plus `data: <json>`:

    response.created, response.in_progress,
    response.output_item.added, response.content_part.added,
    response.output_text.delta ...,
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed | response.incomplete

A failure after the stream began sends `error` (labkit's code and message) and then
`response.failed`, whose `response.error` has OpenAI's code `server_error`. There is no
`[DONE]` line: OpenAI's Responses streams end with their last event.

labkit's extension, `invalid_function_calls`: a reply read for function calls
(labkit.serve.responses_tools) whose blocks are not valid calls lists each, `{"id", "name",
"arguments", "error"}` (chat's `invalid_tool_calls` entry), as a top-level field of the
response object (streamed: of the last event's `response`); absent when there are none.
OpenAI's schema for the response object allows other fields, and the official client keeps it
(`response.model_extra["invalid_function_calls"]`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from labkit.engine.llm_engine import RequestOutput, TokenEvent
from labkit.serve.errors import APIError
from labkit.serve.responses_protocol import ResponsesRequest


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Echo:
    """What a `response` object repeats of its request (or the defaults that applied)."""

    model: str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    tool_choice: str | dict = "auto"
    text_format: dict = field(default_factory=lambda: {"type": "text"})
    tools: list[dict] = field(default_factory=list)
    parallel_tool_calls: bool = True

    @classmethod
    def of(cls, fields: ResponsesRequest, model: str) -> "Echo":
        choice = fields.tool_choice
        tools = [{"type": "function", "name": t.name, "description": t.description,
                  "parameters": t.parameters, "strict": t.strict} for t in fields.tools or ()]
        return cls(model, fields.instructions, fields.max_output_tokens,
                   1.0 if fields.temperature is None else fields.temperature,
                   1.0 if fields.top_p is None else fields.top_p, dict(fields.metadata or {}), fields.user,
                   "auto" if choice is None else choice if isinstance(choice, str) else choice.model_dump(),
                   text_format_echo(fields), tools, fields.parallel_tool_calls is not False)


def text_format_echo(fields: ResponsesRequest) -> dict:
    """`text.format` as OpenAI's answer repeats it: the format sent, `strict` as it applied
    (false unless sent true); `description` only if sent (OpenAI's schema has no null for it)."""
    sent = fields.text.format if fields.text is not None else None
    if sent is None:
        return {"type": "text"}
    echo = sent.model_dump(by_alias=True, exclude_none=True)
    if sent.type == "json_schema":
        echo["strict"] = bool(sent.strict)
    return echo


def usage_of(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """`cached_tokens`: prompt tokens the prefix cache supplied. labkit charges nothing for
    writing the cache, so `cache_write_tokens` is 0; it runs no reasoning, so neither are
    `reasoning_tokens`."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) of an output that ended with the engine's finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    """The assistant's message; `text` None: not begun (no content part yet)."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [output_text(text)]}


def response_body(response_id: str, created_at: int, echo: Echo, status: str, output: list[dict],
                  usage: dict | None = None, incomplete_reason: str | None = None,
                  error: dict | None = None, invalid_calls: Sequence[dict] = ()) -> dict:
    """The response object; `invalid_calls` the reply's invalid function calls (labkit's
    `invalid_function_calls`, absent when there are none: labkit.serve.responses_tools)."""
    done = status in ("completed", "incomplete", "failed")
    body = {"id": response_id, "object": "response", "created_at": created_at, "status": status,
            "completed_at": int(time.time()) if done else None, "background": False, "error": error,
            "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
            "instructions": echo.instructions, "max_output_tokens": echo.max_output_tokens,
            "max_tool_calls": None, "model": echo.model, "output": output,
            "parallel_tool_calls": echo.parallel_tool_calls,
            "previous_response_id": None, "reasoning": None, "service_tier": "default", "store": False,
            "temperature": echo.temperature, "text": {"format": echo.text_format},
            "tool_choice": echo.tool_choice, "tools": echo.tools, "top_logprobs": 0, "top_p": echo.top_p,
            "truncation": "disabled", "metadata": echo.metadata}
    # OpenAI's schema has no null for these: absent until known (usage), or not given (user)
    if usage is not None:
        body["usage"] = usage
    if echo.user is not None:
        body["user"] = echo.user
    if invalid_calls:
        body["invalid_function_calls"] = list(invalid_calls)
    return body


@dataclass
class EventSequence:
    """The events of one streamed response, numbered as they are built."""

    response_id: str
    created_at: int
    echo: Echo
    item_id: str = field(default_factory=new_message_id)
    sequence_number: int = 0

    def event(self, kind: str, **fields) -> dict:
        built = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return built

    def response(self, status: str, output: list[dict], **kwargs) -> dict:
        return response_body(self.response_id, self.created_at, self.echo, status, output, **kwargs)

    def opening(self) -> list[dict]:
        """created, in_progress, the message item and its (empty) text part."""
        return [self.event("response.created", response=self.response("in_progress", [])),
                self.event("response.in_progress", response=self.response("in_progress", [])),
                self.event("response.output_item.added", output_index=0,
                           item=message_item(self.item_id, None, "in_progress")),
                self.event("response.content_part.added", item_id=self.item_id, output_index=0,
                           content_index=0, part=output_text(""))]

    def text_delta(self, delta: str) -> dict:
        return self.event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                          delta=delta, logprobs=[])

    def closing(self, text: str, finish_reason: str | None, usage: dict) -> list[dict]:
        """The text's, the part's and the item's ends, then completed or incomplete."""
        status, reason = status_of(finish_reason)
        item = message_item(self.item_id, text, status)
        final = "response.completed" if status == "completed" else "response.incomplete"
        return [self.event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=self.item_id, output_index=0,
                           content_index=0, part=output_text(text)),
                self.event("response.output_item.done", output_index=0, item=item),
                self.event(final, response=self.response(status, [item], usage=usage,
                                                         incomplete_reason=reason))]

    def failure(self, code: str, message: str, text: str) -> list[dict]:
        """`error` with labkit's code, then `response.failed` holding the text sent so far."""
        item = message_item(self.item_id, text, "incomplete")
        return [self.event("error", code=code, message=message, param=None),
                self.event("response.failed", response=self.response(
                    "failed", [item], error={"code": "server_error", "message": message}))]


def sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def usage_of_output(output: RequestOutput) -> dict:
    return usage_of(len(output.prompt_token_ids), sum(len(s.token_ids) for s in output.samples),
                    output.cached_prompt_tokens)


def whole_response(response_id: str, created_at: int, echo: Echo, output: RequestOutput,
                   items: list[dict] | None = None, invalid_calls: Sequence[dict] = ()) -> dict:
    """The answer to a request without `stream`: its one sample as the assistant's message, or
    the output `items` and invalid calls read from it (labkit.serve.responses_tools)."""
    sample = output.samples[0]
    status, reason = status_of(sample.finish_reason)
    items = [message_item(new_message_id(), sample.text, status)] if items is None else items
    return response_body(response_id, created_at, echo, status, items, usage_of_output(output), reason,
                         invalid_calls=invalid_calls)


@dataclass
class ResponsesStreamWriter:
    """The frames of a streamed response (`labkit.serve.calls.StreamWriter`): each token's
    final text becomes one `response.output_text.delta`."""

    sequence: EventSequence
    sent: list[str] = field(default_factory=list)

    def opening(self) -> list[str]:
        return [sse_event(e) for e in self.sequence.opening()]

    def event(self, index: int, event: TokenEvent) -> list[str]:
        if not event.text:
            return []
        self.sent.append(event.text)
        return [sse_event(self.sequence.text_delta(event.text))]

    def closing(self, outputs: list[RequestOutput]) -> list[str]:
        sample = outputs[0].samples[0]
        return [sse_event(e) for e in self.sequence.closing(sample.text, sample.finish_reason,
                                                             usage_of_output(outputs[0]))]

    def failure(self, error: APIError) -> list[str]:
        return [sse_event(e) for e in self.sequence.failure(error.code, error.message, "".join(self.sent))]

    def ending(self) -> list[str]:
        return []  # no [DONE]: a Responses stream ends with its last event
