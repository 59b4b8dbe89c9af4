"""Chapter 30's scenarios about what clients and the service decide when time runs out or an
attempt fails: timeouts, retries, and a random mix of everything with a worker kill.

* :func:`timeouts`: a client-side timeout (the client leaves; the service cancels) and a
  server-side deadline under `--queue-policy drop-expired` (a waiting request is dropped with
  503 `deadline_expired`; one without a deadline waits its turn).
* :func:`retries`: one worker kill under three streaming clients (a naive greedy one, a safe
  greedy one, a naive sampled one) and, while the worker restarts, a safe client that had
  received nothing: the naive retry duplicates text, the safe rule never does.
* :func:`cancel_during_restart`: a client that leaves while the worker restarts, when the
  service holds its request to submit it again.
* :func:`random_mix`: many kinds of request at once, with a worker kill in the middle.

The shared pieces (the :class:`~labkit.experiments.faults.Scenario` record, solo runs, the
post-condition) are in :mod:`labkit.experiments.faults`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx

from labkit.experiments import fault_client as fc
from labkit.experiments.fault_client import Outcome, body, first_difference, should_retry
from labkit.experiments.faults import Scenario, await_idle, async_client, until_free, bad_requests, solo_texts

CANCELLED = 'labkit:requests_total{outcome="cancelled",route="completions"}'
DROPPED = 'labkit:requests_total{outcome="dropped",route="completions"}'


def backoff_s(attempt: int, base: float = 0.25, cap: float = 4.0) -> float:
    """Seconds to wait before attempt `attempt + 1` (attempt 1 failed: `base`), doubling up
    to `cap`: bounded, so a client that retries cannot hammer a restarting service."""
    if attempt < 1:
        raise ValueError("attempts count from 1")
    return min(cap, base * 2 ** (attempt - 1))


# -- e. timeouts -------------------------------------------------------------------------------

def timeouts(url: str, prompts, *, client_timeout_s: float = 1.0, long_tokens: int = 300,
             filler_tokens: int = 80, deadline_ms: float = 800.0, waiting_tokens: int = 8,
             quiet_s: float = 0.5) -> Scenario:
    """Two timeouts. (1) A whole request of `long_tokens` from a client with an httpx timeout
    of `client_timeout_s`: when is its KV freed, and does the engine stop stepping? (2) With
    every engine slot taken by a long stream (`prompts[1:]`, one per slot of
    `--max-num-seqs`), a request with `deadline_ms` and one with none wait: the first is
    dropped (`--queue-policy drop-expired`), the second waits its turn and is answered. The
    fillers are stopped right after the drop, so the second then gets a slot at once: its
    time says nothing about whether the dropped one could have met its deadline."""
    impatient = Outcome("client timeout", "whole, client timeout")
    fillers = [Outcome(f"filler-{i}", "stream") for i in range(len(prompts) - 1)]
    waiting = Outcome("deadline, waiting", "whole, deadline")
    patient = Outcome("no deadline, waiting", "whole")
    found: dict = {}

    async def client_side(poller) -> None:
        await await_idle(poller, url)
        found["cancelled_before"] = (await poller.metrics())[CANCELLED]
        async with httpx.AsyncClient(timeout=httpx.Timeout(client_timeout_s)) as client:
            await fc.whole(client, url, body(prompts[0], long_tokens), impatient)
        if impatient.code == "ReadTimeout":
            impatient.ended = "left"
        found["release_after_timeout_s"], _ = await until_free(poller, url, impatient.ended_at)
        first = (await poller.metrics())["labkit:engine_steps_total"]
        await asyncio.sleep(quiet_s)
        m = await poller.metrics()
        found["steps_while_quiet"] = m["labkit:engine_steps_total"] - first
        found["cancelled_counted"] = m[CANCELLED] - found["cancelled_before"]

    async def server_side(poller) -> None:
        await await_idle(poller, url)
        found["dropped_before"] = (await poller.metrics())[DROPPED]
        leave = asyncio.Event()
        async with async_client() as client:
            firsts = [asyncio.Event() for _ in fillers]
            run = [asyncio.create_task(fc.stream(client, url, body(p, filler_tokens), o, stop=leave,
                                                 on_chunk=lambda _o, e=e: e.set()))
                   for p, o, e in zip(prompts[1:], fillers, firsts)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
            late = asyncio.create_task(fc.whole(client, url, body(prompts[0], waiting_tokens), patient))
            await fc.whole(client, url, body(prompts[0], waiting_tokens, deadline_ms=deadline_ms), waiting)
            found["queue_at_drop"] = (await poller.metrics()).get("labkit:num_requests_waiting")

            async def shrank():
                return (await poller.metrics()).get("labkit:num_requests_waiting") == 1
            found["queue_shrank_after_s"] = await fc.await_until(shrank, timeout=10)
            found["fillers_running_at_drop"] = sum(not t.done() for t in run)
            leave.set()   # the fillers leave at their next chunk: the patient request runs next
            await asyncio.gather(*run, late)
        found["dropped_counted"] = (await poller.metrics())[DROPPED] - found["dropped_before"]

    async def go():
        async with fc.Poller(url) as poller:
            await client_side(poller)
            await server_side(poller)

    fc.run_async(go)
    return Scenario(
        "timeouts", f"a client that gives up after {client_timeout_s} s; a request with a "
                    f"{deadline_ms:.0f} ms deadline waiting behind {len(fillers)} busy slots",
        [impatient, waiting, patient] + fillers,
        {k: v for k, v in found.items() if k.endswith("_s")} | {"client_timeout_s": client_timeout_s},
        {k: v for k, v in found.items() if not k.endswith("_s")}
        | {"deadline_ms": deadline_ms, "waiting_tokens": waiting_tokens, "filler_tokens": filler_tokens}
        # a latency bound, this machine's: reported, not a claim the scenario must hold. The
        # client's seconds hold the server's arrival-to-drop time plus the way there and back,
        # so a client time under the deadline means the drop came before it; no slack.
        | {"dropped_before_deadline": waiting.seconds is not None and waiting.seconds < deadline_ms / 1e3},
        {"the client's timeout fired": impatient.ended == "left" and impatient.seconds >= client_timeout_s,
         "the service counted it as cancelled": found["cancelled_counted"] == 1,
         "the engine stopped stepping for it": found["steps_while_quiet"] == 0,
         "the waiting request was dropped with 503 deadline_expired":
             waiting.status == 503 and waiting.code == "deadline_expired" and bool(waiting.shape_ok),
         "the engine's queue lost it while the slots stayed busy":
             found["fillers_running_at_drop"] == len(fillers),
         "the service counted it as dropped": found["dropped_counted"] == 1,
         "the request without a deadline waited and was answered": patient.status == 200})


# -- f. retries -------------------------------------------------------------------------------

async def _retrying_stream(client, url, request: dict, policy: str, out: Outcome, got: asyncio.Event,
                           kill_after: int, max_attempts: int, attempt_chunks: list[int] | None = None) -> None:
    """A streaming client that shows every chunk it receives and, after a failed attempt,
    retries the same request if `should_retry(policy, ...)` says so. The text chunks of
    each attempt are appended to `attempt_chunks` (if given)."""
    out.sent_at = time.perf_counter()
    while True:
        attempt = Outcome(out.label, out.kind)
        await fc.stream(client, url, request, attempt,
                        on_chunk=lambda o: got.set() if o.chunks >= kill_after else None)
        out.text += attempt.text
        out.parts.append(attempt.text)
        if attempt_chunks is not None:
            attempt_chunks.append(attempt.chunks)
        out.chunks += attempt.chunks
        out.status, out.code, out.ended, out.shape_ok = attempt.status, attempt.code, attempt.ended, attempt.shape_ok
        if attempt.ended == "answer" or not should_retry(policy, status=attempt.status, code=attempt.code,
                                                          tokens_received=out.chunks, attempt=out.attempts,
                                                          max_attempts=max_attempts):
            break
        await asyncio.sleep(backoff_s(out.attempts))
        out.attempts += 1
    out.mark_ended()


async def _retrying_whole(client, url, request: dict, out: Outcome, max_attempts: int) -> None:
    """The safe rule for a whole answer: retry transient failures (none of its tokens was shown)."""
    out.sent_at = time.perf_counter()
    while True:
        attempt = Outcome(out.label, out.kind)
        await fc.whole(client, url, request, attempt)
        out.parts.append(attempt.code or "answer")
        out.status, out.code, out.ended, out.text = attempt.status, attempt.code, attempt.ended, attempt.text
        if attempt.ended == "answer" or not should_retry("safe", status=attempt.status, code=attempt.code,
                                                          tokens_received=0, attempt=out.attempts,
                                                          max_attempts=max_attempts):
            break
        await asyncio.sleep(backoff_s(out.attempts))
        out.attempts += 1
    out.mark_ended()


def retries(url: str, prompt, sampled_prompt, max_tokens: int, *, kill_after: int = 4,
            max_attempts: int = 10, temperature: float = 1.0) -> Scenario:
    """Kill the worker under three streaming clients, each with `kill_after` chunks shown:
    a naive greedy client (retries any transient failure), a safe greedy one (retries only
    if nothing was shown) and a naive sampled one (`temperature`, no seed). Right after the
    kill, a safe client asks for the same greedy answer whole and meets the restart."""
    solo = solo_texts(url, [prompt], max_tokens)[0]
    naive = Outcome("naive, greedy", "stream, naive retry", expected=solo)
    safe = Outcome("safe, greedy", "stream, safe retry", expected=solo)
    sampled = Outcome("naive, sampled", "stream, naive retry")
    fresh = Outcome("safe, sent during the restart", "whole, safe retry", expected=solo)
    marks: dict = {}
    chunks: list[list[int]] = [[], [], []]   # text chunks of each attempt, per streaming client

    async def go():
        async with async_client() as client:
            got = [asyncio.Event() for _ in range(3)]
            plan = [(body(prompt, max_tokens), "naive", naive),
                    (body(prompt, max_tokens), "safe", safe),
                    (body(sampled_prompt, max_tokens, temperature=temperature), "naive", sampled)]
            tasks = [asyncio.create_task(_retrying_stream(client, url, request, policy, out, g, kill_after,
                                                          max_attempts, n))
                     for (request, policy, out), g, n in zip(plan, got, chunks)]
            await asyncio.wait_for(asyncio.gather(*(g.wait() for g in got)), 120)
            marks["pid"], marks["kill"] = fc.kill_worker(url)

            async def noticed():
                answer = await client.get(url + "/health")
                return answer.status_code == 503
            await fc.await_until(noticed, timeout=30)
            await _retrying_whole(client, url, body(prompt, max_tokens), fresh, max_attempts)
            await asyncio.gather(*tasks)

    fc.run_async(go)
    partial = naive.parts[0] if naive.parts else ""
    retried_sample = sampled.parts[-1] if len(sampled.parts) > 1 else ""
    differs_at = first_difference(sampled.parts[0], retried_sample[:len(sampled.parts[0])])
    return Scenario(
        "retries", f"SIGKILL of worker {marks['pid']} after {kill_after} chunks of three streams; a "
                   "whole request sent while the worker restarted",
        [naive, safe, sampled, fresh],
        {"fresh_seconds": fresh.seconds},
        {"naive_shown_chars": len(naive.text), "solo_chars": len(solo), "duplicated_chars": len(partial),
         # chunks each streaming client had shown when its first attempt broke (the kill came
         # once each had `kill_after`; more may have arrived before the error event)
         "first_attempt_chunks": [n[0] if n else 0 for n in chunks], "kill_after": kill_after,
         "sampled_first_difference": differs_at, "fresh_attempts": fresh.attempts},
        {"naive: the shown text is the partial text and then the whole answer":
             naive.ended == "answer" and naive.attempts >= 2 and bool(partial) and naive.text == partial + solo,
         "safe: no retry after tokens were shown": safe.attempts == 1 and safe.ended == "error",
         "safe: what was shown is a prefix of the solo answer, never duplicated":
             bool(safe.text) and solo.startswith(safe.text) and safe.text != solo,
         "safe: the request sent during the restart was refused with 503, then answered":
             fresh.parts[0] == "engine_unavailable" and fresh.status == 200 and bool(fresh.matches)})


# -- a cancel that arrives while the worker restarts ----------------------------------------------

def cancel_during_restart(url: str, prompts, queued_prompt, queued_tokens: int, *, stream_tokens: int = 64,
                          kill_after: int = 2, ready_timeout: float = 240.0) -> Scenario:
    """Fill every engine slot with a stream (`prompts`), queue one whole request of
    `queued_tokens`, kill the worker, and cancel the queued request's client while the new
    worker starts. The service keeps a request that had received nothing to submit it again;
    does the cancel reach it, or does the new worker run it for nobody?"""
    streams = [Outcome(f"stream-{i}", "stream") for i in range(len(prompts))]
    queued = Outcome("waiting, cancelled during the restart", "whole")
    marks: dict = {}

    async def go():
        async with async_client() as client, fc.Poller(url) as poller:
            got = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(fc.stream(client, url, body(p, stream_tokens), o,
                                                   on_chunk=lambda o, e=e: e.set() if o.chunks >= kill_after
                                                   else None))
                     for p, o, e in zip(prompts, streams, got)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in got)), 120)
            waiting = asyncio.create_task(fc.whole(client, url, body(queued_prompt, queued_tokens), queued))

            async def in_queue():
                return (await poller.metrics()).get("labkit:num_requests_waiting", 0) >= 1
            await fc.await_until(in_queue, timeout=30)
            marks["pid"], marks["kill"] = fc.kill_worker(url)

            async def restarting():
                return (await poller.health())[0] == 503
            await fc.await_until(restarting, timeout=30)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            marks["cancel"] = time.perf_counter()
            queued.ended, queued.ended_at = "left", marks["cancel"]
            queued.seconds = queued.ended_at - queued.sent_at
            await asyncio.gather(*tasks)

            async def back():
                status, state = await poller.health()
                return status == 200 and state["worker_pid"] != marks["pid"]
            await fc.await_until(back, timeout=ready_timeout)
            marks["ready"] = time.perf_counter()
            marks["open_after_restart"] = (await poller.health())[1]["open_requests"]
            while True:
                m, (_, state) = await poller.metrics(), await poller.health()
                if fc.idle(m) and state["open_requests"] == 0:
                    marks["idle"], marks["steps"] = time.perf_counter(), m.get("labkit:engine_steps_total")
                    break
                await asyncio.sleep(0.01)

    fc.run_async(go)
    return Scenario(
        "cancel_during_restart", f"SIGKILL of worker {marks['pid']} with one request waiting; its client "
                                 "left while the new worker started",
        streams + [queued],
        {"restart_s": marks["ready"] - marks["kill"], "cancel_after_kill_s": marks["cancel"] - marks["kill"],
         "busy_after_restart_s": marks["idle"] - marks["ready"]},
        {"engine_steps_after_restart": marks["steps"], "open_requests_after_restart": marks["open_after_restart"],
         "queued_tokens": queued_tokens},
        {"the cancel reached the engine: no work after the restart": marks["steps"] == 0,
         "the streams that had tokens ended with an error": all(o.ended == "error" for o in streams)})


# -- g. a random mix with a worker kill ----------------------------------------------------------

MIX_KINDS = ("stream", "whole", "leave", "bad", "timeout", "sampled")
STREAMING_KINDS = ("stream", "leave", "sampled")


def random_mix(url: str, prompts, *, requests: int = 24, seed: int = 0, kill: bool = True,
               client_timeout_s: float = 0.6, max_tokens: tuple[int, int] = (8, 48)) -> Scenario:
    """`requests` requests of random kinds (:data:`MIX_KINDS`), half sent at once, the worker
    killed once three are open and a stream of them has had its first chunk, then the other
    half: every request must end with an answer, an error in the one shape, or its client's
    own departure. `counters` keep what `/health` counted across the scenario: the worker's
    restarts and the requests it submitted again to the new worker (`replays`), so that a
    reading of the run rests on what the service did. Each sampled request has a seed of its
    own (`seed * 1000 + its index`): the draws are independent and the run repeatable."""
    rng = random.Random(seed)
    table = bad_requests()
    plan = []
    for i in range(requests):
        kind = rng.choice(MIX_KINDS)
        plan.append((kind, rng.choice(prompts), rng.randint(*max_tokens), rng.choice(table), rng.randint(1, 6)))
    outcomes = [Outcome(f"{kind}-{i}", kind) for i, (kind, *_) in enumerate(plan)]
    marks: dict = {}

    async def one(client, spec, out: Outcome, index: int) -> None:
        kind, prompt, tokens, bad, leave_after = spec
        if kind == "bad":
            _, path, content, headers, _, _ = bad
            await fc.raw(client, url, path, content, headers, out)
        elif kind == "whole":
            await fc.whole(client, url, body(prompt, tokens), out)
        elif kind == "timeout":
            async with httpx.AsyncClient(timeout=httpx.Timeout(client_timeout_s)) as impatient:
                await fc.whole(impatient, url, body(prompt, 80), out)
            if out.code == "ReadTimeout":
                out.ended = "left"
        else:
            extra = {"temperature": 1.0, "seed": seed * 1000 + index} if kind == "sampled" else {}
            await fc.stream(client, url, body(prompt, tokens, **extra), out,
                            leave_after=leave_after if kind == "leave" else None)

    async def go():
        async with async_client() as client, fc.Poller(url) as poller:
            marks["before"] = (await poller.health())[1]
            half = requests // 2
            first = [asyncio.create_task(one(client, s, o, i))
                     for i, (s, o) in enumerate(zip(plan[:half], outcomes[:half]))]
            if kill:
                streams_first = any(s[0] in STREAMING_KINDS for s in plan[:half])

                async def busy():
                    status, state = await poller.health()
                    streamed = any(o.chunks for o in outcomes[:half]) or not streams_first
                    return status == 200 and state["open_requests"] >= 3 and streamed
                await fc.await_until(busy, timeout=60)
                marks["open"] = (await poller.health())[1]["open_requests"]
                marks["pid"], marks["kill"] = fc.kill_worker(url)
                marks["streamed"] = sum(o.chunks > 0 for o in outcomes[:half])
                watcher = asyncio.create_task(asyncio.wait_for(until_noticed(poller), 60))
            rest = [asyncio.create_task(one(client, s, o, half + i))
                    for i, (s, o) in enumerate(zip(plan[half:], outcomes[half:]))]
            await asyncio.gather(*first, *rest)
            if kill:
                marks["noticed"] = await watcher

    fc.run_async(go)
    # a fresh connection: the server may have closed the poller's while the clients ran
    fc.wait_until(lambda: fc.ready(url), timeout=120)
    before, after = marks["before"], fc.health(url)[1]
    restarts, replays = after["restarts"] - before["restarts"], after["replays"] - before["replays"]
    bad_ok = [(o.status, o.code) == (spec[3][4], spec[3][5]) for spec, o in zip(plan, outcomes) if spec[0] == "bad"]
    good_errors = {o.code for spec, o in zip(plan, outcomes) if spec[0] != "bad" and o.ended == "error"}
    kill_at, noticed_at = marks.get("kill"), marks.get("noticed")
    counters = {"kinds": {k: sum(s[0] == k for s in plan) for k in MIX_KINDS},
                "error_codes": sorted(c for c in good_errors if c), "worker_restarts": restarts,
                "replays": replays, "open_at_kill": marks.get("open"),
                "streams_with_chunks_at_kill": marks.get("streamed"),
                "noticed_after_kill_s": None if noticed_at is None else noticed_at - kill_at,
                "sent_after_kill_s": [None if kill_at is None else o.sent_at - kill_at for o in outcomes],
                "sent": [sent_phase(o.sent_at, kill_at, noticed_at) for o in outcomes]}
    return Scenario(
        "random_mix", f"{requests} requests of {len(MIX_KINDS)} kinds, seed {seed}"
                      + (f", worker {marks['pid']} killed among them" if kill else ""),
        outcomes, {}, counters,
        {"every request ended": all(o.ended in ("answer", "error", "left") for o in outcomes),
         "every error in the one shape": all(o.shape_ok for o in outcomes if o.ended == "error"),
         "bad requests got their documented status and code": all(bad_ok),
         "good requests failed only because the worker died":
             good_errors <= {"engine_died", "engine_unavailable"},
         "the worker was restarted once per kill (/health)": restarts == int(kill),
         "a new worker took over (/health)": (after["worker_pid"] != before["worker_pid"]) == kill})


BEFORE_KILL, BEFORE_NOTICED, AFTER_NOTICED = ("before the kill", "after the kill, before /health said 503",
                                             "after /health said 503")


async def until_noticed(poller, interval: float = 0.005) -> float:
    """Poll `/health` until it stops answering 200 (the front end has seen its worker die and
    is restarting it); the perf_counter time at which that first non-200 poll was sent. A
    request sent before then may have reached a front end that still took the worker for
    alive: it is accepted, passed to the dead worker and, having no token, submitted again
    to the new one (a replay); one that arrives after is refused with `engine_unavailable`."""
    while True:
        asked = time.perf_counter()
        if (await poller.health())[0] != 200:
            return asked
        await asyncio.sleep(interval)


def sent_phase(sent_at: float, kill_at: float | None, noticed_at: float | None) -> str:
    """When a request was sent, on the client's clock, against the kill and the first `/health`
    poll that showed the front end had noticed the death (:func:`until_noticed`)."""
    if kill_at is None or sent_at < kill_at:
        return BEFORE_KILL
    if noticed_at is None or sent_at < noticed_at:
        return BEFORE_NOTICED
    return AFTER_NOTICED


def mix_request_rows(seed: int, mix: Scenario, text_chars: int = 30) -> list[dict]:
    """:meth:`Scenario.rows` of a :func:`random_mix` run, each with its seed, when it was sent
    (:func:`sent_phase`) and its send time after the kill (ms; negative before it)."""
    after = mix.counters["sent_after_kill_s"]
    return [row | {"seed": seed, "sent": phase,
                   "sent_after_kill_ms": None if t is None else round(1e3 * t, 1)}
            for row, phase, t in zip(mix.rows(text_chars=text_chars), mix.counters["sent"], after)]


def mix_summary(seed: int, mix: Scenario) -> dict:
    """One table row for a :func:`random_mix` run: how its requests ended, why its well-formed
    ones failed (with the `engine_died` ones that had shown their client no chunk), and what `/health` counted (restarts, replays) around the kill."""
    ended = Counter(o.ended for o in mix.outcomes)
    failed = Counter(o.code for o in mix.outcomes if o.kind != "bad" and o.ended == "error")
    # the well-formed requests sent after the kill: accepted (into the dead worker, then
    # replayed) or refused, split by whether /health had shown the death when each was sent
    late = [(o, phase) for o, phase in zip(mix.outcomes, mix.counters["sent"])
            if o.kind != "bad" and phase != BEFORE_KILL]
    refused = [phase for o, phase in late if o.code == "engine_unavailable"]
    noticed = mix.counters["noticed_after_kill_s"]
    return {"seed": seed, "requests": len(mix.outcomes), "answered": ended["answer"], "left": ended["left"],
            "bad": sum(o.kind == "bad" for o in mix.outcomes), "failed": sum(failed.values()),
            "engine_unavailable": failed["engine_unavailable"], "engine_died": failed["engine_died"],
            # a request the engine had given tokens ends so even if its client saw none (a
            # whole request): the front end replays only one that had received nothing
            "engine_died with nothing shown": sum(o.code == "engine_died" and not o.chunks
                                                  for o in mix.outcomes),
            "worker restarts": mix.counters["worker_restarts"], "replays": mix.counters["replays"],
            "open at the kill": mix.counters["open_at_kill"] or 0,
            "streams with chunks at the kill": mix.counters["streams_with_chunks_at_kill"] or 0,
            "noticed after the kill (ms)": None if noticed is None else round(1e3 * noticed),
            "well-formed sent after the kill": len(late),
            "of those, sent before /health said 503": sum(phase == BEFORE_NOTICED for _, phase in late),
            "of those, accepted": len(late) - len(refused),
            "of those, refused": len(refused)}
