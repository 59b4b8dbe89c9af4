"""Anthropic's Messages API on `labkit serve`: the official `anthropic` client and raw HTTP.

One server (engine in its own worker process, two API keys, a fault file) serves the module.
The references: the chat route's answer for the same conversation (greedy, so the same text),
`/tokenize` for prompt lengths (itself held to `transformers` in test_serve_tokenize.py), the
event order of Anthropic's streaming docs, and its documented error shape.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from live_server import LiveServer

MODEL = "smollm2-135m"
KEYS = ("key-alpha", "key-beta")
pytestmark = pytest.mark.slow
SYSTEM = "You are a terse assistant."
QUESTION = [{"role": "user", "content": "Name three primary colours."}]
# this client no longer has temperature, top_p, top_k as arguments (Anthropic's newest models
# refuse them); the API still documents them, and this service takes them
GREEDY = {"temperature": 0}
EVENTS = ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
          "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    return tmp_path_factory.mktemp("faults") / "faults.txt"


@pytest.fixture(scope="module")
def server(tmp_path_factory, faults):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("\n".join(KEYS) + "\n")
    with LiveServer("--model", MODEL, "--api-key-file", str(keys), "--kv-cache-tokens", "8192",
                    "--fault-file", str(faults)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEYS[0], max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0)


def post(server, path, body, key=KEYS[0]):
    return httpx.post(server.url + path, json=body, headers={"x-api-key": key}, timeout=120)


def frames(server, body, key=KEYS[0]) -> list[tuple[str, dict]]:
    """(event, data) of every frame of a raw stream; each must have its `event:` line."""
    with httpx.stream("POST", server.url + "/v1/messages", json=body | {"stream": True},
                      headers={"x-api-key": key}, timeout=120) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        text = "".join(answer.iter_text())
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(lines) == {"event", "data"}, block
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def prompt_tokens(server, messages, add_generation_prompt=True) -> int:
    answer = httpx.post(server.url + "/tokenize", json={"messages": messages,
                                                       "add_generation_prompt": add_generation_prompt},
                        headers={"x-api-key": KEYS[0]}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["count"]


def test_a_message_is_the_chat_routes_greedy_answer(client, chat, server):
    message = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=QUESTION,
                                     extra_body=GREEDY)
    reference = chat.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                             messages=[{"role": "system", "content": SYSTEM}, *QUESTION])
    choice = reference.choices[0]
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and [b.type for b in message.content] == ["text"]
    assert message.content[0].text == choice.message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    assert message.stop_sequence is None
    u = message.usage
    assert u.output_tokens == reference.usage.completion_tokens
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens \
        == reference.usage.prompt_tokens == prompt_tokens(server, [{"role": "system", "content": SYSTEM},
                                                                   *QUESTION])


def test_a_streamed_message_is_the_whole_one(client):
    kwargs = dict(model=MODEL, max_tokens=12, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens \
        == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_the_raw_stream_has_anthropics_events_in_order(server):
    got = frames(server, {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": QUESTION})
    names = [event for event, _ in got]
    deltas = names.count("content_block_delta")
    assert deltas >= 1 and names == EVENTS[:3] + ["content_block_delta"] * deltas + EVENTS[4:]
    assert all(data["type"] == event for event, data in got)
    start, stop = got[0][1]["message"], got[-2][1]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert got[1][1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0
               for e, d in got if e == "content_block_delta")
    assert stop["delta"]["stop_reason"] in ("end_turn", "max_tokens") and stop["usage"]["output_tokens"] <= 6


def test_a_stop_sequence_ends_the_message_where_the_chat_route_stops(client, chat):
    kwargs = dict(model=MODEL, max_tokens=24, messages=QUESTION, extra_body=GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    word = next(w for w in text.split()[1:] if len(w) > 2)
    message = client.messages.create(**kwargs, stop_sequences=["zzzz", word])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    reference = chat.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=QUESTION,
                                             stop=[word])
    assert message.content[0].text == reference.choices[0].message.content == text[:text.index(word)]


def test_count_tokens_is_the_prompt_that_runs(client, server):
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    assert counted.input_tokens == prompt_tokens(server, [{"role": "system", "content": SYSTEM}, *QUESTION])


def test_the_prefix_cache_is_reported_as_anthropics_cache_and_never_across_keys(server):
    preamble = f"Run {time.monotonic()}. " + "A long preamble about inference engines and caches. " * 12
    system = [{"type": "text", "text": preamble, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "system": system, "messages": QUESTION}
    length = prompt_tokens(server, [{"role": "system", "content": preamble}, *QUESTION])
    to_breakpoint = prompt_tokens(server, [{"role": "system", "content": preamble}],
                                  add_generation_prompt=False)

    def usage(key):
        answer = post(server, "/v1/messages", body, key)
        assert answer.status_code == 200, answer.text
        u = answer.json()["usage"]
        assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == length
        return u

    first = usage(KEYS[0])
    assert first["cache_read_input_tokens"] == 0
    assert first["cache_creation_input_tokens"] == to_breakpoint
    again = usage(KEYS[0])
    assert again["cache_read_input_tokens"] > 0
    other = usage(KEYS[1])
    assert other["cache_read_input_tokens"] == 0
    streamed = frames(server, body)[-2][1]["usage"]
    assert streamed["cache_read_input_tokens"] == again["cache_read_input_tokens"]
    without = dict(body, system=preamble)
    plain = post(server, "/v1/messages", without).json()["usage"]
    assert plain["cache_creation_input_tokens"] == 0 and plain["cache_read_input_tokens"] > 0


def test_a_top_level_cache_control_puts_the_breakpoint_after_the_last_block(server):
    question = [{"role": "user", "content": f"Run {time.monotonic()}: name three primary colours."}]
    body = {"model": MODEL, "max_tokens": 1, "messages": question, "cache_control": {"type": "ephemeral"}}
    length = prompt_tokens(server, question)
    without_generation_prompt = prompt_tokens(server, question, add_generation_prompt=False)
    answer = post(server, "/v1/messages", body)
    assert answer.status_code == 200, answer.text
    u = answer.json()["usage"]
    assert u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == without_generation_prompt
    assert u["input_tokens"] == length - without_generation_prompt


@pytest.mark.parametrize("change, status, kind, words", [
    ({"temperature_x": 1}, 400, "invalid_request_error", "unknown parameter temperature_x"),
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": "5"}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "claude-3"}, 404, "not_found_error", "claude-3"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     "server tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": "x"}]}]}, 400, "invalid_request_error",
     "no earlier tool_use block"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "not supported"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]}, 400,
     "invalid_request_error", "prefill"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"max_tokens": 10 ** 6}, 400, "invalid_request_error", "max_tokens"),
])
def test_errors_are_in_anthropics_shape(server, change, status, kind, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION} | change
    body = {k: v for k, v in body.items() if v is not None}
    answer = post(server, "/v1/messages", body)
    assert answer.status_code == status, answer.text
    data = answer.json()
    assert data["type"] == "error" and set(data["error"]) == {"type", "message"}, data
    assert data["error"]["type"] == kind and words in data["error"]["message"], data


def test_the_client_raises_anthropics_exceptions(server, client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-3", max_tokens=4, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=QUESTION, extra_body={"top_k": -1})
    stranger = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(model=MODEL, max_tokens=4, messages=QUESTION)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.count_tokens(model=MODEL, messages=QUESTION)


def test_a_failure_after_the_stream_started_is_an_error_event(server, faults):
    body = {"model": MODEL, "max_tokens": 400, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Count from one to one thousand in words."}]}
    seen, data = [], None
    try:
        with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEYS[0]},
                          timeout=120) as answer:
            for line in answer.iter_lines():
                data = line[6:] if line.startswith("data: ") else data
                if line.startswith("event: "):
                    seen.append(line[7:])
                    if line == "event: content_block_delta" and not faults.exists():
                        faults.write_text("raise-step\n")
    finally:
        faults.unlink(missing_ok=True)
    assert seen[:3] == EVENTS[:3] and seen[-1] == "error" and "message_stop" not in seen
    assert json.loads(data)["type"] == "error" and json.loads(data)["error"]["type"] == "api_error"
    server.wait_until(server.idle, timeout=30)  # the failed request's blocks were freed
