"""Structured outputs on the Responses API (`text.format`) and Anthropic's Messages API
(`output_config.format`), driven by the official `openai` and `anthropic` clients and raw HTTP.

One server for the module. References: `jsonschema` (every completed answer validates against
the schema; one that stopped at its token limit says so), the clients' own structured-output
helpers (`responses.parse` / `.stream` with a pydantic `text_format`, `messages.parse` with an
`output_format`), OpenAI's OpenAPI document (tests/openai_openapi/responses.json: answers and
events validate against it), and the chat route's `response_format`, whose greedy answer the
two routes must repeat for the same conversation and schema.
"""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

MODEL = "smollm2-135m"
DOCUMENT = json.loads((Path(__file__).parent / "openai_openapi" / "responses.json").read_text())
pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "population": {"type": "integer", "minimum": 0},
                   "capital": {"type": "boolean"}},
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
TEXT_FORMAT = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
OUTPUT_CONFIG = {"format": {"type": "json_schema", "schema": SCHEMA}}
QUESTION = "Name a city in France as JSON with city, population and capital."
SEEDS = range(10)
MAX_TOKENS = 60


class City(BaseModel):
    city: str
    population: int
    capital: bool


def schema_check(name: str, value: dict) -> None:
    jsonschema.Draft202012Validator({**DOCUMENT, "$ref": f"#/components/schemas/{name}"}).validate(value)


def valid_or_cut(text: str, stopped_at_limit: bool, schema: dict = SCHEMA) -> bool:
    """True for a complete answer, which must validate; False for one cut at its token limit."""
    if stopped_at_limit:
        return False
    jsonschema.validate(json.loads(text), schema)
    return True


def in_parallel(ask, seeds) -> list:
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(ask, seeds))


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event line, data) of every frame; each frame must have both."""
    out = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n") if line and not line.startswith(":"))
        assert set(lines) == {"event", "data"}, frame
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# -- the Responses API --------------------------------------------------------------------------

def test_responses_json_schema_validates_for_every_seed_at_temperature_1(openai_client):
    def ask(seed):
        return openai_client.responses.with_raw_response.create(
            model=MODEL, input=QUESTION, text={"format": TEXT_FORMAT}, temperature=1.0,
            max_output_tokens=MAX_TOKENS, extra_body={"seed": seed})

    complete = 0
    for raw in in_parallel(ask, list(SEEDS)):
        schema_check("Response", raw.http_response.json())
        response = raw.parse()
        cut = response.status == "incomplete"
        assert not cut or response.incomplete_details.reason == "max_output_tokens"
        complete += valid_or_cut(response.output_text, cut)
        assert response.text.format.model_dump(by_alias=True, exclude_none=True) == TEXT_FORMAT
    assert complete >= len(SEEDS) // 2


def test_responses_parse_and_stream_with_a_pydantic_text_format(openai_client):
    request = dict(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=MAX_TOKENS)
    parsed = openai_client.responses.parse(**request, text_format=City)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    with openai_client.responses.stream(**request, text_format=City) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == parsed.output_text
    assert final.output_parsed == parsed.output_parsed


def test_every_structured_stream_event_is_in_openais_document(server):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": MAX_TOKENS, "temperature": 0,
            "text": {"format": TEXT_FORMAT}, "stream": True}
    answer = httpx.post(server.url + "/v1/responses", json=body, timeout=180)
    assert answer.status_code == 200, answer.text
    events = sse_events(answer.text)
    for name, event in events:
        assert name == event["type"]
        schema_check("ResponseStreamEvent", event)
    last = events[-1][1]["response"]
    assert last["text"]["format"] == TEXT_FORMAT
    assert valid_or_cut(last["output"][0]["content"][0]["text"], last["status"] == "incomplete")


def test_responses_json_object_is_an_object(openai_client):
    response = openai_client.responses.create(model=MODEL, input="Describe a cat as a JSON object.",
                                              text={"format": {"type": "json_object"}}, temperature=0,
                                              max_output_tokens=40)
    assert response.text.format.type == "json_object"
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)


BAD_SCHEMAS = [{"type": "frobnicate"}, {"type": "string", "pattern": "(("},
               {"type": "object", "properties": {"a": {"type": "string"}}}]  # not strict: a is not required


@pytest.mark.parametrize("schema", BAD_SCHEMAS)
def test_a_schema_the_grammar_engine_refuses_is_400_invalid_json_schema(server, openai_client, schema):
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    answer = httpx.post(server.url + "/v1/responses", timeout=60,
                        json={"model": MODEL, "input": "Hi", "max_output_tokens": 4, "text": {"format": fmt}})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == ("invalid_json_schema", "text.format.schema"), error
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, text={"format": fmt})
    assert caught.value.code == "invalid_json_schema"


# -- Anthropic's Messages API -------------------------------------------------------------------

def test_messages_output_config_validates_for_every_sample_at_temperature_1(anthropic_client):
    def ask(_):
        return anthropic_client.messages.create(
            model=MODEL, max_tokens=MAX_TOKENS, output_config=OUTPUT_CONFIG,
            messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 1.0})

    complete = 0
    for message in in_parallel(ask, list(SEEDS)):
        assert [b.type for b in message.content] == ["text"]
        assert message.stop_reason in ("end_turn", "max_tokens")
        complete += valid_or_cut(message.content[0].text, message.stop_reason == "max_tokens")
    assert complete >= len(SEEDS) // 2


def test_messages_parse_and_stream_with_an_output_format(anthropic_client):
    request = dict(model=MODEL, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": QUESTION}],
                   extra_body={"temperature": 0})
    parsed = anthropic_client.messages.parse(**request, output_format=City)
    assert parsed.stop_reason == "end_turn" and isinstance(parsed.parsed_output, City)
    with anthropic_client.messages.stream(**request, output_format=City) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == parsed.content[0].text
    assert final.parsed_output == parsed.parsed_output


def test_a_raw_structured_stream_has_anthropics_events_in_order(server):
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "output_config": OUTPUT_CONFIG,
            "messages": [{"role": "user", "content": QUESTION}], "stream": True}
    answer = httpx.post(server.url + "/v1/messages", json=body, timeout=180)
    assert answer.status_code == 200, answer.text
    got = sse_events(answer.text)
    names = [name for name, _ in got]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", "ping"] + ["content_block_delta"] * deltas + [
        "content_block_stop", "message_delta", "message_stop"]
    text = "".join(data["delta"]["text"] for name, data in got if name == "content_block_delta")
    assert valid_or_cut(text, got[-2][1]["delta"]["stop_reason"] == "max_tokens")


def test_count_tokens_checks_the_format_and_counts_the_same_prompt(anthropic_client, server):
    messages = [{"role": "user", "content": QUESTION}]
    plain = anthropic_client.messages.count_tokens(model=MODEL, messages=messages)
    formatted = anthropic_client.messages.count_tokens(model=MODEL, messages=messages,
                                                       output_config=OUTPUT_CONFIG)
    assert formatted.input_tokens == plain.input_tokens
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.count_tokens(
            model=MODEL, messages=messages, output_config={"format": {"type": "json_schema",
                                                                      "schema": {"type": "frobnicate"}}})


@pytest.mark.parametrize("change, words", [
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "frobnicate"}}}},
     "invalid schema for output_config.format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "string", "pattern": "(("}}}},
     "invalid schema for output_config.format"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}, "name": "x"}}},
     "unknown parameter output_config.format.name"),
    ({"output_config": {"effort": "high"}}, "output_config.effort is not supported"),
    ({"output_format": {"type": "json_schema", "schema": SCHEMA}}, "send output_config.format"),
])
def test_bad_output_configs_are_400_in_anthropics_shape(server, change, words):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **change}
        body |= {"max_tokens": 4} if path == "/v1/messages" else {}
        answer = httpx.post(server.url + path, json=body, timeout=60)
        assert answer.status_code == 400, answer.text
        data = answer.json()
        assert data["type"] == "error" and set(data["error"]) == {"type", "message"}, data
        assert data["error"]["type"] == "invalid_request_error" and words in data["error"]["message"], data


# -- the routes agree ---------------------------------------------------------------------------

def test_the_three_routes_give_the_chat_routes_greedy_json(openai_client, anthropic_client, server):
    question = f"{QUESTION} (run {uuid.uuid4().hex[:8]})"
    message = anthropic_client.messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, output_config=OUTPUT_CONFIG,
        messages=[{"role": "user", "content": question}], extra_body={"temperature": 0})
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
        extra_body={"cache_salt": uuid.uuid4().hex})
    response = openai_client.responses.create(model=MODEL, input=question, text={"format": TEXT_FORMAT},
                                              temperature=0, max_output_tokens=MAX_TOKENS,
                                              extra_body={"cache_salt": uuid.uuid4().hex})
    assert message.content[0].text == chat.choices[0].message.content == response.output_text
    server.wait_until(server.idle)
