"""Chapter 30's faults of the service's supervision and shutdown: a hung worker, a worker
that cannot start again, and a SIGTERM while requests run.

* :func:`hung_worker`: `SIGSTOP` the worker once a stream has tokens, then send a request
  that receives nothing. The front end must declare the worker hung after `--hang-timeout`,
  kill it, end the stream with `engine_died`, and answer the waiting request from a new
  worker. Runs on a shared service; :func:`~labkit.experiments.faults.after_scenario` applies.
* :func:`crash_loop`: `fail-start` in the fault file, then `SIGKILL`: every start fails,
  the waits between starts double from `--restart-backoff` up to `--max-restart-backoff`,
  and after `--max-failed-starts` the server says `failed` and refuses requests. It leaves
  its server failed, so it starts its own.
* :func:`drain`: `SIGTERM` while a short request and a long stream run: the short one is
  answered, the long one ends with `shutting_down` after `--drain-timeout`, a request sent
  meanwhile gets 503 `server_draining`, the process exits 0 and its worker is gone. Its own
  server too.

The pure parts (:func:`rises`, :func:`closed_form_backoff`, :func:`backoff_gaps`,
:func:`process_gone`) read what the scenarios sampled.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import threading
import time

from labkit.experiments import fault_client as fc
from labkit.experiments.fault_client import Outcome, body, error_code
from labkit.experiments.faults import Scenario, async_client, solo_texts
from labkit.serve.fault_injection import write_faults


# -- pure parts ------------------------------------------------------------------------------------

def process_gone(pid: int) -> bool:
    """True when no process `pid` runs: none exists, or it is a zombie (it has ended and
    only waits for its parent to collect its exit status)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as file:
            return file.read().rpartition(")")[2].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not process_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def rises(samples: list[dict], key: str) -> list[tuple[float, int]]:
    """(t_s, value) for each value a counter took after the first sample, at the first sample
    that showed it. A counter that rose by several between two samples gives each value
    that sample's time."""
    out: list[tuple[float, int]] = []
    if not samples:
        return out
    last = samples[0][key]
    for sample in samples[1:]:
        for value in range(last + 1, sample[key] + 1):
            out.append((sample["t_s"], value))
        last = max(last, sample[key])
    return out


def closed_form_backoff(failures: int, first: float, cap: float) -> float:
    """The wait before the start that follows `failures` failed generations in a row:
    `first * 2**(failures - 1)`, capped at `cap`; none after no failure."""
    return 0.0 if failures <= 0 else min(cap, first * 2.0 ** (failures - 1))


def backoff_gaps(starts: list[float], failures: list[float], first: float, cap: float) -> list[dict]:
    """One row per failed start that was followed by another start: when it began and
    failed, when the next start began, the wait between them (`gap_s`) and its closed form.
    `starts[k]` and `failures[k]` are the times of the (k+1)-th start and failure."""
    rows = []
    for k, failed in enumerate(failures):
        row = {"start": k + 1, "started_s": starts[k] if k < len(starts) else None, "failed_s": failed,
               "start_took_s": failed - starts[k] if k < len(starts) else None}
        if k + 1 < len(starts):
            row |= {"next_start_s": starts[k + 1], "gap_s": starts[k + 1] - failed,
                    "closed_form_s": closed_form_backoff(k + 1, first, cap)}
            row["gap_minus_closed_form_s"] = row["gap_s"] - row["closed_form_s"]
        rows.append(row)
    return rows


# -- a. a hung worker ---------------------------------------------------------------------------

def hung_worker(url: str, stream_prompt, waiting_prompt, *, hang_timeout: float, stream_tokens: int = 200,
                waiting_tokens: int = 8, freeze_after: int = 3, ready_timeout: float = 240.0) -> Scenario:
    """Stream `stream_prompt`; once it has `freeze_after` chunks, `SIGSTOP` the worker and
    send `waiting_prompt` as a whole request, which the frozen worker never answers. Time
    the freeze to `/health` 503 (the server started with `--hang-timeout hang_timeout`) and
    to 200 with a new worker; record what both clients got."""
    solo = solo_texts(url, [waiting_prompt], waiting_tokens)[0]
    before = fc.health(url)[1]
    pid = before["worker_pid"]
    streamed = Outcome("stream", "stream")
    waiting = Outcome("waiting", "whole", expected=solo)
    marks: dict = {}

    async def go():
        frozen = asyncio.Event()

        def freeze(out: Outcome) -> None:
            if out.chunks >= freeze_after and not frozen.is_set():
                os.kill(pid, signal.SIGSTOP)
                marks["freeze"] = time.perf_counter()
                frozen.set()

        async with async_client() as client, fc.Poller(url) as poller:
            run = asyncio.create_task(fc.stream(client, url, body(stream_prompt, stream_tokens), streamed,
                                                on_chunk=freeze))
            await asyncio.wait_for(frozen.wait(), 120)
            asked = asyncio.create_task(fc.whole(client, url, body(waiting_prompt, waiting_tokens), waiting))

            async def both_open():
                status, state = await poller.health()
                marks.setdefault("status_while_waiting", status)
                return state.get("open_requests", 0) >= 2
            await fc.await_until(both_open, timeout=30)
            marks["waiting_open"] = time.perf_counter()

            async def unhealthy():
                return (await poller.health())[0] == 503
            await fc.await_until(unhealthy, timeout=hang_timeout + 60, interval=0.005)
            marks["unhealthy"] = time.perf_counter()

            async def back():
                status, state = await poller.health()
                return status == 200 and state["worker_pid"] not in (None, pid)
            await fc.await_until(back, timeout=ready_timeout, interval=0.02)
            marks["ready"] = time.perf_counter()
            await asyncio.gather(run, asked)

    try:
        fc.run_async(go)
    finally:
        if not process_gone(pid):  # the scenario broke before the front end killed it: let it go on
            os.kill(pid, signal.SIGCONT)
    after = fc.health(url)[1]
    gone = wait_gone(pid)
    detect = marks["unhealthy"] - marks["freeze"]
    return Scenario(
        "hung_worker", f"SIGSTOP of worker {pid} after a stream's {freeze_after} chunks, then a whole "
                       f"request it never answers (--hang-timeout {hang_timeout:g} s)",
        [streamed, waiting],
        {"detect_s": detect, "detect_over_timeout_s": detect - hang_timeout,
         "ready_s": marks["ready"] - marks["freeze"],
         "waiting_open_after_freeze_s": marks["waiting_open"] - marks["freeze"],
         "stream_error_after_freeze_s": streamed.ended_at - marks["freeze"],
         "waiting_answered_after_freeze_s": waiting.ended_at - marks["freeze"]},
        {"hang_timeout_s": hang_timeout, "old_pid": pid, "new_pid": after["worker_pid"],
         "hangs_before": before["hangs"], "hangs_after": after["hangs"],
         "restarts_before": before["restarts"], "restarts_after": after["restarts"],
         "health_while_waiting": marks.get("status_while_waiting"), "last_failure": after["last_failure"]},
        {"the stream kept its tokens, then got engine_died and [DONE]":
             streamed.ended == "error" and streamed.code == "engine_died" and streamed.done
             and streamed.chunks >= freeze_after,
         "the waiting request was open before the hang was declared": marks["waiting_open"] < marks["unhealthy"],
         "the waiting request was resubmitted and answered": waiting.ended == "answer" and waiting.status == 200,
         # exact: the stream has ended, so the new worker runs it alone, as its solo run ran
         "its answer equals its solo run": bool(waiting.matches),
         "every request ended with an answer or a documented error":
             all(o.ended == "answer" or (o.ended == "error" and o.code == "engine_died")
                 for o in (streamed, waiting)),
         # the worker's last batch came before the freeze, so it cannot be declared sooner
         "declared hung no sooner than the hang timeout": detect >= hang_timeout - 0.25,
         "one hang and one restart counted": after["hangs"] == before["hangs"] + 1
                                             and after["restarts"] == before["restarts"] + 1,
         "the frozen worker is gone": gone})


# -- b. a crash loop ----------------------------------------------------------------------------------

def crash_loop(serve_args, *, first_backoff: float, max_backoff: float, max_failed_starts: int,
               sample_every: float = 0.01, quiet_s: float | None = None, timeout: float = 300.0) -> Scenario:
    """Start a service of its own (`serve_args` plus a fault file and the backoff flags), have
    its worker serve one request (a worker that served and died is not a failed start), write
    `fail-start`, SIGKILL its worker and sample `/health` every `sample_every` s until it
    says `failed`; then wait `quiet_s` (default 1.5 x `max_backoff`) for any further start
    and send one request. Last, SIGTERM: a failed server must still exit (0)."""
    quiet_s = 1.5 * max_backoff if quiet_s is None else quiet_s
    samples: list[dict] = []
    served = Outcome("before the kill", "whole")
    refused = Outcome("after failed", "whole")
    marks: dict = {}
    with tempfile.TemporaryDirectory(prefix="labkit-faults-") as folder:
        path = os.path.join(folder, "faults")
        flags = ["--fault-file", path, "--restart-backoff", first_backoff, "--max-restart-backoff", max_backoff,
                 "--max-failed-starts", max_failed_starts]
        with fc.LiveService(*serve_args, *flags) as service:
            url = service.url
            before = fc.health(url)[1]

            async def go():
                async with async_client() as client, fc.Poller(url) as poller:
                    await fc.whole(client, url, body("The capital of France is", 4), served)
                    before.update(fc.health(url)[1])
                    write_faults(path, "fail-start")
                    marks["pid"], kill = fc.kill_worker(url)
                    while True:
                        status, state = await poller.health()
                        samples.append({"t_s": time.perf_counter() - kill, "status": status, "state": state["state"],
                                        "restarts": state["restarts"], "failed_starts": state["failed_starts"]})
                        if state["state"] == "failed" or samples[-1]["t_s"] > timeout:
                            break
                        await asyncio.sleep(sample_every)
                    await asyncio.sleep(quiet_s)
                    marks["later"] = (await poller.health())[1]
                    await fc.whole(client, url, body("The capital of France is", 4), refused)

            fc.run_async(go)
            status, state = fc.health(url)
            # a failed server must still stop: SIGTERM, and it has nothing to drain
            popen = service.process.process
            popen.send_signal(signal.SIGTERM)
            term = time.perf_counter()
            try:
                marks["code"] = popen.wait(30)
            except subprocess.TimeoutExpired:
                marks["code"] = None
            marks["exit_s"] = time.perf_counter() - term
    # rises after the kill: the first sample (just after it) is the baseline
    base = [{"t_s": 0.0, "restarts": before["restarts"], "failed_starts": before["failed_starts"]}] + samples
    starts = [t for t, _ in rises(base, "restarts")]
    failures = [t for t, _ in rises(base, "failed_starts")]
    gaps = backoff_gaps(starts, failures, first_backoff, max_backoff)
    waits = [row for row in gaps if "gap_s" in row]
    failed_at = next((s["t_s"] for s in samples if s["state"] == "failed"), None)
    return Scenario(
        "crash_loop", f"fail-start injected, then SIGKILL of worker {marks['pid']}: every start fails "
                      f"(--restart-backoff {first_backoff:g}, --max-restart-backoff {max_backoff:g}, "
                      f"--max-failed-starts {max_failed_starts})",
        [served, refused],
        {"failed_after_kill_s": failed_at, "first_start_after_kill_s": starts[0] if starts else None,
         "gaps_s": [row["gap_s"] for row in waits], "closed_form_s": [row["closed_form_s"] for row in waits],
         "start_took_s": [row["start_took_s"] for row in gaps if row["start_took_s"] is not None],
         "starts_s": starts, "failures_s": failures, "sample_every_s": sample_every, "quiet_s": quiet_s,
         "exit_after_term_s": marks["exit_s"]},
        {"starts": len(starts), "failed_starts": state["failed_starts"], "max_failed_starts": max_failed_starts,
         "first_backoff_s": first_backoff, "max_backoff_s": max_backoff, "last_failure": state["last_failure"],
         "exit_code": marks["code"],
         "max_sample_gap_s": max((b["t_s"] - a["t_s"] for a, b in zip(samples, samples[1:])), default=None)},
        {"the killed worker had served a request": served.status == 200,
         "the server said failed (503) after max_failed_starts failed starts":
             status == 503 and state["status"] == "failed" and state["failed_starts"] == max_failed_starts,
         "every start after the kill failed": len(starts) == max_failed_starts == len(failures),
         "no start came before its wait": all(row["gap_s"] >= row["closed_form_s"] - 0.02 for row in waits),
         "no start after it gave up": marks["later"]["restarts"] == state["restarts"],
         "the reason names the injected fault": "fail-start injected" in (state["last_failure"] or ""),
         "a request then got 503 engine_unavailable":
             refused.status == 503 and refused.code == "engine_unavailable" and bool(refused.shape_ok),
         "the failed server still exited 0 on SIGTERM": marks["code"] == 0},
        samples)


# -- c. a drain --------------------------------------------------------------------------------------

def drain(serve_args, short_prompt, long_prompt, late_prompt, *, drain_timeout: float, short_tokens: int = 24,
          long_tokens: int = 4000) -> Scenario:
    """Start a service of its own (`serve_args` plus `--drain-timeout`), stream `long_prompt`
    (`long_tokens`, far more than the drain allows) and, once it has a chunk, send
    `short_prompt` as a whole request; with both open, SIGTERM the server. Then send
    `late_prompt` while it drains, and time the process's exit."""
    short = Outcome("short", "whole")
    long = Outcome("long", "stream")
    late = Outcome("sent during the drain", "whole")
    marks: dict = {}
    with fc.LiveService(*serve_args, "--drain-timeout", drain_timeout) as service:
        url, popen = service.url, service.process.process
        pid = fc.health(url)[1]["worker_pid"]

        def wait_exit():
            marks["code"] = popen.wait()
            marks["exit"] = time.perf_counter()

        async def go():
            async with async_client() as client, fc.Poller(url) as poller:
                first = asyncio.Event()
                run = asyncio.create_task(fc.stream(client, url, body(long_prompt, long_tokens), long,
                                                    on_chunk=lambda _o: first.set()))
                await asyncio.wait_for(first.wait(), 120)
                asked = asyncio.create_task(fc.whole(client, url, body(short_prompt, short_tokens), short))

                async def both_open():
                    return (await poller.health())[1].get("open_requests", 0) >= 2
                await fc.await_until(both_open, timeout=30)
                popen.send_signal(signal.SIGTERM)
                marks["term"] = time.perf_counter()
                threading.Thread(target=wait_exit, daemon=True).start()

                async def draining():
                    status, state = await poller.health()
                    marks["health"] = state.get("status")
                    return status == 503
                await fc.await_until(draining, timeout=10)
                marks["draining"] = time.perf_counter()
                late.sent_at = time.perf_counter()
                answer = await client.post(url + "/v1/completions", json=body(late_prompt, 4))
                late.status, late.ended = answer.status_code, "error" if answer.status_code >= 400 else "answer"
                late.code, late.shape_ok = error_code(answer.json())
                late.mark_ended()
                marks["retry_after"] = answer.headers.get("retry-after")
                await asyncio.gather(run, asked)

        fc.run_async(go)
        deadline = time.monotonic() + 60
        while "exit" not in marks and time.monotonic() < deadline:
            time.sleep(0.01)
    gone = wait_gone(pid)
    term = marks["term"]
    exit_s = marks["exit"] - term if "exit" in marks else None
    return Scenario(
        "drain", f"SIGTERM with a {short_tokens}-token request and a {long_tokens}-token stream running "
                 f"(--drain-timeout {drain_timeout:g} s)",
        [short, long, late],
        {"draining_after_term_s": marks["draining"] - term, "short_ended_after_term_s": short.ended_at - term,
         "long_ended_after_term_s": long.ended_at - term, "exit_after_term_s": exit_s,
         "drain_timeout_s": drain_timeout},
        {"exit_code": marks.get("code"), "retry_after": marks["retry_after"], "long_chunks": long.chunks,
         "worker_pid": pid, "health_status": marks["health"]},
        {"the short request was running at the SIGTERM": short.ended_at > term,
         "the short request was answered": short.ended == "answer" and short.status == 200 and bool(short.text),
         "the long stream kept its tokens, then got shutting_down and [DONE]":
             long.ended == "error" and long.code == "shutting_down" and long.done and long.chunks > 1,
         "the long stream ended no sooner than the drain timeout": long.ended_at - term >= drain_timeout - 0.05,
         "/health said draining": marks["health"] == "draining",
         "a request during the drain got 503 server_draining with Retry-After":
             late.status == 503 and late.code == "server_draining" and bool(late.shape_ok)
             and bool(marks["retry_after"]),
         "the process exited 0": marks.get("code") == 0,
         "the worker is gone": gone})
