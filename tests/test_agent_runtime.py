"""The agent loop: a scripted model over two rounds with one trace id; malformed and unknown
calls answered, never run; and the loop against a live `labkit serve` (the official `openai`
client), whose second request reuses the first's prefix from the cache, while sandbox
escapes run beside another client's requests."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from live_server import LiveServer

from labkit.agent.runtime import ScriptedModel, run_agent
from labkit.agent.sandbox import ErrorKind, Limits, Sandbox, SandboxUnavailable
from labkit.agent.serve_model import ServeModel
from labkit.agent.tool_calls import parse_reply
from labkit.agent.toolbox import default_registry, run_python
from labkit.agent.tools import ToolRegistry

MODEL = "smollm2-135m"


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_two_rounds_with_one_trace_id():
    model = ScriptedModel([
        "Let me work it out.\n" + call("calculator", expression="17 * 23")
        + call("word_count", text="the quick brown fox"),
        "17 * 23 = 391, and the text has 4 words.",
    ])
    trace = run_agent(model, default_registry(), [{"role": "user", "content": "17 * 23? And count words."}],
                      max_rounds=4, trace_id="trace-abc")
    assert trace.stopped == "answered" and trace.answer == "17 * 23 = 391, and the text has 4 words."
    assert model.trace_ids == ["trace-abc", "trace-abc"]
    assert {step.trace_id for step in trace.steps} == {"trace-abc"}
    assert [(s.round, s.kind, s.name) for s in trace.steps] == [
        (0, "model", "scripted-0"), (0, "tool", "calculator"), (0, "tool", "word_count"),
        (1, "model", "scripted-1")]
    assert all(s.elapsed_s >= 0 for s in trace.steps)
    assert [s.started_s for s in trace.steps] == sorted(s.started_s for s in trace.steps)
    calc, words = trace.tool_steps()
    assert calc.result.output == repr(17 * 23)
    assert json.loads(words.result.output)["words"] == len("the quick brown fox".split())
    # the second prompt: the first, the assistant's reply as generated, then the tool turns
    first, second = model.seen
    assert second[:len(first)] == first
    assistant, *tools = second[len(first):]
    assert assistant["content"] == model.replies[0]
    ids = [c["id"] for c in assistant["tool_calls"]]
    assert ids == [t["tool_call_id"] for t in tools] == ["call_0_0", "call_0_1"]
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"expression": "17 * 23"}
    assert [t["content"] for t in tools] == ["391", words.result.output]


def test_malformed_and_unknown_calls_are_answered_not_run():
    model = ScriptedModel([
        call("rm_rf", path="/") + "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": }"
        "</tool_call>" + call("calculator", expr="1"),
        "Sorry.",
    ])
    trace = run_agent(model, default_registry(), [{"role": "user", "content": "go"}])
    outcomes = {s.call_id: s.result.error for s in trace.tool_steps()}
    assert outcomes == {"call_0_0": ErrorKind.REFUSED, "call_0_2": ErrorKind.BAD_ARGUMENTS,
                        "call_0_1": ErrorKind.BAD_ARGUMENTS}
    told = [m for m in model.seen[1] if m["role"] == "tool"]
    assert len(told) == 3 and all(m["content"].startswith("error (") for m in told)


def test_calls_past_max_calls_in_one_turn_are_refused():
    model = ScriptedModel(["".join(call("calculator", expression=f"{i} * 2") for i in range(5)), "done"])
    trace = run_agent(model, default_registry(), [{"role": "user", "content": "go"}], max_calls=3)
    assert [s.result.ok for s in trace.tool_steps()] == [True, True, True, False, False]
    assert trace.tool_steps()[-1].result.error is ErrorKind.REFUSED
    rows = trace.rows()
    assert [r["kind"] for r in rows] == ["model"] + ["tool"] * 5 + ["model"]
    assert rows[0]["calls"] == 5 and rows[-2]["error"] == "refused" and rows[1]["error"] is None


def test_the_loop_stops_at_max_rounds():
    model = ScriptedModel([call("calculator", expression=f"{i} + 1") for i in range(5)])
    trace = run_agent(model, default_registry(), [{"role": "user", "content": "count"}], max_rounds=3)
    assert trace.stopped == "max_rounds" and len(trace.model_steps()) == 3 and trace.answer == ""


@pytest.mark.parametrize("reply, names, problems", [
    ("no call here", [], 0),
    (call("a", x=1) + " and " + call("b"), ["a", "b"], 0),
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', ["a"], 0),  # arguments as a string
    ("<tool_call>{\"name\": \"a\"", [], 1),                                          # unclosed
    ("<tool_call>[1]</tool_call>", [], 1),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', [], 1),
])
def test_parse_reply(reply, names, problems):
    parsed = parse_reply(reply)
    assert [c.name for c in parsed.calls] == names and len(parsed.problems) == problems
    assert "<tool_call>" not in parsed.text


PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",", '"a"',
                          "[", "]", "1", "null", " ", "\n", "text"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(PIECES, st.text(max_size=5)), max_size=30).map("".join))
def test_parse_reply_never_raises_and_never_passes_a_broken_call(reply):
    parsed = parse_reply(reply)
    for found in parsed.calls:
        assert isinstance(found.name, str) and isinstance(found.arguments, dict)
    # a reply with a block has a call or a problem: nothing is silently dropped
    assert (len(parsed.calls) + len(parsed.problems) > 0) == ("<tool_call>" in reply)


# What this 135M model does reliably at temperature 0: copy a line it is asked to copy. The
# loop does not know that; it sees a tool call in the reply, runs it, and resumes.
COPY_A_CALL = ("Repeat this line exactly, and nothing else:\n"
               '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>')


@pytest.fixture(scope="module")
def server():
    with LiveServer("--model", MODEL, "--kv-cache-tokens", "8192", "--log-level", "info") as live:
        yield live


@pytest.mark.slow
def test_the_loop_over_http_resumes_from_the_cached_prefix(server):
    model = ServeModel(server.url, MODEL, max_tokens=40)
    trace = run_agent(model, default_registry(), [{"role": "user", "content": COPY_A_CALL}], max_rounds=2,
                      trace_id="trace-live-1")
    first, second = trace.model_steps()
    assert [c.name for c in first.turn.parsed.calls] == ["calculator"]
    (tool,) = trace.tool_steps()
    assert tool.result.ok and tool.result.output == "391"
    assert {s.trace_id for s in trace.steps} == {"trace-live-1"}
    assert first.turn.response_id != second.turn.response_id
    # the second prompt starts with the first and the reply as generated: the cache serves
    # all of the first prompt's whole 16-token blocks at least (the reply's blocks too, where
    # the reply re-encodes to the tokens generated), never the new tail
    assert second.turn.prompt_tokens > first.turn.prompt_tokens
    assert second.turn.cached_tokens > 0
    assert first.turn.prompt_tokens // 16 * 16 - 16 <= second.turn.cached_tokens < second.turn.prompt_tokens
    print(f"auto: prompt {first.turn.prompt_tokens} + reply {first.turn.completion_tokens}; resume prompt "
          f"{second.turn.prompt_tokens}, cached {second.turn.cached_tokens}")
    assert server.idle() or server.wait_until(server.idle, timeout=10) >= 0
    # the server saw the trace id on both requests (X-Request-Id, its access log)
    logged = [json.loads(line[line.index("{"):]) for line in server.lines if '"trace-live-1"' in line]
    assert [(r["request_id"], r["response_id"]) for r in logged if r.get("route") == "chat"] == [
        ("trace-live-1", first.turn.response_id), ("trace-live-1", second.turn.response_id)]


@pytest.mark.slow
def test_a_forced_call_resumes_with_the_whole_reply_cached(server):
    """With the call forced (a named tool_choice), the assistant turn the server re-renders from
    `tool_calls` is the text the grammar made the model write, and it re-encodes to the same
    tokens: the resume prompt is served from the cache through the reply, not only through
    the first prompt (full 16-token blocks; the tool's result is the new tail)."""
    model = ServeModel(server.url, MODEL, max_tokens=64,
                       tool_choice={"type": "function", "function": {"name": "calculator"}})
    ask = "Forced. " + COPY_A_CALL  # not the other test's prompt, whose resume the cache may hold
    trace = run_agent(model, default_registry(), [{"role": "user", "content": ask}], max_rounds=2)
    first, second = trace.model_steps()
    assert first.turn.finish_reason == "tool_calls", first.turn
    assert [c.name for c in first.turn.parsed.calls] == ["calculator"]
    through_reply = first.turn.prompt_tokens + first.turn.completion_tokens
    print(f"forced: prompt {first.turn.prompt_tokens} + reply {first.turn.completion_tokens}; resume prompt "
          f"{second.turn.prompt_tokens}, cached {second.turn.cached_tokens}")
    assert second.turn.cached_tokens >= through_reply // 16 * 16 - 16 > first.turn.prompt_tokens // 16 * 16 - 16
    assert second.turn.cached_tokens < second.turn.prompt_tokens
    server.wait_until(server.idle)


@pytest.mark.slow
def test_escapes_end_as_tool_errors_while_the_server_serves_others(server):
    box = Sandbox(Limits(wall_s=8, cpu_s=3, nproc=16))
    try:
        box.probe()
    except SandboxUnavailable as e:
        pytest.skip(f"the sandbox cannot run here: {e}")
    registry = ToolRegistry([run_python(box)])
    escapes = {
        "socket": "import socket; socket.create_connection(('127.0.0.1', %d), timeout=2)"
                  % int(server.url.rsplit(":", 1)[1]),
        "write": "open('/etc/labkit-agent-escape', 'w').write('x')",
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "loop": "while True: pass",
        "allocation": "b = bytearray(4 << 30)",
        "environment": "import os; assert 'PYTEST_CURRENT_TEST' in os.environ, sorted(os.environ)",
    }
    results, spans = {}, {}

    def escape(name: str, code: str) -> None:
        start = time.monotonic()
        results[name] = registry.call("run_python", {"code": code})
        spans[name] = (start, time.monotonic())

    threads = [threading.Thread(target=escape, args=item) for item in escapes.items()]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    other = ServeModel(server.url, MODEL, max_tokens=8)  # another client, meanwhile
    asked = time.monotonic()
    answers = [other.generate([{"role": "user", "content": f"Say {word}."}], [], f"other-{word}", 0)
               for word in ("yes", "no")]
    answered = time.monotonic()
    for thread in threads:
        thread.join(timeout=60)
    assert all(a.completion_tokens > 0 for a in answers)
    starved = {name: r.detail for name, r in results.items() if r.error is ErrorKind.TIMEOUT
               and name not in ("fork bomb", "loop") and (r.cpu_s or 0.0) < 0.5}
    if starved:  # the tools run at idle priority: a machine with every core busy gives them none
        pytest.skip(f"escapes killed by the wall clock before they had CPU: {starved}")
    assert spans["fork bomb"][0] < answered and spans["fork bomb"][1] > asked  # they overlapped
    assert {name: r.ok for name, r in results.items()} == {name: False for name in escapes}
    assert results["fork bomb"].error in (ErrorKind.TIMEOUT, ErrorKind.CPU)
    assert results["loop"].error in (ErrorKind.CPU, ErrorKind.TIMEOUT)
    assert results["allocation"].error is ErrorKind.MEMORY
    assert results["socket"].error is ErrorKind.CRASHED and results["write"].error is ErrorKind.CRASHED
    assert "AssertionError" in results["environment"].detail
    assert server.get("/health").status_code == 200
