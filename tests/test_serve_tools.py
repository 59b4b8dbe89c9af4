"""Tool calling on `labkit serve`'s chat route, driven by the official `openai` client and raw
HTTP: required and named choices are forced (every call validates with `jsonschema`), whole
and streamed; the client's own stream helper accumulates the streamed deltas into the calls
of the whole answer; no block text leaks into streamed content; `parallel_tool_calls: false`
gives one call; `auto` never passes an invalid call on as valid; `none` renders no tools and
reads nothing; a conversation with past calls and results is taken and served from the
prefix cache; bad tools, choices and tool turns are 400s in OpenAI's shape; no KV block is
left behind."""

import json

import httpx
import jsonschema
import pytest

MODEL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_calls(calls, names=tuple(SCHEMAS)):
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


@pytest.mark.parametrize("tool_choice, names", [
    ("required", ("get_weather", "add")),
    ({"type": "function", "function": {"name": "add"}}, ("add",)),
])
def test_forced_calls_whole_and_streamed_agree(openai_client, server, tool_choice, names):
    ask = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
               temperature=0, max_tokens=60)
    whole = openai_client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = valid_calls(whole.message.tool_calls, names)
    assert len(calls) == 1
    with openai_client.chat.completions.stream(**ask) as stream:  # the client's own accumulation of deltas
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and not streamed.message.content
    assert valid_calls(streamed.message.tool_calls, names) == calls
    server.wait_until(server.idle)


def raw_stream(server, body):
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_raw_stream_deltas_carry_calls_by_index_and_no_block_text(server):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
            "max_tokens": 100}
    chunks = raw_stream(server, body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert calls and [t["index"] for t in calls] == list(range(len(calls)))  # parallel: greedy repeats
    assert all(t["id"].startswith("call_") and t["type"] == "function" for t in calls)
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] in ("tool_calls", "length") and all(r is None for r in reasons[:-1])
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    assert (whole["message"]["content"] or "") == content  # a cut-off block is content in both
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert "<tool_call>" not in content or "invalid_tool_calls" in whole["message"]


def test_parallel_off_gives_one_call_and_on_may_give_more(openai_client):
    one = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False,
                                                temperature=1, seed=5, max_tokens=60)
    assert one.choices[0].finish_reason == "tool_calls" and len(valid_calls(one.choices[0].message.tool_calls)) == 1
    many = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                 tool_choice="required", parallel_tool_calls=True,
                                                 temperature=0, max_tokens=90)
    assert len(valid_calls(many.choices[0].message.tool_calls)) >= 2  # SmolLM2 greedily repeats the call


FEW_SHOT = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "What is 7 + 8?"},
]


def test_auto_reads_calls_and_never_passes_an_invalid_one(server):
    """Whatever SmolLM2 writes at temperature 1, a `tool_calls` entry validates and a block
    that does not is reported in `invalid_tool_calls` with its text kept in the content."""
    seen = {"calls": 0, "invalid": 0, "text": 0}
    for seed in range(6):
        body = {"model": MODEL, "messages": FEW_SHOT, "tools": TOOLS, "temperature": 1.0, "seed": seed,
                "max_tokens": 48, "logit_bias": {"44": 4}}  # 44 is "<": a nudge towards writing a block
        choice = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
        message = choice["message"]
        for call in message.get("tool_calls", []):
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        for bad in message.get("invalid_tool_calls", []):
            assert set(bad) == {"id", "name", "arguments", "error"} and bad["error"]
            assert bad["arguments"] is None or bad["arguments"] in message["content"]
        assert (choice["finish_reason"] == "tool_calls") == bool(message.get("tool_calls")) or \
            choice["finish_reason"] == "length"
        seen["calls"] += len(message.get("tool_calls", []))
        seen["invalid"] += len(message.get("invalid_tool_calls", []))
        seen["text"] += not message.get("tool_calls")
    print(seen)


def test_none_renders_no_tools_and_reads_nothing(openai_client):
    plain = openai_client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
    none = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                                 temperature=0, max_tokens=12)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None


def test_a_conversation_with_calls_and_results_is_taken_and_cached(openai_client, server):
    add = {"type": "function", "function": {"name": "add"}}
    first = openai_client.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=TOOLS,
                                                  tool_choice=add, temperature=0, max_tokens=40)
    call = first.choices[0].message.tool_calls[0]
    follow = FEW_SHOT + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "15"}]
    second = openai_client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, temperature=0,
                                                   max_tokens=12)
    assert second.choices[0].finish_reason in ("stop", "length")
    # the forced reply, rendered back, is the tokens the model wrote: the cache serves the whole
    # prompt before the tool's result (full blocks only)
    before_result = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= (before_result // 16) * 16 - 16
    server.wait_until(server.idle)


BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "frobnicate"}}}


@pytest.mark.parametrize("change, param, code", [
    ({"tools": [{"type": "function", "function": {"name": "bad name", "parameters": ADD}}]},
     "tools[0].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": BAD_SCHEMA}}]},
     "tools[0].function.parameters", "invalid_function_parameters"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": {
        "y": {"not": {"type": "string"}}}}}}]}, "tools[0].function.parameters", "invalid_function_parameters"),
    ({"tools": [{"type": "function", "function": {"name": "x", "strict": True, "parameters": {
        "type": "object", "properties": {"y": {"type": "string"}}}}}]}, "tools[0].function.parameters",
     "invalid_function_parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "invalid_value"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "missing_required_parameter"),
    ({"tools": []}, "tools", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_type"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "invalid_value"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages[1].tool_call_id",
     "invalid_value"),
    ({"messages": [{"role": "tool", "content": "1"}]}, "messages[0].tool_call_id", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": FEW_SHOT[1]["tool_calls"]}]},
     "messages[0].tool_calls", "invalid_value"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "invalid_value"),
])
def test_bad_tool_requests_are_400_in_openais_shape(server, change, param, code):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5} | change
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error


def test_no_kv_block_is_left_behind(server):
    server.wait_until(server.idle)
