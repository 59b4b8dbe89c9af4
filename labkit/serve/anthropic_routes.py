"""Anthropic's Messages API over the shared request path (text, structured outputs, tools).

    POST /v1/messages               one message, whole (JSON) or streamed (Server-Sent Events)
    POST /v1/messages/count_tokens  {"input_tokens": N}: the prompt /v1/messages would run

The conversation (`system`, then `messages`) is rendered with the model's chat template and
tokenized exactly as the chat route renders it (`labkit.serve.prompt_ids`), so the same
conversation gets the same ids, and greedy decoding the same text. The request is checked,
admitted and submitted by the `RequestPath` like any other; its answer, its events and its
errors are Anthropic's (`labkit.serve.anthropic_wire`). The API key may come as `x-api-key`,
as Anthropic's clients send it.

`output_config.format` constrains the answer's text to JSON valid against its schema through
the engine's grammar mask, as `response_format` does on the chat route (the same compile, the
same 400 for a schema the grammar engine refuses). It puts nothing in the prompt, so
`count_tokens` checks it the same way and counts the same prompt with it or without it.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from labkit.protocols.templates import encode_conversation
from labkit.sampling import SamplingParams
from labkit.serve import prompt_ids
from labkit.serve.anthropic_protocol import CountTokensRequest, MessagesRequest, parse
from labkit.serve.anthropic_tools import BlockFrames, answer_content, tool_messages, tool_use_of
from labkit.serve.anthropic_wire import ANTHROPIC_ERRORS, message_body, message_events
from labkit.serve.errors import APIError, invalid
from labkit.serve.request_path import EngineWork, RequestPath
from labkit.serve.settings import tenant_of
from labkit.serve.structured_formats import checked_format
from labkit.serve.tool_requests import ToolUse
from labkit.structured.contract import ResponseFormat

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


def conversation(fields: CountTokensRequest) -> list[dict[str, str]]:
    system = fields.system_text
    return ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": m.role, "content": m.text} for m in fields.messages]


def before_last_breakpoint(fields: CountTokensRequest) -> list[dict[str, str]] | None:
    """The conversation cut after the last text block with `cache_control` (system blocks come
    first, then the messages'), or None if no block has one; all of it with a top-level one."""
    if fields.cache_control is not None:
        return conversation(fields)
    last = None
    if isinstance(fields.system, list):
        last = next((("system", j) for j in reversed(range(len(fields.system)))
                     if fields.system[j].cache_control is not None), None)
    for i, message in enumerate(fields.messages):
        if isinstance(message.content, list):
            marked = [j for j, block in enumerate(message.content)
                      if getattr(block, "cache_control", None) is not None]
            if marked:
                last = (i, marked[-1])
    if last is None:
        return None
    whole = conversation(fields)
    if last[0] == "system":
        return [{"role": "system", "content": "\n".join(b.text for b in fields.system[:last[1] + 1])}]
    i, j = last
    first = 1 if fields.system_text is not None else 0
    blocks = fields.messages[i].content[:j + 1]
    cut = {"role": fields.messages[i].role, "content": "\n".join(b.text for b in blocks)}
    return whole[:first + i] + [cut]


async def output_format(fields: CountTokensRequest, path: RequestPath) -> ResponseFormat | None:
    """`output_config.format` compiled before any work (`checked_format`); None if not given."""
    config = fields.output_config
    if config is None or config.format is None:
        return None
    schema = config.format.schema_
    return await checked_format(lambda: ResponseFormat.json_schema(schema), path.tokenizer, path.vocab_size,
                                "output_config.format.schema", "output_config.format")


def anthropic_router(path: RequestPath) -> APIRouter:
    router = APIRouter()
    tokenizer = path.tokenizer

    async def prompt_of(fields: CountTokensRequest, tool_use: ToolUse | None) -> tuple[list[int], int]:
        """The prompt's ids, and how many of them come before the last cache breakpoint (the
        common prefix of the prompt and the conversation rendered up to the breakpoint)."""
        messages = conversation(fields) if tool_use is None else tool_messages(fields, tool_use)
        try:
            ids = await prompt_ids.chat_ids(messages, tokenizer, path.vocab_size)
        except ValueError as error:
            raise invalid(str(error), "messages") from None
        cut = before_last_breakpoint(fields)
        if cut is None:
            return ids, 0
        if tool_use is not None:
            raise APIError(400, "cache_control breakpoints in a request with tools or tool blocks are not "
                                "supported by this service yet", "unsupported_parameter", "cache_control")

        prefix = await asyncio.to_thread(encode_conversation, tokenizer, cut, False)
        shared = next((k for k, (a, b) in enumerate(zip(ids, prefix)) if a != b), min(len(ids), len(prefix)))
        return ids, shared

    @router.post(MESSAGES_PATH)
    async def messages(request: Request):
        arrival = time.perf_counter()
        marks = {"arrival": arrival}
        with path.refusals_counted("messages"):
            key, fields = await path.receive(request, lambda body: parse(MessagesRequest, body), marks)
            tool_use = await tool_use_of(fields, tokenizer, path.vocab_size)
            ids, breakpoint_tokens = await prompt_of(fields, tool_use)
            marks["tokenized"] = time.perf_counter()
            path.check_size(ids, fields.max_tokens, "max_tokens", 1)
            fmt = await output_format(fields, path)
            if tool_use is not None and tool_use.forced is not None:
                if fmt is not None:
                    raise invalid("output_config.format cannot be combined with a tool_choice that forces a "
                                  "call (any, tool): the call's grammar is the output's",
                                  "output_config.format")
                fmt = tool_use.forced
            params = SamplingParams(temperature=1.0 if fields.temperature is None else fields.temperature,
                                    top_p=1.0 if fields.top_p is None else fields.top_p,
                                    top_k=fields.top_k or 0, max_tokens=fields.max_tokens,
                                    stop=tuple(fields.stop_sequences or ()), response_format=fmt)
            work = EngineWork("messages", f"msg_{uuid.uuid4().hex}", [ids], params, marks,
                              deadline=path.deadline(request, None, arrival), tenant=tenant_of(key))
            streams = path.start(work)
        user = fields.metadata.user_id if fields.metadata is not None else None
        call = path.call(work, streams, user=user)
        if fields.stream:
            call.attach(request)
            blocks = BlockFrames(tool_use) if tool_use is not None and tool_use.reads_calls else None
            events = message_events(call, len(ids), params.stop, tokenizer.decode, breakpoint_tokens, blocks)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        def render(outputs) -> dict:
            read = answer_content(outputs[0].samples[0].text, tool_use)
            return message_body(work.response_id, path.settings.model_name, outputs[0], params.stop,
                                tokenizer.decode, breakpoint_tokens, read.blocks, read.called, read.invalid)

        return await call.answer(request, shape=ANTHROPIC_ERRORS, render=render)

    @router.post(COUNT_TOKENS_PATH)
    async def count_tokens(request: Request):
        path.authenticate(request)
        fields: CountTokensRequest = parse(CountTokensRequest, await path.read_body(request))
        path.check_model(fields.model)
        ids, _ = await prompt_of(fields, await tool_use_of(fields, tokenizer, path.vocab_size))
        await output_format(fields, path)  # refused as /v1/messages would refuse it; adds no tokens
        return {"input_tokens": len(ids)}

    return router
