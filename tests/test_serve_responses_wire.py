"""The Responses API's request rules and answer shapes, without a server.

References: OpenAI's OpenAPI document (vendored in tests/openai_openapi/responses.json; the
answers are validated with `jsonschema` against its `Response` and event schemas) and the
official `openai` package (its types parse the answers, and its stream accumulator rebuilds the
final response from the events).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from labkit.serve.errors import APIError
from labkit.serve.responses_protocol import (RESPONSES_NO_OPS, FunctionCallItem, FunctionCallOutputItem,
                                             MessageItem, ResponsesRequest, messages_of, parse_request)
from labkit.protocols.tool_use import ToolCall, ToolResult, Turn
from labkit.serve.responses_tools import turns_of
from labkit.serve.responses_wire import (Echo, EventSequence, message_item, response_body, sse_event,
                                         status_of, usage_of)

DOCUMENT = json.loads((Path(__file__).parent / "openai_openapi" / "responses.json").read_text())
MODEL = "smollm2-135m"


def schema_check(name: str, value: dict) -> None:
    """`value` against the document's component `name` (OpenAPI 3.1 schemas are JSON Schema)."""
    jsonschema.Draft202012Validator({**DOCUMENT, "$ref": f"#/components/schemas/{name}"}).validate(value)


def refusal(body: dict) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_request(body)
    return caught.value


# -- requests ---------------------------------------------------------------------------------

def test_a_string_input_is_one_user_message_after_the_instructions():
    parsed = parse_request({"model": MODEL, "input": "Hi", "instructions": "Be brief."})
    assert messages_of(parsed) == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}]


def test_items_become_the_chat_routes_messages():
    parsed = parse_request({"model": MODEL, "input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                          {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}]},
        {"role": "user", "content": "again"}]})
    assert messages_of(parsed) == [{"role": "system", "content": "Rules."},
                                   {"role": "user", "content": "a\nb"},
                                   {"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": "again"}]


def test_function_call_items_become_the_cores_turns_and_an_unknown_call_id_is_400():
    items = [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "Let me add."},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 2}'},
             {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 1, "b": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "4"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "2"}]}]
    parsed = parse_request({"model": MODEL, "input": items})
    assert isinstance(parsed.items[2], FunctionCallItem) and parsed.items[2].name == "add"
    assert isinstance(parsed.items[4], FunctionCallOutputItem) and parsed.items[4].output == "4"
    turns = turns_of(parsed)
    assert turns == [Turn("user", "What is 2+2?"),
                     Turn("assistant", "Let me add.", (ToolCall("call_1", "add", {"a": 2, "b": 2}),
                                                       ToolCall("call_2", "add", {"a": 1, "b": 1}))),
                     ToolResult("call_1", "add", "4"), ToolResult("call_2", "add", "2")]
    for bad, param in (({"call_id": "call_9"}, "input[4].call_id"), ({"output": "x"}, None)):
        broken = [dict(item) for item in items]
        broken[4] |= bad
        if param is None:
            broken[2]["arguments"] = "[1, 2]"
            param = "input[2].arguments"
        with pytest.raises(APIError) as caught:
            turns_of(parse_request({"model": MODEL, "input": broken}))
        assert (caught.value.status, caught.value.param) == (400, param), caught.value.message


@pytest.mark.parametrize("field, value, param", [
    ("store", True, "store"), ("previous_response_id", "resp_1", "previous_response_id"),
    ("conversation", "conv_1", "conversation"), ("background", True, "background"),
    ("include", ["message.output_text.logprobs"], "include"),
    ("tools", [{"type": "web_search"}], "tools[0].type"),
    ("tool_choice", {"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice.type"),
    ("text", {"verbosity": "low"}, "text.verbosity"),
    ("truncation", "auto", "truncation"), ("reasoning", {"effort": "low"}, "reasoning"),
    ("stream_options", {"include_obfuscation": True}, "stream_options.include_obfuscation"),
])
def test_what_this_server_cannot_do_is_refused_by_name(field, value, param):
    body = {"model": MODEL, "input": "Hi", field: value}
    if field == "stream_options":
        body["stream"] = True
    error = refusal(body)
    assert (error.status, error.code, error.param) == (400, "unsupported_parameter", param), error.message


@pytest.mark.parametrize("field, value", [
    ("store", False), ("background", False), ("include", []), ("tools", []), ("tool_choice", "none"),
    ("tool_choice", "auto"), ("parallel_tool_calls", True), ("service_tier", "auto"),
    ("truncation", "disabled"), ("text", {"format": {"type": "text"}, "verbosity": "medium"}),
    ("top_logprobs", 0), ("previous_response_id", None),
])
def test_values_that_ask_for_nothing_are_taken(field, value):
    parse_request({"model": MODEL, "input": "Hi", field: value})


@pytest.mark.parametrize("body, code, param", [
    ({"model": MODEL}, "missing_required_parameter", "input"),
    ({"model": MODEL, "input": []}, "invalid_value", "input"),
    ({"model": MODEL, "input": "Hi", "max_output_tokens": "5"}, "invalid_type", "max_output_tokens"),
    ({"model": MODEL, "input": "Hi", "max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
    ({"model": MODEL, "input": "Hi", "temperature": 3}, "invalid_value", "temperature"),
    ({"model": MODEL, "input": "Hi", "n": 2}, "unknown_parameter", "n"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "invalid_type", "input[0].role"),
    ({"model": MODEL, "input": [{"role": "user", "content": "x", "colour": 1}]}, "unknown_parameter",
     "input[0].colour"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "missing_required_parameter", "input[0].content[0].text"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
     "invalid_value", "input[0].content[0].type"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "unsupported_parameter", "input[0].content[0].type"),
    ({"model": MODEL, "input": [{"type": "item_reference", "id": "msg_1"}]}, "unsupported_parameter",
     "input[0].type"),
    ({"model": MODEL, "input": [{"type": "telepathy"}]}, "invalid_value", "input[0].type"),
    ({"model": MODEL, "input": [7]}, "invalid_type", "input[0]"),
    ({"model": MODEL, "input": "Hi", "stream_options": {}}, "invalid_value", "stream_options"),
])
def test_bad_requests_get_400_naming_the_field(body, code, param):
    error = refusal(body)
    assert (error.status, error.code, error.param) == (400, code, param), error.message


def resolve(schema: dict) -> dict:
    while "$ref" in schema:
        schema = DOCUMENT["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def documented_defaults() -> dict:
    """CreateResponse's fields that have a `default:` (on an `anyOf` branch: OpenAPI 3.1's
    spelling of a nullable field), and the default."""
    def properties(schema: dict) -> dict:
        schema = resolve(schema)
        found = {}
        for part in schema.get("allOf", []):
            found |= properties(part)
        return found | schema.get("properties", {})

    defaults = {}
    for name, field in properties(DOCUMENT["components"]["schemas"]["CreateResponse"]).items():
        for schema in (field, resolve(field), *map(resolve, resolve(field).get("anyOf", []))):
            if "default" in schema:
                defaults[name] = schema["default"]
    return defaults


# OpenAI stores responses by default; this server stores nothing, and says so (README)
DEVIATIONS = {"store": True}


def test_every_documented_default_is_taken_but_the_stored_response():
    defaults = documented_defaults()
    assert {"temperature", "top_p", "background", "store", "stream", "truncation"} <= set(defaults)
    for name, value in defaults.items():
        if DEVIATIONS.get(name, object()) == value:
            assert refusal({"model": MODEL, "input": "Hi", name: value}).code == "unsupported_parameter"
            continue
        parse_request({"model": MODEL, "input": "Hi", name: value})
        assert name in ResponsesRequest.model_fields or name in RESPONSES_NO_OPS, name


# -- answers ----------------------------------------------------------------------------------

ECHO = Echo(MODEL, instructions="Be brief.", max_output_tokens=8, temperature=0.0, metadata={"k": "v"})


@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_a_whole_answer_is_openais_response_object(finish_reason):
    status, reason = status_of(finish_reason)
    body = response_body("resp_1", 1700000000, ECHO, status, [message_item("msg_1", "Hello", status)],
                         usage_of(12, 3, 8), reason)
    schema_check("Response", body)
    parsed = Response.model_validate(body)
    assert parsed.output_text == "Hello" and parsed.status == status
    assert parsed.usage.input_tokens_details.cached_tokens == 8 and parsed.usage.total_tokens == 15
    assert (parsed.incomplete_details.reason if parsed.incomplete_details else None) == \
        ("max_output_tokens" if finish_reason == "length" else None)


def stream_of(sequence: EventSequence, deltas: list[str], finish_reason: str) -> list[dict]:
    events = sequence.opening() + [sequence.text_delta(d) for d in deltas]
    return events + sequence.closing("".join(deltas), finish_reason, usage_of(5, len(deltas), 0))


@pytest.mark.parametrize("finish_reason, last", [("stop", "response.completed"),
                                                 ("length", "response.incomplete")])
def test_a_stream_is_openais_event_sequence_and_the_client_rebuilds_it(finish_reason, last):
    events = stream_of(EventSequence("resp_1", 1700000000, ECHO), ["Hel", "lo", "!"], finish_reason)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=[], text_format=omit)
    adapter = TypeAdapter(ResponseStreamEvent)
    rebuilt = []
    for event in events:
        schema_check("ResponseStreamEvent", event)
        rebuilt += state.handle_event(adapter.validate_python(event))
        frame = sse_event(event)
        assert frame.startswith(f"event: {event['type']}\ndata: ")
        assert json.loads(frame.split("data: ", 1)[1]) == event
    assert rebuilt[-1].type == last and rebuilt[-1].response.output_text == "Hello!"


def test_a_failed_stream_ends_with_error_then_response_failed():
    sequence = EventSequence("resp_1", 1700000000, ECHO)
    events = (sequence.opening() + [sequence.text_delta("Hi")]
              + sequence.failure("engine_died", "the worker died", "Hi"))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    for event in events:
        schema_check("ResponseStreamEvent", event)
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.output_text == "Hi"


def test_a_message_items_text_joins_its_parts():
    item = MessageItem(role="user", content=[{"type": "input_text", "text": "a"},
                                             {"type": "input_text", "text": "b"}])
    assert item.text == "a\nb"


# -- text.format --------------------------------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}


@pytest.mark.parametrize("sent, echoed", [
    (None, {"type": "text"}),
    ({"type": "text"}, {"type": "text"}),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "city", "schema": CITY},
     {"type": "json_schema", "name": "city", "schema": CITY, "strict": False}),
    ({"type": "json_schema", "name": "city", "schema": CITY, "strict": True, "description": "A city."},
     {"type": "json_schema", "name": "city", "schema": CITY, "strict": True, "description": "A city."}),
])
def test_text_format_is_taken_and_echoed_as_openai_echoes_it(sent, echoed):
    body = {"model": MODEL, "input": "Hi"} | ({} if sent is None else {"text": {"format": sent}})
    echo = Echo.of(parse_request(body).fields, MODEL)
    answer = response_body("resp_1", 1700000000, echo, "completed",
                           [message_item("msg_1", '{"city": "Paris"}', "completed")], usage_of(5, 3, 0))
    assert answer["text"] == {"format": echoed}
    schema_check("Response", answer)
    parsed = Response.model_validate(answer)
    assert parsed.text.format.type == echoed["type"]


@pytest.mark.parametrize("fmt, code, param", [
    ({"type": "xml"}, "invalid_type", "text.format.type"),
    ({"name": "x"}, "missing_required_parameter", "text.format.type"),
    ({"type": "json_schema", "schema": CITY}, "missing_required_parameter", "text.format.name"),
    ({"type": "json_schema", "name": "x"}, "missing_required_parameter", "text.format.schema"),
    ({"type": "json_schema", "name": "no spaces", "schema": CITY}, "invalid_value", "text.format.name"),
    ({"type": "json_schema", "name": "x", "schema": True}, "invalid_type", "text.format.schema"),
    ({"type": "json_schema", "name": "x", "schema": CITY, "strict": "yes"}, "invalid_type",
     "text.format.strict"),
    ({"type": "json_object", "schema": CITY}, "unknown_parameter", "text.format.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": CITY}}, "unknown_parameter",
     "text.format.json_schema"),
])
def test_a_malformed_text_format_is_400_naming_its_field(fmt, code, param):
    error = refusal({"model": MODEL, "input": "Hi", "text": {"format": fmt}})
    assert (error.status, error.code, error.param) == (400, code, param), error.message
