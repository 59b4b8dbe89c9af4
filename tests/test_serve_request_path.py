"""The shared request path while the engine is not there yet: every route answers 503
`engine_unavailable` with Retry-After (never a 500), whatever the request leaves unset."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from labkit.models.registry import fetch
from labkit.serve.app import ServeSettings, build_app
from labkit.serve.engine_client import EngineUnavailable
from labkit.tokenizer import Tokenizer


class StartingEngine:
    """An engine client whose worker has not started: no limits, nothing can be submitted."""

    limits = None
    weights = None
    ready = False

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def stats(self): return None
    def health(self) -> dict: return {"state": "starting"}

    def submit(self, request, *, max_buffered, policy):
        raise EngineUnavailable("the engine is starting")


@pytest.fixture(scope="module")
def client():
    app = build_app(StartingEngine(), Tokenizer.from_gguf(fetch("smollm2-135m")), ServeSettings("smollm2-135m"))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "smollm2-135m", "prompt": "Hi"}),
    ("/v1/chat/completions", {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/chat/completions", {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 4, "stream": True}),
])
def test_a_request_while_the_engine_starts_gets_503(client, path, body):
    answer = client.post(path, json=body)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "engine_unavailable"
    assert "retry-after" in answer.headers
