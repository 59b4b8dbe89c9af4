"""The foil: the service a first attempt writes with framework defaults.

    labkit serve --naive      the same model through `transformers` `generate`, one request at a time

Everything here is what the defaults give, on purpose, so the book can measure what they
cost (see `labkit/serve/README.md` for what the real service does instead):
- a lax pydantic model: `"5"` becomes 5, unknown fields are dropped without a word, NaN is a
  float like any other;
- FastAPI's own errors: 422 with a list of `detail`s, 404 `{"detail": "Not Found"}`, and a
  bare 500 for anything the model code raises (temperature 0 asks `generate` to sample at
  temperature 0);
- one global lock around `generate`: requests queue in arrival order and run one by one,
  however many clients wait; nothing stops a request whose client has gone;
- streaming through `TextIteratorStreamer`, in OpenAI's chunk format (so the same load
  generator can read it), with usage at the end.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel


class NaiveCompletion(BaseModel):
    model: str
    prompt: str | list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    stream: bool = False


def build_naive_app(model_name: str, reference, tokenizer) -> FastAPI:
    import torch
    from transformers import TextIteratorStreamer

    app = FastAPI(title="naive")
    lock = threading.Lock()

    class _Text:  # what TextIteratorStreamer needs of a tokenizer: it also decodes one bare id
        def decode(self, ids, skip_special_tokens=False, **_):
            ids = [ids] if isinstance(ids, int) else ids
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def ids_of(prompt) -> list[int]:
        return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def run(ids: list[int], body: NaiveCompletion, streamer=None) -> list[int]:
        try:
            with lock, torch.inference_mode():
                out = reference.generate(torch.tensor([ids]), max_new_tokens=body.max_tokens,
                                         do_sample=True, temperature=body.temperature, pad_token_id=0,
                                         streamer=streamer)
        except BaseException:
            if streamer is not None:  # else its reader waits for the end forever
                streamer.end()
            raise
        return out[0, len(ids):].tolist()

    def usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @app.post("/v1/completions")
    async def completions(body: NaiveCompletion):
        ids = ids_of(body.prompt)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if not body.stream:
            tokens = await asyncio.to_thread(run, ids, body)
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": tokenizer.decode(tokens), "logprobs": None,
                                 "finish_reason": "length"}], "usage": usage(len(ids), len(tokens))}
        streamer = TextIteratorStreamer(_Text(), skip_prompt=True)
        worker = asyncio.ensure_future(asyncio.to_thread(run, ids, body, streamer))

        async def events():
            pieces = iter(streamer)
            while True:
                piece = await asyncio.to_thread(next, pieces, None)
                if piece is None:
                    break
                if piece:
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                             "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
            tokens = await worker
            end = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                   "choices": [], "usage": usage(len(ids), len(tokens))}
            yield f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app
