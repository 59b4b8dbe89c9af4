"""Chapter 34's experiments: tool calls parsed, validated and authorised; an agent run over
HTTP with its trace, and what each resume would cost without the prefix cache; how often a
small model calls a tool correctly, on its own and forced by the chat route. The sandbox's
refusals while the server answers another client are in `tool_escapes`, tool output that
tries to give orders in `tool_injection`; both share this module's call format and budgets.

    cases = call_format_rows()                       # scripted replies through the real loop
    with agent_server() as server:                   # `labkit serve` on a free loopback port
        runs = cached_and_cold(server.url, COPY_A_CALL, repeats=3)
        tasks = tool_use_tasks(server.url, arithmetic_tasks(20, seed=0))

Everything here goes through `labkit.agent` (the loop, the allow-list, the sandbox) and the
official `openai` client; nothing is simulated except where a scripted model is named as one.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.agent.runtime import AgentTrace, ScriptedModel, run_agent
from labkit.agent.sandbox import ToolResult
from labkit.agent.serve_model import ServeModel
from labkit.agent.toolbox import default_registry
from labkit.agent.tools import Tool, ToolRegistry, tool_content
from labkit.serve.server import ServerProcess

MODEL = "smollm2-135m"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Each model reply's token budget, by experiment (the chapter states them)
TASK_TOKENS = 40          # a question's agent run, auto or forced
NATIVE_TOKENS = 60        # the one forced answer shown whole
INJECTION_TOKENS = 60     # each round of the live-injection run


def call_text(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# --- the call format and the allow-list ------------------------------------------------------

FORMAT_CASES: list[tuple[str, str]] = [
    ("a valid call", call_text("calculator", expression="17 * 23")),
    ("arguments as a JSON string",
     '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2 ** 10\\"}"}</tool_call>'),
    ("not JSON", '<tool_call>{"name": "calculator", "arguments": {"expression": }}</tool_call>'),
    ("no closing tag", '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}'),
    ("an argument the schema lacks", call_text("calculator", expr="1 + 1")),
    ("a number where the schema wants text", call_text("calculator", expression=391)),
    ("a tool not on the allow-list", call_text("shell", command="cat /etc/passwd")),
    ("arithmetic the tool refuses", call_text("calculator", expression="1 / 0")),
]


def counted(registry: ToolRegistry) -> tuple[ToolRegistry, Counter]:
    """The same tools, each handler counting its runs: what reached a tool's code."""
    runs: Counter = Counter()

    def wrap(tool: Tool) -> Tool:
        def handler(arguments: dict) -> ToolResult:
            runs[tool.name] += 1
            return tool.handler(arguments)
        return dataclasses.replace(tool, handler=handler)

    return ToolRegistry(wrap(t) for t in registry.tools.values()), runs


def call_format_rows(cases: Sequence[tuple[str, str]] = FORMAT_CASES) -> list[dict]:
    """Each reply through `run_agent` (a scripted model: the reply is fixed, the loop is real):
    how the call ended, whether any tool's code ran, and the first line the model is told."""
    rows = []
    for label, reply in cases:
        registry, runs = counted(default_registry())
        trace = run_agent(ScriptedModel([reply, "done"]), registry, [{"role": "user", "content": "go"}],
                          max_rounds=2)
        (step,) = trace.tool_steps()
        told = tool_content(step.result).splitlines()[0]
        rows.append({"the reply holds": label, "outcome": "ok" if step.result.ok else step.result.error.value,
                     "tool code ran": sum(runs.values()) > 0, "the model is told": told[:90]})
    return rows


# --- an agent run over HTTP, and its resumes without the cache ----------------------------------

# What this 135M model does reliably at temperature 0: copy a line it is asked to copy.
COPY_A_CALL = ("Repeat this line exactly, and nothing else:\n"
               + call_text("calculator", expression="17 * 23"))




def agent_server(*extra: str) -> ServerProcess:
    """`labkit serve` (the project's own command) on a free loopback port; a context manager."""
    return ServerProcess("--model", MODEL, "--kv-cache-tokens", "16384", *extra)


class Recorder:
    """A model side that keeps what each request was given, so it can be sent again."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def generate(self, messages, tools, trace_id, round):
        self.seen.append(([dict(m) for m in messages], tools))
        return self.inner.generate(messages, tools, trace_id, round)


def cached_and_cold(url: str, prompt: str, repeats: int, max_rounds: int = 3, max_tokens: int = 40
                    ) -> tuple[list[AgentTrace], list[dict]]:
    """`repeats` agent runs over HTTP, each in a prefix-cache scope of its own (a fresh
    `cache_salt`: its first request finds nothing, its resumes find its own earlier rounds);
    then each of its model requests sent again in a fresh scope (nothing cached: what that
    resume would have cost without the cache). One row per model request."""
    traces, rows = [], []
    for run in range(repeats):
        recorder = Recorder(ServeModel(url, MODEL, max_tokens=max_tokens, cache_salt=uuid.uuid4().hex))
        trace = run_agent(recorder, default_registry(), [{"role": "user", "content": prompt}],
                          max_rounds=max_rounds, trace_id=f"ch34-run-{run}")
        traces.append(trace)
        for step, (messages, tools) in zip(trace.model_steps(), recorder.seen):
            cold_model = ServeModel(url, MODEL, max_tokens=max_tokens, cache_salt=uuid.uuid4().hex)
            began = time.perf_counter()
            cold = cold_model.generate(messages, tools, f"ch34-cold-{run}", step.round)
            cold_s = time.perf_counter() - began
            turn = step.turn
            rows.append({"run": run, "round": step.round, "prompt_tokens": turn.prompt_tokens,
                         "cached_tokens": turn.cached_tokens, "completion_tokens": turn.completion_tokens,
                         "calls": len(turn.parsed.calls), "elapsed_s": step.elapsed_s,
                         "prefill_ms": turn.server_ms.get("prefill"),
                         "cold_cached_tokens": cold.cached_tokens, "cold_elapsed_s": cold_s,
                         "cold_prefill_ms": cold.server_ms.get("prefill"),
                         "same_reply": cold.reply == turn.reply})
    return traces, rows


def median_by_round(rows: list[dict], key: str) -> dict[int, float]:
    rounds = sorted({r["round"] for r in rows})
    return {n: statistics.median(r[key] for r in rows if r["round"] == n) for n in rounds}


# --- how often the small model calls a tool correctly --------------------------------------------

@dataclass(frozen=True)
class Task:
    question: str
    answer: int


def arithmetic_tasks(count: int, seed: int = 0) -> list[Task]:
    """Questions a calculator answers and this model does not know by heart."""
    rng, tasks = random.Random(seed), []
    for _ in range(count):
        a, b, op = rng.randint(12, 99), rng.randint(12, 99), rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        tasks.append(Task(f"What is {a} {op} {b}? Use the calculator tool.", value))
    return tasks


NUMBER = re.compile(r"-?\d[\d,]*")


def numbers_in(text: str) -> list[int]:
    return [int(n.replace(",", "")) for n in NUMBER.findall(text) if n.replace(",", "").lstrip("-")]


@dataclass
class TaskOutcome:
    task: Task
    attempted: bool       # the first reply held a tool-call block
    valid: bool           # ... a call that parsed, was allowed, and that the tool ran without error
    right_call: bool      # ... a calculator call whose result is the answer
    right_answer: bool    # the final reply states the answer
    first_reply: str
    problem: str = ""     # why the first reply's first unreadable block was not a call
    finish: str = ""      # the first reply's finish reason ("length": its token budget ran out)
    calls: int = 0        # blocks in the first reply that parsed as calls (valid or refused)


def tool_use_outcome(task: Task, trace: AgentTrace) -> TaskOutcome:
    first = trace.model_steps()[0].turn
    round0 = [s for s in trace.tool_steps() if s.round == 0]
    valid = any(s.result.ok for s in round0)
    right_call = any(s.result.ok and s.name == "calculator" and s.result.output.strip() == str(task.answer)
                     for s in round0)
    attempted = bool(first.parsed.calls or first.parsed.problems)
    final = trace.answer if trace.stopped == "answered" else ""
    problem = first.parsed.problems[0].reason if first.parsed.problems else ""
    return TaskOutcome(task, attempted, valid, right_call, task.answer in numbers_in(final), first.reply,
                       problem, first.finish_reason, len(first.parsed.calls))


def first_reply_reasons(outcomes: Sequence[TaskOutcome]) -> list[dict]:
    """How each first reply was read, with its finish reason: a row per (reading, finish). A
    reply may hold several blocks (a forced reply may, while parallel calls are on): its reading
    names the calls and the first unreadable block both ("a call the tool ran + <problem>"), the
    problem cut before its position details (the same fault, wherever in the reply)."""
    counts = Counter()
    for o in outcomes:
        call = ("a call the tool ran" if o.valid else "a call the tool refused") if o.calls else ""
        held = [part for part in (call, o.problem.split(":")[0]) if part]
        reading = " + ".join(held) if o.attempted and held else "no call"
        counts[reading, o.finish] += 1
    return [{"the first reply": reading, "finish reason": finish, "replies": n}
            for (reading, finish), n in counts.most_common()]


def tool_use_tasks(url: str, tasks: Sequence[Task], max_tokens: int = TASK_TOKENS, forced: bool = False
                   ) -> list[TaskOutcome]:
    """Each task as one agent run (at most two model turns), greedy, tools: calculator,
    word_count; the first turn free to call or not ("auto"), or `forced` to call one."""
    model = ForcedFirst(url, max_tokens) if forced else ServeModel(url, MODEL, max_tokens=max_tokens)
    outcomes = []
    for index, task in enumerate(tasks):
        trace = run_agent(model, default_registry(), [{"role": "user", "content": task.question}],
                          max_rounds=2, trace_id=f"ch34-task-{index}")
        outcomes.append(tool_use_outcome(task, trace))
    return outcomes


# --- the chat route's own tool calling ----------------------------------------------------------

def native_answer(url: str, question: str, tools: list[dict], tool_choice: str | dict = "required",
                  max_tokens: int = NATIVE_TOKENS, model: str = MODEL) -> dict:
    """One request with the official client's `tools=` and `tool_choice=`: the answer's
    message as JSON (`tool_calls` with their ids, names and argument strings) and its finish."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], tools=tools,
        tool_choice=tool_choice, max_tokens=max_tokens, temperature=0.0)
    choice = answer.choices[0]
    return {"finish_reason": choice.finish_reason, "message": choice.message.model_dump(exclude_none=True)}


class ForcedFirst:
    """A model side whose first round is forced to call a tool (`tool_choice` "required", the
    grammar's) and whose later rounds choose ("auto"), so that the run can end in an answer."""

    def __init__(self, url: str, max_tokens: int = TASK_TOKENS, model: str = MODEL,
                 cache_salt: str | None = None):
        self.forced, self.free = (ServeModel(url, model, max_tokens=max_tokens, tool_choice=choice,
                                             cache_salt=cache_salt) for choice in ("required", "auto"))

    def generate(self, messages, tools, trace_id, round):
        return (self.forced if round == 0 else self.free).generate(messages, tools, trace_id, round)
