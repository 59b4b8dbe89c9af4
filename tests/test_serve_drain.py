"""SIGTERM drains `labkit serve`: no new requests (503 with Retry-After, /health says
draining), the running ones get `--drain-timeout` seconds, any still open then end with an
error event and [DONE], and the process exits 0 without leaving its worker behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from live_server import LiveServer

MODEL = "smollm2-135m"
DRAIN_TIMEOUT = 8.0
pytestmark = pytest.mark.slow


def worker_pid(server) -> int:
    return server.get("/health").json()["worker_pid"]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_finishes_short_requests_ends_long_ones_and_exits_zero():
    with LiveServer("--model", MODEL, "--drain-timeout", str(DRAIN_TIMEOUT), "--kv-cache-tokens", "4096") as server:
        pid = worker_pid(server)
        long_events: list = []
        outcome: dict = {}
        started = threading.Event()

        def long_stream():
            body = {"model": MODEL, "prompt": "Count from one to one thousand: one, two,", "max_tokens": 2000,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data: "):
                        data = line.removeprefix("data: ")
                        long_events.append(data if data == "[DONE]" else json.loads(data))
                        started.set()

        def short_request():
            started.wait(60)
            # 24 tokens keep it open for tens of steps: a 3-token one could end between two
            # /health polls on a busy machine, and the drain would then have nothing short to finish
            body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}
            outcome["short"] = httpx.post(server.url + "/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=long_stream), threading.Thread(target=short_request)]
        for thread in threads:
            thread.start()
        assert started.wait(60)
        server.wait_until(lambda: server.get("/health").json()["open_requests"] >= 2 or "short" in outcome,
                          timeout=30, interval=0.01)
        assert "short" not in outcome, "the short request ended before the test saw it open"
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        server.wait_until(lambda: server.get("/health").status_code == 503, timeout=5, interval=0.02)
        health = server.get("/health")
        assert health.json()["status"] == "draining"
        refused = httpx.post(server.url + "/v1/completions", timeout=30,
                             json={"model": MODEL, "prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "server_draining"
        for thread in threads:
            thread.join(120)
        code = server.process.wait(60)
        took = time.monotonic() - signalled
        assert code == 0
        assert took < DRAIN_TIMEOUT + 15, took
        assert outcome["short"].status_code == 200, outcome["short"].text
        assert outcome["short"].json()["choices"][0]["text"]
        # the long stream kept its tokens, then learned why it stopped
        assert long_events[-1] == "[DONE]"
        assert long_events[-2]["error"]["code"] == "shutting_down"
        assert sum(1 for e in long_events if isinstance(e, dict) and "choices" in e) > 1
        assert time.monotonic() - signalled >= DRAIN_TIMEOUT - 0.5  # it waited for the long one
        deadline = time.monotonic() + 10
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(pid), "the engine worker was left behind"


def test_sigterm_with_nothing_running_exits_zero_at_once():
    with LiveServer("--model", MODEL, "--drain-timeout", "30", "--kv-cache-tokens", "4096") as server:
        pid = worker_pid(server)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert server.process.wait(60) == 0
        assert time.monotonic() - signalled < 15  # not the 30 s of the drain timeout
        deadline = time.monotonic() + 10
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(pid)
