"""Chapter 34's sandbox section: the escapes issue 32 names, run as code a model could send
to `run_python`, while another client keeps asking the same server for chat answers; each
attempt's outcome, and that client's latency and throughput inside the attacks' windows
against quiet windows of the same length.

    rows, served = attacks_while_serving(server.url, sandbox, escapes(port, server_pid))
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from labkit.agent.sandbox import Limits, Sandbox, SandboxUnavailable
from labkit.agent.toolbox import default_registry
from labkit.experiments.protocol_envelopes import verdict
from labkit.experiments.tool_calling import MODEL
from labkit.util.timing import quantile

ESCAPE_PATH = "/etc/labkit-ch34-escape"   # the write attempt's target, checked on the host after


def escapes(port: int, server_pid: int) -> dict[str, str]:
    """The attempts issue 32 names, as code a model could send to run_python."""
    return {
        "connect to the server's port": "import socket\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=2)",
        "write outside the scratch directory": f"open({ESCAPE_PATH!r}, 'w').write('x')",
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "infinite loop": "while True:\n    pass",
        "allocate 4 GiB": "b = bytearray(4 << 30)",
        "read the server's environment": "import os\nprint(sorted(os.environ))\n"
        f"print(open('/proc/{server_pid}/environ', 'rb').read()[:80])",
    }


@dataclass
class AttackRow:
    attempt: str
    outcome: str          # an ErrorKind's value, "ok", or NOT_RUN
    detail: str
    wall_s: float
    started_s: float      # from the attacks' start
    ended_s: float
    printed: str = ""     # the first line the attempt printed (the environment's names)


def first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0][:160] if lines else ""


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:100] if lines else ""


def chat_latency(url: str, prompt: str, max_tokens: int = 8, model: str = MODEL) -> float:
    """Seconds for one short, non-streamed chat request (another client's)."""
    began = time.perf_counter()
    answer = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0.0})
    answer.raise_for_status()
    return time.perf_counter() - began


@dataclass
class Window:
    """One window of the other client's requests, times in seconds from the window's start."""

    kind: str                                  # "quiet" or "attack"
    seconds: float
    spans: list[tuple[float, float]]           # each request's (start, end), every one sent
    attack: tuple[float, float] | None = None  # the escapes' first start and last end

    def completed_per_s(self) -> float:
        """Requests that ended inside the window, per second of it: the client's throughput."""
        return sum(end <= self.seconds for _, end in self.spans) / self.seconds

    def latencies(self) -> list[float]:
        """Every request that began inside the window (one that straddles its end included)."""
        return [end - start for start, end in self.spans if start < self.seconds]

    def during_attack(self) -> list[float]:
        """Latencies of the requests that overlapped the escapes' running (none when quiet)."""
        if self.attack is None:
            return []
        began, ended = self.attack
        return [end - start for start, end in self.spans if start < ended and end > began]

    def answered_during_attack(self) -> int:
        """Requests that ended while the escapes ran: answers the client got from the server
        meanwhile (0 when quiet)."""
        if self.attack is None:
            return 0
        began, ended = self.attack
        return sum(began < end < ended for _, end in self.spans)

    def answer_rate(self) -> float:
        """Answers per second of the escapes' running (0 when quiet): the client's pace while
        they ran, to set against a quiet window's `completed_per_s`."""
        if self.attack is None:
            return 0.0
        return self.answered_during_attack() / (self.attack[1] - self.attack[0])

    def longest_silence(self) -> float:
        """The longest stretch of the escapes' running with no answer ending in it (0 when
        quiet): the escapes' whole span when the server answered nothing meanwhile."""
        if self.attack is None:
            return 0.0
        began, ended = self.attack
        ends = sorted(end for _, end in self.spans if began < end < ended)
        marks = [began, *ends, ended]
        return max(b - a for a, b in zip(marks, marks[1:]))


@dataclass
class ServedMeanwhile:
    windows: list[Window]          # quiet, attack, quiet, attack, ... (pairs in order)
    window_s: float                # each window's length: the attempts' wall limit plus 1 s

    def of_kind(self, kind: str) -> list[Window]:
        return [w for w in self.windows if w.kind == kind]

    @property
    def quiet_s(self) -> list[float]:
        return [x for w in self.of_kind("quiet") for x in w.latencies()]

    @property
    def attack_window_s(self) -> list[float]:
        """Latencies of every request that began in a window with the escapes."""
        return [x for w in self.of_kind("attack") for x in w.latencies()]

    @property
    def under_attack_s(self) -> list[float]:
        return [x for w in self.of_kind("attack") for x in w.during_attack()]

    def p90_difference(self) -> tuple[float, float, str]:
        """The 90th percentile of the client's latency under attack minus quiet, for each pair
        of windows: the lowest, the highest, and the shared verdict ("more": every pair slower)."""
        return self.per_pair(lambda q, a: p90(a.latencies()) - p90(q.latencies()))

    def rate_difference(self) -> tuple[float, float, str]:
        """Requests per second under attack minus quiet, for each pair of windows: the lowest,
        the highest, and the shared verdict on that range ("less": every pair lost)."""
        return self.per_pair(lambda q, a: a.completed_per_s() - q.completed_per_s())

    def answer_rate_difference(self) -> tuple[float, float, str]:
        """Answers per second while the escapes ran minus the quiet window's requests per
        second, for each pair: the lowest, the highest, and the shared verdict ("less": every
        pair answered more slowly while the escapes ran)."""
        return self.per_pair(lambda q, a: a.answer_rate() - q.completed_per_s())

    def per_pair(self, difference: Callable[[Window, Window], float]) -> tuple[float, float, str]:
        """`difference(quiet, attack)` for each pair of windows: the lowest, the highest, and
        the shared verdict on that range."""
        pairs = [difference(q, a) for q, a in zip(self.of_kind("quiet"), self.of_kind("attack"))]
        return min(pairs), max(pairs), verdict(min(pairs), max(pairs))

    def rows(self) -> list[dict]:
        """A row per window: how many requests, how fast, how long each took."""
        rows = []
        for index, w in enumerate(self.windows):
            times, attacked = w.latencies(), w.attack is not None
            rows.append({"window": index // 2 + 1, "escapes running": w.kind == "attack",
                         "requests completed": sum(end <= w.seconds for _, end in w.spans),
                         "requests per s": round(w.completed_per_s(), 2),
                         "median (s)": round(statistics.median(times), 3) if times else None,
                         "p90 (s)": round(p90(times), 3) if times else None,
                         "answered while the escapes ran": w.answered_during_attack() if attacked else None,
                         "longest wait for an answer (s)":
                             round(w.longest_silence(), 2) if attacked else None,
                         "escapes ran (s)": f"{w.attack[0]:.2f}-{w.attack[1]:.2f}" if w.attack else ""})
        return rows


def served_headline(served: ServedMeanwhile) -> str:
    """What the other client got from the server while the escapes ran, read from the attack
    windows: answers in every one, in none (a stall until the escapes ended), or in some; with
    the answers' pace against the quiet windows' and, when every window had answers, the
    shared verdict on it per pair (`ServedMeanwhile.answer_rate_difference`)."""
    attacked = served.of_kind("attack")
    answered = [w.answered_during_attack() for w in attacked]
    wait = max(w.longest_silence() for w in attacked)
    ran_for = max(w.attack[1] - w.attack[0] for w in attacked)
    running_s = sum(w.attack[1] - w.attack[0] for w in attacked)
    quiet_rate = statistics.mean(w.completed_per_s() for w in served.of_kind("quiet"))
    answers = f"{sum(answered)} answer" + ("" if sum(answered) == 1 else "s")
    pace = (f"{answers} in {running_s:.1f} s of escapes, "
            f"{sum(answered) / running_s:.1f} a second against {quiet_rate:.1f} in the quiet windows")
    some = sum(count > 0 for count in answered)
    if some == len(answered):
        how = {"less": ", but more slowly than in the quiet windows",
               "more": ", faster than in the quiet windows",
               "no measurable difference": ", at a pace these windows cannot tell from the quiet ones'",
               }[served.answer_rate_difference()[2]]
        return (f"while they ran, the same server went on answering another client{how} "
                f"({pace}; its longest wait {wait:.2f} s of the escapes' {ran_for:.2f} s)")
    if some == 0:
        return (f"while they ran, the same server answered another client nothing (its "
                f"requests waited up to {wait:.2f} s, until the escapes ended)")
    return (f"while they ran, the same server answered another client in {some} of "
            f"{len(answered)} windows and nothing in the others ({pace}; longest wait {wait:.2f} s)")


def priority_reading(served: ServedMeanwhile) -> str:
    """Whether the other client was slowed all the same, now that the tool runs at the lowest
    priority: the shared verdicts on its pace and its 90th percentile latency per pair of
    windows. The cause is not told apart: the tool keeps a small share under SCHED_IDLE, and
    each launcher's interpreter start-up (before `confine.lowest_priority`), the runtime's
    threads and the client run at the usual priority on the same cores."""
    pace = served.rate_difference()[2]
    latency = served.p90_difference()[2]
    if pace == "less" or latency == "more":
        return ("yet the other client was slowed all the same (the numbers above): the tool "
                "keeps a small share of the cores, and the launchers' start-up, the runtime's "
                "threads and the client itself run at the usual priority on the same cores; "
                "these windows do not tell which took the time")
    if pace == latency == "no measurable difference":
        return ("and the other client's pace and latency could not be told from the quiet "
                "windows' (the numbers above)")
    return "and the other client was not slowed (the numbers above)"


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (linear between order statistics; the value itself for one)."""
    return quantile(values, 0.9)


def client_loop(url: str, stop: threading.Event, salt: str) -> list[tuple[float, float]]:
    """Another client: short chat requests one after another until `stop`, each with a prompt
    and a cache scope of its own (no request finds another's prefix). (start, end) of each."""
    spans, count = [], 0
    while not stop.is_set():
        began = time.perf_counter()
        httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPTS[count % len(PROMPTS)]}],
            "max_tokens": 8, "temperature": 0.0, "cache_salt": f"{salt}-{count}"}).raise_for_status()
        spans.append((began, time.perf_counter()))
        count += 1
    return spans


def window(url: str, seconds: float, during: Callable[[], tuple[float, float]] | None) -> Window:
    """The other client's requests over `seconds` (with `during` run at the window's start; it
    returns when its work began and ended, on time.perf_counter's clock). Every request is
    kept; the client stops after the one in flight at the window's end."""
    stop, spans = threading.Event(), []
    client = threading.Thread(target=lambda: spans.extend(client_loop(url, stop, uuid.uuid4().hex)))
    start = time.perf_counter()
    client.start()
    attack = during() if during is not None else None
    rest = seconds - (time.perf_counter() - start)
    if rest > 0:
        time.sleep(rest)
    stop.set()
    client.join(180)
    return Window("quiet" if during is None else "attack", seconds,
                  [(a - start, b - start) for a, b in spans],
                  (attack[0] - start, attack[1] - start) if attack else None)


PROMPTS = [f"Say the word {w}." for w in ("yes", "no", "maybe", "blue", "red", "green", "one", "two")]


def attacks_while_serving(url: str, sandbox: Sandbox, attempts: dict[str, str], repeats: int = 2
                          ) -> tuple[list[AttackRow], ServedMeanwhile]:
    """Another client sends short requests all the time; windows of the attempts' wall limit
    (plus 1 s) alternate, quiet then under attack, `repeats` times (the attempts run through
    the allow-listed run_python, all at once, in this process: the server shares only the
    CPU). The server is warmed up first. Returns a row per attempt (the last repeat's) and
    every window's requests."""
    chat_latency(url, "Warm up.")
    registry = default_registry(sandbox)
    rows: dict[str, AttackRow] = {}
    windows = []
    seconds = sandbox.limits.wall_s + 1.0

    def attack_all() -> tuple[float, float]:
        start = time.perf_counter()

        def attack(name: str, code: str) -> None:
            began = time.perf_counter()
            result = registry.call("run_python", {"code": code})
            ended = time.perf_counter()
            detail = last_line(result.detail) or last_line(result.output)
            rows[name] = AttackRow(name, "ok" if result.ok else result.error.value, detail, ended - began,
                                   began - start, ended - start, first_line(result.output))

        threads = [threading.Thread(target=attack, args=item) for item in attempts.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        return start, time.perf_counter()

    for _ in range(repeats):
        windows.append(window(url, seconds, None))
        windows.append(window(url, seconds, attack_all))
    return [rows[name] for name in attempts], ServedMeanwhile(windows, seconds)


def not_run_rows(attempts: dict[str, str], reason: str) -> list[AttackRow]:
    return [AttackRow(name, "NOT_RUN", reason, 0.0, 0.0, 0.0) for name in attempts]


def sandbox_or_reason(limits: Limits) -> tuple[Sandbox | None, str]:
    """A sandbox that started here, or None and the mechanism that refused (SandboxUnavailable)."""
    sandbox = Sandbox(limits)
    try:
        return sandbox, sandbox.probe()
    except SandboxUnavailable as e:
        return None, str(e)
