"""Tools on Anthropic's Messages API and the Responses API, over the shared tool-calling core,
driven by the official `anthropic` and `openai` clients and raw HTTP.

One server for the module. References: `jsonschema` (a call's input / arguments validate
against the tool's schema), the clients' stream accumulators (`messages.stream`,
`responses.stream` rebuild the calls from the events, and must rebuild the whole answer's),
Anthropic's documented event order for a tool_use block, and OpenAI's OpenAPI document
(tests/openai_openapi/responses.json: every answer and event validates against it). Invalid
calls are provoked without depending on what the model chooses: a reply format whose only
answer writes a block that is not JSON (it ends by itself), or a forced call cut by the token
limit (no closing tag); the reference for each is the reply's own text.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

MODEL = "smollm2-135m"
DOCUMENT = json.loads((Path(__file__).parent / "openai_openapi" / "responses.json").read_text())
pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ASK = "What is the weather in Paris?"
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                  "parameters": WEATHER, "strict": True}
ORPHAN_OUTPUT = {"type": "function_call_output", "call_id": "call_9", "output": "x"}
# A reply that writes a call the model's way but not as JSON: the reply format forces it (the
# reply is this JSON string) while the tools stay on auto, so the call is read and refused
NOT_A_CALL = "<tool_call>get_time()</tool_call>"
WRITES_NOT_A_CALL = {"type": "json_schema", "schema": {"type": "string", "const": NOT_A_CALL}}
BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "frobnicate"}}}


def schema_check(name: str, value: dict) -> None:
    jsonschema.Draft202012Validator({**DOCUMENT, "$ref": f"#/components/schemas/{name}"}).validate(value)


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n") if line and not line.startswith(":"))
        assert set(lines) == {"event", "data"}, frame
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# -- Anthropic ----------------------------------------------------------------------------------

def test_a_forced_tool_use_whole_and_streamed(anthropic_client, server):
    request = dict(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": ASK}],
                   tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": "get_weather"},
                   extra_body={"temperature": 0})
    message = anthropic_client.messages.create(**request)
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    use = message.content[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    with anthropic_client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == use.input
    body = {k: v for k, v in request.items() if k != "extra_body"} | {"temperature": 0, "stream": True}
    got = sse_events(httpx.post(server.url + "/v1/messages", json=body, timeout=180).text)
    assert [name for name, _ in got] == ["message_start", "ping", "content_block_start",
                                          "content_block_delta", "content_block_stop", "message_delta",
                                          "message_stop"]
    start, delta = got[2][1], got[3][1]
    assert start["content_block"] == {"type": "tool_use", "id": start["content_block"]["id"],
                                      "name": "get_weather", "input": {}}
    assert delta["delta"]["type"] == "input_json_delta"
    assert json.loads(delta["delta"]["partial_json"]) == use.input
    assert got[5][1]["delta"]["stop_reason"] == "tool_use"


def test_any_choice_calls_a_tool_for_every_sample_at_temperature_1(anthropic_client):
    for _ in range(3):
        message = anthropic_client.messages.create(
            model=MODEL, max_tokens=60, messages=[{"role": "user", "content": ASK}], tools=[ANTHROPIC_TOOL],
            tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 1.0})
        if message.stop_reason == "max_tokens":
            continue
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(uses) == 1
        jsonschema.validate(uses[0].input, WEATHER)


def test_a_tool_result_goes_back_and_count_tokens_counts_the_tools(anthropic_client):
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris", "unit": "celsius"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    message = anthropic_client.messages.create(model=MODEL, max_tokens=20, messages=history,
                                               tools=[ANTHROPIC_TOOL], extra_body={"temperature": 0})
    assert message.stop_reason in ("end_turn", "tool_use", "max_tokens")
    with_tools = anthropic_client.messages.count_tokens(model=MODEL, messages=history, tools=[ANTHROPIC_TOOL])
    without = anthropic_client.messages.count_tokens(model=MODEL, messages=history)
    assert with_tools.input_tokens > without.input_tokens > 0


@pytest.mark.parametrize("change, words", [
    ({"tools": [dict(ANTHROPIC_TOOL, input_schema=BAD_SCHEMA)]}, "tools[0].input_schema"),
    ({"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool", "name": "get_time"}}, "get_time"),
    ({"tools": [ANTHROPIC_TOOL], "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "18 C"}]}]}, "toolu_9"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "server tools"),
])
def test_tool_errors_are_400_in_anthropics_shape(server, anthropic_client, change, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": ASK}]} | change
    answer = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    data = answer.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", data
    assert words in data["error"]["message"], data
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(**body)


INVALID_CASES = {"ended": ("the call is not JSON", "end_turn", "completed"),
                 "cut": ("<tool_call> without </tool_call>", "max_tokens", "incomplete")}


def check_invalid_entries(entries: list[dict], text: str, case: str, id_prefix: str) -> None:
    """One entry for the reply's one block: no name (none could be read), its text as written
    between the tags, and the reason; the reply's text is the block as the model wrote it."""
    if case == "ended":
        assert json.loads(text) == NOT_A_CALL    # the forced reply, whole
    else:
        assert text.startswith('<tool_call>{"name": "get_weather"') and "</tool_call>" not in text
    written = text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    assert len(entries) == 1, entries
    entry = entries[0]
    assert set(entry) == {"id", "name", "arguments", "error"} and entry["id"].startswith(id_prefix)
    assert (entry["name"], entry["arguments"]) == (None, written)
    assert entry["error"].startswith(INVALID_CASES[case][0]), entry["error"]


def anthropic_invalid_request(case: str) -> dict:
    request = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[ANTHROPIC_TOOL])
    if case == "ended":
        return request | dict(max_tokens=40, extra_body={"temperature": 0,
                                                        "output_config": {"format": WRITES_NOT_A_CALL}})
    return request | dict(max_tokens=16, tool_choice={"type": "any"}, extra_body={"temperature": 0})


@pytest.mark.parametrize("case", INVALID_CASES)
def test_an_invalid_tool_use_is_listed_and_never_a_block_whole_and_streamed(anthropic_client, case):
    request = anthropic_invalid_request(case)
    message = anthropic_client.messages.create(**request)
    assert [b.type for b in message.content] == ["text"]
    assert message.stop_reason == INVALID_CASES[case][1]    # what a text reply's would be
    listed = message.model_extra["invalid_tool_uses"]
    check_invalid_entries(listed, message.content[0].text, case, "toolu_")
    with anthropic_client.messages.stream(**request) as stream:
        deltas = [event for event in stream if event.type == "message_delta"]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == message.content[0].text
    assert final.stop_reason == deltas[0].delta.stop_reason == message.stop_reason and len(deltas) == 1
    streamed = deltas[0].delta.model_extra["invalid_tool_uses"]
    check_invalid_entries(streamed, final.content[0].text, case, "toolu_")
    assert [e | {"id": ""} for e in streamed] == [e | {"id": ""} for e in listed]


# -- the Responses API --------------------------------------------------------------------------

def test_a_forced_function_call_whole_and_streamed(openai_client, server):
    request = dict(model=MODEL, input=ASK, tools=[RESPONSES_TOOL], max_output_tokens=60, temperature=0,
                   tool_choice={"type": "function", "name": "get_weather"})
    raw = openai_client.responses.with_raw_response.create(**request)
    schema_check("Response", raw.http_response.json())
    response = raw.parse()
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(response.output) == len(calls) == 1
    call = calls[0]
    assert call.call_id.startswith("call_") and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert response.tools[0].name == "get_weather" and response.tool_choice.name == "get_weather"
    with openai_client.responses.stream(**request) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["function_call"]
    assert final.output[0].arguments == call.arguments
    events = sse_events(httpx.post(server.url + "/v1/responses", json=request | {"stream": True},
                                   timeout=180).text)
    for name, event in events:
        assert name == event["type"]
        schema_check("ResponseStreamEvent", event)
    assert [name for name, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))


def test_required_calls_validate_for_every_seed_at_temperature_1(openai_client):
    def ask(seed):
        return openai_client.responses.create(
            model=MODEL, input=ASK, tools=[RESPONSES_TOOL], tool_choice="required", parallel_tool_calls=False,
            max_output_tokens=60, temperature=1.0, extra_body={"seed": seed})

    with ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(ask, range(10)))
    for response in responses:
        if response.status == "incomplete":
            assert response.incomplete_details.reason == "max_output_tokens"
            continue
        calls = [item for item in response.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather", response.output
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


def test_a_function_call_output_goes_back(openai_client):
    history = [{"role": "user", "content": ASK},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
               {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}]
    response = openai_client.responses.create(model=MODEL, input=history, tools=[RESPONSES_TOOL],
                                              max_output_tokens=20, temperature=0)
    assert response.status in ("completed", "incomplete") and response.output


def responses_invalid_request(case: str) -> dict:
    request = dict(model=MODEL, input=ASK, tools=[RESPONSES_TOOL], temperature=0)
    if case == "ended":
        return request | dict(max_output_tokens=40, text={"format": WRITES_NOT_A_CALL | {"name": "reply"}})
    return request | dict(max_output_tokens=16, tool_choice="required")


@pytest.mark.parametrize("case", INVALID_CASES)
def test_an_invalid_function_call_is_listed_and_never_an_item_whole_and_streamed(openai_client, server, case):
    request, status = responses_invalid_request(case), INVALID_CASES[case][2]
    raw = openai_client.responses.with_raw_response.create(**request)
    schema_check("Response", raw.http_response.json())
    response = raw.parse()
    assert [item.type for item in response.output] == ["message"] and response.status == status
    listed = response.model_extra["invalid_function_calls"]
    check_invalid_entries(listed, response.output_text, case, "call_")
    with openai_client.responses.stream(**request) as stream:
        last = [event for event in stream][-1]
    assert last.type == f"response.{status}" and [i.type for i in last.response.output] == ["message"]
    assert last.response.output_text == response.output_text
    streamed = last.response.model_extra["invalid_function_calls"]
    check_invalid_entries(streamed, last.response.output_text, case, "call_")
    assert [e | {"id": ""} for e in streamed] == [e | {"id": ""} for e in listed]
    events = sse_events(httpx.post(server.url + "/v1/responses", json=request | {"stream": True},
                                   timeout=180).text)
    for name, event in events:
        schema_check("ResponseStreamEvent", event)
    assert "function_call" not in {e.get("item", {}).get("type") for _, e in events}
    assert events[-1][1]["response"]["invalid_function_calls"][0]["error"] == listed[0]["error"]


@pytest.mark.parametrize("change, code, param", [
    ({"tools": [dict(RESPONSES_TOOL, parameters=BAD_SCHEMA)]}, "invalid_function_parameters",
     "tools[0].parameters"),
    ({"tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "get_time"}},
     "invalid_value", "tool_choice"),
    ({"tools": [RESPONSES_TOOL], "input": [{"role": "user", "content": ASK}, ORPHAN_OUTPUT]},
     "invalid_value", "input[1].call_id"),
    ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
])
def test_tool_errors_are_400_in_openais_shape(server, openai_client, change, code, param):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 4} | change
    answer = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param), error
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(**body)
    server.wait_until(server.idle)
