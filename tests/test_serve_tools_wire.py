"""Tool calls read from a reply into Anthropic's content blocks and the Responses API's output
items, whole and streamed, without a server. References: the official `anthropic` package's
stream accumulator (`accumulate_event`), which must rebuild from the streamed events the
blocks of the whole answer, and the core's own reading (`read_tool_calls`)."""

from __future__ import annotations

import json
import random

import pytest
from anthropic.lib.streaming._messages import accumulate_event

from labkit.protocols.tool_use import CallSplitter, ToolChoice, ToolSpec
from labkit.serve.anthropic_tools import BlockFrames, answer_content
from labkit.serve.anthropic_wire import frame
from labkit.serve.responses_tools import output_items
from labkit.serve.tool_requests import ToolUse

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = (ToolSpec("get_weather", "The weather", WEATHER),)
AUTO = ToolUse(TOOLS, ToolChoice("auto"))
ONE_AT_A_TIME = ToolUse(TOOLS, ToolChoice("auto", parallel=False))
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
UNKNOWN = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
BAD_ARGS = '<tool_call>{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>'

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
    blocks, made = answer_content(reply, tool_use)
    assert [b["type"] for b in blocks] == kinds and made == called
    for block in blocks:
        if block["type"] == "tool_use":
            assert block["id"].startswith("toolu_") and block["input"] == {"city": "Paris"}
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    for wrong in (UNKNOWN, BAD_ARGS):
        assert (wrong in text) == (wrong in reply)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("reply, tool_use, kinds, called", REPLIES)
def test_the_stream_rebuilds_the_whole_answers_blocks(reply, tool_use, kinds, called, seed):
    cuts = sorted(random.Random(seed).sample(range(1, max(2, len(reply))), min(6, max(0, len(reply) - 1))))
    pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
    splitter, state = CallSplitter(tool_use.specs, tool_use.choice.parallel), BlockFrames()
    frames = [frame("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}})]
    for piece in pieces:
        frames += state.add(splitter.feed(piece))
    frames += state.add(splitter.finish()) + state.end()
    snapshot, buffers = None, {}
    for text in frames:
        event, data = (line.split(": ", 1)[1] for line in text.strip().split("\n"))
        assert json.loads(data)["type"] == event
        snapshot = accumulate_event(event=json.loads(data), current_snapshot=snapshot, json_bufs=buffers)
    rebuilt = [b.model_dump(exclude_none=True) for b in snapshot.content]
    rebuilt = [{k: v for k, v in b.items() if k in ("type", "text", "name", "input")} for b in rebuilt]
    assert blocks_without_ids(answer_content(reply, tool_use)[0]) == rebuilt
    assert state.called == called


@pytest.mark.parametrize("reply, tool_use, kinds, called", REPLIES)
def test_a_reply_becomes_responses_output_items(reply, tool_use, kinds, called):
    items = output_items(reply, "stop", tool_use)
    assert [i["type"] for i in items] == [{"text": "message", "tool_use": "function_call"}[k] for k in kinds]
    assert "".join(i["content"][0]["text"] for i in items if i["type"] == "message") == \
        "".join(b["text"] for b in answer_content(reply, tool_use)[0] if b["type"] == "text")
    for item in items:
        if item["type"] == "function_call":
            assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
            assert json.loads(item["arguments"]) == {"city": "Paris"} and item["status"] == "completed"
