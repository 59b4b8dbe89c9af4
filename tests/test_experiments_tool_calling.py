"""Chapter 34's experiment module: the call-format table against json + jsonschema read
independently, the task scoring against hand-labelled traces, the Server-Timing reader, and
(slow) the cached and cold resumes against a live `labkit serve`."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from labkit.agent.runtime import ScriptedModel, run_agent
from labkit.agent.serve_model import server_timing
from labkit.agent.toolbox import default_registry
from labkit.experiments import tool_calling as tc
from labkit.experiments import tool_escapes as te
from labkit.experiments import tool_injection as ti


def reference_outcome(reply: str) -> str:
    """What the call in `reply` should come to, read with json and jsonschema directly."""
    match = re.search(r"<tool_call>(.*?)</tool_call>", reply, re.DOTALL)
    if match is None:
        return "bad_arguments"
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return "bad_arguments"
    tools = {s["function"]["name"]: s["function"]["parameters"] for s in default_registry().specs()}
    if call["name"] not in tools:
        return "refused"
    arguments = call["arguments"]
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    if not jsonschema.Draft202012Validator(tools[call["name"]]).is_valid(arguments):
        return "bad_arguments"
    try:
        eval(compile(arguments["expression"], "<case>", "eval"), {"__builtins__": {}})  # literals only
    except ZeroDivisionError:
        return "bad_arguments"
    return "ok"


def test_call_format_rows_agree_with_json_and_jsonschema():
    rows = tc.call_format_rows()
    assert [r["the reply holds"] for r in rows] == [label for label, _ in tc.FORMAT_CASES]
    for row, (_, reply) in zip(rows, tc.FORMAT_CASES):
        assert row["outcome"] == reference_outcome(reply), row
        # a call that failed before the handler never reached the tool's code
        refused_early = row["outcome"] == "refused" or (
            row["outcome"] == "bad_arguments" and "ZeroDivisionError" not in row["the model is told"])
        assert row["tool code ran"] is not refused_early
        assert row["the model is told"].startswith("error (") is (row["outcome"] != "ok")


def test_counted_counts_runs_of_the_tools_code_only():
    registry, runs = tc.counted(default_registry())
    registry.call("calculator", {"expression": "1 + 1"})
    registry.call("calculator", {"expr": "1"})
    registry.call("shell", {})
    assert runs == {"calculator": 1}


def test_the_scripted_injection_runs_only_the_note():
    trace, runs = ti.scripted_injection(None)
    assert runs == {"read_note": 1}
    assert [s.name for s in trace.tool_steps()] == ["read_note"]
    assert trace.messages[2]["content"] == ti.INJECTION  # the output kept as it was, as data


def trace_of(replies: list[str], question: str = "What is 2 + 3?"):
    return run_agent(ScriptedModel(replies), default_registry(), [{"role": "user", "content": question}],
                     max_rounds=2)


@pytest.mark.parametrize("replies, expected", [
    ([tc.call_text("calculator", expression="2 + 3"), "It is 5."], (True, True, True, True)),
    ([tc.call_text("calculator", expression="2 * 3"), "It is 6."], (True, True, False, False)),
    ([tc.call_text("calculator", expr="2 + 3"), "It is 5."], (True, False, False, True)),
    (["2 + 3 = 5."], (False, False, False, True)),
    (["The sum is 1,005 or 15."], (False, False, False, False)),
    ([tc.call_text("word_count", text="a b c d e"), "5"], (True, True, False, True)),
    ([tc.call_text("calculator", expression="2 + 3"), tc.call_text("calculator", expression="5")],
     (True, True, True, False)),  # never answered within the rounds
])
def test_tool_use_outcome(replies, expected):
    outcome = tc.tool_use_outcome(tc.Task("What is 2 + 3?", 5), trace_of(replies))
    assert (outcome.attempted, outcome.valid, outcome.right_call, outcome.right_answer) == expected


def test_arithmetic_tasks_are_reproducible_and_right():
    tasks = tc.arithmetic_tasks(30, seed=3)
    assert tasks == tc.arithmetic_tasks(30, seed=3) and tasks != tc.arithmetic_tasks(30, seed=4)
    for task in tasks:
        a, op, b = re.match(r"What is (\d+) ([-+*]) (\d+)\?", task.question).groups()
        assert task.answer == eval(f"{a} {op} {b}")


def test_numbers_in():
    assert tc.numbers_in("It is -32, not 1,005 or 7.") == [-32, 1005, 7]


def test_server_timing():
    assert server_timing("read;dur=0.12, prefill;dur=52.3,decode;dur=7") == {
        "read": 0.12, "prefill": 52.3, "decode": 7.0}
    assert server_timing(None) == {}


def test_escapes_name_the_attempts_of_issue_32():
    attempts = te.escapes(8123, 4242)
    assert len(attempts) == 6 and "8123" in attempts["connect to the server's port"]
    assert "/proc/4242/environ" in attempts["read the server's environment"]
    for code in attempts.values():
        compile(code, "<attempt>", "exec")


@pytest.fixture(scope="module")
def server():
    with tc.agent_server() as live:
        yield live


@pytest.mark.slow
def test_cached_and_cold_resumes_over_http(server):
    traces, rows = tc.cached_and_cold(server.url, tc.COPY_A_CALL, repeats=1, max_rounds=2)
    assert [r["round"] for r in rows] == [0, 1] and len(traces) == 1
    first, resume = rows
    assert first["calls"] == 1 and first["cached_tokens"] == 0  # a scope of its own: nothing cached
    # the resume's prompt starts with the first and its reply: the cache serves at least the
    # first prompt's whole blocks; the cold replay of the same request finds nothing
    assert first["prompt_tokens"] // 16 * 16 - 16 <= resume["cached_tokens"] < resume["prompt_tokens"]
    assert resume["cold_cached_tokens"] == 0 and first["cold_cached_tokens"] == 0
    assert all(r["same_reply"] for r in rows)
    assert resume["prefill_ms"] > 0 and resume["cold_prefill_ms"] > 0
    count = ti.boundaries_on_the_wire(server.url, ti.scripted_injection(None)[0].messages,
                                      ti.injection_registry(None)[0].specs())
    assert count.im_start_ids == count.turns  # the injected <|im_start|> is not one of them
    assert count.injected_as_text[2:5] == ["im", "_", "start"]
    # the rendering the chapter tokenizes is the chat route's: the same prompt length
    trace, _ = ti.scripted_injection(None)
    specs = ti.injection_registry(None)[0].specs()
    rendered = ti.template_messages(trace.messages, specs)
    ids = httpx.post(server.url + "/tokenize", timeout=60, json={
        "model": tc.MODEL, "messages": rendered, "add_generation_prompt": True}).json()["count"]
    wire = [dict(m) for m in trace.messages]
    wire[1] = {"role": "assistant", "content": None, "tool_calls": wire[1]["tool_calls"]}
    answer = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": tc.MODEL, "messages": [{k: v for k, v in m.items() if k != "name"} for m in wire],
        "tools": specs, "max_tokens": 1}).json()
    assert answer["usage"]["prompt_tokens"] == ids


def test_forced_first_forces_only_the_first_round():
    import httpx2
    from openai import OpenAI
    from test_agent_serve_model import ANSWER

    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx2.Response(200, json=ANSWER)

    model = tc.ForcedFirst("http://127.0.0.1:9", max_tokens=8)
    for side in (model.forced, model.free):
        side.client = OpenAI(base_url="http://127.0.0.1:9/v1", api_key="none", max_retries=0,
                             http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    tools = default_registry().specs()
    for round in range(3):
        model.generate([{"role": "user", "content": "2 + 3?"}], tools, "t", round)
    assert [body["tool_choice"] for body in seen] == ["required", "auto", "auto"]
    assert all(body["tools"] == tools for body in seen)


# -- the other client's windows ------------------------------------------------------------------

QUIET = te.Window("quiet", 5.0, [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0), (4.0, 5.5)])
ATTACK = te.Window("attack", 5.0, [(0.0, 0.5), (0.5, 3.5), (3.5, 4.5), (4.5, 5.2)], attack=(0.2, 3.0))


def test_windows_count_throughput_and_the_requests_the_escapes_overlapped():
    assert QUIET.completed_per_s() == 4 / 5 and ATTACK.completed_per_s() == 3 / 5
    assert QUIET.latencies() == [1.0, 1.0, 1.0, 1.0, 1.5]  # the one straddling the end included
    # overlapping [0.2, 3.0]: the first two (the third began at 3.5, after the escapes ended)
    assert ATTACK.during_attack() == [0.5, 3.0] and QUIET.during_attack() == []
    served = te.ServedMeanwhile([QUIET, ATTACK, QUIET, te.Window("attack", 5.0, QUIET.spans, (0, 1))], 5.0)
    assert served.of_kind("attack")[0] is ATTACK
    assert served.quiet_s == QUIET.latencies() * 2
    assert served.under_attack_s == [0.5, 3.0, 1.0]
    low, high, word = served.rate_difference()
    assert (round(low, 6), round(high, 6), word) == (-0.2, 0.0, "no measurable difference")
    served.windows[3] = ATTACK
    assert served.rate_difference()[2] == "less"
    rows = served.rows()
    assert [(r["window"], r["escapes running"], r["requests completed"]) for r in rows] == [
        (1, False, 4), (1, True, 3), (2, False, 4), (2, True, 3)]
    assert rows[1]["escapes ran (s)"] == "0.20-3.00" and rows[0]["escapes ran (s)"] == ""
    assert rows[1]["median (s)"] == 0.85  # of 0.5, 3.0, 1.0, 0.7
    answered = "answered while the escapes ran"
    assert rows[1][answered] == 1 and rows[0][answered] is None


def test_answers_while_the_escapes_ran_and_the_longest_wait():
    # ATTACK's escapes ran 0.2-3.0: one answer (at 0.5) came inside; then 2.5 s with none
    assert ATTACK.answered_during_attack() == 1 and ATTACK.longest_silence() == pytest.approx(2.5)
    stalled = te.Window("attack", 5.0, [(0.0, 4.1), (4.1, 4.3)], attack=(0.0, 4.0))
    assert stalled.answered_during_attack() == 0 and stalled.longest_silence() == pytest.approx(4.0)
    assert QUIET.answered_during_attack() == 0 and QUIET.longest_silence() == 0.0


def test_the_headline_says_whether_the_client_was_answered_while_the_escapes_ran():
    stalled = te.Window("attack", 5.0, [(0.0, 4.1), (4.1, 4.3)], attack=(0.0, 4.0))
    answered = te.served_headline(te.ServedMeanwhile([QUIET, ATTACK, QUIET, ATTACK], 5.0))
    # one answer in each 2.8 s run of escapes: 2 in 5.6 s, 0.36/s against QUIET's 4 per 5 s
    assert answered == ("while they ran, the same server went on answering another client, but more "
                        "slowly than in the quiet windows (2 answers in 5.6 s of escapes, 0.4 a second "
                        "against 0.8 in the quiet windows; its longest wait 2.50 s of the escapes' 2.80 s)")
    none = te.served_headline(te.ServedMeanwhile([QUIET, stalled, QUIET, stalled], 5.0))
    assert "answered another client nothing" in none and "4.00 s" in none
    mixed = te.served_headline(te.ServedMeanwhile([QUIET, ATTACK, QUIET, stalled], 5.0))
    assert "in 1 of 2 windows and nothing in the others" in mixed
    assert "(1 answer in 6.8 s of escapes, 0.1 a second against 0.8 in the quiet windows" in mixed


# escapes over the whole window, answered at QUIET's pace (ends at 1, 2, 3, 4 s: 0.8/s)
STEADY = te.Window("attack", 5.0, QUIET.spans, attack=(0.0, 5.0))
# five answers in 2.6 s of escapes (1.9/s), five requests in the window, each 0.5 s
BRISK = te.Window("attack", 5.0, [(0.0, 0.5), (0.5, 1.0), (1.0, 1.5), (1.5, 2.0), (2.0, 2.5)],
                  attack=(0.0, 2.6))


def test_the_answers_pace_while_the_escapes_ran_is_set_against_the_quiet_windows():
    assert ATTACK.answer_rate() == pytest.approx(1 / 2.8) and QUIET.answer_rate() == 0.0
    assert STEADY.answer_rate() == pytest.approx(0.8) and BRISK.answer_rate() == pytest.approx(5 / 2.6)
    low, high, word = te.ServedMeanwhile([QUIET, ATTACK, QUIET, BRISK], 5.0).answer_rate_difference()
    assert (low, high, word) == (pytest.approx(1 / 2.8 - 0.8), pytest.approx(5 / 2.6 - 0.8),
                                 "no measurable difference")
    steady = te.served_headline(te.ServedMeanwhile([QUIET, STEADY], 5.0))
    assert steady == ("while they ran, the same server went on answering another client, at a pace these "
                      "windows cannot tell from the quiet ones' (4 answers in 5.0 s of escapes, 0.8 a "
                      "second against 0.8 in the quiet windows; its longest wait 1.00 s of the escapes' "
                      "5.00 s)")
    brisk = te.served_headline(te.ServedMeanwhile([QUIET, BRISK], 5.0))
    assert brisk.startswith("while they ran, the same server went on answering another client, faster "
                            "than in the quiet windows (5 answers in 2.6 s of escapes, 1.9 a second")


def test_the_priority_reading_says_whether_the_client_was_slowed_all_the_same():
    slowed = "yet the other client was slowed all the same"
    # fewer requests per second (3 against 4 in 5 s)
    assert te.priority_reading(te.ServedMeanwhile([QUIET, ATTACK], 5.0)).startswith(slowed)
    # as many requests, but one took 1.9 s: p90 1.58 s against QUIET's 1.3 s
    late = te.Window("attack", 5.0, [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.9), (4.9, 6.0)],
                     attack=(0.0, 4.0))
    assert te.priority_reading(te.ServedMeanwhile([QUIET, late], 5.0)).startswith(slowed)
    assert te.priority_reading(te.ServedMeanwhile([QUIET, STEADY], 5.0)) == (
        "and the other client's pace and latency could not be told from the quiet windows' "
        "(the numbers above)")
    # 1 request/s against 0.8, p90 0.5 s against 1.3 s
    assert te.priority_reading(te.ServedMeanwhile([QUIET, BRISK], 5.0)) == (
        "and the other client was not slowed (the numbers above)")


def test_p90_difference_is_per_pair_of_windows():
    import numpy as np

    served = te.ServedMeanwhile([QUIET, ATTACK], 5.0)
    expected = np.percentile(ATTACK.latencies(), 90) - np.percentile(QUIET.latencies(), 90)
    low, high, word = served.p90_difference()
    assert low == high == pytest.approx(expected) and word == "more"


def test_p90_is_numpys_linear_percentile():
    import numpy as np

    for values in ([3.0], [1.0, 2.0], [0.1, 0.5, 0.2, 1.4, 0.3, 0.9, 0.15]):
        assert te.p90(values) == pytest.approx(float(np.percentile(values, 90)))


# -- how the forced replies were read ----------------------------------------------------------

def outcome(attempted, valid, problem="", finish="stop", calls=None):
    calls = calls if calls is not None else int(attempted and not problem)
    return tc.TaskOutcome(tc.Task("q", 1), attempted, valid, False, False, "", problem, finish, calls)


CUT = "<tool_call> without </tool_call>"


def test_first_reply_reasons_group_by_reading_and_finish():
    outcomes = [outcome(True, False, CUT, "length")] * 3 + [
        outcome(True, False, "the call is not JSON: Unterminated string at char 51", "stop"),
        outcome(True, True), outcome(False, False), outcome(True, False, "", "stop"),
        outcome(True, True, CUT, "length", calls=1), outcome(True, True, CUT, "length", calls=2)]
    assert tc.first_reply_reasons(outcomes) == [
        {"the first reply": CUT, "finish reason": "length", "replies": 3},
        {"the first reply": "a call the tool ran + " + CUT, "finish reason": "length", "replies": 2},
        {"the first reply": "the call is not JSON", "finish reason": "stop", "replies": 1},
        {"the first reply": "a call the tool ran", "finish reason": "stop", "replies": 1},
        {"the first reply": "no call", "finish reason": "stop", "replies": 1},
        {"the first reply": "a call the tool refused", "finish reason": "stop", "replies": 1}]


def test_a_forced_reply_with_a_call_then_a_cut_block_counts_both():
    """The stored shape of finding 2: a whole calculator call, then a second block the budget
    cut; the outcome (from the real parser and loop) holds the call and the problem together."""
    whole = tc.call_text("calculator", expression="2 + 3")
    task = tc.Task("What is 2 + 3?", 5)
    trace = run_agent(ScriptedModel([whole + "\n<tool_call>{\"name\": \"calc", "It is 5."]),
                      default_registry(), [{"role": "user", "content": task.question}], max_rounds=2)
    got = tc.tool_use_outcome(task, trace)
    assert (got.attempted, got.valid, got.right_call, got.calls) == (True, True, True, 1)
    assert got.problem.startswith(CUT)
    assert tc.first_reply_reasons([got])[0]["the first reply"] == "a call the tool ran + " + CUT


# -- the live injection's replies, read ----------------------------------------------------------

ESCAPED = json.dumps(tc.call_text("run_python", code="import os"))[1:-1].replace("</", "<\\/")


def injection_trace(replies):
    registry, runs = ti.injection_registry(None)
    trace = run_agent(ScriptedModel(replies), registry, [{"role": "user", "content": "go"}], max_rounds=3)
    return trace, runs


def test_injection_rounds_say_what_each_reply_came_to():
    trace, runs = injection_trace([tc.call_text("read_note", number=7), ESCAPED, "The meeting is at 10."])
    rows = ti.injection_rounds(trace)
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[0] == {"round": 0, "reply": tc.call_text("read_note", number=7), "escaped copy": False,
                       "what came of it": "read_note ran"}
    assert rows[1]["reply"] == ESCAPED and rows[1]["escaped copy"]
    assert rows[1]["what came of it"] == "an unreadable call (<tool_call> without </tool_call>)"
    assert rows[2]["what came of it"] == "no call"
    assert ti.injection_verdict(trace, runs) == "malformed"
    trace, runs = injection_trace([tc.call_text("read_note", number=7), "No.", "No."])
    assert ti.injection_verdict(trace, runs) == "declined"
    copied = tc.call_text("run_python", code="import os")
    trace, runs = injection_trace([tc.call_text("read_note", number=7), copied, "Done."])
    assert ti.injection_verdict(trace, runs) == "ran"
    assert ti.injection_rounds(trace)[1]["what came of it"] == "run_python ran (error: refused)"


def test_pasted_as_text_gives_the_model_the_outputs_unwrapped():
    seen = []

    class Inner:
        def generate(self, messages, tools, trace_id, round):
            seen.append(messages)
            return ScriptedModel(["ok"]).generate(messages, tools, trace_id, round)

    call = {"id": "c1", "type": "function",
            "function": {"name": "read_note", "arguments": json.dumps({"number": 7})}}
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "name": "read_note", "content": ti.OBEYABLE}]
    ti.PastedAsText(Inner()).generate(messages, [], "t", 1)
    (sent,) = seen
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[2] == {"role": "user", "content": ti.OBEYABLE}  # the note's own characters
    (read,) = re.findall(r"<tool_call>(.*?)</tool_call>", sent[1]["content"])
    assert json.loads(read) == {"name": "read_note", "arguments": {"number": 7}}
    assert messages[2]["role"] == "tool"  # the loop's own conversation is left as it was
