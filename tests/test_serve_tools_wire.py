"""Tool calls read from a reply into Anthropic's content blocks and the Responses API's output
items, whole and streamed, without a server; invalid calls reported on both. References: the
official `anthropic` package's stream accumulator (`accumulate_event`), which must rebuild from
the streamed events the blocks of the whole answer, and its and the `openai` package's types,
which must parse every answer and event; OpenAI's OpenAPI document (vendored: every Responses
answer and event validates against it); the core's own reasons, written out by hand."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import jsonschema
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from labkit.engine.llm_engine import RequestOutput, SampleOutput, TokenEvent
from labkit.protocols.tool_use import ToolChoice, ToolSpec
from labkit.serve.anthropic_tools import BlockFrames, answer_content
from labkit.serve.anthropic_wire import message_body, message_events
from labkit.serve.engine_client import EngineFailure
from labkit.serve.openapi_schema import AnthropicMessage
from labkit.serve.responses_openapi import ResponseObject
from labkit.serve.responses_tools import ToolStreamWriter, output_items
from labkit.serve.responses_wire import Echo, EventSequence, whole_response
from labkit.serve.tool_requests import ToolUse

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = (ToolSpec("get_weather", "The weather", WEATHER),)
AUTO = ToolUse(TOOLS, ToolChoice("auto"))
ONE_AT_A_TIME = ToolUse(TOOLS, ToolChoice("auto", parallel=False))
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
UNKNOWN = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
BAD_ARGS = '<tool_call>{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>'
UNCLOSED = '<tool_call>{"name": "get_weather", "argu'
DOCUMENT = json.loads((Path(__file__).parent / "openai_openapi" / "responses.json").read_text())

REPLIES = [  # (reply, tool use, the blocks' types, a valid call made)
    ("Let me look.\n" + CALL, AUTO, ["text", "tool_use"], True),
    (CALL, AUTO, ["tool_use"], True),
    (CALL + "\n" + CALL, AUTO, ["tool_use", "tool_use"], True),
    (CALL + "\n" + CALL, ONE_AT_A_TIME, ["tool_use", "text"], True),   # the second call stays text
    ("Hmm. " + UNKNOWN, AUTO, ["text"], False),
    (BAD_ARGS, AUTO, ["text"], False),
    ("Just text.", AUTO, ["text"], False),
    ("", AUTO, ["text"], False),
]


def blocks_without_ids(blocks: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


@pytest.mark.parametrize("reply, tool_use, kinds, called", REPLIES)
def test_a_reply_becomes_anthropics_blocks_and_invalid_calls_stay_text(reply, tool_use, kinds, called):
    blocks, made, _ = answer_content(reply, tool_use)
    assert [b["type"] for b in blocks] == kinds and made == called
    for block in blocks:
        if block["type"] == "tool_use":
            assert block["id"].startswith("toolu_") and block["input"] == {"city": "Paris"}
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    for wrong in (UNKNOWN, BAD_ARGS):
        assert (wrong in text) == (wrong in reply)


class PlayedCall:
    """What `message_events` asks of a `labkit.serve.calls.Call`: a reply played back as the
    engine's token events, cut into `pieces`, then its output (or an engine failure)."""

    response_id, model, keepalive_s = "msg_1", "m", None

    def __init__(self, pieces: list[str], finish_reason: str = "stop", failure: Exception | None = None):
        self.pieces, self.failure, self.outcome = pieces, failure, None
        sample = SampleOutput(0, list(range(len(pieces))), "".join(pieces), finish_reason)
        self.streams = [type("Stream", (), {"output": RequestOutput("r", [1, 2, 3], [sample], 0.0, None, None,
                                                                   0, 0)})()]

    async def events(self, keepalive_s):
        for i, piece in enumerate(self.pieces):
            yield 0, TokenEvent("r", 0, i, piece)
        if self.failure is not None:
            raise self.failure

    def abort_all(self) -> None:
        pass

    def finish(self, outcome: str, error: BaseException | None = None) -> None:
        self.outcome = outcome


def streamed(call: PlayedCall, blocks: BlockFrames | None) -> list[tuple[str, dict]]:
    """The frames `message_events` writes for the call, as (event, data)."""
    async def frames():
        return [text async for text in message_events(call, 3, (), lambda ids: "", 0, blocks)]

    out = []
    for text in asyncio.run(frames()):
        event, data = (line.split(": ", 1)[1] for line in text.strip().split("\n"))
        assert json.loads(data)["type"] == event
        out.append((event, json.loads(data)))
    return out


def cut(reply: str, seed: int) -> list[str]:
    cuts = sorted(random.Random(seed).sample(range(1, max(2, len(reply))), min(6, max(0, len(reply) - 1))))
    return [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]


def rebuilt_message(events: list[tuple[str, dict]]):
    """The message the `anthropic` client's accumulator rebuilds; each event parsed by its types."""
    snapshot, buffers, adapter = None, {}, TypeAdapter(RawMessageStreamEvent)
    for event, data in events:
        if event != "ping":
            snapshot = accumulate_event(event=adapter.validate_python(data), current_snapshot=snapshot,
                                        json_bufs=buffers)
    return snapshot


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("reply, tool_use, kinds, called", REPLIES)
def test_the_stream_rebuilds_the_whole_answers_blocks(reply, tool_use, kinds, called, seed):
    blocks = BlockFrames(tool_use)
    events = streamed(PlayedCall(cut(reply, seed) or [""]), blocks)
    assert [e for e, _ in events][:2] == ["message_start", "ping"]
    assert [e for e, _ in events][-2:] == ["message_delta", "message_stop"]
    rebuilt = [b.model_dump(exclude_none=True) for b in rebuilt_message(events).content]
    rebuilt = [{k: v for k, v in b.items() if k in ("type", "text", "name", "input")} for b in rebuilt]
    assert blocks_without_ids(answer_content(reply, tool_use).blocks) == rebuilt
    assert blocks.called == called
    assert events[-2][1]["delta"]["stop_reason"] == ("tool_use" if called else "end_turn")


def test_a_plain_stream_and_a_failed_one_go_through_the_same_writer():
    """Without tools: message_start, the text block opened before the first ping, its deltas,
    the closing frames; an engine failure ends either kind of stream with one `error` event."""
    events = streamed(PlayedCall(["Hel", "lo"]), None)
    assert [e for e, _ in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "message_delta",
                                      "message_stop"]
    assert rebuilt_message(events).content[0].text == "Hello"
    assert "invalid_tool_uses" not in events[-2][1]["delta"]
    for blocks in (None, BlockFrames(AUTO)):
        call = PlayedCall(["Hel", "lo"], failure=EngineFailure("the worker died"))
        events = streamed(call, blocks)
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
        assert "message_delta" not in [e for e, _ in events] and call.outcome == "failed"


INVALID = [  # (reply, tool use, each invalid call as (name, arguments, the start of the reason))
    ("Hmm. " + UNKNOWN, AUTO, [("get_time", "{}", "there is no tool named 'get_time'")]),
    (BAD_ARGS, AUTO, [("get_weather", '{"town": "Paris"}',
                       "the arguments for 'get_weather' do not match its schema at (the arguments)")]),
    (CALL + "\n" + CALL, ONE_AT_A_TIME, [("get_weather", '{"city": "Paris"}',
                                          "parallel tool calls are off")]),
    ("Say " + UNCLOSED, AUTO, [(None, '{"name": "get_weather", "argu', "<tool_call> without </tool_call>")]),
    ('<tool_call>{"name": 1}</tool_call> ' + CALL, AUTO, [(None, '{"name": 1}', 'a call is {"name"')]),
]


def check_listed(entries: list[dict], expected: list[tuple], id_prefix: str) -> None:
    assert [(e["name"], e["arguments"]) for e in entries] == [(name, args) for name, args, _ in expected]
    for entry, (_, _, reason) in zip(entries, expected):
        assert set(entry) == {"id", "name", "arguments", "error"} and entry["id"].startswith(id_prefix)
        assert entry["error"].startswith(reason), entry["error"]


@pytest.mark.parametrize("reply, tool_use, expected", INVALID)
def test_anthropic_lists_invalid_calls_whole_and_streamed(reply, tool_use, expected):
    read = answer_content(reply, tool_use)
    check_listed(read.invalid, expected, "toolu_")
    text = "".join(b["text"] for b in read.blocks if b["type"] == "text")
    assert all(args in text for _, args, _ in expected)   # the call's text stays as written
    valid = reply.count(CALL) if tool_use.choice.parallel else min(1, reply.count(CALL))
    uses = [b for b in read.blocks if b["type"] == "tool_use"]
    assert len(uses) == valid and all(b["input"] == {"city": "Paris"} for b in uses)
    sample = SampleOutput(0, [5, 6], reply, "stop")
    body = message_body("msg_1", "m", RequestOutput("r", [1, 2], [sample], 0.0, None, None, 0, 0), (),
                        lambda ids: reply, 0, read.blocks, read.called, read.invalid)
    assert body["stop_reason"] == ("tool_use" if read.called else "end_turn")
    parsed = Message.model_validate(body)    # the official client's type keeps the extension
    assert parsed.model_extra["invalid_tool_uses"] == read.invalid
    assert AnthropicMessage.model_validate(body).invalid_tool_uses    # /openapi.json describes it
    events = streamed(PlayedCall(cut(reply, 1)), BlockFrames(tool_use))
    delta = TypeAdapter(RawMessageStreamEvent).validate_python(events[-2][1]).delta
    check_listed(delta.model_extra["invalid_tool_uses"], expected, "toolu_")
    assert delta.stop_reason == body["stop_reason"]
    assert "invalid_tool_uses" not in message_body("msg_1", "m", RequestOutput(
        "r", [1, 2], [sample], 0.0, None, None, 0, 0), (), lambda ids: reply, 0)


def schema_check(name: str, value: dict) -> None:
    jsonschema.Draft202012Validator({**DOCUMENT, "$ref": f"#/components/schemas/{name}"}).validate(value)


@pytest.mark.parametrize("finish_reason, status", [("stop", "completed"), ("length", "incomplete")])
@pytest.mark.parametrize("reply, tool_use, expected", INVALID)
def test_responses_lists_invalid_calls_whole_and_streamed(reply, tool_use, expected, finish_reason, status):
    read = output_items(reply, finish_reason, tool_use)
    check_listed(read.invalid, expected, "call_")
    sample = SampleOutput(0, [5, 6], reply, finish_reason)
    output = RequestOutput("r", [1, 2], [sample], 0.0, None, None, 0, 0)
    body = whole_response("resp_1", 1700000000, Echo("m"), output, read.items, read.invalid)
    schema_check("Response", body)
    parsed = Response.model_validate(body)
    assert parsed.status == status and parsed.model_extra["invalid_function_calls"] == read.invalid
    assert ResponseObject.model_validate(body).invalid_function_calls    # /openapi.json describes it
    writer = ToolStreamWriter(EventSequence("resp_1", 1700000000, Echo("m")), tool_use)
    frames = writer.opening()
    for i, piece in enumerate(cut(reply, 2)):
        frames += writer.event(0, TokenEvent("r", 0, i, piece))
    frames += writer.closing([output])
    state, adapter = ResponseStreamState(input_tools=[], text_format=omit), TypeAdapter(ResponseStreamEvent)
    rebuilt = []
    for text in frames:
        event = json.loads(text.split("data: ", 1)[1])
        schema_check("ResponseStreamEvent", event)
        rebuilt += state.handle_event(adapter.validate_python(event))
    last = rebuilt[-1]
    assert last.type == f"response.{status}" and last.response.status == status
    check_listed(last.response.model_extra["invalid_function_calls"], expected, "call_")
    assert [i.type for i in last.response.output] == [i["type"] for i in read.items]


@pytest.mark.parametrize("reply, tool_use, kinds, called", REPLIES)
def test_a_reply_becomes_responses_output_items(reply, tool_use, kinds, called):
    items, invalid = output_items(reply, "stop", tool_use)
    assert [i["type"] for i in items] == [{"text": "message", "tool_use": "function_call"}[k] for k in kinds]
    assert [(b["name"], b["arguments"]) for b in invalid] == \
        [(b["name"], b["arguments"]) for b in answer_content(reply, tool_use).invalid]
    assert "".join(i["content"][0]["text"] for i in items if i["type"] == "message") == \
        "".join(b["text"] for b in answer_content(reply, tool_use)[0] if b["type"] == "text")
    for item in items:
        if item["type"] == "function_call":
            assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
            assert json.loads(item["arguments"]) == {"city": "Paris"} and item["status"] == "completed"
