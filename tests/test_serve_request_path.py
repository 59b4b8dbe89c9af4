"""The shared request path while the engine is not there yet: every route answers 503
`engine_unavailable` with Retry-After (never a 500), whatever the request leaves unset; and
with an engine, Server-Timing's stages, which never run backwards before they are clamped."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from fastapi.testclient import TestClient

from labkit.engine.core import AddRequest
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.models.registry import fetch
from labkit.sampling import SamplingParams
from labkit.serve.app import ServeSettings, build_app
from labkit.serve.engine_client import EngineRequest, EngineUnavailable, InProcessEngine
from labkit.serve.request_path import EngineWork, RequestPath
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


# -- Server-Timing's stages, raw ----------------------------------------------------------------

class ReceivedAtOnce(EngineRequest):
    """A request whose worker stamps its arrival as the send begins (a worker process reads
    the pipe on a thread of its own while the front end's write call is still returning)."""

    def command(self) -> AddRequest:
        return dataclasses.replace(super().command(), arrival_time=time.perf_counter())


class QuickToReceive(InProcessEngine):
    """An engine whose send returns 10 ms after the worker has the request."""

    def submit(self, request, *, max_buffered=1024, policy="abort"):
        fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
        stream = super().submit(ReceivedAtOnce(**fields), max_buffered=max_buffered, policy=policy)
        time.sleep(0.01)
        return stream


def test_no_stage_of_server_timing_is_negative_before_it_is_clamped(model):
    """`submitted` is stamped before the send, so the worker's arrival can never precede it:
    every stage, unclamped, ends at or after its start (the header would hide a negative
    one as 0)."""
    async def run():
        client = QuickToReceive(LLMEngine(model, EngineConfig(kv_cache_tokens=1024)))
        path = RequestPath(client, model.tokenizer, ServeSettings("smollm2-135m"))
        await client.start()
        try:
            begun = time.perf_counter()
            marks = {"arrival": begun, "read": begun, "parsed": begun}
            marks["tokenized"] = time.perf_counter()
            work = EngineWork("completions", "cmpl-t", [model.tokenizer.encode("Hello")],
                              SamplingParams(temperature=0.0, max_tokens=3), marks)
            streams = path.start(work)
            async for _ in streams[0]:
                pass
            marks["collected"] = marks["serialized"] = time.perf_counter()
            return path.call(work, streams).timing_stages()
        finally:
            await client.stop()
    stages = asyncio.run(run())
    assert [name for name, _, _ in stages][:5] == ["read", "parse", "tokenize", "submit", "to-engine"]
    assert "queue" in [name for name, _, _ in stages]
    assert [(name, end - begin) for name, begin, end in stages if end < begin] == []
