"""The service's streams: the slow-reader policy, concurrent streams against solo runs, and a
randomized mix of clients that leaves no KV block behind (engine in process, so the test can
ask the engine itself)."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import pytest

from labkit.engine.core import StreamEnd
from labkit.engine.llm_engine import EngineConfig, LLMEngine, TokenEvent
from labkit.engine.loop import generate
from labkit.sampling import SamplingParams
from labkit.serve.app import ServeSettings, build_app
from labkit.serve.engine_client import EngineFailure, EngineRequest, InProcessEngine, ResultStream
from labkit.serve.server import BackgroundServer

MODEL = "smollm2-135m"


def token(i: int) -> TokenEvent:
    return TokenEvent("r", 0, i, f"t{i}")


def test_a_reader_that_falls_behind_is_cut_off_after_what_it_had():
    async def run():
        aborted = []
        stream = ResultStream(EngineRequest("r", [1], SamplingParams()), aborted.append, max_buffered=4)
        for i in range(10):
            stream.put(token(i))
        assert aborted == ["r"] and stream.finished
        got = [(await stream.next()).token_id for _ in range(4)]
        with pytest.raises(EngineFailure) as caught:
            await stream.next()
        return got, caught.value
    got, failure = asyncio.run(run())
    assert got == [0, 1, 2, 3] and failure.code == "slow_reader" and failure.client_error


def test_an_unbounded_stream_keeps_everything_and_ends_with_the_output():
    async def run():
        stream = ResultStream(EngineRequest("r", [1], SamplingParams()), lambda _: None, max_buffered=4,
                              policy="unbounded")
        for i in range(10):
            stream.put(token(i))
        stream.put(StreamEnd(None))
        return [e.token_id async for e in stream]
    assert asyncio.run(run()) == list(range(10))


def test_coalescing_folds_text_once_the_buffer_is_full_and_loses_nothing():
    async def run():
        aborted = []
        stream = ResultStream(EngineRequest("r", [1], SamplingParams()), aborted.append, max_buffered=3,
                              policy="coalesce")
        for i in range(10):
            stream.put(token(i))
        stream.put(StreamEnd(None))
        return aborted, [(e.token_id, e.text) async for e in stream], stream
    aborted, events, stream = asyncio.run(run())
    assert aborted == [] and len(events) == 3 and stream.coalesced == 7
    assert "".join(text for _, text in events) == "".join(f"t{i}" for i in range(10))
    assert events[-1][0] == 9 and stream.tokens_received == 10


def test_a_refused_request_raises_its_value_error():
    async def run():
        stream = ResultStream(EngineRequest("r", [1], SamplingParams()), lambda _: None)
        stream.put(StreamEnd(None, ValueError("prompt too long")))
        with pytest.raises(ValueError, match="too long"):
            await stream.next()
    asyncio.run(run())


@pytest.fixture(scope="module")
def served(model):
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=4096))
    client = InProcessEngine(engine)
    with BackgroundServer(build_app(client, model.tokenizer, ServeSettings(MODEL))) as server:
        yield server, engine


def sse_texts(lines) -> tuple[str, list[dict]]:
    text, errors = "", []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        payload = json.loads(line[len("data: "):])
        if "error" in payload:
            errors.append(payload["error"])
        else:
            text += "".join(c["text"] for c in payload["choices"])
    return text, errors


@pytest.mark.slow
def test_concurrent_streams_each_equal_their_solo_run(served, model):
    from conftest import PROMPTS

    server, engine = served
    results = {}

    def stream(i: int, prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as answer:
            results[i] = sse_texts(answer.iter_lines())

    threads = [threading.Thread(target=stream, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, prompt in enumerate(PROMPTS):
        solo = generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=12))
        assert results[i] == (solo.text, []), prompt
    engine.check_invariants()


@pytest.mark.slow
def test_a_random_mix_of_clients_leaves_no_block_behind(served):
    server, engine = served
    rng = random.Random(2026)
    outcomes: dict[int, str] = {}

    def client(i: int, kind: str) -> None:
        body = {"model": MODEL, "prompt": f"Request {i}: count 1, 2, 3,", "max_tokens": rng.randint(4, 40),
                "temperature": rng.choice([0, 0.8]), "seed": i}
        try:
            if kind == "bad":
                answer = httpx.post(server.url + "/v1/completions", json=body | {"max_tokens": "ten"}, timeout=60)
                outcomes[i] = f"status {answer.status_code}"
            elif kind == "whole":
                answer = httpx.post(server.url + "/v1/completions", json=body | {"n": rng.randint(1, 3)}, timeout=120)
                outcomes[i] = f"status {answer.status_code}"
            else:
                with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True},
                                  timeout=120) as answer:
                    for n, line in enumerate(answer.iter_lines()):
                        if kind == "leave" and n >= 2:
                            break  # the client goes away mid-stream
                outcomes[i] = "left" if kind == "leave" else "streamed"
        except httpx.HTTPError as error:
            outcomes[i] = f"error {error!r}"

    kinds = [rng.choice(["bad", "whole", "stream", "leave"]) for _ in range(24)]
    threads = [threading.Thread(target=client, args=(i, k)) for i, k in enumerate(kinds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(outcomes) == len(kinds)
    for i, kind in enumerate(kinds):
        expected = {"bad": "status 400", "whole": "status 200", "stream": "streamed", "leave": "left"}[kind]
        assert outcomes[i] == expected, (kind, outcomes[i])
    client_state = server.app.state.client
    deadline = threading.Event()
    for _ in range(100):
        if client_state.core.open_requests == 0 and engine.stats().blocks_used == 0:
            break
        deadline.wait(0.05)
    assert client_state.core.open_requests == 0
    assert engine.stats().blocks_used == 0 and not engine.requests
    engine.check_invariants()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
