"""Each protocol's errors in its own shape, chosen by the route's prefix, and the API key as
either protocol's clients send it. A TestClient app whose engine has not started is enough:
these answers come before any engine work."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from labkit.models.registry import fetch
from labkit.serve.anthropic_wire import ANTHROPIC_ERRORS
from labkit.serve.app import ServeSettings, build_app
from labkit.serve.errors import APIError
from labkit.tokenizer import Tokenizer
from test_serve_request_path import StartingEngine

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def client():
    settings = ServeSettings("smollm2-135m", api_keys=[KEY])
    app = build_app(StartingEngine(), Tokenizer.from_gguf(fetch("smollm2-135m")), settings)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def test_an_unknown_route_under_messages_answers_in_anthropics_shape(client):
    answer = client.post("/v1/messages/nope", json={}, headers={"x-api-key": KEY})
    assert answer.status_code == 404
    assert answer.json() == {"type": "error", "error": {"type": "not_found_error",
                                                        "message": "no route /v1/messages/nope"}}


@pytest.mark.parametrize("path", ["/v1/nope", "/v1/messagesx"])
def test_other_paths_keep_openais_shape(client, path):
    body = client.post(path, json={}).json()
    assert set(body) == {"error"} and body["error"]["code"] == "unknown_route"


# Anthropic's documented mapping (https://docs.claude.com/en/api/errors)
ANTHROPIC_DOCS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                  413: "request_too_large", 429: "rate_limit_error", 500: "api_error"}


@pytest.mark.parametrize("status, code, sent, kind", [
    *[(s, "x", s, t) for s, t in ANTHROPIC_DOCS.items()],
    (405, "method_not_allowed", 400, "invalid_request_error"),   # "other 4XX status codes"
    (415, "unsupported_media_type", 400, "invalid_request_error"),
    (503, "queue_full", 529, "overloaded_error"),
    (503, "engine_unavailable", 529, "overloaded_error"),
    (503, "server_draining", 529, "overloaded_error"),
    (503, "engine_failure", 500, "api_error"),
])
def test_anthropics_status_mapping(status, code, sent, kind):
    error = APIError(status, "why", code, retry_after=2.0 if status == 503 else None)
    answer = error.response(ANTHROPIC_ERRORS)
    assert answer.status_code == sent
    assert ANTHROPIC_ERRORS.body(error) == {"type": "error", "error": {"type": kind, "message": "why"}}
    assert ("retry-after" in answer.headers) is (status == 503)


@pytest.mark.parametrize("headers, status", [
    ({"Authorization": f"Bearer {KEY}"}, 200),
    ({"x-api-key": KEY}, 200),                                   # Anthropic's clients
    ({"x-api-key": "wrong"}, 401),
    ({"Authorization": "Bearer wrong", "x-api-key": KEY}, 401),  # Authorization wins when both come
    ({}, 401),
])
def test_the_key_comes_as_bearer_or_x_api_key(client, headers, status):
    answer = client.get("/v1/models", headers=headers)
    assert answer.status_code == status, answer.text
    if status == 401:
        assert answer.json()["error"]["type"] == "authentication_error"
