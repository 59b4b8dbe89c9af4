"""`POST /v1/responses` on a live server, driven by the official `openai` client and raw HTTP.

One server for the module. References: the chat route's greedy answer to the same
conversation (the Responses route renders it with the same chat template), OpenAI's OpenAPI
document (tests/openai_openapi/responses.json: every answer and every stream event is
validated against it with `jsonschema`), and the `openai` package's own stream accumulator
(`client.responses.stream`), which rebuilds the final response from the events.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from labkit.serve.responses_protocol import RESPONSES_NO_OPS
from live_server import LiveServer

MODEL = "smollm2-135m"
DOCUMENT = json.loads((Path(__file__).parent / "openai_openapi" / "responses.json").read_text())
pytestmark = pytest.mark.slow

CONVERSATION = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
OPENING = ["response.created", "response.in_progress", "response.output_item.added",
           "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    faults = tmp_path_factory.mktemp("faults") / "faults.txt"
    with LiveServer("--model", MODEL, "--kv-cache-tokens", "8192", "--fault-file", str(faults)) as live:
        live.faults = faults
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def schema_check(name: str, value: dict) -> None:
    jsonschema.Draft202012Validator({**DOCUMENT, "$ref": f"#/components/schemas/{name}"}).validate(value)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json=body, timeout=120)


def sse_events(answer: httpx.Response) -> list[dict]:
    """Each event's data, after checking its `event:` line names its type."""
    events = []
    for frame in answer.text.split("\n\n"):
        lines = [line for line in frame.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        event = json.loads(lines[1][len("data: "):])
        assert lines[0] == f"event: {event['type']}"
        events.append(event)
    return events


def unshared() -> dict:
    """A prefix-cache scope of its own: each compared answer computes its whole prompt, so two
    answers to the same ids run the same arithmetic."""
    return {"cache_salt": uuid.uuid4().hex}


def chat_text(client, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                            temperature=0, extra_body=unshared())
    return answer.choices[0].message.content, answer.usage.prompt_tokens


# -- answers ----------------------------------------------------------------------------------

def test_text_input_with_instructions_is_the_chat_routes_greedy_answer(server, client):
    raw = client.responses.with_raw_response.create(
        model=MODEL, instructions=CONVERSATION[0]["content"], input=CONVERSATION[1]["content"],
        max_output_tokens=24, temperature=0, extra_body=unshared())
    body = raw.http_response.json()
    schema_check("Response", body)
    response = raw.parse()
    text, prompt_tokens = chat_text(client, CONVERSATION, 24)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text == text and text
    assert response.usage.input_tokens == prompt_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == CONVERSATION[0]["content"] and response.temperature == 0
    message = response.output[0]
    assert len(response.output) == 1 and message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"


def test_item_input_with_an_earlier_answer_sent_back_is_the_chat_routes_answer(server, client):
    first = client.responses.create(
        model=MODEL, max_output_tokens=16, temperature=0, extra_body=unshared(),
        input=[{"role": "developer", "content": CONVERSATION[0]["content"]},
               {"role": "user", "content": CONVERSATION[1]["content"]}])
    follow_up = "And of Italy?"
    second = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=16, extra_body=unshared(),
        input=[{"type": "message", "role": "system", "content": [{"type": "input_text",
                                                                  "text": CONVERSATION[0]["content"]}]},
               {"role": "user", "content": CONVERSATION[1]["content"]}, *first.output,
               {"role": "user", "content": [{"type": "input_text", "text": follow_up}]}])
    messages = CONVERSATION + [{"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": follow_up}]
    text, prompt_tokens = chat_text(client, messages, 16)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    assert first.output_text == chat_text(client, CONVERSATION, 16)[0]


def test_a_stream_is_openais_event_sequence_and_its_text_is_the_whole_answers(server, client):
    request = dict(model=MODEL, instructions=CONVERSATION[0]["content"], input=CONVERSATION[1]["content"],
                   max_output_tokens=24, temperature=0)
    whole = client.responses.create(**request, extra_body=unshared())
    with client.responses.stream(**request, extra_body=unshared()) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == OPENING + ["response.output_text.delta"] * len(deltas) + CLOSING + [
        "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text == whole.output_text and deltas
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_every_event_on_the_wire_is_in_openais_document(server):
    answer = post(server, {"model": MODEL, "input": "Say hello.", "max_output_tokens": 8, "temperature": 0,
                           "stream": True})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in answer.text
    events = sse_events(answer)
    for event in events:
        schema_check("ResponseStreamEvent", event)
    assert events[0]["response"]["status"] == "in_progress"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == events[-4]["text"]


def test_max_output_tokens_ends_the_answer_as_incomplete_with_the_reason(server, client):
    response = client.responses.create(model=MODEL, input="Count from 1 to 100: 1, 2, 3,",
                                       max_output_tokens=3, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    events = sse_events(post(server, {"model": MODEL, "input": "Count from 1 to 100: 1, 2, 3,",
                                      "max_output_tokens": 3, "temperature": 0, "stream": True}))
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"
    schema_check("Response", last["response"])


NO_OPS = [(name, value) for name, (taken, _) in RESPONSES_NO_OPS.items() for value in taken] + [
    ("text", {"format": {"type": "text"}, "verbosity": "medium"}), ("metadata", {"team": "search"}),
    ("user", "user-1234"), ("tool_choice", None), ("store", None)]


def test_each_value_that_asks_for_nothing_gives_the_answer_without_it(server):
    base = {"model": MODEL, "input": "Count: 1, 2, 3,", "max_output_tokens": 4, "temperature": 0}
    plain = post(server, base | unshared()).json()["output"][0]["content"][0]["text"]
    for name, value in NO_OPS:
        answer = post(server, base | unshared() | {name: value})
        assert answer.status_code == 200, (name, value, answer.text)
        assert answer.json()["output"][0]["content"][0]["text"] == plain, (name, value)


# -- refusals ---------------------------------------------------------------------------------

def assert_openai_error(answer: httpx.Response, status: int, code: str, param: str | None) -> None:
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert (body["error"]["code"], body["error"]["param"]) == (code, param), body


@pytest.mark.parametrize("field, value, param", [
    ("store", True, "store"), ("previous_response_id", "resp_123", "previous_response_id"),
    ("conversation", "conv_123", "conversation"), ("background", True, "background"),
    ("include", ["message.output_text.logprobs"], "include"),
    ("tools", [{"type": "web_search"}], "tools[0].type"),
])
def test_what_a_stateless_server_without_tools_cannot_do_gets_400_by_name(server, field, value, param):
    answer = post(server, {"model": MODEL, "input": "Hi", "max_output_tokens": 4, field: value})
    assert_openai_error(answer, 400, "unsupported_parameter", param)


def test_the_official_client_raises_the_refusal(server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    assert caught.value.code == "unsupported_parameter" and caught.value.param == "previous_response_id"
    assert "keeps no state" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=[
            {"role": "user", "content": "What is 2 + 2?"},
            {"type": "function_call", "call_id": "call_1", "name": "add",
             "arguments": "{\"a\": 2, \"b\": 2}"},
            {"type": "function_call_output", "call_id": "call_7", "output": "4"}])
    assert caught.value.code == "invalid_value" and caught.value.param == "input[2].call_id"


@pytest.mark.parametrize("body, status, code, param", [
    ({"model": MODEL}, 400, "missing_required_parameter", "input"),
    ({"model": MODEL, "input": "Hi", "max_output_tokens": "4"}, 400, "invalid_type", "max_output_tokens"),
    ({"model": MODEL, "input": "Hi", "max_output_tokens": 10 ** 6}, 400, "context_length_exceeded",
     "max_output_tokens"),
    ({"model": MODEL, "input": "Hi", "n": 2}, 400, "unknown_parameter", "n"),
    ({"model": "gpt-4o", "input": "Hi"}, 404, "model_not_found", "model"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "unsupported_parameter", "input[0].content[0].type"),
])
def test_bad_requests_get_openais_error_shape(server, body, status, code, param):
    assert_openai_error(post(server, body), status, code, param)


def test_the_route_is_counted_and_leaks_no_kv_block(server):
    assert server.metric('labkit:requests_total{outcome="ok",route="responses"}') > 0
    assert server.metric('labkit:requests_total{outcome="client_error",route="responses"}') > 0
    server.wait_until(server.idle)


# -- an engine that fails (last: the fault file is shared) -------------------------------------

def test_an_engine_failure_mid_stream_ends_with_error_then_response_failed(server):
    server.faults.write_text("raise-step\n")
    try:
        streamed = post(server, {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True})
        whole = post(server, {"model": MODEL, "input": "Hi", "max_output_tokens": 4})
    finally:
        server.faults.unlink()
    events = sse_events(streamed)
    assert [e["type"] for e in events] == OPENING + ["error", "response.failed"]
    for event in events:
        schema_check("ResponseStreamEvent", event)
    assert events[-2]["code"] == "engine_failure" and "raise-step" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert_openai_error(whole, 503, "engine_failure", None)
    server.wait_until(server.idle)
    assert post(server, {"model": MODEL, "input": "Hi", "max_output_tokens": 2}).status_code == 200
