"""What `labkit serve` says and refuses at start-up: a KV pool that cannot hold one sequence
of the model's context caps the context (the start line says so) and a chat request without
max_tokens then gets what fits; a --max-model-len that the pool cannot hold stops the server
with the reason."""

from __future__ import annotations

import re

import httpx
import pytest

from live_server import LiveServer

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow


def test_a_small_pool_caps_the_context_and_a_chat_without_max_tokens_fits():
    with LiveServer("--model", MODEL, "--kv-cache-tokens", "1024") as server:
        line = next(l for l in server.lines if "labkit serve: http" in l)
        assert re.search(r"context 1024 tokens: context capped to 1024 tokens by the KV pool", line), line
        card = server.get(f"/v1/models/{MODEL}").json()
        assert card["max_model_len"] == 1024
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "stream": True,
                "temperature": 0}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as answer:
            assert answer.status_code == 200, answer.read()
            first = next(l for l in answer.iter_lines() if l.startswith("data: "))
            assert '"choices"' in first
        server.wait_until(server.idle, timeout=10)


def test_a_set_context_that_the_pool_cannot_hold_stops_the_server_with_the_reason():
    with pytest.raises(RuntimeError) as stopped:
        with LiveServer("--model", MODEL, "--kv-cache-tokens", "1024", "--max-model-len", "4096",
                        start_timeout=240):
            pass
    assert "does not fit the KV pool" in str(stopped.value)
    assert "Raise kv_cache_tokens or lower max_model_len" in str(stopped.value)
