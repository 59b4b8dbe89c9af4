"""POST /tokenize and POST /detokenize, as vLLM serves them (its `serving_tokenization`).

    /tokenize    {model?, prompt, add_special_tokens? (true), return_token_strs? (false)}
              or {model?, messages, add_generation_prompt? (true), add_special_tokens? (false),
                  return_token_strs? (false)}
              -> {count, max_model_len, tokens, token_strs}
    /detokenize  {model?, tokens} -> {prompt}

A prompt's ids are those the completions route runs (with BOS where the model expects one,
unless add_special_tokens is false); a conversation's are those the chat route runs (the chat
template writes any BOS itself; add_special_tokens adds one on top, as in vLLM). Nothing
reaches the engine, so these routes are not admitted or counted as engine work; they check
the API key, the body, the fields (strictly, as the OpenAI routes do) and the model's name,
and answer 503 while the engine starts (its context length and vocabulary are not known yet).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import Field, ValidationError

from labkit.engine.output import with_bos
from labkit.protocols.templates import encode_conversation
from labkit.serve.errors import invalid
from labkit.serve.protocol import ChatMessage, Strict, check_fields, field_refusal
from labkit.serve.request_path import RequestPath

TOKENIZE_PATH, DETOKENIZE_PATH = "/tokenize", "/detokenize"


class TokenizeCompletionRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True      # BOS where the model expects one, as completions runs it
    return_token_strs: bool | None = False


class TokenizeChatRequest(Strict):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True   # as the chat route renders it
    add_special_tokens: bool = False     # the template writes any BOS itself
    return_token_strs: bool | None = False


class TokenizeResponse(Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(Strict):
    prompt: str


def parse(model: type[Strict], body: dict) -> Strict:
    """The request model, or a 400 naming the first field it does not take or finds wrong."""
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(message, dict):
            check_fields(message, ChatMessage, {}, f"messages[{i}].")
    try:
        return model.model_validate(check_fields(body, model, {}))
    except ValidationError as error:
        raise field_refusal(error) from None


def tokenize_router(path: RequestPath) -> APIRouter:
    router = APIRouter()
    tokenizer = path.tokenizer

    async def checked_body(request: Request) -> dict:
        path.authenticate(request)
        return await path.read_body(request)

    @router.post(TOKENIZE_PATH)
    async def tokenize(request: Request):
        body = await checked_body(request)
        chat = "messages" in body
        if chat and "prompt" in body:
            raise invalid("give prompt or messages, not both", "messages")
        fields = parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        if fields.model is not None:
            path.check_model(fields.model)
        max_model_len = path.max_model_len()
        if chat:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text}
                        for m in fields.messages]
            try:  # as the chat route encodes it: message text never becomes a special token
                ids = await asyncio.to_thread(encode_conversation, tokenizer, messages,
                                              fields.add_generation_prompt)
            except ValueError as error:
                raise invalid(str(error), "messages") from None
        else:
            ids = (await asyncio.to_thread(tokenizer.encode_batch, [fields.prompt]))[0]
        if fields.add_special_tokens:
            ids = with_bos(ids, tokenizer)
        answer = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if fields.return_token_strs:
            answer["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
        return answer

    @router.post(DETOKENIZE_PATH)
    async def detokenize(request: Request):
        fields: DetokenizeRequest = parse(DetokenizeRequest, await checked_body(request))
        if fields.model is not None:
            path.check_model(fields.model)
        path.max_model_len()  # 503 while the engine starts, as /tokenize
        known = min(tokenizer.vocab_size, path.vocab_size or tokenizer.vocab_size)
        outside = next((i for i, t in enumerate(fields.tokens) if t >= known), None)
        if outside is not None:
            raise invalid(f"tokens[{outside}]: {fields.tokens[outside]} is outside the vocabulary "
                          f"[0, {known})", f"tokens[{outside}]", "token_out_of_vocabulary")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, fields.tokens)}

    return router
