"""OpenAI's Responses API over the shared request path: `POST /v1/responses`.

The request is parsed by `labkit.serve.responses_protocol` (a stateless server's subset), its
`instructions` and input items become the chat route's conversation and go through the
model's chat template exactly as a chat request's messages do, so a greedy answer here is the
chat route's for the same conversation. `text.format` (`json_object`, `json_schema`) is
compiled and applied as chat's `response_format` is (`labkit.serve.structured_formats`), and
echoed in the answer. The answer is a `response` object, or with `stream` the `response.*`
events (`labkit.serve.responses_wire`); errors are OpenAI's one shape.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from labkit.sampling import SamplingParams
from labkit.serve import prompt_ids
from labkit.serve.errors import invalid
from labkit.serve.request_path import EngineWork, RequestPath
from labkit.serve.responses_protocol import ResponsesRequest, TextFormatJsonSchema, messages_of, parse_request
from labkit.serve.responses_wire import (Echo, EventSequence, ResponsesStreamWriter, new_response_id,
                                         whole_response)
from labkit.serve.responses_tools import ToolStreamWriter, output_items, tool_messages, tool_use_of
from labkit.serve.settings import tenant_of
from labkit.serve.structured_formats import checked_format
from labkit.structured.contract import ResponseFormat

RESPONSES_PATH = "/v1/responses"


def sampling_of(fields: ResponsesRequest, max_tokens: int,
                fmt: ResponseFormat | None = None) -> SamplingParams:
    """The request's sampling as the engine's parameters (unset fields: OpenAI's defaults)."""
    return SamplingParams(temperature=1.0 if fields.temperature is None else fields.temperature,
                          top_p=1.0 if fields.top_p is None else fields.top_p, top_k=fields.top_k or 0,
                          min_p=fields.min_p or 0.0, max_tokens=max_tokens, seed=fields.seed,
                          response_format=fmt)


async def text_format(fields: ResponsesRequest, path: RequestPath) -> ResponseFormat | None:
    """`text.format` compiled before any work (`checked_format`); None for plain text."""
    sent = fields.text.format if fields.text is not None else None
    if sent is None or sent.type == "text":
        return None
    if isinstance(sent, TextFormatJsonSchema):
        return await checked_format(
            lambda: ResponseFormat.json_schema(sent.schema_, strict=bool(sent.strict), name=sent.name),
            path.tokenizer, path.vocab_size, "text.format.schema", "text.format")
    return await checked_format(ResponseFormat.json_object, path.tokenizer, path.vocab_size, "text.format",
                                "text.format")


def responses_router(path: RequestPath) -> APIRouter:
    router = APIRouter()

    @router.post(RESPONSES_PATH)
    async def create_response(request: Request):
        arrival = time.perf_counter()
        marks = {"arrival": arrival}
        with path.refusals_counted("responses"):
            key, parsed = await path.receive(request, parse_request, marks,
                                             model_of=lambda parsed: parsed.fields.model)
            fields = parsed.fields
            tool_use = await tool_use_of(parsed, path.tokenizer, path.vocab_size)
            messages = messages_of(parsed) if tool_use is None else tool_messages(parsed, tool_use)
            try:
                ids = await prompt_ids.chat_ids(messages, path.tokenizer, path.vocab_size)
            except ValueError as error:
                raise invalid(str(error), "input") from None
            marks["tokenized"] = time.perf_counter()
            limit = fields.max_output_tokens
            max_model_len = path.max_model_len()  # the rest of the context is not known before
            max_tokens = limit if limit is not None else max(1, max_model_len - len(ids))
            path.check_size(ids, max_tokens, "max_output_tokens" if limit is not None else "input", 1)
            fmt = await text_format(fields, path)
            if tool_use is not None and tool_use.forced is not None:
                if fmt is not None:
                    raise invalid("text.format cannot be combined with a tool_choice that forces a call "
                                  "(required or a function): the call's grammar is the output's",
                                  "text.format")
                fmt = tool_use.forced
            params = sampling_of(fields, max_tokens, fmt)
            work = EngineWork("responses", new_response_id(), [ids], params, marks, 1, fields.cache_salt,
                              path.deadline(request, fields.deadline_ms, arrival), tenant_of(key))
            streams = path.start(work)
        call = path.call(work, streams, user=fields.user, metadata=fields.metadata)
        echo = Echo.of(fields, path.settings.model_name)
        reads_calls = tool_use is not None and tool_use.reads_calls
        if fields.stream:
            sequence = EventSequence(work.response_id, call.created, echo)
            writer = ToolStreamWriter(sequence, tool_use) if reads_calls else ResponsesStreamWriter(sequence)
            return call.stream_as(request, writer)

        def render(outputs) -> dict:
            if not reads_calls:
                return whole_response(work.response_id, call.created, echo, outputs[0])
            sample = outputs[0].samples[0]
            read = output_items(sample.text, sample.finish_reason, tool_use)
            return whole_response(work.response_id, call.created, echo, outputs[0], read.items, read.invalid)

        return await call.answer(request, render=render)

    return router
