"""`/openapi.json` describes what the POST routes take and answer, as valid OpenAPI 3.1
whose request schemas agree with the routes' own validation. No server: the document is
built from the app."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from labkit.serve.app import ServeSettings, build_app
from labkit.serve.errors import APIError
from labkit.serve.protocol import ChatCompletionRequest, CompletionRequest, validate
from labkit.serve.responses_protocol import parse_request

POSTS = {"/v1/completions": ("CompletionRequest", lambda body: validate(CompletionRequest, body)),
         "/v1/chat/completions": ("ChatCompletionRequest",
                                  lambda body: validate(ChatCompletionRequest, body)),
         "/v1/responses": ("ResponsesRequest", parse_request)}
ERROR_STATUSES = ("400", "401", "404", "413", "415", "429", "503")


class NoEngine:
    """What build_app needs to describe the routes: nothing is submitted."""

    limits = None
    weights = "f32"


@pytest.fixture(scope="module")
def document() -> dict:
    return build_app(NoEngine(), None, ServeSettings(model_name="m")).openapi()


def validator(document: dict, name: str) -> jsonschema.Draft202012Validator:
    root = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    return jsonschema.Draft202012Validator(root)


def test_the_document_is_openapi_3_1_with_every_reference_inside_it(document):
    assert re.fullmatch(r"3\.1\.\d+", document["openapi"])
    assert document["info"]["title"] and document["info"]["version"]
    schemas = document["components"]["schemas"]
    for name, schema in schemas.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert "$defs" not in schema, name  # OpenAPI resolves "#/..." from the document's root
    references = set(re.findall(r'"\$ref": "([^"]+)"', json.dumps(document)))
    assert references and all(ref.startswith("#/components/schemas/") for ref in references)
    assert {ref.rsplit("/", 1)[1] for ref in references} <= set(schemas)
    for path, item in document["paths"].items():
        for method, operation in item.items():
            assert method in {"get", "post", "put", "delete", "patch", "head", "options"}
            assert operation["responses"] and "422" not in operation["responses"], (path, method)
            for status in operation["responses"]:
                assert re.fullmatch(r"[1-5]\d\d", status)


@pytest.mark.parametrize("path", POSTS)
def test_each_post_route_describes_its_body_answers_and_errors(document, path):
    operation = document["paths"][path]["post"]
    body = operation["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{POSTS[path][0]}"}
    answer = operation["responses"]["200"]["content"]
    assert set(answer) == {"application/json", "text/event-stream"}
    for status in ERROR_STATUSES:
        assert operation["responses"][status]["content"]["application/json"]["schema"] == \
            {"$ref": "#/components/schemas/ErrorResponse"}


GOOD = {"/v1/completions": {"model": "m", "prompt": ["a", "b"], "max_tokens": 4, "temperature": 0,
                            "stop": ["\n"], "echo": True, "logit_bias": {"5": -100, "0": 2.5},
                            "stop_token_ids": [2]},
        "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": [{"type": "text",
                                                                                         "text": "hi"}]}],
                                 "max_completion_tokens": 3, "store": False, "metadata": {"team": "a"},
                                 "response_format": {"type": "text"}},
        "/v1/responses": {"model": "m", "input": [{"role": "user", "content": "hi"}],
                          "instructions": "Be brief.", "max_output_tokens": 3, "store": False, "tools": [],
                          "metadata": {"team": "a"}}}
BAD = {"/v1/completions": [{"model": "m"}, {"model": "m", "prompt": "x", "max_tokens": "5"},
                           {"model": "m", "prompt": "x", "temprature": 1},
                           {"model": "m", "prompt": "x", "echo": 1},
                           {"model": "m", "prompt": "x", "logit_bias": {"x": 1}},
                           {"model": "m", "prompt": "x", "logit_bias": {"1": -101}},
                           {"model": "m", "prompt": [1, -2]}],
       "/v1/chat/completions": [{"model": "m", "messages": []},
                                {"model": "m", "messages": [{"role": "tool", "content": "x"}]},
                                {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                 "response_format": {"type": "xml"}},
                                {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                 "metadata": {"k": 1}}],
       "/v1/responses": [{"model": "m"}, {"model": "m", "input": []},
                         {"model": "m", "input": "x", "max_output_tokens": "5"},
                         {"model": "m", "input": "x", "store": True}, {"model": "m", "input": "x", "n": 2}]}


@pytest.mark.parametrize("path", POSTS)
def test_the_request_schemas_take_what_the_routes_take_and_refuse_what_they_refuse(document, path):
    name, parse = POSTS[path]
    check = validator(document, name)
    check.validate(GOOD[path])
    parse(json.loads(json.dumps(GOOD[path])))  # the route takes it too
    for bad in BAD[path]:
        assert not check.is_valid(bad), bad
        with pytest.raises(APIError):
            parse(json.loads(json.dumps(bad)))


def test_the_answer_and_error_schemas_describe_what_is_sent(document):
    from labkit.serve.responses import chat_chunk, completion_chunk

    validator(document, "ErrorResponse").validate(APIError(400, "bad", "invalid_value", "n").body())
    validator(document, "CompletionResponse").validate(completion_chunk("cmpl-1", 0, "m", 0, "a", None))
    validator(document, "ChatCompletionChunk").validate(chat_chunk("c-1", 0, "m", 0, {"content": "a"}, "stop"))
    assert not validator(document, "ErrorResponse").is_valid({"detail": "FastAPI's own shape"})


def test_the_responses_answer_and_event_schemas_describe_what_is_sent(document):
    from labkit.serve.responses_wire import Echo, EventSequence, usage_of

    sequence = EventSequence("resp_1", 0, Echo("m", user="u"))
    events = sequence.opening() + [sequence.text_delta("a")]
    events += sequence.closing("a", "length", usage_of(3, 1, 0))
    events += sequence.failure("engine_died", "gone", "a")
    for event in events:
        validator(document, "ResponseStreamEvent").validate(event)
    incomplete = events[-3]["response"]
    assert incomplete["status"] == "incomplete" and incomplete["usage"]["total_tokens"] == 4
    validator(document, "ResponseObject").validate(incomplete)
    assert not validator(document, "ResponseObject").is_valid(dict(incomplete, usage=None))
