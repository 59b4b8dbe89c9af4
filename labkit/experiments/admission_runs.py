"""Admission control on the live service, and the simulator held to it (chapter 26).

The live half drives `labkit serve` in worker mode with one request on the engine at a time
(``--max-num-seqs 1``, as the source's service) under each ``--queue-policy``:

* :class:`LiveService`: the server as a context manager; :meth:`LiveService.calibrate` times
  one request at a time at a few answer lengths, :meth:`LiveService.warm_up` teaches the
  service's estimator, :meth:`LiveService.run` sends an open-loop workload and gives up on
  what is still open at a time limit (it stops the server: `run_open_loop` has no client
  timeout), so an unbounded queue's drain stays bounded.
* :class:`Workload` / :func:`source_shaped_workload`: Poisson arrivals from a seed, shaped
  like the source's (the same offered load and the same deadline in service times) around
  the service time measured here.
* :class:`LiveRun`: one policy's records, classified as the client saw them
  (:func:`classify`): answered in time, late, unanswered at the give-up time (late too),
  refused at arrival, dropped while waiting.

The simulated half feeds :mod:`labkit.sim.admission` the live run's arrival times and the
engine times its answers reported (`Server-Timing`), so the simulator's counts can be set
beside the service's (:func:`replay_requests`, :func:`simulate_run`), checks the simulator
against M/M/1 and M/D/1 (:func:`theory_check`) and studies estimates that are out of date
(:func:`stale_sweep`).
"""

from __future__ import annotations

import json
import math
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Sequence

import httpx
import numpy as np

from labkit.bench.http_load import HttpRecord, parse_server_timing, run_open_loop
from labkit.serve.admission import ServiceEstimator
from labkit.serve.server import ServerProcess
from labkit.sim import admission as sim
from labkit.util.palette import OKABE_ITO
from labkit.util.threads import run_in_thread

MODEL = "smollm2-135m"
# The source's workload and results (its chapter abstract).
SOURCE_COUNT, SOURCE_HORIZON_S, SOURCE_SERVICE_S, SOURCE_DEADLINE_S = 279, 40.0, 0.3, 2.0
SOURCE_LOAD = SOURCE_COUNT * SOURCE_SERVICE_S / SOURCE_HORIZON_S
SOURCE_IN_TIME = {"unbounded": 23, "bounded": 48, "drop-expired": 185, "admit-by-estimate": 224}
SOURCE_WAIT_P50_S, SOURCE_WAIT_P99_S = 26.0, 57.0
REFUSAL_CODES = ("queue_full", "deadline_unreachable")
BEFORE_ENGINE = ("read", "parse", "tokenize", "submit", "to-engine", "queue")  # Server-Timing


# -- the workload -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """`count` requests arriving over `horizon_s` (Poisson, conditioned on the count: sorted
    uniform times from `seed`), each `prompt_tokens` long, asking for `max_tokens` tokens,
    with a deadline of `deadline_s` after it is sent."""
    count: int
    horizon_s: float
    deadline_s: float
    max_tokens: int
    prompt_tokens: int = 16
    seed: int = 0

    def arrivals(self) -> list[float]:
        rng = np.random.default_rng(self.seed)
        return np.sort(rng.uniform(0.0, self.horizon_s, self.count)).tolist()

    def prompts(self, text_ids: Sequence[int]) -> list[list[int]]:
        """Consecutive slices of `text_ids` (wrapping round): every prompt differs from its
        first token, so no request finds another's prefix cached."""
        n, p = len(text_ids), self.prompt_tokens
        return [[int(text_ids[(i * p + j) % n]) for j in range(p)] for i in range(self.count)]

    def offered_load(self, service_s: float) -> float:
        """Seconds of engine work per second of arrivals."""
        return self.count * service_s / self.horizon_s


def source_shaped_workload(service_s: float, count: int, max_tokens: int, *, seed: int = 0,
                           prompt_tokens: int = 16) -> Workload:
    """A workload with the source's offered load (279 x 0.3 s over 40 s) and its deadline
    measured in service times (2 s / 0.3 s) around the service time `service_s` measured
    here: at `service_s` = 0.3 and 279 requests it is the source's 40 s and 2 s."""
    scale = service_s / SOURCE_SERVICE_S
    return Workload(count, count * service_s / SOURCE_LOAD, SOURCE_DEADLINE_S * scale, max_tokens,
                    prompt_tokens, seed)


def fixed_cost_ceiling(horizon_s: float, deadline_s: float, service_s: float) -> int:
    """The most requests one server can answer in time when each takes `service_s`: every
    answer in time ends by the last arrival plus the deadline, and they run one at a time."""
    return int((horizon_s + deadline_s) // service_s)


# -- one request's record, as the client saw it ----------------------------------------------------

def error_code(record: HttpRecord) -> str:
    """The `code` of an error answer's body ("" when there is none)."""
    try:
        return json.loads(record.error or "")["error"]["code"] or ""
    except (ValueError, KeyError, TypeError):
        return ""


def classify(record: HttpRecord, deadline_s: float, give_up_s: float = math.inf) -> str:
    """in_time | late | unanswered | refused | dropped | failed, by the client's clock.
    Unanswered: no status (still open when the client gave up), or an error that came after
    `give_up_s`."""
    if record.status == 200 and record.error is None:
        return "in_time" if record.e2e_s <= deadline_s else "late"
    if record.status is None or (record.end_s is not None and record.end_s >= give_up_s):
        return "unanswered"  # still open when the run gave up
    code = error_code(record)
    if code in REFUSAL_CODES:
        return "refused"
    return "dropped" if code == "deadline_expired" else "failed"


def engine_span(record: HttpRecord) -> tuple[float, float] | None:
    """(start, finish) of a served request on the engine, in seconds of the run's clock:
    the send time plus the Server-Timing stages before it (None if it was not served)."""
    st = record.server_timing
    if not st or "prefill" not in st or "decode" not in st:
        return None
    start = record.sent_s + sum(st.get(k, 0.0) for k in BEFORE_ENGINE) / 1e3
    return start, start + (st["prefill"] + st["decode"]) / 1e3


def engine_seconds(records: Sequence[HttpRecord]) -> list[float]:
    """Prefill + decode seconds of each served record (the others are left out)."""
    return [b - a for r in records if (span := engine_span(r)) for a, b in [span]]


@dataclass
class LiveRun:
    """One policy's run: its records, in request order, and how it ended."""
    policy: str
    label: str
    workload: Workload
    records: list[HttpRecord]
    wall_s: float
    give_up_s: float
    gave_up: bool = False  # the client gave up with requests still open

    def statuses(self) -> list[str]:
        return [classify(r, self.workload.deadline_s, self.give_up_s if self.gave_up else math.inf)
                for r in self.records]

    def counts(self) -> dict:
        """Requests per outcome; `late` includes the unanswered, and refusals by code."""
        s = self.statuses()
        codes = [error_code(r) for r, x in zip(self.records, s) if x == "refused"]
        return {"in_time": s.count("in_time"), "late": s.count("late") + s.count("unanswered"),
                "unanswered": s.count("unanswered"), "refused": s.count("refused"),
                "dropped": s.count("dropped"), "failed": s.count("failed"),
                **{f"refused_{c}": codes.count(c) for c in REFUSAL_CODES}}

    def served_late_by_s(self) -> list[float]:
        """How far past its deadline each late answer came (s)."""
        return [r.e2e_s - self.workload.deadline_s for r, x in zip(self.records, self.statuses())
                if x == "late"]

    def waits(self) -> tuple[np.ndarray, int]:
        """Send to engine start of every served request, plus give-up minus send (a lower
        bound) for the unanswered; and how many of the values are such lower bounds."""
        served = [span[0] - r.sent_s for r in self.records if (span := engine_span(r))]
        open_ = [self.give_up_s - r.sent_s for r, x in zip(self.records, self.statuses())
                 if x == "unanswered"]
        return np.array(served + open_), len(open_)

    def engine_times(self) -> np.ndarray:
        """Prefill + decode seconds of each served request (engine clock)."""
        return np.array(engine_seconds(self.records))

    def summary(self) -> dict:
        waits, censored = self.waits()
        pct = (lambda q: float(np.percentile(waits, q))) if len(waits) else (lambda q: math.nan)
        return {"policy": self.label, **self.counts(), "wait_p50_s": pct(50), "wait_p99_s": pct(99),
                "waits_lower_bounds": censored, "wall_s": self.wall_s}


# -- the live service ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Calibration:
    """One-at-a-time requests: (max_tokens, seconds on the engine) and a straight-line fit."""
    samples: list[tuple[int, float]]
    intercept_s: float
    per_token_s: float

    def service_s(self, max_tokens: int) -> float:
        return self.intercept_s + self.per_token_s * max_tokens

    def max_tokens_for(self, target_s: float, low: int = 2, high: int = 64) -> int:
        """The answer length whose predicted service time is nearest `target_s`."""
        return min(range(low, high + 1), key=lambda m: abs(self.service_s(m) - target_s))


def fit_line(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y on x."""
    x, y = np.array(samples, dtype=float).T
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


@dataclass
class LiveService:
    """`labkit serve` (worker mode, one sequence on the engine) under one queue policy:

        with LiveService("admit-by-estimate") as service:
            service.warm_up(prompts[:3], max_tokens=5)
            run = service.run(workload, prompts, give_up_s=60)
    """
    policy: str
    max_queue: int = 8
    threads: int = 1   # engine threads: on 2 cores the other one serves the client and front end
    server: ServerProcess | None = field(default=None, repr=False)
    # the untimed first request: the service's estimator learned from it (`estimator_after`)
    startup: list[HttpRecord] = field(default_factory=list, repr=False)

    def __enter__(self) -> "LiveService":
        self.server = ServerProcess("--max-num-seqs", "1", "--queue-policy", self.policy,
                                    "--max-queue", str(self.max_queue), "--threads", str(self.threads),
                                    "--weights", "f32")
        self.server.__enter__()
        try:
            self.wait_ready()
            # the first request pays one-off costs: untimed, but kept (the estimator saw it)
            self.startup = [self.post(list(range(100, 116)), 2)]
        except BaseException:
            self.server.__exit__(None, None, None)
            raise
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until `/health` answers 200: the URL is printed once uvicorn listens, which can be
        before the engine worker has loaded the model."""
        deadline = time.monotonic() + timeout_s
        while httpx.get(self.server.url + "/health", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.policy}: the engine worker was not ready in {timeout_s} s")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)

    def post(self, prompt: list[int], max_tokens: int) -> HttpRecord:
        """One whole request, no deadline; its record (Server-Timing included)."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        record = HttpRecord(0, len(prompt), 0.0)
        start = time.perf_counter()
        answer = httpx.post(self.server.url + "/v1/completions", json=body, timeout=120)
        record.end_s, record.status = time.perf_counter() - start, answer.status_code
        answer.raise_for_status()
        record.output_tokens = answer.json()["usage"]["completion_tokens"]
        record.server_timing = parse_server_timing(answer.headers.get("server-timing"))
        return record

    def warm_up(self, prompts: Sequence[list[int]], max_tokens: int) -> list[HttpRecord]:
        """Serve `prompts` one at a time, so the service's estimator learns from each."""
        return [self.post(list(p), max_tokens) for p in prompts]

    def calibrate(self, prompts: Sequence[list[int]], token_counts: Sequence[int]) -> Calibration:
        """Each prompt at each answer length, one at a time; a line through the median engine
        seconds of each length (a median, because a busy machine adds outliers)."""
        samples = [(m, engine_seconds([self.post(list(p), m)])[0]) for m in token_counts for p in prompts]
        medians = [(m, float(np.median([t for k, t in samples if k == m]))) for m in token_counts]
        return Calibration(samples, *fit_line(medians))

    def run(self, workload: Workload, prompts: Sequence[list[int]], give_up_s: float,
            label: str | None = None) -> LiveRun:
        """Send `workload` open loop, each request with its deadline, and wait for the answers;
        at `give_up_s` after the start the client closes what is still open (the service sees
        disconnects and aborts those requests): those are unanswered."""
        load = partial(run_open_loop, self.server.url, MODEL, [list(p) for p in prompts],
                       [workload.max_tokens] * workload.count, workload.arrivals(),
                       extra={"stream": False, "ignore_eos": True,
                              "deadline_ms": workload.deadline_s * 1e3},
                       give_up_s=give_up_s)
        records, wall = run_in_thread(load)  # run_open_loop starts an event loop; a notebook has one
        return LiveRun(self.policy, label or self.policy, workload, records, wall, give_up_s,
                       any(r.status is None for r in records))


@contextmanager
def live_services(policies: Sequence[str], max_queue: int = 8, threads: int = 1):
    """One `LiveService` per policy, started at the same time (a start is mostly loading
    and packing the model, which needs no quiet machine), stopped on leaving, failure or not.
    The runs themselves go one after another; an idle server costs next to nothing."""
    services = {p: LiveService(p, max_queue, threads) for p in policies}
    errors: list[BaseException] = []

    def start(service: LiveService) -> None:
        try:
            service.__enter__()
        except BaseException as error:  # noqa: BLE001 - re-raised below, after the others stop
            errors.append(error)
            service.server = None

    with ExitStack() as stack:
        starters = [threading.Thread(target=start, args=(s,)) for s in services.values()]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        for service in services.values():
            if service.server is not None:
                stack.push(service.__exit__)
        if errors:
            raise errors[0]
        yield services


def estimator_after(*batches: Sequence[HttpRecord]) -> ServiceEstimator:
    """The service's estimator as it would stand after learning from the answers of each
    batch of records in turn, each in the order the engine ran it (rebuilt from their
    Server-Timing stages; a batch's times share one clock, different batches' need not)."""
    estimator = ServiceEstimator()
    for records in batches:
        served = sorted(((span[0], i), r) for i, r in enumerate(records) if (span := engine_span(r)))
        for (start, _), r in served:
            st = r.server_timing
            first = start + st["prefill"] / 1e3
            estimator.observe(SimpleNamespace(
                first_scheduled_time=start, first_token_time=first,
                finish_time=first + st["decode"] / 1e3, prompt_token_ids=[0] * r.prompt_tokens,
                cached_prompt_tokens=0, samples=[SimpleNamespace(token_ids=[0] * r.output_tokens)]))
    return estimator


@dataclass
class LiveExperiment:
    """Everything the live half of the chapter measured."""
    calibration: Calibration
    workload: Workload
    warmup_s: list[float]      # engine seconds of the one-at-a-time warm-up requests
    runs: list[LiveRun]        # one per policy, in `POLICIES` order
    stale: LiveRun | None      # admit-by-estimate again, after a warm-up on other requests
    stale_teaching: tuple[int, int, int]  # (requests, prompt tokens, max_tokens) of that warm-up
    # the service's estimate of one request before the first run, and before the stale one:
    # reconstructed (`estimator_after`) from every answer it learned from, in order (the
    # service does not report its estimate)
    estimate_fresh_s: float
    estimate_stale_s: float
    rounds: list[list[LiveRun]] = field(default_factory=list)  # every round, each in `runs` order

    @property
    def service_s(self) -> float:
        """The workload's service time: the median of the warm-up requests' engine times."""
        return float(np.median(self.warmup_s))


def run_experiment(services: dict[str, LiveService], text_ids: Sequence[int], count: int, *,
                   target_s: float = SOURCE_SERVICE_S, warmups: int = 4, stale_warmups: int = 10,
                   stale_prompt_tokens: int = 1, give_up_factor: float = 1.3,
                   prompt_tokens: int = 16, seed: int = 0, rounds: int = 1) -> LiveExperiment:
    """The chapter's live experiment on `services` (one per policy, from `live_services`):

    1. calibrate on the first: engine seconds at 2, 6 and 10 answer tokens; choose the
       answer length whose time is nearest `target_s` (the source's 0.3 s);
    2. warm each service up with `warmups` such requests (its estimator learns), and shape the
       workload around their median time (:func:`source_shaped_workload`);
    3. run each policy; give up at `give_up_factor` x the workload's total work + the deadline
       (an unbounded queue would otherwise drain for as long as it took to fill). With
       `rounds` > 1 the policies run again, in reverse order every second round (A B C D,
       D C B A, ...), so that a drift of the machine's speed over the runs favours no policy
       on the whole; `runs` is the first round, `rounds` all of them;
    4. teach admit-by-estimate on `stale_warmups` requests of `stale_prompt_tokens` prompt
       tokens (a step's fixed cost spread over few tokens: too many seconds per prompt token)
       and run the workload again.
    """
    policies = list(services)
    slices = (lambda start, n, p: [list(text_ids[start + i * p: start + (i + 1) * p]) for i in range(n)])
    first = services[policies[0]]
    calibration = first.calibrate(slices(0, 2, prompt_tokens), (2, 6, 10))
    max_tokens = calibration.max_tokens_for(target_s)
    teach = {p: s.warm_up(slices(4000, warmups, prompt_tokens), max_tokens) for p, s in services.items()}
    warm = [x for records in teach.values() for x in engine_seconds(records)]
    service = float(np.median(warm))
    workload = source_shaped_workload(service, count, max_tokens, seed=seed, prompt_tokens=prompt_tokens)
    prompts = workload.prompts(text_ids)
    give_up = give_up_factor * workload.count * service + workload.deadline_s
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    every = []
    for r in range(rounds):
        label = (lambda p: p) if r == 0 else (lambda p: f"{p}, round {r + 1}")
        ran = {p: services[p].run(workload, prompts, give_up, label=label(p))
               for p in (policies if r % 2 == 0 else policies[::-1])}
        every.append([ran[p] for p in policies])
    runs = every[0]
    stale = None
    estimates = [math.nan, math.nan]
    if "admit-by-estimate" in services:
        service = services["admit-by-estimate"]
        ran = [rs[policies.index("admit-by-estimate")].records for rs in every]  # every round
        seen = (service.startup, teach["admit-by-estimate"])  # what it learned before round 1
        estimates[0] = estimator_after(*seen).service_s(prompt_tokens, max_tokens)
        taught = service.warm_up(slices(8000, stale_warmups, stale_prompt_tokens), max_tokens)
        estimates[1] = estimator_after(*seen, *ran, taught).service_s(prompt_tokens, max_tokens)
        stale = service.run(workload, prompts, give_up, label="admit-by-estimate, stale")
    return LiveExperiment(calibration, workload, warm, runs, stale,
                          (stale_warmups, stale_prompt_tokens, max_tokens), *estimates, every)


def order_across_rounds(rounds: Sequence[Sequence[LiveRun]]) -> dict:
    """How the policies ranked by requests answered in time, round by round: `in_time`
    (policy -> its count in each round), `spread` (policy -> how far its count moved between
    rounds, max - min), `agreed` (pairs (a, b) where a answered more in time than b in every
    round, each time by more than the spread of a and of b: nothing changed between rounds but
    the machine's moment, so a smaller difference is one that moment can make) and `disputed`
    (every other pair: ordered differently, tied, or apart by no more than the spread)."""
    in_time = {run.policy: [] for run in rounds[0]}
    for runs in rounds:
        for run in runs:
            in_time[run.policy].append(run.counts()["in_time"])
    spread = {p: max(c) - min(c) for p, c in in_time.items()}
    agreed, disputed = [], []
    names = list(in_time)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            diffs = [x - y for x, y in zip(in_time[a], in_time[b])]
            moved = max(spread[a], spread[b])
            if all(d > moved for d in diffs):
                agreed.append((a, b))
            elif all(-d > moved for d in diffs):
                agreed.append((b, a))
            else:
                disputed.append((a, b))
    return {"in_time": in_time, "spread": spread, "agreed": agreed, "disputed": disputed}


def ranked(order: dict, a: str, b: str) -> int:
    """1 if `order` (from `order_across_rounds`) puts a above b, -1 if below, 0 if its rounds
    cannot order them."""
    return 1 if (a, b) in order["agreed"] else -1 if (b, a) in order["agreed"] else 0


def _rounds_word(rounds: int) -> str:
    return "both rounds" if rounds == 2 else f"all {rounds} rounds"


def _rounds_subject(rounds: int) -> str:
    return "This one round" if rounds == 1 else "The two rounds" if rounds == 2 else f"The {rounds} rounds"


def _and(items: Sequence[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def source_order_phrase(order: dict) -> str:
    """Whether `order` bears out the source's order (answers in time rising in `POLICIES`
    order, unbounded fewest), pair of neighbours by pair: a sentence that claims an order only
    where `order_across_rounds` does."""
    rounds = len(next(iter(order["in_time"].values())))
    pairs = list(zip(sim.POLICIES, sim.POLICIES[1:]))
    verdict = {(a, b): ranked(order, b, a) for a, b in pairs}  # 1: b above a, as the source
    if all(v == 1 for v in verdict.values()):
        return ("The order of the four is the source's" + (" in this one round" if rounds == 1 else
                f" in {_rounds_word(rounds)}, each neighbour further apart than either's count "
                "moved between rounds"))
    one = rounds == 1
    pronoun, put = ("it", "puts") if one else ("they", "put")
    parts = []
    if unsure := [f"{a} against {b}" for (a, b), v in verdict.items() if v == 0]:
        parts.append(f"{pronoun} cannot order {_and(unsure)}")
    if against := [f"{a} above {b}" for (a, b), v in verdict.items() if v == -1]:
        parts.append(f"{pronoun} {put} {_and(against)}, against the source")
    if any(v == 1 for v in verdict.values()):
        how = "bears out only part of" if one else "bear out only part of"
    else:
        how = "does not bear out" if one else "do not bear out"
    return f"{_rounds_subject(rounds)} {how} the source's order: {'; '.join(parts)}"


def rounds_phrase(order: dict) -> str:
    """`order_across_rounds` in a sentence that claims only what every round showed, by more
    than the policies' counts moved between rounds."""
    rounds = len(next(iter(order["in_time"].values())))
    if rounds == 1:
        return ("With one round, how far a policy's count moves between runs is not measured, "
                "so the order of the policies is this run's alone.")
    total = len(order["agreed"]) + len(order["disputed"])
    if not order["disputed"]:
        return (f"{_rounds_word(rounds).capitalize()} put the policies in the same order, every "
                "pair further apart than either's count moved between rounds.")
    pairs = _and([f"{a} against {b}" for a, b in order["disputed"]])
    moved = ("the counts moved from one round to the next "
             f"({', '.join(f'{p} by {m}' for p, m in order['spread'].items())})")
    if not order["agreed"]:
        return (f"{_rounds_subject(rounds)} cannot order any pair of policies: each difference is "
                f"no larger in some round than how far {moved}.")
    return (f"{_rounds_subject(rounds)} order {len(order['agreed'])} of the {total} pairs of policies "
            f"the same way, each by more than either's count moved between rounds; they cannot "
            f"order {pairs}, whose differences are no larger in some round than how far {moved}.")


def unbounded_rank_phrase(order: dict) -> str:
    """Where the unbounded queue's answers in time stand among the others, claiming only the
    pairs `order_across_rounds` orders."""
    rounds = len(next(iter(order["in_time"].values())))
    others = [p for p in order["in_time"] if p != "unbounded"]
    rank = {p: ranked(order, p, "unbounded") for p in others}
    if all(v == 1 for v in rank.values()):
        return "the fewest of the four" + (" in this one round" if rounds == 1 else
                                           f" in {_rounds_word(rounds)}, by more than any of "
                                           "their counts moved between rounds")
    claims = []
    if above := [p for p, v in rank.items() if v == 1]:
        claims.append("fewer than " + _and(above))
    if below := [p for p, v in rank.items() if v == -1]:
        claims.append("more than " + _and(below))
    unsure = [p for p, v in rank.items() if v == 0]
    if not unsure:
        return " and ".join(claims)
    counts = _and([f"{p} {' and '.join(map(str, order['in_time'][p]))}" for p in unsure])
    mine = " and ".join(map(str, order["in_time"]["unbounded"]))
    why = (f"({counts}, against its own {mine}: "
           + ("tied)" if rounds == 1 else "apart by no more than the counts moved between rounds)"))
    if not claims:
        return f"a count the rounds cannot order against any other policy's {why}"
    return f"{' and '.join(claims)}, but the rounds cannot order it against {_and(unsure)} {why}"


def stale_verdict_phrase(stale_in_time: int, fresh_in_time: Sequence[int]) -> str:
    """How the stale run's answers in time compare with the same service's counts in the
    rounds (`fresh_in_time`, one per round): a difference no larger than those counts moved
    between rounds with nothing changed is not called fewer or more."""
    d = stale_in_time - fresh_in_time[0]
    lo, hi = min(fresh_in_time), max(fresh_in_time)
    if len(fresh_in_time) > 1 and abs(d) <= hi - lo:
        return ("a difference no larger than its count moved between rounds with nothing "
                f"changed, {lo} to {hi}")
    if d == 0:
        return "as many"
    word = "fewer" if d < 0 else "more"
    if len(fresh_in_time) == 1:
        return (f"{abs(d)} {word}, though with one round how far its count moves between runs "
                "is not measured")
    return f"{abs(d)} {word}, a difference larger than its count moved between rounds ({lo} to {hi})"


# -- the simulator on the live workload ---------------------------------------------------------------

def engine_gaps_s(run: LiveRun) -> list[float]:
    """Engine time between one served request's finish and the next one's start, for each
    pair where the next had already been sent (the queue was not empty): a scheduling step,
    plus any engine time spent on a request between them that was never answered (a prefill
    begun and then dropped; an error answer carries no Server-Timing, so this is where such
    work shows)."""
    spans = sorted((span[0], span[1], r.sent_s) for r in run.records if (span := engine_span(r)))
    return [b[0] - a[1] for a, b in zip(spans, spans[1:]) if b[2] < a[1]]


def engine_gap_s(run: LiveRun) -> float:
    """Median of `engine_gaps_s`: the step of scheduling work a request occupies the engine
    for beyond its own prefill and decode (a median: blind to a few long gaps)."""
    gaps = engine_gaps_s(run)
    return float(np.median(gaps)) if gaps else 0.0


def engine_idle_s(run: LiveRun) -> float:
    """Sum of `engine_gaps_s`: all the engine time, while requests waited, that went to no
    answer (idle, scheduling, or work thrown away)."""
    return float(np.sum(engine_gaps_s(run)))


def waste_phrase(idle_s: dict[str, float], request_s: float, policy: str = "drop-expired") -> str:
    """`policy`'s total engine time between answers (`engine_idle_s`, per policy in `idle_s`)
    against the largest of the other policies', in a sentence; a difference of more than one
    request's engine time `request_s` is called a cost, a smaller one is not."""
    mine = idle_s[policy]
    others = max(v for p, v in idle_s.items() if p != policy)
    head = (f"Under {policy} that time came to {mine:.2f} s over the run, against at most "
            f"{others:.2f} s under the other policies")
    excess = mine - others
    if excess > request_s:
        return f"{head}: {excess:.2f} s more, the engine time of about {excess / request_s:.0f} requests"
    return f"{head}: less than one request's engine time more, so in this run it cost little"


def replay_requests(run: LiveRun, seed: int = 0, gap_s: float | None = None) -> list[sim.Request]:
    """The live run's requests for the simulator: its send times, and as service time each
    served request's own engine time (+ the engine gap); a request the run did not serve
    draws one from those it did (seeded)."""
    gap = engine_gap_s(run) if gap_s is None else gap_s
    measured = run.engine_times()
    rng = np.random.default_rng(seed)
    service = []
    for r in run.records:
        span = engine_span(r)
        service.append(span[1] - span[0] if span else float(rng.choice(measured)))
    return sim.make_requests([r.sent_s for r in run.records], [s + gap for s in service],
                             run.workload.deadline_s)


def live_rule_estimate_s(run: LiveRun) -> float:
    """What the live estimator predicts for one of the run's requests, from its answers: the
    prefill time plus decode seconds per token after the first times max_tokens (it counts
    one decode step too many, the first token being prefill's)."""
    m = run.workload.max_tokens
    timings = [r.server_timing for r in run.records if engine_span(r)]
    prefill = np.mean([t["prefill"] for t in timings]) / 1e3
    decode = np.mean([t["decode"] for t in timings]) / 1e3
    return float(prefill + decode * m / max(1, m - 1))


def simulate_run(run: LiveRun, estimator: str = "live", seed: int = 0,
                 max_queue: int = 8) -> sim.SimResult:
    """The live run replayed in the simulator under the same policy; the estimate is the live
    rule's mean (`"live"`) or every request's true service time (`"exact"`)."""
    chosen = (sim.ExactEstimator() if estimator == "exact"
              else sim.MeanEstimator(live_rule_estimate_s(run)))
    return sim.simulate(replay_requests(run, seed), sim.make_policy(run.policy, max_queue, chosen))


def predicted_requests(workload: Workload, engine_s: Sequence[float], seed: int = 0,
                       gap_s: float = 0.0) -> list[sim.Request]:
    """A prediction made before any run: the workload's planned arrivals, with log-normal
    service times of the mean and spread of one-at-a-time measurements `engine_s`."""
    mean = float(np.mean(engine_s)) + gap_s
    cv = float(np.std(engine_s) / np.mean(engine_s)) if len(engine_s) > 1 else 0.0
    draw = sim.lognormal_service(mean, max(cv, 1e-6))(np.random.default_rng(seed), workload.count)
    return sim.make_requests(workload.arrivals(), draw, workload.deadline_s)


def live_vs_sim(runs: Sequence[LiveRun], engine_s: Sequence[float], max_queue: int = 8,
                seed: int = 0) -> list[dict]:
    """Per policy: answered in time, late, refused and dropped, live and in the simulator
    (replayed with the live estimate, replayed with exact estimates, and predicted from the
    one-at-a-time times alone)."""
    rows = []
    for run in runs:
        live = run.counts()
        gap = engine_gap_s(run)
        predicted = sim.simulate(predicted_requests(run.workload, engine_s, seed, gap),
                                 sim.make_policy(run.policy, max_queue,
                                                 sim.MeanEstimator(float(np.mean(engine_s)) + gap)))
        cases = {"live": live, "replay": simulate_run(run, "live", seed, max_queue).summary(),
                 "replay_exact": simulate_run(run, "exact", seed, max_queue).summary(),
                 "predicted": predicted.summary()}
        row = {"policy": run.label}
        for case, got in cases.items():
            for k in ("in_time", "late", "refused", "dropped"):
                row[f"{case}_{k}"] = got[k] if isinstance(got, dict) else getattr(got, k)
        rows.append(row)
    return rows


# -- the simulator against theory, and stale estimates -----------------------------------------------

T_975_29 = 2.045  # Student's t, 97.5% quantile, 29 degrees of freedom (30 batches)


def batch_means(values: Sequence[float], batches: int = 30, warmup: float = 0.02) -> tuple[float, float]:
    """(mean, 95% half-width) of correlated samples by batch means, after a warm-up share."""
    values = np.asarray(values, dtype=float)[int(len(values) * warmup):]
    means = np.array([b.mean() for b in np.array_split(values, batches)])
    return float(means.mean()), float(T_975_29 * means.std(ddof=1) / math.sqrt(batches))


def closed_form_wait(kind: str, rho: float, mu: float = 1.0) -> float:
    """Mean queue wait: M/M/1 rho / (mu - lambda); M/D/1 rho / (2 mu (1 - rho))."""
    if kind == "M/M/1":
        return rho / (mu - rho * mu)
    if kind == "M/D/1":
        return rho / (2 * mu * (1 - rho))
    raise ValueError(f"no closed form for {kind!r}")


def theory_check(rhos: Sequence[float], count: int, seed: int = 1) -> list[dict]:
    """Simulated mean wait (batch-means interval) against the closed form, one server with
    mean service 1 s, exponential (M/M/1) or fixed (M/D/1) service, at each load `rho`."""
    rows = []
    for kind, draw in (("M/M/1", sim.exponential_service(1.0)), ("M/D/1", sim.deterministic_service(1.0))):
        for rho in rhos:
            waits = sim.simulate(sim.poisson_requests(rho, count, draw, seed=seed), sim.Unbounded()).waits()
            mean, half = batch_means(waits)
            theory = closed_form_wait(kind, rho)
            rows.append({"queue": kind, "rho": rho, "simulated_s": mean, "half_width_s": half,
                         "theory_s": theory, "inside": abs(mean - theory) <= half})
    return rows


def stale_sweep(factors: Sequence[float], scenario: sim.Scenario = sim.Scenario(),
                seeds: Sequence[int] = (0, 1, 2), max_queue: int = 8) -> list[dict]:
    """admit-by-estimate and drop-expired with a mean estimate `factor` times the true mean
    (below 1: an engine that was faster when it was measured), averaged over `seeds`."""
    rows = []
    for name in ("admit-by-estimate", "drop-expired"):
        for factor in factors:
            estimator = sim.StaleEstimator(factor * scenario.service)
            got = [sim.source_scenario(s, sim.make_policy(name, max_queue, estimator), scenario).summary()
                   for s in seeds]
            rows.append({"policy": name, "factor": factor,
                         **{k: float(np.mean([getattr(g, k) for g in got]))
                            for k in ("in_time", "late", "refused", "dropped")}})
    return rows


def served_mean_service(result: sim.SimResult) -> float:
    """Mean service time of the requests a simulated run served (s)."""
    return float(np.mean([o.request.service for o in result.outcomes if o.start is not None]))


# -- figures ----------------------------------------------------------------------------------------

# Refused in grey: the source's marker is black.
OUTCOME_COLOURS = {"in_time": OKABE_ITO[2], "late": OKABE_ITO[3], "refused": "#999999",
                   "dropped": OKABE_ITO[5]}


def plot_outcomes(ax, summaries: Sequence[dict], source: dict[str, int] = SOURCE_IN_TIME,
                  source_count: int = SOURCE_COUNT) -> None:
    """One horizontal bar per policy: the shares of its requests answered in time, late,
    refused and dropped; a black diamond marks the source's share answered in time."""
    labels = [s["policy"] for s in summaries]
    for row, s in enumerate(summaries):
        total, left = sum(s[k] for k in OUTCOME_COLOURS), 0.0
        for k, colour in OUTCOME_COLOURS.items():
            share = s[k] / total
            ax.barh(row, share, left=left, color=colour, label=k.replace("_", " ") if row == 0 else None)
            left += share
        if s["policy"] in source:
            ax.plot(source[s["policy"]] / source_count, row, "D", color="black", ms=6,
                    label="source: in time" if row == 0 else None)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set(xlim=(0, 1), xlabel="share of the requests")
    ax.grid(axis="y", visible=False)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8, frameon=False)


def plot_wait_trace(ax, run: LiveRun, result: sim.SimResult) -> None:
    """Queue wait of every served request against its send time: live (dots) and the
    simulator on the same arrivals and engine times (line)."""
    live = [(r.sent_s, span[0] - r.sent_s) for r in run.records if (span := engine_span(r))]
    ax.plot(*zip(*live), "o", ms=3, alpha=0.7, color=OKABE_ITO[0], label="live service")
    simulated = [(o.request.arrival, o.waited) for o in result.outcomes if o.start is not None]
    ax.plot(*zip(*simulated), "-", lw=1.2, color=OKABE_ITO[1], label="simulator")
    ax.axhline(run.workload.deadline_s, ls="--", lw=1, color="grey", label="deadline")
    ax.set(xlabel="request sent at (s)", ylabel="wait for the engine (s)", ylim=(0, None), xlim=(0, None))
    ax.legend(loc="upper left", fontsize=8)


def plot_theory(ax, rows: Sequence[dict]) -> None:
    """Simulated mean wait (95% interval) against load, with the closed forms as lines."""
    for (kind, colour, marker) in (("M/M/1", OKABE_ITO[0], "o"), ("M/D/1", OKABE_ITO[1], "s")):
        mine = [r for r in rows if r["queue"] == kind]
        rho = [r["rho"] for r in mine]
        grid = np.linspace(min(rho), max(rho), 100)
        ax.plot(grid, [closed_form_wait(kind, x) for x in grid], "-", color=colour, lw=1,
                label=f"{kind} closed form")
        ax.errorbar(rho, [r["simulated_s"] for r in mine], yerr=[r["half_width_s"] for r in mine],
                    fmt=marker, color=colour, ms=4, capsize=2, label=f"{kind} simulated")
    ax.set_yscale("log")
    ax.set(xlabel="load ρ (arrival rate / service rate)", ylabel="mean wait\n(mean services)")
    ax.legend(fontsize=8)


def plot_stale(axes, rows: Sequence[dict]) -> None:
    """Per policy (one panel each): requests answered in time and late against the ratio of
    the estimate to the true mean service time (log axis)."""
    for ax, name in zip(axes, ("admit-by-estimate", "drop-expired")):
        mine = [r for r in rows if r["policy"] == name]
        factor = [r["factor"] for r in mine]
        for k in ("in_time", "late"):
            ax.plot(factor, [r[k] for r in mine], marker="o", ms=3, color=OUTCOME_COLOURS[k],
                    label=k.replace("_", " "))
        ax.axvline(1.0, ls="--", lw=1, color="grey")
        ax.set_xscale("log")
        ticks = [t for t in (0.5, 0.7, 1.0, 1.4, 2.0, 4.0) if min(factor) <= t <= max(factor)]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set(xlabel="estimate / true mean service", ylim=(0, None))
        ax.set_title(name, fontsize=9)  # above the axes: inside, it sat on a curve
    axes[0].set_ylabel("requests (mean of seeds)")
    axes[0].legend(loc="center left", fontsize=8)
