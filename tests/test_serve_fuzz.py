"""Fuzzing `labkit serve`: no client input gets a 5xx, and every 200 is what the documents say.

One live server for the module. Schemathesis generates requests from OpenAI's OpenAPI document
(vendored in tests/openai_openapi/, `createCompletion`, `createChatCompletion` and `createResponse`) and from
labkit's own `/openapi.json`; Hypothesis builds hostile JSON bodies (unpaired surrogates, NUL,
long strings, numbers beyond a float or int, deep nesting, huge arrays, wrong types) for every
route. Each request names the served model and asks for at most 4 tokens and 2 samples, so it
is cheap. `LABKIT_FUZZ_EXAMPLES` sets the examples per route (default 50; 1000 for a long run,
see labkit/serve/README.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from live_server import LiveServer

MODEL = "smollm2-135m"
EXAMPLES = int(os.environ.get("LABKIT_FUZZ_EXAMPLES", "50"))
MAX_TOKENS, MAX_N = 4, 2
OPENAI = {name: json.loads((Path(__file__).parent / "openai_openapi" / f"{name}.json").read_text())
          for name in ("completions", "responses")}
pytestmark = pytest.mark.slow

FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(HealthCheck), print_blob=True)


@pytest.fixture(scope="module")
def server():
    # a short context: a long generated prompt is refused at once instead of prefilled
    with LiveServer("--model", MODEL, "--kv-cache-tokens", "2048", "--max-model-len", "512") as live:
        yield live


def cheap(body, path: str = "/completions"):
    """The generated body, made to name the served model and to cost at most a few tokens;
    values the server would refuse anyway (0, -1, "5") are left as they are. Only OpenAI's
    routes get a token limit added (the others take no such field, or require it)."""
    if not isinstance(body, dict):
        return body
    body = dict(body, model=MODEL)
    for field, cap in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS), ("n", MAX_N),
                       ("best_of", MAX_N), ("max_output_tokens", MAX_TOKENS)):
        if type(body.get(field)) is int and body[field] > cap:
            body[field] = cap
    if not path.endswith(("/completions", "/responses")):
        return body
    if "prompt" in body and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # completions' default is 16
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = MAX_TOKENS  # chat's default is the rest of the context
    if "input" in body and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = MAX_TOKENS  # the Responses API's default is the rest of the context
    return body


def fuzz_operation(operation, base_url: str, check_streams: bool = True) -> dict[int, int]:
    """How many answers of each status the generated requests got."""
    statuses: dict[int, int] = {}

    @FUZZ_SETTINGS
    @given(case=operation.as_strategy())
    def run(case):
        case.body = cheap(case.body, operation.path)
        response = case.call(base_url=base_url, timeout=120)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        streamed = any(value.startswith("text/event-stream") for value in response.headers.get("content-type", []))
        checks = [not_a_server_error] + ([response_schema_conformance] if check_streams or not streamed else [])
        case.validate_response(response, checks=checks)

    run()
    print(operation.label, dict(sorted(statuses.items())))
    return statuses


@pytest.mark.parametrize("document, path", [("completions", "/completions"),
                                            ("completions", "/chat/completions"),
                                            ("responses", "/responses")])
def test_openais_document_finds_no_5xx_and_no_answer_outside_it(server, document, path):
    schema = schemathesis.openapi.from_dict(OPENAI[document])
    # OpenAI's document gives a stream's `schema` as one chunk, where OpenAPI 3.1 reads it as one
    # event ({"data": "...", ...}): its streams can only be checked for status
    fuzz_operation(schema[path]["POST"], server.url + "/v1", check_streams=False)


LABKIT_OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                     ("GET", "/v1/models/{name}"), ("GET", "/health"), ("GET", "/metrics"),
                     ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/messages"),
                     ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses")]


def test_every_route_of_labkits_document_is_fuzzed(server):
    document = httpx.get(server.url + "/openapi.json", timeout=30).json()
    documented = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    assert documented == set(LABKIT_OPERATIONS)


@pytest.mark.parametrize("method, path", LABKIT_OPERATIONS)
def test_labkits_own_document_finds_no_5xx_and_no_answer_outside_it(server, method, path):
    schema = schemathesis.openapi.from_dict(httpx.get(server.url + "/openapi.json", timeout=30).json())
    statuses = fuzz_operation(schema[path][method], server.url)
    if path != "/v1/models/{name}":  # (a generated name is rarely the served model's)
        assert statuses.get(200), "no request was answered: the answers' schemas went unchecked"


# -- hostile bodies ---------------------------------------------------------------------------

def json_text(value) -> str:
    """JSON for a Python value; lone surrogates come out as \\udXXX escapes."""
    return json.dumps(value, ensure_ascii=True)


text_with_odd_characters = st.lists(st.one_of(st.characters(codec=None, categories=None),
                                              st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\x00"])),
                                    max_size=40).map("".join)
scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
           | text_with_odd_characters)
wrong_types = scalars | st.lists(scalars, max_size=4) | st.dictionaries(text_with_odd_characters,
                                                                       scalars | st.lists(scalars, max_size=4),
                                                                       max_size=4)
hostile_values = st.one_of(
    text_with_odd_characters.map(json_text),
    st.integers(1, 200_000).map(lambda k: json_text("a" * k)),                    # long strings
    st.sampled_from(["1e999", "-1e999", "1e-999", "-0", "9" * 5000, "12345678901234567890123456789",
                     "18446744073709551616", "-9223372036854775809", "NaN", "Infinity", "0.5e1"]),
    st.integers(1, 20_000).map(lambda d: "[" * d + "]" * d),                       # deep arrays
    st.integers(900, 1000).map(lambda d: "[" * d + "]" * d),                       # about the parser's limit
    st.integers(1, 20_000).map(lambda d: '{"a":' * d + "1" + "}" * d),             # deep objects
    st.integers(1, 300_000).map(lambda k: "[" + ",".join(["1"] * k) + "]"),       # huge arrays
    wrong_types.map(json_text),
)
BASES = {"/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0},
         "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 2, "temperature": 0},
         "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                          "temperature": 0},
         "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
         "/tokenize": {"model": MODEL, "prompt": "Hi"},
         "/detokenize": {"model": MODEL, "tokens": [1, 2]},
         "/v1/responses": {"model": MODEL, "input": [{"role": "user", "content": "Hi"}],
                           "max_output_tokens": 2, "temperature": 0}}
# Every field a hostile value may replace, but the token counts: a valid large count costs a
# long generation (the overlong numbers above reach them through the whole-body cases).
FIELDS = ["model", "prompt", "messages", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logprobs",
          "top_logprobs", "presence_penalty", "frequency_penalty", "user", "cache_salt", "ignore_eos",
          "deadline_ms", "stream", "stream_options", "metadata", "logit_bias", "store", "response_format",
          "echo", "best_of", "suffix", "tools", "service_tier", "stop_token_ids", "no_such_field", "\ud800",
          "system", "stop_sequences", "cache_control", "tokens", "add_special_tokens", "add_generation_prompt",
          "input", "instructions", "text", "include", "previous_response_id", "conversation", "background",
          "truncation"]


def body_with(path: str, field: str, raw_value: str) -> str:
    """The route's plain request with one field set to raw JSON text (or a message's content)."""
    base = dict(BASES[path])
    if (field == "messages" and "messages" in base) or (field, path) == ("input", "/v1/responses"):
        return json_text(base).replace('"content": "Hi"', f'"content": {raw_value}', 1)
    base.pop(field, None)
    return json_text(base)[:-1] + f", {json_text(field)}: {raw_value}}}"


hostile_bodies = st.one_of(
    st.tuples(st.sampled_from(FIELDS), hostile_values).map(lambda pair: ("field", *pair)),
    hostile_values.map(lambda raw: ("body", None, raw)),
    st.sampled_from(["max_tokens", "max_completion_tokens", "n", "max_output_tokens"]).flatmap(
        lambda f: st.sampled_from(["1e999", "9" * 5000, "12345678901234567890123456789", "-1", '"4"', "4.0",
                                   "true", "null", "[4]"]).map(lambda raw: ("field", f, raw))),
)
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/v1/models/" + MODEL), ("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/embeddings"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/messages"),
          ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses")]


def assert_one_error_shape(answer: httpx.Response, path: str = "") -> None:
    """The route's protocol's one shape: Anthropic's on its routes, OpenAI's elsewhere."""
    body = answer.json()
    if path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}, body
        assert body["type"] == "error" and body["error"]["message"], body
        return
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and body["error"]["code"], body


@pytest.mark.parametrize("method, path", ROUTES)
def test_hostile_bodies_get_no_5xx_and_every_refusal_has_the_one_shape(server, method, path):
    @FUZZ_SETTINGS
    @given(hostile=hostile_bodies)
    def run(hostile):
        kind, field, raw = hostile
        text = body_with(path, field, raw) if kind == "field" and path in BASES else raw
        answer = httpx.request(method, server.url + path, content=text.encode("utf-8", "surrogatepass"),
                               headers={"Content-Type": "application/json"}, timeout=120)
        assert answer.status_code < 500, (answer.status_code, answer.text[:300], text[:300])
        if answer.status_code >= 400:
            assert_one_error_shape(answer, path)

    run()
