"""OpenAI's routes over the shared request path: completions, chat completions, models.

    POST /v1/completions, POST /v1/chat/completions   (JSON, or Server-Sent Events with stream)
    GET  /v1/models, /v1/models/{id}

Each route parses its body (`labkit.serve.protocol`), tokenizes the prompt, turns the fields
into one `EngineWork` and starts it through the `RequestPath`; the answer, whole or streamed,
is OpenAI's (`labkit.serve.calls`, `labkit.serve.responses`), and so is every error's shape
(`labkit.serve.errors`).
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from labkit.sampling import SamplingParams
from labkit.serve import openai_tools, prompt_ids
from labkit.serve.errors import invalid
from labkit.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, validate
from labkit.serve.request_path import EngineWork, RequestPath
from labkit.serve.settings import tenant_of
from labkit.serve.structured_formats import checked_format
from labkit.structured.contract import ResponseFormat

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


def sampling(fields: SamplingFields, max_tokens: int, logprobs: int | None,
             response_format: ResponseFormat | None = None) -> SamplingParams:
    """OpenAI's sampling fields as the engine's parameters (unset fields: OpenAI's defaults)."""
    if response_format is not None and fields.ignore_eos:
        raise invalid("ignore_eos cannot be combined with a response_format: the grammar ends the output",
                      "ignore_eos")
    return SamplingParams(
        temperature=1.0 if fields.temperature is None else fields.temperature,
        top_p=1.0 if fields.top_p is None else fields.top_p,
        top_k=fields.top_k or 0, min_p=fields.min_p or 0.0, max_tokens=max_tokens, seed=fields.seed,
        stop=fields.stop_strings, presence_penalty=fields.presence_penalty or 0.0,
        frequency_penalty=fields.frequency_penalty or 0.0, logprobs=logprobs,
        ignore_eos=bool(fields.ignore_eos), logit_bias=fields.bias_pairs, stop_token_ids=fields.stop_ids,
        response_format=response_format)


def check_engine_limits(path: RequestPath, ids: list[int], params: SamplingParams, param: str,
                        n: int) -> None:
    """The engine's limits for one prompt (`param` names the field a size refusal is about),
    with the token ids the request names for stopping and biasing."""
    path.check_size(ids, params.max_tokens, param, n, params.stop_token_ids,
                    tuple(token for token, _ in params.logit_bias))

async def response_format(fields: SamplingFields, tokenizer, vocab_size: int | None) -> ResponseFormat | None:
    """The request's response format, compiled before any work (`checked_format`); None for
    `text` or no field."""
    sent = fields.response_format
    if sent is None or sent.type == "text":
        return None
    if sent.type == "json_object":
        return await checked_format(ResponseFormat.json_object, tokenizer, vocab_size, "response_format",
                                    "response_format")
    spec = sent.json_schema
    return await checked_format(
        lambda: ResponseFormat.json_schema({} if spec.schema_ is None else spec.schema_,
                                           strict=bool(spec.strict), name=spec.name),
        tokenizer, vocab_size, "response_format.json_schema.schema", "response_format")


def openai_router(path: RequestPath) -> APIRouter:
    router = APIRouter()
    settings, client, tokenizer = path.settings, path.client, path.tokenizer

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "labkit",
                "max_model_len": client.limits.max_model_len if client.limits else None,
                "weights": client.weights}

    @router.get("/v1/models")
    async def models(request: Request):
        path.authenticate(request)
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        path.authenticate(request)
        path.check_model(name)
        return model_card()

    @router.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        marks = {"arrival": arrival}
        with path.refusals_counted("completions"):
            key, fields = await path.receive(request, lambda body: validate(CompletionRequest, body), marks)
            prompts = fields.prompt
            if isinstance(prompts, str) or isinstance(prompts[0], int):
                prompts = [prompts]
            try:
                encoded = await prompt_ids.completion_ids(prompts, tokenizer, path.vocab_size)
            except ValueError as error:
                raise invalid(str(error), "prompt") from None
            try:  # echo: each prompt's text, put before its choices' texts
                echo = await prompt_ids.prompt_texts(prompts, tokenizer) if fields.echo else None
            except ValueError as error:
                raise invalid(str(error), "echo") from None
            marks["tokenized"] = time.perf_counter()
            max_tokens = fields.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
            n = fields.n or 1
            fmt = await response_format(fields, tokenizer, path.vocab_size)
            params = sampling(fields, max_tokens, fields.logprobs, fmt)
            for ids in encoded:
                check_engine_limits(path, ids, params, "prompt", n)
            until = path.deadline(request, fields.deadline_ms, arrival)
            work = EngineWork("completions", f"cmpl-{uuid.uuid4().hex}", encoded, params, marks, n,
                              fields.cache_salt, until, tenant_of(key), numbered=True)
            streams = path.start(work)
        call = path.call(work, streams, logprobs=fields.logprobs is not None, user=fields.user)
        call.echo = echo
        if fields.stream:
            usage = bool(fields.stream_options and fields.stream_options.include_usage)
            return call.stream(request, chat=False, include_usage=usage)
        return await call.answer(request, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        marks = {"arrival": arrival}
        with path.refusals_counted("chat"):
            key, fields = await path.receive(request, lambda body: validate(ChatCompletionRequest, body),
                                             marks)
            plan = await openai_tools.tool_plan(fields, tokenizer, path.vocab_size)
            messages = openai_tools.chat_messages(fields.messages, plan)
            try:
                ids = await prompt_ids.chat_ids(messages, tokenizer, path.vocab_size)
            except ValueError as error:
                raise invalid(str(error), "messages") from None
            marks["tokenized"] = time.perf_counter()
            limit = fields.max_completion_tokens or fields.max_tokens
            max_model_len = path.max_model_len()  # the rest of the context is not known before
            max_tokens = limit if limit is not None else max(1, max_model_len - len(ids))
            n = fields.n or 1
            logprobs = (fields.top_logprobs or 0) if fields.logprobs else None
            fmt = plan.forcing or await response_format(fields, tokenizer, path.vocab_size)
            params = sampling(fields, max_tokens, logprobs, fmt)
            size_param = "max_completion_tokens" if limit is not None else "messages"
            check_engine_limits(path, ids, params, size_param, n)
            until = path.deadline(request, fields.deadline_ms, arrival)
            work = EngineWork("chat", f"chatcmpl-{uuid.uuid4().hex}", [ids], params, marks, n,
                              fields.cache_salt, until, tenant_of(key))
            streams = path.start(work)
        call = path.call(work, streams, logprobs=logprobs is not None, user=fields.user,
                         metadata=fields.metadata)
        call.replies = openai_tools.ChatToolReplies(plan) if plan.reads_calls else None
        if fields.stream:
            usage = bool(fields.stream_options and fields.stream_options.include_usage)
            return call.stream(request, chat=True, include_usage=usage)
        return await call.answer(request, chat=True)

    return router
