"""What the front end's event loop owes every other client: a long prompt is tokenized off
the loop (another client's stream keeps flowing), a stream that waits gets SSE keep-alive
comments, and with include_usage every chunk but the last says "usage": null."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.scheduler import SchedulerConfig
from labkit.serve.app import ServeSettings, build_app
from labkit.serve.engine_client import InProcessEngine
from labkit.serve.server import BackgroundServer

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow
LONG = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 80, "temperature": 0, "ignore_eos": True,
        "stream": True}


@pytest.fixture(scope="module")
def server(model):
    """One sequence at a time, so a second request waits; keep-alive after 0.1 s of silence."""
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=4096, scheduler=SchedulerConfig(max_num_seqs=1)))
    settings = ServeSettings(MODEL, max_body_bytes=16 << 20, sse_keepalive_seconds=0.1, max_queue=8)
    with BackgroundServer(build_app(InProcessEngine(engine), model.tokenizer, settings)) as live:
        yield live


def read_stream(url: str, body: dict, lines: list, arrivals: list) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as answer:
        for line in answer.iter_lines():
            if line:
                lines.append(line)
                arrivals.append(time.perf_counter())


def test_a_waiting_stream_gets_keepalive_comments_and_clients_skip_them(server):
    first_lines, first_times = [], []
    first = threading.Thread(target=read_stream, args=(server.url, LONG, first_lines, first_times))
    first.start()
    while not first_lines:
        time.sleep(0.01)
    waiting_lines, waiting_times = [], []
    read_stream(server.url, LONG | {"max_tokens": 3}, waiting_lines, waiting_times)  # queued behind it
    first.join(120)
    before_data = waiting_lines[:next(i for i, l in enumerate(waiting_lines) if l.startswith("data: "))]
    assert before_data and all(l == ": keep-alive" for l in before_data)
    assert waiting_lines[-1] == "data: [DONE]"
    # the official client reads the same kind of stream unharmed
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    first = threading.Thread(target=read_stream, args=(server.url, LONG, [], []))
    first.start()
    texts = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="1, 2,", max_tokens=3,
                                                                    temperature=0, stream=True)]
    first.join(120)
    assert "".join(texts)


def test_with_include_usage_every_chunk_but_the_last_says_usage_null(server):
    for route, body in (("/v1/completions", {"prompt": "1, 2, 3,"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        request = {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}} | body
        with httpx.stream("POST", server.url + route, json=request, timeout=120) as answer:
            chunks = [json.loads(l[6:]) for l in answer.iter_lines() if l.startswith("data: {")]
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), route
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        plain = {k: v for k, v in request.items() if k != "stream_options"}
        with httpx.stream("POST", server.url + route, json=plain, timeout=120) as answer:
            chunks = [json.loads(l[6:]) for l in answer.iter_lines() if l.startswith("data: {")]
        assert not any("usage" in c for c in chunks)  # without it, no usage key at all


def test_a_huge_prompt_is_tokenized_off_the_loop_while_another_stream_flows(server, model):
    text = "The quick brown fox jumps over the lazy dog. " * 100_000  # about 1M tokens
    began = time.perf_counter()
    model.tokenizer.encode(text)
    encode_s = time.perf_counter() - began
    lines, times = [], []
    reader = threading.Thread(target=read_stream, args=(server.url, LONG | {"max_tokens": 400}, lines, times))
    reader.start()
    while len(lines) < 3:
        time.sleep(0.01)
    sent = time.perf_counter()
    refused = httpx.post(server.url + "/v1/completions", timeout=120,
                         json={"model": MODEL, "prompt": text, "max_tokens": 1})
    answered = time.perf_counter()
    reader.join(180)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert answered - sent > 0.5 * encode_s  # the server did tokenize it, meanwhile:
    during = [b - a for a, b in zip(times, times[1:]) if sent <= b <= answered]
    assert during, "the stream sent nothing while the prompt was tokenized"
    assert max(during) < 0.5 * encode_s, (max(during), encode_s)
