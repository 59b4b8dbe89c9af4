"""`labkit bench soak --minutes N`: a bounded soak of `labkit serve` on loopback.

Many clients at once, for a bounded time, each sending one request after another, drawn at
random: whole answers, streams read to the end, streams left after a few chunks, whole
answers whose client gives up (a short timeout), and malformed requests. Halfway through,
the engine worker is killed (SIGKILL). At the end the service must be whole again:

- no request got a 5xx that is not a documented one (`DOCUMENTED_5XX`: the worker died or
  restarted, the queue was full, a limit ran out), and every error came in the one shape;
- every request ended with an answer, a documented error, or its own client's departure;
- once the clients stop, nothing runs, nothing waits, and no KV block is held;
- the front end's and the worker's resident memory (RSS) before and after are reported,
  so a leak shows as growth between runs of different lengths.

The record (`soak.json`: environment, configuration, git revision, every request's outcome)
goes to `--out` (default `results/bench/soak`). This is a command, not a CI test: it runs
for minutes.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from labkit.experiments import fault_client as fc
from labkit.util.environment import capture

# 5xx codes the service documents (labkit/serve/README.md, Errors): none is a bug by itself
DOCUMENTED_5XX = {"engine_died", "engine_unavailable", "engine_failure", "queue_full", "request_timeout",
                  "deadline_expired", "deadline_unreachable", "shutting_down", "server_draining"}
KINDS = {"whole": 3, "stream": 3, "leave": 2, "give_up": 1, "bad": 1}   # relative weights
BAD_BODIES = (b'{"model": "smollm2-135m", "prompt": "x", "max_tokens": "5"}', b'{"model": ', b'[1, 2]',
              b'{"model": "smollm2-135m", "prompt": "\\ud800", "max_tokens": 2}',
              b'{"model": "smollm2-135m", "prompt": "x", "n": 100}', b'{"prompt": "x"}')


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = 10.0
    clients: int = 8
    seed: int = 0
    model: str = "smollm2-135m"
    threads: int | None = None
    kill_at: float = 0.5            # fraction of the run at which the worker is killed
    max_tokens: tuple[int, int] = (4, 64)


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _one(client: httpx.AsyncClient, url: str, kind: str, label: str, rng: random.Random,
               config: SoakConfig) -> fc.Outcome:
    out = fc.Outcome(label, kind)
    request = fc.body(f"{label}: the numbers are 1, 2, 3,", rng.randint(*config.max_tokens),
                      model=config.model)
    if kind == "whole":
        return await fc.whole(client, url, request, out)
    if kind == "stream":
        return await fc.stream(client, url, request, out)
    if kind == "leave":
        return await fc.stream(client, url, request | {"max_tokens": 64}, out, leave_after=rng.randint(1, 4))
    if kind == "give_up":
        try:
            return await fc.whole(client, url, request | {"max_tokens": 256}, out)
        finally:
            out.ended = "left" if out.code in ("ReadTimeout", "TimeoutException") else out.ended
    return await fc.raw(client, url, "/v1/completions", rng.choice(BAD_BODIES), {}, out)


async def _client(url: str, index: int, until: float, config: SoakConfig, outcomes: list) -> None:
    rng = random.Random(config.seed * 1000 + index)
    kinds, weights = zip(*KINDS.items())
    patient = httpx.AsyncClient(timeout=300)
    hasty = httpx.AsyncClient(timeout=httpx.Timeout(300, read=0.3))  # gives up on slow answers
    try:
        count = 0
        while time.monotonic() < until:
            kind = rng.choices(kinds, weights)[0]
            label = f"c{index}-{count}"
            client = hasty if kind == "give_up" else patient
            outcomes.append(await _one(client, url, kind, label, rng, config))
            count += 1
    finally:
        await patient.aclose()
        await hasty.aclose()


async def _run(url: str, config: SoakConfig, kills: list) -> list[fc.Outcome]:
    outcomes: list[fc.Outcome] = []
    began = time.monotonic()
    until = began + 60 * config.minutes

    async def killer():
        await asyncio.sleep(60 * config.minutes * config.kill_at)
        await asyncio.to_thread(fc.wait_until, lambda: fc.ready(url), 300)
        kills.append((await asyncio.to_thread(fc.kill_worker, url))[0])

    tasks = [asyncio.create_task(_client(url, i, until, config, outcomes)) for i in range(config.clients)]
    tasks.append(asyncio.create_task(killer()))
    await asyncio.gather(*tasks)
    return outcomes


def verdicts(outcomes: list[fc.Outcome], after: dict[str, float]) -> dict:
    """The soak's checks, from what the clients saw and the service's gauges afterwards."""
    undocumented = [o.row() for o in outcomes if o.status is not None and o.code not in DOCUMENTED_5XX
                    and (o.status >= 500 or (o.status == 200 and o.ended == "error"))]  # a stream's error event
    bad_shape = [o.row() for o in outcomes if o.ended == "error" and o.status is not None and o.shape_ok is False]
    unended = [o.row() for o in outcomes if o.ended == "lost"]
    return {"undocumented_5xx": len(undocumented), "errors_not_in_the_one_shape": len(bad_shape),
            "requests_without_an_end": len(unended),
            "leaked_kv_blocks": after.get("labkit:kv_blocks_used"),
            "idle_after": fc.idle(after), "examples": (undocumented + bad_shape + unended)[:10],
            "passed": not undocumented and not bad_shape and not unended and fc.idle(after)}


def run_soak(config: SoakConfig, out: str | Path = "results/bench/soak") -> dict:
    args = ["--model", config.model] + (["--threads", str(config.threads)] if config.threads else [])
    kills: list[int] = []
    with fc.LiveService(*args) as service:
        url = service.url
        front_pid = service.process.process.pid
        worker_before = fc.health(url)[1]["worker_pid"]
        rss_before = {"front_end": rss_mib(front_pid), "worker": rss_mib(worker_before)}
        began = time.perf_counter()
        outcomes = fc.run_async(lambda: _run(url, config, kills))
        wall = time.perf_counter() - began
        fc.wait_until(lambda: fc.ready(url) and fc.idle(fc.metrics(url)), timeout=120, interval=0.2)
        after = fc.metrics(url)
        worker_after = fc.health(url)[1]["worker_pid"]
        rss_after = {"front_end": rss_mib(front_pid), "worker": rss_mib(worker_after)}
    counts = Counter((o.kind, o.ended, o.status, o.code) for o in outcomes)
    record = {
        "config": asdict(config), "wall_s": round(wall, 1), "requests": len(outcomes),
        "killed_workers": kills, "verdicts": verdicts(outcomes, after),
        "rss_mib": {"before": rss_before, "after": rss_after,
                    "front_end_growth": _growth(rss_before["front_end"], rss_after["front_end"]),
                    "note": "the worker after the kill is a new process: its RSS is a fresh start's"},
        "outcomes_by_kind": [{"kind": k, "ended": e, "status": s, "code": c, "count": n}
                             for (k, e, s, c), n in sorted(counts.items(), key=str)],
        "environment": capture(),
        "outcomes": [o.row() for o in outcomes],
    }
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "soak.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _growth(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 1)


def summary_line(record: dict) -> str:
    v = record["verdicts"]
    return (f"soak: {record['requests']} requests in {record['wall_s']} s, worker killed {len(record['killed_workers'])}x; "
            f"undocumented 5xx {v['undocumented_5xx']}, errors outside the shape {v['errors_not_in_the_one_shape']}, "
            f"requests without an end {v['requests_without_an_end']}, KV blocks held after {v['leaked_kv_blocks']}; "
            f"front-end RSS growth {record['rss_mib']['front_end_growth']} MiB: "
            f"{'passed' if v['passed'] else 'FAILED'}")
