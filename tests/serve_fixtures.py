"""The live-server fixtures the serve tests share (tests/conftest.py makes them visible to every
test module, which asks for them by name):

    server            one `labkit serve` process per test module: the module's `SERVER_ARGS`,
                      or the default model with 8192 KV-cache tokens
    openai_client     the official `openai` client on its `/v1` routes
    anthropic_client  the official `anthropic` client on its Messages routes

A module whose server needs more (API keys, a fault file) defines its own `server` fixture;
the clients then use that one. Clients never retry: a test sees each answer as it came.
"""

from __future__ import annotations

import pytest

from live_server import LiveServer

MODEL = "smollm2-135m"
SERVER_ARGS = ("--model", MODEL, "--kv-cache-tokens", "8192")
CLIENT_TIMEOUT_S = 300   # a bound on a hung request, not a measurement


@pytest.fixture(scope="module")
def server(request):
    with LiveServer(*getattr(request.module, "SERVER_ARGS", SERVER_ARGS)) as live:
        yield live


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S)
