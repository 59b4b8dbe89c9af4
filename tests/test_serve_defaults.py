"""What official clients send by default is taken and changes nothing.

OpenAI's OpenAPI document (vendored in tests/openai_openapi/) gives each request field's
`default:`; SDKs and frameworks send many fields at those values. Each one, and each value
`labkit.serve.openai_fields` takes as a no-op, is sent to a live server on its own: the answer
must be a 200 with the greedy text of the same request without the field. One server for the
module; answers of 4 tokens (enough to repeat one, so that a penalty would show).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from labkit.serve.openai_fields import CHAT_NO_OPS, COMPLETION_NO_OPS
from labkit.serve.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "smollm2-135m"
SERVER_ARGS = ("--model", MODEL, "--kv-cache-tokens", "4096")   # the `server` fixture's (serve_fixtures)
DOCUMENT = json.loads((Path(__file__).parent / "openai_openapi" / "completions.json").read_text())
pytestmark = pytest.mark.slow

ROUTES = {  # OpenAI's schema, labkit's model and no-ops, the request every field is added to
    "/v1/completions": ("CreateCompletionRequest", CompletionRequest, COMPLETION_NO_OPS,
                        {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 4, "temperature": 0}),
    "/v1/chat/completions": ("CreateChatCompletionRequest", ChatCompletionRequest, CHAT_NO_OPS,
                             {"model": MODEL, "messages": [{"role": "user", "content": "Count: 1, 2, 3,"}],
                              "max_tokens": 4, "temperature": 0}),
}
INFORMATIONAL = {"/v1/completions": [("user", "user-1234")],
                 "/v1/chat/completions": [("user", "user-1234"), ("metadata", {}),
                                          ("metadata", {"team": "search", "k" * 64: "v" * 512})]}
# fields labkit implements, at the values that ask for nothing
EMPTY = {"/v1/completions": [("logit_bias", {}), ("stop_token_ids", []), ("echo", False)],
         "/v1/chat/completions": [("logit_bias", {}), ("stop_token_ids", [])]}


def resolve(schema: dict) -> dict:
    while "$ref" in schema:
        schema = DOCUMENT["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def properties(schema: dict) -> dict:
    schema = resolve(schema)
    found = {}
    for part in schema.get("allOf", []):
        found |= properties(part)
    return found | schema.get("properties", {})


def documented_default(field: dict):
    """The field's `default:`, on the field, on the schema it refers to, or on the one branch
    of an `anyOf` with null (OpenAPI 3.1's spelling of a nullable field); KeyError if none."""
    for schema in (field, resolve(field)):
        if "default" in schema:
            return schema["default"]
    branches = [resolve(b) for b in resolve(field).get("anyOf", [])]
    with_default = [b for b in branches if "default" in b]
    if len(with_default) == 1 and all(b is with_default[0] or b.get("type") == "null" for b in branches):
        return with_default[0]["default"]
    raise KeyError("no default")


def cases() -> list[tuple[str, str, object]]:
    out = []
    for path, (name, _, no_ops, base) in ROUTES.items():
        fields = properties(DOCUMENT["components"]["schemas"][name])
        required = set(resolve(DOCUMENT["components"]["schemas"][name]).get("required", []))
        required |= {r for part in resolve(DOCUMENT["components"]["schemas"][name]).get("allOf", [])
                     for r in resolve(part).get("required", [])}
        for field, schema in fields.items():
            if field in required or field in base:  # the request's own choices, not defaults
                continue
            try:
                out.append((path, field, documented_default(schema)))
            except KeyError:
                pass
        out += [(path, field, value) for field, values in no_ops.items() for value in values]
        out += [(path, field, value) for field, value in INFORMATIONAL[path] + EMPTY[path]]
    unique = {(p, f, json.dumps(v, sort_keys=True)): (p, f, v) for p, f, v in out}
    return list(unique.values())


CASES = cases()


def test_the_document_lists_the_defaults_clients_send():
    """The vendored document is the one read: the defaults this file is about are in it."""
    sent = {(path, field, json.dumps(value)) for path, field, value in CASES}
    for expected in [("/v1/completions", "echo", "false"), ("/v1/completions", "best_of", "1"),
                     ("/v1/chat/completions", "store", "false"), ("/v1/chat/completions", "service_tier", '"auto"'),
                     ("/v1/chat/completions", "parallel_tool_calls", "true"),
                     ("/v1/chat/completions", "logit_bias", "null"), ("/v1/chat/completions", "n", "1")]:
        assert expected in sent, expected


@pytest.mark.parametrize("path", ROUTES)
def test_every_openai_field_is_one_labkit_knows(path):
    """A field of OpenAI's request is taken, or refused as unsupported, never as unknown."""
    name, model, no_ops, _ = ROUTES[path]
    fields = properties(DOCUMENT["components"]["schemas"][name])
    unknown = sorted(set(fields) - set(model.model_fields) - set(no_ops))
    assert not unknown, f"OpenAI's {name} has fields labkit does not list: {unknown}"


def answer_text(server, path: str, body: dict) -> str:
    answer = httpx.post(server.url + path, json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.fixture(scope="module")
def plain_answers(server) -> dict[str, str]:
    return {path: answer_text(server, path, base) for path, (_, _, _, base) in ROUTES.items()}


CASE_IDS = [f"{'chat' if 'chat' in p else 'completions'}-{f}={json.dumps(v)[:30]}" for p, f, v in CASES]


@pytest.mark.parametrize("path, field, value", CASES, ids=CASE_IDS)
def test_a_field_at_its_default_changes_nothing(server, plain_answers, path, field, value):
    base = ROUTES[path][3]
    assert answer_text(server, path, base | {field: value}) == plain_answers[path]
