"""`ServeModel` on the wire, read from the HTTP request the official `openai` client sends (a
mock transport in place of the server): the trace id as X-Request-Id and metadata, the
`cache_salt` only when one is set, and the answer's Server-Timing kept with the turn."""

from __future__ import annotations

import json

import httpx2
import pytest
from openai import OpenAI

from labkit.agent.serve_model import ServeModel

ANSWER = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "smollm2-135m",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "It is 4."}}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44,
              "prompt_tokens_details": {"cached_tokens": 32}},
}


def answered(model: ServeModel, seen: list) -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(200, json=ANSWER, headers={
            "Server-Timing": "read;dur=0.1, queue;dur=2.5, prefill;dur=31.25, decode;dur=12"})

    model.client = OpenAI(base_url="http://127.0.0.1:9/v1", api_key="none", max_retries=0,
                          http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


@pytest.mark.parametrize("salt", [None, "run-7"])
def test_the_request_and_the_turn(salt):
    model, seen = ServeModel("http://127.0.0.1:9", "smollm2-135m", max_tokens=16, cache_salt=salt), []
    answered(model, seen)
    turn = model.generate([{"role": "user", "content": "2 + 2?"}], [], "trace-9", 3)
    (request,) = seen
    body = json.loads(request.content)
    assert request.headers["x-request-id"] == "trace-9"
    assert body["metadata"] == {"trace_id": "trace-9", "round": "3"}
    assert body.get("cache_salt") == salt and ("cache_salt" in body) == (salt is not None)
    assert body["max_tokens"] == 16 and body["temperature"] == 0.0
    assert (turn.reply, turn.prompt_tokens, turn.cached_tokens) == ("It is 4.", 40, 32)
    assert turn.completion_tokens == 4
    assert turn.server_ms == {"read": 0.1, "queue": 2.5, "prefill": 31.25, "decode": 12.0}
