"""`response_format` through `labkit serve`, read by the official `openai` client: a
json_schema answer parses and validates (`jsonschema`) unless it stopped at max_tokens and
says so, whole and streamed; json_object gives an object; the completions route takes the
same object (vLLM's extension); a schema the grammar engine refuses, a strict schema that
breaks OpenAI's rules and a malformed response_format are 400s in OpenAI's error shape."""

import json

import httpx
import jsonschema
import pytest

MODEL = "smollm2-135m"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "population": {"type": "integer", "minimum": 0},
                   "capital": {"type": "boolean"}},
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Name a city in France as JSON with city, population and capital."}]


def check(text, finish_reason):
    if finish_reason == "length":
        return False
    assert finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


def test_json_schema_answers_parse_and_validate(openai_client, server):
    reply = openai_client.chat.completions.create(model=MODEL, messages=ASK, response_format=FORMAT,
                                                  max_tokens=60, temperature=1.0, seed=3, n=4)
    complete = sum(check(c.message.content, c.finish_reason) for c in reply.choices)
    assert complete >= 2
    greedy = openai_client.chat.completions.create(model=MODEL, messages=ASK, response_format=FORMAT,
                                                   max_tokens=60, temperature=0)
    assert check(greedy.choices[0].message.content, greedy.choices[0].finish_reason)
    server.wait_until(server.idle)


def test_a_streamed_answer_is_the_same_json(openai_client):
    chunks = openai_client.chat.completions.create(model=MODEL, messages=ASK, response_format=FORMAT,
                                                   max_tokens=60, temperature=0, stream=True)
    text, finish = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert check(text, finish)


def test_max_tokens_first_says_length(openai_client):
    reply = openai_client.chat.completions.create(model=MODEL, messages=ASK, response_format=FORMAT,
                                                  max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length"


def test_the_parse_helper_of_the_official_client(openai_client):
    """openai's own structured-output path: `chat.completions.parse` with a pydantic model."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=20)
        population: int
        capital: bool

    reply = openai_client.chat.completions.parse(model=MODEL, messages=ASK, response_format=City,
                                                 max_tokens=60, temperature=0)
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(choice.message.parsed, City)


def test_json_object_and_completions(openai_client):
    reply = openai_client.chat.completions.create(model=MODEL,
                                                  messages=[{"role": "user", "content": "A JSON object."}],
                                                  response_format={"type": "json_object"}, max_tokens=40,
                                                  temperature=0)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    text = openai_client.completions.create(model=MODEL, prompt="A French city as JSON:", max_tokens=60,
                                            temperature=0, extra_body={"response_format": FORMAT})
    assert check(text.choices[0].text, text.choices[0].finish_reason)


@pytest.mark.parametrize("response_format, param, code", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
     "response_format.json_schema.schema", "invalid_json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                             "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}},
     "response_format.json_schema.schema", "invalid_json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
     "response_format.json_schema.schema", "invalid_json_schema"),
    ({"type": "json_schema"}, "response_format.json_schema", "missing_required_parameter"),
    ({"type": "json_object", "json_schema": {"name": "x"}}, "response_format.json_schema", "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}}, "response_format.json_schema.name",
     "invalid_value"),
    ({"type": "xml"}, "response_format.type", "invalid_type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": True}}, "response_format.json_schema.schema",
     "invalid_type"),
])
def test_bad_formats_are_400_in_openais_shape(server, response_format, param, code):
    for route, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "x"})):
        reply = httpx.post(server.url + route, json={"model": MODEL, "response_format": response_format,
                                                     "max_tokens": 5, **body}, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert (error["param"], error["code"]) == (param, code), error


def test_ignore_eos_with_a_format_is_refused(server):
    reply = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 5,
                                                                  "response_format": FORMAT, "ignore_eos": True},
                       timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "ignore_eos"
    server.wait_until(server.idle)
