"""Fault injection against a live `labkit serve` (worker mode), one function per fault.

Each scenario drives the service over real sockets, breaks something on purpose, and
returns a :class:`Scenario`: what was done, what every request got (an
:class:`~labkit.experiments.fault_client.Outcome` each), timings, counters, and its key claims
as named booleans. :func:`after_scenario` is the common post-condition, run after every one:
once the service is idle, no KV block is held, nothing runs or waits, `/health` answers 200
and a fresh greedy request gives the expected text.

* :func:`kv_exhaustion`: more concurrent long requests than the KV pool holds: the engine
  preempts (recomputes) instead of failing, and every answer equals its solo run.
* :func:`worker_kill`: SIGKILL the engine worker under running streams and one waiting
  request: streams that had tokens end with an error event, the waiting one is retried by
  the service and succeeds; how long the restart takes.
* :func:`malformed`: bad requests at the same time as good streams: 4xx in one shape for the
  bad, untouched text for the good.
* :func:`disconnects`: the time from a client's disconnect to its KV blocks being free, over
  many trials, streamed and whole, against one engine step (:func:`engine_step_seconds`).

The scenarios about timeouts, retries, a cancel during a restart and a random mix of
everything are in :mod:`labkit.experiments.fault_policies`; a hung worker, a crash loop and a
SIGTERM drain in :mod:`labkit.experiments.supervision_faults`; the client side (the live
service, metrics, one request as its client saw it, the retry rules) in
:mod:`labkit.experiments.fault_client`.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from labkit.bench.http_load import percentiles
from labkit.experiments import fault_client as fc
from labkit.experiments.fault_client import Outcome, body

DEFAULT_BLOCK = 16


@dataclass
class Scenario:
    """One fault and what followed. `checks` are the scenario's claims (True: held)."""

    name: str
    done: str
    outcomes: list[Outcome] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    trace: list[dict] = field(default_factory=list, repr=False)   # sampled service state
    after: dict | None = None

    @property
    def ok(self) -> bool:
        return all(self.checks.values()) and (self.after is None or self.after["ok"])

    def rows(self, text_chars: int | None = None) -> list[dict]:
        """One row per request; with `text_chars`, texts cut to that many characters (with
        newlines shown as the two characters \\n) for a table."""
        rows = [o.row() for o in self.outcomes]
        if text_chars is not None:
            for row in rows:
                text = row["text"].replace("\n", "\\n")
                row["text"] = text if len(text) <= text_chars else text[:text_chars - 1] + "…"
        return rows


def summary_rows(records: list[Scenario]) -> list[dict]:
    """One row per scenario: its claims held, and the post-condition found after it."""
    rows = []
    for r in records:
        after = r.after or {}
        rows.append({"scenario": r.name, "claims_held": f"{sum(r.checks.values())} of {len(r.checks)}",
                     "waited_for_idle_s": round(after.get("waited_s", float("nan")), 2),
                     "kv_blocks_used": after.get("kv_blocks_used"), "running": after.get("running"),
                     "waiting": after.get("queue"), "open_requests": after.get("open_requests"),
                     "health": after.get("health_status"), "fresh_answer_correct": after.get("fresh_correct"),
                     "post_condition": after.get("ok")})
    return rows


@dataclass(frozen=True)
class Probe:
    """A fresh request after a scenario, and the text it must give (from an independent run)."""

    prompt: list[int] | str
    max_tokens: int
    expected: str


def reference_probe(model, prompt: str = "The capital of France is", max_tokens: int = 8) -> Probe:
    """A probe whose expected text is the greedy continuation by the engine's simple loop in
    this process (:func:`labkit.engine.loop.generate`), not by the service under test."""
    from labkit.engine.loop import generate
    from labkit.sampling import SamplingParams

    run = generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return Probe(prompt, max_tokens, run.text)


def prompt_pool(count: int, tokens: int, first: int = 0) -> list[list[int]]:
    """`count` prompts of `tokens` token ids each: consecutive slices of the book's
    evaluation text, starting at slice `first` (so scenarios can take disjoint ones)."""
    from labkit.eval import eval_text
    from labkit.models.loader import load_tokenizer

    ids = load_tokenizer(fc.MODEL).encode(eval_text())
    if (first + count) * tokens > len(ids):
        raise ValueError(f"the text holds only {len(ids) // tokens} slices of {tokens} tokens")
    return [ids[(first + i) * tokens:(first + i + 1) * tokens] for i in range(count)]


# -- the common post-condition ---------------------------------------------------------------

def after_scenario(url: str, probe: Probe, *, timeout: float = 120.0) -> dict:
    """Wait until the service is idle (or `timeout`), then check: no KV block used, no
    sequence running, none waiting, no request open in the front end, `/health` 200, and a
    fresh greedy request answers with `probe.expected`. Never raises on a failed check: the
    dict says what held (`ok`: all of them)."""
    start = time.perf_counter()
    waited = True
    try:
        fc.wait_until(lambda: fc.ready(url) and fc.idle(fc.metrics(url))
                      and fc.health(url)[1].get("open_requests") == 0, timeout=timeout, interval=0.05)
    except TimeoutError:
        waited = False
    idle_s = time.perf_counter() - start
    m = fc.metrics(url)
    status, state = fc.health(url)
    answer = httpx.post(url + "/v1/completions", json=body(probe.prompt, probe.max_tokens), timeout=120)
    text = answer.json()["choices"][0]["text"] if answer.status_code == 200 else None
    out = {"idle_within_timeout": waited, "waited_s": idle_s,
           "kv_blocks_used": m.get("labkit:kv_blocks_used"), "running": m.get("labkit:num_requests_running"),
           "queue": m.get("labkit:num_requests_waiting"), "open_requests": state.get("open_requests"),
           "health_status": status, "fresh_status": answer.status_code, "fresh_text": text,
           "fresh_correct": text == probe.expected}
    out["ok"] = (waited and out["kv_blocks_used"] == 0 and out["running"] == 0 and out["queue"] == 0
                 and out["open_requests"] == 0 and status == 200 and out["fresh_correct"])
    return out


def solo_texts(url: str, prompts, max_tokens: int) -> list[str]:
    """Each prompt's greedy text, one request at a time (the reference for batched runs)."""
    out = []
    for prompt in prompts:
        answer = httpx.post(url + "/v1/completions", json=body(prompt, max_tokens), timeout=300)
        answer.raise_for_status()
        out.append(answer.json()["choices"][0]["text"])
    return out


def async_client(timeout: float = 300.0, connections: int = 64) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits)


async def _sample_state(poller, url, trace: list, stop: asyncio.Event, every: float) -> None:
    """Append the service's gauges and counters to `trace` every `every` seconds."""
    start = time.perf_counter()
    while not stop.is_set():
        m = await poller.metrics()
        trace.append({"t_s": time.perf_counter() - start, "kv_blocks_used": m.get("labkit:kv_blocks_used"),
                      "running": m.get("labkit:num_requests_running"), "waiting": m.get("labkit:num_requests_waiting"),
                      "preemptions": m.get("labkit:num_preemptions_total"),
                      "engine_steps": m.get("labkit:engine_steps_total")})
        await asyncio.sleep(every)


def longest_steady_wait(trace: list[dict], slots: int) -> dict | None:
    """The longest stretch of consecutive `trace` samples (:func:`_sample_state`) in which
    sequences waited while a slot was free (fewer than `slots` running: with every slot taken,
    the slot limit explains the wait) and neither the running count, the waiting count nor
    the KV blocks in use changed, so that the exhaustion figure is flat in its panels of
    both: its first and last sample's times, those counts, the blocks, and how far the
    engine's step counter moved across it. The worker publishes its gauges after each step,
    so a stretch with no step at all is one step that ran that long, the gauges showing the
    state from before it; None when no sample had a sequence waiting with a slot free."""
    def key(row):
        return (row["running"], row["waiting"], row["kv_blocks_used"])
    best, start = None, None
    for i, row in enumerate(trace + [None]):
        if start is not None and (row is None or key(row) != key(trace[start])):
            first, last = trace[start], trace[i - 1]
            if best is None or last["t_s"] - first["t_s"] > best["end_s"] - best["start_s"]:
                best = {"start_s": first["t_s"], "end_s": last["t_s"], "running": first["running"],
                        "waiting": first["waiting"], "blocks_used": first["kv_blocks_used"],
                        "engine_steps": last["engine_steps"] - first["engine_steps"]}
            start = None
        if start is None and row is not None and (row["waiting"] or 0) > 0 and (row["running"] or 0) < slots:
            start = i
    return best


def steady_wait_reading(flat: dict | None, slots: int) -> str:
    """The chapter's sentence on :func:`longest_steady_wait`'s stretch: one step that ran the
    whole stretch when the step counter did not move, otherwise steps that ran while the
    waiting sequences were not admitted; when sequences waited only with every slot taken,
    that the slot limit held them."""
    if flat is None:
        return (f"Sequences waited only while all {slots} slots were taken: the slot limit "
                "(`--max-num-seqs`) held them.")
    stretch = (f"Leaving out the samples with all {slots} slots taken (there the slot limit, "
               "`--max-num-seqs`, explains the wait), the longest stretch with sequences "
               "waiting and no count changing in panels (a) and (b), from "
               f"{flat['start_s']:.1f} to {flat['end_s']:.1f} s "
               f"({flat['running']:.0f} running, {flat['waiting']:.0f} waiting, "
               f"{flat['blocks_used']:.0f} blocks used),")
    if flat["engine_steps"] == 0:
        return (f"{stretch} holds no engine step at all (the step counter in the same samples "
                "did not move): one step ran that long, and `/metrics` showed the state from "
                "before it; which work made that step so long, this trace does not show.")
    return (f"{stretch} held {flat['engine_steps']:.0f} engine steps (the step counter in the "
            "same samples): the engine ran on while the waiting sequences were not admitted; "
            "why the scheduler held them there, this run does not trace.")


# -- the near-tie rule for answers of two numerical paths ----------------------------------------

def judge_near_ties(record: Scenario, check: str, model, prompts: dict[str, list[int]], max_tokens: int,
                    tolerance: float, *, prefix: bool = False):
    """Re-judge ``record.checks[check]``, a claim that some answers equal their solo runs,
    by the book's near-tie rule. The answers went through another numerical path than their
    solo runs (batched rows, a recomputed prefill after a preemption), so where one differs
    from its solo text, both texts are held to the engine's simple loop in this process on
    the same prompt (:mod:`labkit.experiments.text_agreement`): the claim holds if every one
    of them agrees with it, exactly or up to an excused near-tie. `prompts` maps an outcome's
    label to its prompt ids (the outcomes the claim is about); with `prefix`, an answer may
    be cut short (a stream that ended in an error). The excused count goes to
    ``record.counters["near_tie_excused"]``. Returns the
    :class:`~labkit.util.near_tie.AgreementSummary` of the texts that differed (empty if none)."""
    from labkit.experiments import text_agreement as ta
    from labkit.util.near_tie import AgreementSummary

    def equal(o: Outcome) -> bool:
        return o.expected.startswith(o.text) if prefix else o.text == o.expected

    if check not in record.checks:
        raise KeyError(f"{record.name} has no check {check!r}")
    differ = [o for o in record.outcomes if o.label in prompts and o.expected is not None and not equal(o)]
    sequences = []
    if differ:
        refs = ta.reference_runs(model, [prompts[o.label] for o in differ], max_tokens)
        for o, ref in zip(differ, refs):
            sequences.append(ta.text_agreement(model.tokenizer, ref, o.expected, tolerance))
            sequences.append(ta.text_agreement(model.tokenizer, ref, o.text, tolerance, prefix=prefix))
    summary = AgreementSummary(tuple(sequences))
    excused = record.counters.get("near_tie_excused", 0)
    if differ:  # the claim was exact equality; now it is agreement under the rule
        record.checks[check] = summary.ok
        excused += len(differ) if summary.ok else 0
    record.counters["near_tie_excused"] = excused
    return summary


# -- a. KV exhaustion --------------------------------------------------------------------------

def kv_exhaustion(url: str, prompts, max_tokens: int, *, block_size: int = DEFAULT_BLOCK,
                  sample_every: float = 0.05) -> Scenario:
    """Send every prompt at once (greedy, `max_tokens` each, past EOS) to a service whose KV
    pool is smaller than their sum; compare each answer with its solo run."""
    solo = solo_texts(url, prompts, max_tokens)
    before, restarts = fc.metrics(url), fc.health(url)[1]["restarts"]
    pool = before["labkit:kv_blocks_used"] + before["labkit:kv_blocks_free"]
    demand = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    outcomes = [Outcome(f"long-{i}", "stream", expected=solo[i]) for i in range(len(prompts))]
    trace: list[dict] = []

    async def go():
        stop = asyncio.Event()
        async with async_client() as client, fc.Poller(url) as poller:
            sampler = asyncio.create_task(_sample_state(poller, url, trace, stop, sample_every))
            start = time.perf_counter()
            await asyncio.gather(*(fc.stream(client, url, body(p, max_tokens), o)
                                   for p, o in zip(prompts, outcomes)))
            wall = time.perf_counter() - start
            stop.set()
            await sampler
            return wall

    wall = fc.run_async(go)
    after = fc.metrics(url)
    same_worker = fc.health(url)[1]["restarts"] == restarts
    preempted = after["labkit:num_preemptions_total"] - before["labkit:num_preemptions_total"]
    peak = max((row["kv_blocks_used"] or 0) for row in trace) if trace else None
    return Scenario(
        "kv_exhaustion", f"{len(prompts)} greedy streams of {max_tokens} tokens at once into a "
                         f"{pool:.0f}-block pool that they would need {demand} blocks to hold",
        outcomes, {"wall_s": wall},
        {"pool_blocks": pool, "demand_blocks": demand, "preemptions": preempted, "peak_blocks_used": peak},
        {"demand exceeds the pool": demand > pool, "same worker throughout": same_worker,
         "preemptions happened": preempted > 0,
         "every request answered": all(o.ended == "answer" and o.status == 200 for o in outcomes),
         "every answer equals its solo run": all(o.matches for o in outcomes)}, trace)


# -- b. a worker killed mid-stream ---------------------------------------------------------------

def worker_kill(url: str, prompts, max_tokens: int, queued_prompt, queued_tokens: int, *,
                kill_after: int = 3, ready_timeout: float = 240.0) -> Scenario:
    """Stream `prompts` with the official `openai` client (one per engine slot, so that they
    fill `--max-num-seqs`), add one whole request that must wait, and SIGKILL the worker once
    every stream has `kill_after` chunks and the extra request is in the engine's queue."""
    import openai

    solo_q = solo_texts(url, [queued_prompt], queued_tokens)[0]
    _, state = fc.health(url)
    restarts0, pid0 = state["restarts"], state["worker_pid"]
    streams = [Outcome(f"stream-{i}", "stream (openai)") for i in range(len(prompts))]
    queued = Outcome("waiting", "whole", expected=solo_q)
    marks: dict = {}

    async def one(oa, prompt, out: Outcome, got: asyncio.Event) -> None:
        out.sent_at = time.perf_counter()
        try:
            answer = await oa.completions.create(model=fc.MODEL, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
            out.status = 200
            async for chunk in answer:
                if chunk.choices and chunk.choices[0].text:
                    out.text += chunk.choices[0].text
                    out.chunks += 1
                    if out.chunks >= kill_after:
                        got.set()
            out.ended = "answer"
        except openai.APIError as error:
            out.code, out.ended = error.code or type(error).__name__, "error"
        finally:
            out.ended_at = time.perf_counter()
            out.seconds = out.ended_at - out.sent_at

    async def go():
        oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key="labkit", max_retries=0, timeout=300)
        async with async_client() as client, fc.Poller(url) as poller:
            got = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(one(oa, p, o, g)) for p, o, g in zip(prompts, streams, got)]
            await asyncio.wait_for(asyncio.gather(*(g.wait() for g in got)), 120)
            waiting = asyncio.create_task(fc.whole(client, url, body(queued_prompt, queued_tokens), queued))

            async def in_queue():
                return (await poller.metrics()).get("labkit:num_requests_waiting", 0) >= 1
            await fc.await_until(in_queue, timeout=30)
            marks["pid"], marks["kill"] = fc.kill_worker(url)
            await asyncio.gather(*tasks)

            async def back():
                status, state = await poller.health()
                return status == 200 and state["worker_pid"] != marks["pid"]
            await fc.await_until(back, timeout=ready_timeout, interval=0.02)
            marks["ready"] = time.perf_counter()
            await waiting
        await oa.close()

    fc.run_async(go)
    _, state = fc.health(url)
    restart_s = marks["ready"] - marks["kill"]
    errors_after = [o.ended_at - marks["kill"] for o in streams]
    return Scenario(
        "worker_kill", f"SIGKILL of worker {marks['pid']} under {len(prompts)} streams with at least "
                       f"{kill_after} chunks each and one request waiting for a slot",
        streams + [queued],
        {"restart_s": restart_s, "stream_error_after_kill_s": errors_after},
        {"restarts_before": restarts0, "restarts_after": state["restarts"], "old_pid": pid0,
         "new_pid": state["worker_pid"], "restarts_metric": fc.metrics(url).get("labkit:engine_restarts_total")},
        {"every stream with tokens ended with an error": all(o.ended == "error" and o.chunks >= kill_after
                                                             for o in streams),
         "the official client raised it": all(o.code == "engine_died" for o in streams),
         "the waiting request was retried and answered": queued.status == 200,
         # exact, not the near-tie rule: the streams have all ended, so the new worker runs it
         # alone, one sequence as its solo run was: the same numerical path
         "its answer equals its solo run": bool(queued.matches),
         "one restart counted": state["restarts"] == restarts0 + 1,
         "a new worker": state["worker_pid"] not in (None, pid0)})


# -- c. malformed input beside good traffic -------------------------------------------------------

_GOOD = {"model": fc.MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def bad_requests() -> list[tuple[str, str, bytes, dict, int, str]]:
    """(what, path, body bytes, extra headers, documented status, documented code)."""

    def j(payload) -> bytes:
        return json.dumps(payload).encode()

    return [
        ("not JSON", "/v1/completions", b"hello", {}, 400, "invalid_json"),
        ("truncated JSON", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "x"', {}, 400,
         "invalid_json"),
        ("NaN temperature", "/v1/completions",
         b'{"model": "smollm2-135m", "prompt": "x", "temperature": NaN}', {}, 400, "invalid_json"),
        ("invalid UTF-8", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "\xc3\x28"}', {}, 400,
         "invalid_utf8"),
        ("form content type", "/v1/completions", b"model=x",
         {"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
        ("body over 1 MiB", "/v1/completions", j(_GOOD | {"prompt": "x" * (1 << 20)}), {}, 413,
         "body_too_large"),
        ('"5" as max_tokens', "/v1/completions", j(_GOOD | {"max_tokens": "5"}), {}, 400, "invalid_type"),
        ("misspelt field", "/v1/completions", j(_GOOD | {"max_token": 5}), {}, 400, "unknown_parameter"),
        # suffix is OpenAI's, not implemented here: taken only at "" (asks for nothing)
        ('unsupported OpenAI field (suffix "!")', "/v1/completions", j(_GOOD | {"suffix": "!"}), {}, 400,
         "unsupported_parameter"),
        ("empty prompt", "/v1/completions", j(_GOOD | {"prompt": ""}), {}, 400, "invalid_value"),
        ("token id outside the vocabulary", "/v1/completions", j(_GOOD | {"prompt": [10 ** 7]}), {}, 400,
         "invalid_value"),
        # labkit serve caps its context to what the KV pool holds for one sequence, so a
        # request too big for the pool is over the context first (kv_budget_exceeded is the
        # engine's check for an engine whose context was not capped)
        ("more tokens than the context (capped to the KV pool)", "/v1/completions",
         j(_GOOD | {"max_tokens": 10 ** 9}), {}, 400, "context_length_exceeded"),
        ("unknown model", "/v1/completions", j(_GOOD | {"model": "gpt-5"}), {}, 404, "model_not_found"),
        ("unknown route", "/v1/embeddings", j(_GOOD), {}, 404, "unknown_route"),
    ]


def malformed(url: str, prompts, max_tokens: int, *, rounds: int = 1) -> Scenario:
    """Good greedy streams run while every request of :func:`bad_requests` is sent `rounds`
    times, all at once, once each stream has its first chunk."""
    solo = solo_texts(url, prompts, max_tokens)
    good = [Outcome(f"good-{i}", "stream", expected=solo[i]) for i in range(len(prompts))]
    table = bad_requests()
    bad = [Outcome(what, "malformed") for _ in range(rounds) for what, *_ in table]
    documented = [(status, code) for _ in range(rounds) for *_, status, code in table]

    async def go():
        async with async_client() as client:
            first = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(fc.stream(client, url, body(p, max_tokens), o,
                                                   on_chunk=lambda _o, e=e: e.set()))
                     for p, o, e in zip(prompts, good, first)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 120)
            sends = [fc.raw(client, url, path, content, headers, out)
                     for out, (_, path, content, headers, _, _) in zip(bad, table * rounds)]
            await asyncio.gather(*sends)
            good_still_running = sum(not t.done() for t in tasks)
            await asyncio.gather(*tasks)
            return good_still_running

    running = fc.run_async(go)
    as_documented = [(o.status, o.code) == d for o, d in zip(bad, documented)]
    return Scenario(
        "malformed", f"{len(bad)} malformed requests ({len(table)} kinds) sent at once while "
                     f"{len(prompts)} good streams ran",
        good + bad, {}, {"good_streams_running_when_the_bad_were_answered": running},
        {"good streams answered": all(o.ended == "answer" for o in good),
         "good text equals the solo run": all(o.matches for o in good),
         "every bad request got a 4xx": all(o.status is not None and 400 <= o.status < 500 for o in bad),
         "each with its documented status and code": all(as_documented),
         "every error body in the one shape": all(o.shape_ok for o in bad)})


# -- d. disconnects: how soon are the blocks free? -------------------------------------------------

def server_timing(header: str) -> dict[str, float]:
    """A `Server-Timing` header -> {stage: milliseconds}."""
    stages = {}
    for part in header.split(","):
        name, _, duration = part.strip().partition(";dur=")
        stages[name] = float(duration)
    return stages


def engine_step_seconds(url: str, prompt, tokens: int = 48, repeats: int = 3) -> dict:
    """One decode step of a lone greedy request, on the engine's own clock: the `decode`
    stage of the answer's `Server-Timing` header over its `tokens - 1` decode steps (no
    network in it). Cross-checked with `labkit:engine_steps_total`: a prompt that fits one
    step takes `tokens` steps (one prefill, then one per further token)."""
    per_step, steps = [], []
    for _ in range(repeats):
        before = fc.metrics(url)["labkit:engine_steps_total"]
        answer = httpx.post(url + "/v1/completions", json=body(prompt, tokens), timeout=300)
        answer.raise_for_status()
        per_step.append(server_timing(answer.headers["server-timing"])["decode"] / 1e3 / (tokens - 1))
        steps.append(fc.metrics(url)["labkit:engine_steps_total"] - before)
    return {"step_s": statistics.median(per_step), "per_request_s": per_step,
            "engine_steps_per_request": steps, "tokens": tokens}


async def blocks_used(poller, url) -> float | None:
    return (await poller.metrics()).get("labkit:kv_blocks_used")


async def until_free(poller, url, since: float, timeout: float = 30.0) -> tuple[float, float]:
    """Poll until no KV block is used: (upper, lower) bounds of the seconds from `since`. The
    zero was served during the last poll and was not yet seen by the start of the one before."""
    previous = since
    while True:
        began = time.perf_counter()
        used = await blocks_used(poller, url)
        seen = time.perf_counter()
        if used == 0:
            return seen - since, max(0.0, previous - since)
        if seen - since > timeout:
            raise TimeoutError(f"blocks still used {timeout} s after the disconnect")
        previous = began


async def await_idle(poller, url, timeout: float = 60.0) -> None:
    async def quiet():
        return fc.idle(await poller.metrics())
    await fc.await_until(quiet, timeout=timeout, interval=0.01)


def disconnects(url: str, prompt, *, trials: int, max_tokens: int = 400, leave_after: int = 2,
                jitter_s: float = 0.03, modes=("stream", "whole"), seed: int = 0) -> Scenario:
    """`trials` disconnects per mode, alternating: a stream left after `leave_after` chunks,
    or a whole request whose client is cancelled once its blocks are held; each then waits a
    random 0 to `jitter_s` seconds (so the disconnect falls anywhere in an engine step) and
    closes its connection. The release time runs from the close to the first `/metrics`
    that shows no KV block used (an upper bound; the lower bound is kept too)."""
    rng = random.Random(seed)
    release: dict[str, list[float]] = {m: [] for m in modes}
    lower: dict[str, list[float]] = {m: [] for m in modes}
    held: dict[str, list[float]] = {m: [] for m in modes}
    outcomes: list[Outcome] = []
    cancelled = 'labkit:requests_total{outcome="cancelled",route="completions"}'
    before = fc.metrics(url)[cancelled]

    async def one(client, poller, mode: str, k: int) -> None:
        await await_idle(poller, url)
        out = Outcome(f"{mode}-{k}", mode, sent_at=time.perf_counter())
        request = body(prompt, max_tokens)
        if mode == "stream":
            async with client.stream("POST", url + "/v1/completions", json=request | {"stream": True}) as answer:
                out.status = answer.status_code
                async for line in answer.aiter_lines():
                    if line.startswith("data: {"):
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        out.chunks += bool(choices[0].get("text"))
                    if out.chunks >= leave_after:
                        break
                held[mode].append(await blocks_used(poller, url))
                await asyncio.sleep(rng.uniform(0, jitter_s))
        else:
            task = asyncio.create_task(client.post(url + "/v1/completions", json=request))

            async def holding():
                return (await blocks_used(poller, url) or 0) > 0
            await fc.await_until(holding, timeout=60, interval=0.002)
            held[mode].append(await blocks_used(poller, url))
            await asyncio.sleep(rng.uniform(0, jitter_s))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        out.ended, out.ended_at = "left", time.perf_counter()
        out.seconds = out.ended_at - out.sent_at
        upper, low = await until_free(poller, url, out.ended_at)
        release[mode].append(upper)
        lower[mode].append(low)
        outcomes.append(out)

    async def go():
        async with fc.Poller(url) as poller:
            for k in range(trials):
                for mode in modes:
                    async with async_client() as client:   # a fresh connection per trial
                        await one(client, poller, mode, k)

    fc.run_async(go)
    counted = fc.metrics(url)[cancelled] - before
    return Scenario(
        "disconnects", f"{trials} disconnects per mode ({', '.join(modes)}), each once the request "
                       f"held KV blocks", outcomes,
        {"release_s": release, "release_lower_s": lower, "jitter_s": jitter_s},
        {"held_blocks": held, "cancelled_counted": counted, "max_tokens": max_tokens},
        {"every disconnect freed its blocks": all(len(v) == trials for v in release.values()),
         "blocks were held before each disconnect": all(b and b > 0 for v in held.values() for b in v),
         "the service counted each as cancelled": counted == trials * len(modes)})


def release_summary(samples: list[float], step_s: float) -> dict:
    """Median, p90, p99 and max of release times (s), and the same in engine steps."""
    stats = percentiles(samples, (0.5, 0.9, 0.99))
    out = {"trials": len(samples), "median_s": stats["p50"], "p90_s": stats["p90"],
           "p99_s": stats["p99"], "max_s": max(samples)}
    out |= {key.replace("_s", "_steps"): value / step_s for key, value in list(out.items()) if key != "trials"}
    return out
