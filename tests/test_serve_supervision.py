"""The front end's supervision of its engine worker: a step that raises, a worker frozen with
SIGSTOP mid-stream, a worker whose step blocks, and a worker that fails every start.

The policy's arithmetic is checked against its closed form; the behaviour on a real
`labkit serve` (engine in its own worker process) with faults injected through
`--fault-file` (labkit/serve/fault_injection.py) and signals. The crash-loop test runs last:
it leaves the server failed on purpose.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from labkit.serve.fault_injection import FAULTS, FaultFile, InjectedFault, write_faults
from labkit.serve.supervision import Supervision
from live_server import LiveServer

MODEL = "smollm2-135m"
HANG_TIMEOUT = 6.0  # s; a first step on a loaded 2-core machine can take a few seconds
FIRST_BACKOFF, MAX_BACKOFF, MAX_FAILED = 0.4, 0.8, 3
COUNTING = "Count from one to one hundred: one, two, three,"


# -- the policy -----------------------------------------------------------------------------

def test_backoff_doubles_from_the_first_wait_up_to_its_cap():
    policy = Supervision(first_backoff=0.5, max_backoff=3.0, max_failed_starts=9)
    assert [policy.backoff(k) for k in range(7)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert [policy.gives_up(k) for k in (0, 8, 9, 10)] == [False, False, True, True]


def test_only_a_worker_with_work_can_be_hung():
    policy = Supervision(hang_timeout=2.0)
    assert not policy.hung(has_work=False, silent_for=1e6)
    assert not policy.hung(has_work=True, silent_for=2.0)
    assert policy.hung(has_work=True, silent_for=2.01)


def test_a_generation_fails_when_it_dies_before_it_served_and_soon_after_its_start():
    policy = Supervision(stable_after=60.0)
    assert policy.generation_failed(served=False, lived_for=0.1)       # crashed in its first step
    assert policy.generation_failed(served=False, lived_for=59.9)
    assert not policy.generation_failed(served=False, lived_for=60.0)  # idle for a minute, then killed
    assert not policy.generation_failed(served=True, lived_for=0.1)    # it ran a step with work


@pytest.mark.parametrize("fields", [{"hang_timeout": 0}, {"first_backoff": -1}, {"max_failed_starts": 0},
                                    {"stable_after": 0},
                                    {"first_backoff": 2.0, "max_backoff": 1.0}])
def test_a_policy_that_cannot_work_is_refused(fields):
    with pytest.raises(ValueError):
        Supervision(**fields)


def test_failed_starts_wait_their_backoff_then_the_engine_gives_up():
    """The restart loop itself, with a start that fails at once: the gaps between starts are
    the policy's waits (a loop without them would start again at once), and after
    `max_failed_starts` the engine is failed and refuses requests."""
    import asyncio

    from labkit.serve.engine_client import EngineUnavailable
    from labkit.serve.worker import WorkerEngine, WorkerSpec

    policy = Supervision(first_backoff=0.2, max_backoff=0.3, max_failed_starts=4)
    engine = WorkerEngine(WorkerSpec(), supervision=policy)
    starts = []

    async def failing_launch():
        starts.append(time.monotonic())
        raise RuntimeError("the engine worker failed to start: injected")

    engine._launch = failing_launch
    engine._served = True  # the worker that died had served: its replacement starts at once
    began = time.monotonic()
    asyncio.run(engine._recover("died (exit code -9)"))
    gaps = [b - a for a, b in zip([began] + starts, starts)]
    assert len(starts) == 4 and engine.failed_starts == 4 and engine.state == "failed"
    assert gaps[0] < 0.15
    for gap, wait in zip(gaps[1:], (0.2, 0.3, 0.3)):
        assert wait - 0.01 <= gap < wait + 1.0, gaps
    assert "injected" in engine.last_failure
    with pytest.raises(EngineUnavailable, match="failed"):
        engine.submit(None)


def test_a_fault_file_names_known_faults_only(tmp_path):
    path = str(tmp_path / "faults")
    faults = FaultFile(path)
    assert faults.active() == set()
    write_faults(path, "raise-step")
    assert faults.active() == {"raise-step"}
    with pytest.raises(InjectedFault):
        faults.wrap_step(lambda: [])()
    write_faults(path)
    assert faults.active() == set() and faults.wrap_step(lambda: ["ran"])() == ["ran"]
    with pytest.raises(ValueError):
        write_faults(path, "explode")
    assert set(FAULTS) == {"fail-start", "raise-step", "hang-step", "crash-step"}


# -- a real server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("faults") / "faults.txt")


@pytest.fixture(scope="module")
def server(faults):
    with LiveServer("--model", MODEL, "--kv-cache-tokens", "4096", "--fault-file", faults,
                    "--hang-timeout", str(HANG_TIMEOUT), "--restart-backoff", str(FIRST_BACKOFF),
                    "--max-restart-backoff", str(MAX_BACKOFF), "--max-failed-starts", str(MAX_FAILED)) as live:
        yield live


def health(server) -> tuple[int, dict]:
    answer = server.get("/health")
    return answer.status_code, answer.json()


def complete(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0} | fields
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def stream_events(server, received: list, on_event=None, **fields) -> None:
    """Read one streamed completion into `received` (parsed data lines, and "[DONE]")."""
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 400, "temperature": 0, "stream": True} | fields
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            received.append(data if data == "[DONE]" else json.loads(data))
            if on_event is not None:
                on_event(received)


@pytest.mark.slow
def test_a_step_that_raises_fails_its_requests_and_the_worker_goes_on(server, faults):
    pid = health(server)[1]["worker_pid"]
    write_faults(faults, "raise-step")
    try:
        answer = complete(server)
    finally:
        write_faults(faults)
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert "raise-step injected" in error["message"] and answer.headers["retry-after"]
    status, state = health(server)
    assert status == 200 and state["worker_pid"] == pid and state["state"] == "ready"
    after = complete(server)
    assert after.status_code == 200, after.text
    server.wait_until(server.idle, timeout=10)


@pytest.mark.slow
def test_a_worker_frozen_mid_stream_is_declared_hung_and_replaced(server):
    server.wait_until(server.ready, timeout=60)
    before = health(server)[1]
    frozen = {}

    def freeze(received):
        if len(received) == 3 and not frozen:
            frozen["at"] = time.monotonic()
            os.kill(before["worker_pid"], signal.SIGSTOP)

    received: list = []
    reader = threading.Thread(target=stream_events, args=(server, received, freeze))
    reader.start()
    # declared hung: /health answers 503 while the replacement starts
    server.wait_until(lambda: health(server)[0] == 503, timeout=HANG_TIMEOUT + 10, interval=0.05)
    reader.join(60)
    assert not reader.is_alive()
    waited = time.monotonic() - frozen["at"]
    # declared hung about HANG_TIMEOUT after its last batch (which came a little before the
    # reader saw its third event), not at once and not never
    assert HANG_TIMEOUT - 1.0 <= waited < HANG_TIMEOUT + 30, waited
    # the stream kept what it had, then ended with an error in the one shape, then [DONE]
    assert received[-1] == "[DONE]" and "error" in received[-2]
    assert received[-2]["error"]["code"] == "engine_died" and "hung" in received[-2]["error"]["message"]
    assert sum(1 for r in received if isinstance(r, dict) and "choices" in r) >= 3
    server.wait_until(server.ready, timeout=120, interval=0.1)
    after = health(server)[1]
    assert after["hangs"] == before["hangs"] + 1 and after["restarts"] == before["restarts"] + 1
    assert after["worker_pid"] != before["worker_pid"]
    with pytest.raises(ProcessLookupError):  # the frozen worker is gone, not left behind
        for _ in range(100):
            os.kill(before["worker_pid"], 0)
            time.sleep(0.05)
    assert complete(server).status_code == 200
    server.wait_until(server.idle, timeout=10)


@pytest.mark.slow
def test_a_request_that_received_nothing_from_a_hung_worker_is_resubmitted(server, faults):
    server.wait_until(server.ready, timeout=60)
    before = health(server)[1]
    outcome = {}
    write_faults(faults, "hang-step")
    thread = threading.Thread(target=lambda: outcome.setdefault("answer", complete(server, max_tokens=4)))
    thread.start()
    # the worker is blocked in its step; clear the fault once it has been declared hung, so
    # the next worker serves the request that never received a token
    server.wait_until(lambda: health(server)[1]["hangs"] == before["hangs"] + 1, timeout=HANG_TIMEOUT + 30,
                      interval=0.05)
    write_faults(faults)
    thread.join(180)
    answer = outcome["answer"]
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1
    assert answer.json()["choices"][0]["text"] == complete(server, max_tokens=4).json()["choices"][0]["text"]
    assert health(server)[1]["replays"] == before["replays"] + 1   # /health counts the replay
    server.wait_until(server.idle, timeout=10)


@pytest.mark.slow
def test_a_worker_that_crashes_in_its_first_step_with_work_counts_as_a_failed_start(server, faults):
    """A worker that starts, idles (sending its counters, as an idle worker does once), then
    dies in its first step with work (a kernel crash) is a failed generation, and so is the one
    its request is resubmitted to: the request is answered engine_died instead of killing
    workers for ever, and a worker that then serves resets the count. A worker that had served
    and is killed is not a failed start."""
    server.wait_until(server.ready, timeout=60)
    first = complete(server)
    assert first.status_code == 200, first.text  # this generation has served
    before = health(server)[1]
    write_faults(faults, "crash-step")
    os.kill(before["worker_pid"], signal.SIGKILL)
    server.wait_until(lambda: health(server)[1]["restarts"] == before["restarts"] + 1 and server.ready(),
                      timeout=120, interval=0.05)
    assert health(server)[1]["failed_starts"] == before["failed_starts"]
    time.sleep(0.5)  # the new worker idles and sends its counters before its first work
    answer = complete(server)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_died", answer.text
    server.wait_until(server.ready, timeout=120, interval=0.05)
    crashed = health(server)[1]
    # two workers died in their first step with work: two failed generations in a row
    assert crashed["failed_starts"] == before["failed_starts"] + 2, crashed
    assert crashed["restarts"] == before["restarts"] + 3
    write_faults(faults)
    assert complete(server).status_code == 200
    assert health(server)[1]["failed_starts"] == 0
    server.wait_until(server.idle, timeout=10)


@pytest.mark.slow
def test_a_worker_that_fails_every_start_backs_off_then_the_server_says_failed(server, faults):
    """Runs last: the server stays failed."""
    server.wait_until(server.ready, timeout=60)
    assert complete(server).status_code == 200  # the worker to be killed has served
    before = health(server)[1]
    write_faults(faults, "fail-start")
    killed_at = time.monotonic()
    os.kill(before["worker_pid"], signal.SIGKILL)
    server.wait_until(lambda: health(server)[1]["state"] == "failed", timeout=120, interval=0.05)
    took = time.monotonic() - killed_at
    status, state = health(server)
    assert status == 503 and state["status"] == "failed"
    # the first replacement starts at once (the killed worker had served); each start fails, and
    # the waits before the 2nd and 3rd start are 0.4 and 0.8 s: the loop does not spin
    assert state["failed_starts"] == MAX_FAILED
    assert state["restarts"] == before["restarts"] + MAX_FAILED
    assert took >= FIRST_BACKOFF + MAX_BACKOFF, took
    assert "fail-start injected" in state["last_failure"]
    time.sleep(1.5 * MAX_BACKOFF)
    assert health(server)[1]["restarts"] == state["restarts"]  # it gave up: no more starts
    refused = complete(server)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
    assert "failed" in refused.json()["error"]["message"]
