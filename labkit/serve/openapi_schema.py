"""What `/openapi.json` says about the POST routes: their bodies, answers and errors.

The routes read their bodies as raw JSON (`labkit.serve.protocol`: strict types, duplicate
keys refused, every error in one shape), so FastAPI cannot see the request models. This module
describes them instead, from the same pydantic models (`model_json_schema`), with models of the
answers that `labkit.serve.responses` builds as dicts; those models only document the answers
(what is sent is built there). The models' `$defs` go to `components/schemas`, so the document
is valid OpenAPI 3.1 and every `$ref` points inside it.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from labkit.serve.anthropic_protocol import CountTokensRequest, MessagesRequest
from labkit.serve.anthropic_routes import COUNT_TOKENS_PATH, MESSAGES_PATH
from labkit.serve.openai_fields import CHAT_NO_OPS, COMPLETION_NO_OPS
from labkit.serve.protocol import ChatCompletionRequest, CompletionRequest
from labkit.serve.responses_openapi import InvalidToolCallEntry, ResponseObject, ResponseStreamEvent
from labkit.serve.responses_protocol import RESPONSES_NO_OPS, ResponsesRequest
from labkit.serve.tokenize_routes import (DETOKENIZE_PATH, TOKENIZE_PATH, DetokenizeRequest,
                                          DetokenizeResponse, TokenizeChatRequest, TokenizeCompletionRequest,
                                          TokenizeResponse)

REF = "#/components/schemas/{model}"


# -- the answers, as sent by labkit.serve.responses ---------------------------------------

class CachedTokens(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[str]


class CompletionResponse(BaseModel):
    """A whole completion, and each chunk of a streamed one (one choice each; a last chunk
    with `usage` and no choices where `stream_options.include_usage` asked for it)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class AlternativeLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(AlternativeLogprob):
    top_logprobs: list[AlternativeLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None


class CalledFunction(BaseModel):
    name: str
    arguments: str


class ToolCallEntry(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]  # null when the reply is only tool calls
    refusal: None
    tool_calls: Optional[list[ToolCallEntry]] = None
    invalid_tool_calls: Optional[list[InvalidToolCallEntry]] = None


class ToolCallDelta(ToolCallEntry):
    index: int


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None
    invalid_tool_calls: Optional[list[InvalidToolCallEntry]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str]


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """The one error shape (`labkit.serve.errors`)."""

    error: ErrorDetail


class AnthropicText(BaseModel):
    type: Literal["text"]
    text: str


class AnthropicToolUse(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class AnthropicMessage(BaseModel):
    """A whole message of `/v1/messages` (labkit.serve.anthropic_wire)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[Union[AnthropicText, AnthropicToolUse]]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: Optional[str]
    usage: AnthropicUsage
    invalid_tool_uses: list[InvalidToolCallEntry] = None   # labkit's extension; absent when none


class InputTokens(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape, on its routes (labkit.serve.anthropic_wire)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


# -- the routes ----------------------------------------------------------------------------

ERRORS = {400: "a bad body or field, or what the engine cannot do", 401: "no key or a wrong key",
          404: "unknown model", 413: "body over --max-body-bytes", 415: "not application/json in UTF-8",
          429: "the queue is full (with Retry-After)",
          503: "the engine is (re)starting or has failed, the server is draining, or the deadline cannot be met "
               "(with Retry-After)"}

ROUTES = {"/v1/completions": (CompletionRequest, CompletionResponse, CompletionResponse, COMPLETION_NO_OPS),
          "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk, CHAT_NO_OPS),
          "/v1/responses": (ResponsesRequest, ResponseObject, ResponseStreamEvent,
                            {name: taken for name, (taken, _) in RESPONSES_NO_OPS.items()})}
STREAMS = {"/v1/responses": "Server-Sent Events, each an `event:` line naming the event's type and a `data:` "
                            "line with the event, the last `response.completed`, `response.incomplete` or "
                            "`response.failed`"}


# routes without a stream: (request models, one of which the body is; the answer's model)
PLAIN_ROUTES = {TOKENIZE_PATH: ((TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse),
                DETOKENIZE_PATH: ((DetokenizeRequest,), DetokenizeResponse)}
PLAIN_ERRORS = {400: "a bad body or field, or a token id outside the vocabulary",
                401: "no key or a wrong key",
                404: "unknown model", 413: "body over --max-body-bytes", 415: "not application/json in UTF-8",
                503: "the engine is starting: the context length and vocabulary are not known yet"}


ANTHROPIC_ERRORS = {400: "invalid_request_error: a bad body or field, a block or field not supported yet, or "
                         "what the engine cannot do", 401: "authentication_error: no key or a wrong key",
                    404: "not_found_error: unknown model",
                    413: "request_too_large: body over --max-body-bytes",
                    429: "rate_limit_error: over --max-concurrent-per-key (with Retry-After)",
                    500: "api_error: the engine failed the request",
                    529: "overloaded_error: the queue is full, the engine is (re)starting or the server "
                         "drains (with Retry-After)"}


def schema_of(model: type[BaseModel], components: dict, mode: str) -> dict:
    """A `$ref` to the model in `components`, which gets the model and its `$defs`."""
    schema = model.model_json_schema(ref_template=REF, mode=mode)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def event_schema(chunk: dict, error: dict) -> dict:
    """One Server-Sent Event of a stream, as OpenAPI 3.1 reads an event-stream `schema`: its
    `data` is a chunk in JSON, the error that ends a failed stream, or the closing `[DONE]`."""
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
        "data": {"anyOf": [{"const": "[DONE]"},
                           {"type": "string", "contentMediaType": "application/json",
                            "contentSchema": {"anyOf": [chunk, error]}}]}}}


def describe_post_routes(document: dict) -> dict:
    """The document with each POST route's request body, 200 answer and errors filled in."""
    components = document.setdefault("components", {}).setdefault("schemas", {})
    error = schema_of(ErrorResponse, components, "serialization")
    for path, (request, whole, chunk, no_ops) in ROUTES.items():
        operation = document["paths"][path]["post"]
        body = schema_of(request, components, "validation")
        # OpenAI's fields that are taken only at the values that change nothing
        components[request.__name__]["properties"].update(
            {name: {"enum": [None, *values], "description": "not implemented: only these values, which "
                    "change nothing, are taken"} for name, values in no_ops.items()})
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        operation["responses"] = {
            "200": {"description": "The answer: one JSON object, or with `stream: true` " + STREAMS.get(
                        path, "Server-Sent Events, each `data:` line one chunk, ending with `data: [DONE]`"),
                    "content": {"application/json": {"schema": schema_of(whole, components, "serialization")},
                                "text/event-stream": {"schema": event_schema(schema_of(chunk, components,
                                                                                       "serialization"), error)}}},
            **{str(status): {"description": why, "content": {"application/json": {"schema": error}}}
               for status, why in ERRORS.items()}}
    for path, (requests, answer) in PLAIN_ROUTES.items():
        bodies = [schema_of(request, components, "validation") for request in requests]
        document["paths"][path]["post"].update(
            requestBody={"required": True, "content": {"application/json": {
                "schema": bodies[0] if len(bodies) == 1 else {"anyOf": bodies}}}},
            responses={"200": {"description": "The answer", "content": {"application/json": {
                "schema": schema_of(answer, components, "serialization")}}},
                **{str(status): {"description": why, "content": {"application/json": {"schema": error}}}
                   for status, why in PLAIN_ERRORS.items()}})
    describe_anthropic_routes(document, components)
    # Path and query parameters that fail validation get 400 in the one shape, not FastAPI's 422
    for item in document["paths"].values():
        for operation in item.values():
            if operation.get("responses", {}).pop("422", None) is not None:
                operation["responses"]["400"] = {"description": "a bad path or query parameter",
                                                 "content": {"application/json": {"schema": error}}}
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return document


def describe_anthropic_routes(document: dict, components: dict) -> None:
    error = schema_of(AnthropicErrorResponse, components, "serialization")
    errors = {str(status): {"description": why, "content": {"application/json": {"schema": error}}}
              for status, why in ANTHROPIC_ERRORS.items()}
    event = {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"type": "object", "required": ["type"]}}}}
    for path, request, answer in ((MESSAGES_PATH, MessagesRequest, AnthropicMessage),
                                  (COUNT_TOKENS_PATH, CountTokensRequest, InputTokens)):
        content = {"application/json": {"schema": schema_of(answer, components, "serialization")}}
        if path == MESSAGES_PATH:
            content["text/event-stream"] = {"schema": event}
        document["paths"][path]["post"].update(
            requestBody={"required": True, "content": {"application/json": {
                "schema": schema_of(request, components, "validation")}}},
            responses={"200": {"description": "The answer: one JSON object, or with `stream: true` "
                                              "Anthropic's Server-Sent Events, each with its `event:` line",
                               "content": content}, **errors})


def install_openapi(app: FastAPI) -> None:
    """Serve the described document at `/openapi.json` (built once, on first request)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = describe_post_routes(get_openapi(title=app.title, version=app.version,
                                                                  routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi
