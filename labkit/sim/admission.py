"""Request scheduling and admission control: a discrete-event simulator of a FIFO service.

Chapter 26. A service with `servers` identical servers (the source's service had one: one
request on the engine at a time) and one first-in-first-out queue. Each request has an
arrival time, a service time (the engine time it needs) and an absolute deadline. A
`Policy` decides two things:

- ``admit(request, state)`` at arrival: enter the queue, or be refused there and then;
- ``drop(request, now)`` while it waits: the simulator asks it of every queued request at
  each arrival (before the newcomer's admission, so hopeless requests do not hold queue
  places) and of the head of the queue each time a server is about to start it.

Four policies, the source's: ``"unbounded"`` (admit all, drop none), ``"bounded"`` (refuse
when `max_queue` requests are already waiting; the one in service does not count, so
bounded(q) on one server is the M/M/1/K queue with K = q + 1), ``"drop-expired"`` (bounded,
and a waiting request is dropped once it could no longer finish by its deadline even if it
started now) and ``"admit-by-estimate"`` (refuse at arrival a request whose predicted finish,
the remaining work ahead of it plus its own service, is past its deadline). The last two
predict with a pluggable `Estimator`: exact (the true service time), a mean, a stale mean
(the mean of some earlier time, the chapter's study), or a noisy per-request estimate.

Events at one instant: departures first (a freed server is free for an arrival at the same
time), then the arrival. Time spent in the system is recorded as a step function, so the
time-average number in system is measured directly rather than through Little's law.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

POLICIES = ("unbounded", "bounded", "drop-expired", "admit-by-estimate")
STATUSES = ("in_time", "late", "refused", "dropped")


@dataclass(frozen=True, slots=True)
class Request:
    index: int
    arrival: float   # s
    service: float   # s of server time it really needs
    deadline: float  # absolute time, s
    size: float = 1.0  # what a service-time function reads (e.g. tokens)


def make_requests(arrivals: Sequence[float], service: Sequence[float] | Callable[[float], float],
                  deadline: float | Sequence[float] = math.inf,
                  sizes: Sequence[float] | None = None) -> list[Request]:
    """Requests from arrival times; `service` is one time per request or a function of the
    request's size; `deadline` is the time allowed after arrival (one for all, or each)."""
    n = len(arrivals)
    sizes = [1.0] * n if sizes is None else list(sizes)
    budgets = [deadline] * n if isinstance(deadline, (int, float)) else list(deadline)
    times = [service(s) for s in sizes] if callable(service) else list(service)
    if not len(sizes) == len(budgets) == len(times) == n:
        raise ValueError("arrivals, service, deadline and sizes must have one entry per request")
    return [Request(i, float(a), float(t), float(a) + float(b), float(s))
            for i, (a, t, b, s) in enumerate(zip(arrivals, times, budgets, sizes))]


@dataclass(frozen=True)
class QueueState:
    """What a policy may look at on arrival (read-only views of the simulator's own lists)."""
    now: float
    queue: Sequence[Request]                  # waiting, head first
    running: Sequence[tuple[float, Request]]  # (start time, request) on a server
    servers: int


# -- estimators -------------------------------------------------------------------------------

class Estimator(Protocol):
    def service(self, request: Request) -> float:
        """Predicted service time of `request`, s."""


@dataclass(frozen=True)
class ExactEstimator:
    """Knows every request's true service time: the best any estimate can do."""
    def service(self, request: Request) -> float:
        return request.service


@dataclass(frozen=True)
class MeanEstimator:
    """Predicts the same mean for every request (what a service that knows its average
    cost per request would do)."""
    mean: float

    def service(self, request: Request) -> float:
        return self.mean


@dataclass(frozen=True)
class StaleEstimator(MeanEstimator):
    """A mean measured earlier that no longer holds (the engine got slower, or faster, since):
    `mean` is the outdated value; the true service times are whatever the requests carry."""


@dataclass(frozen=True)
class NoisyEstimator:
    """`base`'s estimate times a log-normal error of spread `sigma`, the same error every
    time the same request is estimated (seeded by `seed` and the request's index)."""
    base: Estimator
    sigma: float
    seed: int = 0

    def service(self, request: Request) -> float:
        error = random.Random(self.seed * 1_000_003 + request.index).gauss(0.0, self.sigma)
        return self.base.service(request) * math.exp(error)


def predicted_finish(request: Request, state: QueueState, estimator: Estimator) -> float:
    """When `request` would finish if queued now: FIFO list scheduling of the waiting work
    onto the servers' predicted free times. With an exact estimator and no later drops this
    is the true finish; drops ahead of it can only make it earlier."""
    est = estimator.service
    free = [max(state.now, start + est(r)) for start, r in state.running]
    free += [state.now] * (state.servers - len(free))
    heapq.heapify(free)
    for r in state.queue:
        heapq.heappush(free, heapq.heappop(free) + est(r))
    return free[0] + est(request)


# -- policies ---------------------------------------------------------------------------------

class Policy(Protocol):
    name: str
    refuse_reason: str  # why admit() said no, in the outcome record
    drop_reason: str    # why drop() said yes

    def admit(self, request: Request, state: QueueState) -> bool: ...

    def drop(self, request: Request, now: float) -> bool: ...


@dataclass(frozen=True)
class Unbounded:
    name = "unbounded"
    refuse_reason = drop_reason = ""

    def admit(self, request: Request, state: QueueState) -> bool:
        return True

    def drop(self, request: Request, now: float) -> bool:
        return False


@dataclass(frozen=True)
class Bounded(Unbounded):
    """Refuse an arrival when `max_queue` requests are already waiting."""
    max_queue: int = 8
    name = "bounded"
    refuse_reason = "queue full"

    def admit(self, request: Request, state: QueueState) -> bool:
        return len(state.queue) < self.max_queue


@dataclass(frozen=True)
class DropExpired(Bounded):
    """Bounded, and a waiting request is dropped when now + its estimated service > deadline."""
    estimator: Estimator = field(default_factory=ExactEstimator)
    name = "drop-expired"
    drop_reason = "cannot finish by deadline"

    def drop(self, request: Request, now: float) -> bool:
        return now + self.estimator.service(request) > request.deadline


@dataclass(frozen=True)
class AdmitByEstimate(Unbounded):
    """Refuse at arrival what the estimate says cannot finish by its deadline; never drop."""
    estimator: Estimator = field(default_factory=ExactEstimator)
    name = "admit-by-estimate"
    refuse_reason = "estimate past deadline"

    def admit(self, request: Request, state: QueueState) -> bool:
        return predicted_finish(request, state, self.estimator) <= request.deadline


def make_policy(name: str, max_queue: int = 8, estimator: Estimator | None = None) -> Policy:
    """One of `POLICIES` by name."""
    estimator = estimator or ExactEstimator()
    table = {"unbounded": lambda: Unbounded(), "bounded": lambda: Bounded(max_queue),
             "drop-expired": lambda: DropExpired(max_queue, estimator),
             "admit-by-estimate": lambda: AdmitByEstimate(estimator)}
    if name not in table:
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
    return table[name]()


# -- the simulator ----------------------------------------------------------------------------

@dataclass(slots=True)
class Outcome:
    request: Request
    status: str = ""              # one of STATUSES
    start: float | None = None    # service began
    finish: float | None = None   # service ended
    ended: float | None = None    # refused or dropped at
    reason: str = ""

    @property
    def waited(self) -> float | None:
        """Time in the queue: to the start of service, or to the drop; 0 if refused."""
        if self.start is not None:
            return self.start - self.request.arrival
        return None if self.ended is None else self.ended - self.request.arrival

    @property
    def response(self) -> float | None:
        return None if self.finish is None else self.finish - self.request.arrival


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


@dataclass
class SimResult:
    policy: str
    servers: int
    outcomes: list[Outcome]  # in request order
    times: list[float]       # event times ...
    in_system: list[int]     # ... and the number in system just after each
    busy_time: float         # server-seconds spent serving

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    def waits(self) -> np.ndarray:
        """Queue waits of the served requests, in request order."""
        return np.array([o.start - o.request.arrival for o in self.outcomes if o.start is not None])

    def time_average_in_system(self, start: float = 0.0, end: float | None = None) -> float:
        """Mean of the number in system over [start, end] (default: to the last event)."""
        end = self.times[-1] if end is None else end
        return float(self.window_means_in_system([start, end])[0])

    def window_means_in_system(self, edges: Sequence[float]) -> np.ndarray:
        """Time-average number in system over each window [edges[j], edges[j+1]]."""
        t = np.asarray(self.times)
        n = np.asarray(self.in_system, dtype=float)
        area = np.concatenate([[0.0], np.cumsum(n[:-1] * np.diff(t))])  # integral up to t[j]
        edges = np.asarray(edges, dtype=float)
        j = np.clip(np.searchsorted(t, edges, side="right") - 1, 0, None)
        at = np.where(edges < t[0], 0.0, area[j] + n[j] * (edges - t[j]))
        return np.diff(at) / np.diff(edges)

    def summary(self) -> Summary:
        waits = self.waits().tolist()
        responses = [o.response for o in self.outcomes if o.finish is not None]
        horizon = self.times[-1] if self.times else 0.0
        return Summary(self.policy, len(self.outcomes), self.count("in_time"), self.count("late"),
                       self.count("refused"), self.count("dropped"),
                       _percentile(waits, 50), _percentile(waits, 99),
                       float(np.mean(waits)) if waits else math.nan,
                       _percentile(responses, 50), _percentile(responses, 99),
                       self.busy_time / (self.servers * horizon) if horizon else 0.0)


@dataclass(frozen=True)
class Summary:
    policy: str
    requests: int
    in_time: int
    late: int
    refused: int
    dropped: int
    wait_p50: float      # s, served requests only
    wait_p99: float
    wait_mean: float
    response_p50: float  # s, arrival to finish, served requests only
    response_p99: float
    utilisation: float   # busy server time / (servers x time to the last event)

    def to_row(self) -> dict:
        return dict(vars(self))


def to_rows(summaries: Sequence[Summary]) -> list[dict]:
    return [s.to_row() for s in summaries]


def simulate(requests: Sequence[Request], policy: Policy, servers: int = 1) -> SimResult:
    """Run `requests` through `servers` FIFO servers under `policy`; see the module docstring."""
    if servers < 1:
        raise ValueError("need at least one server")
    order = sorted(requests, key=lambda r: (r.arrival, r.index))
    outcomes = {r.index: Outcome(r) for r in order}
    if len(outcomes) != len(order):
        raise ValueError("request indices must be unique")
    queue: deque[Request] = deque()
    running: list[tuple[float, Request]] = []
    departures: list[tuple[float, int, float, Request]] = []  # (finish, index, start, request)
    times: list[float] = []
    in_system: list[int] = []
    busy = 0.0

    def drop(request: Request, now: float) -> None:
        out = outcomes[request.index]
        out.status, out.ended, out.reason = "dropped", now, policy.drop_reason

    def start_service(now: float) -> None:
        nonlocal busy
        while queue and len(running) < servers:
            head = queue.popleft()
            if policy.drop(head, now):
                drop(head, now)
                continue
            running.append((now, head))
            outcomes[head.index].start = now
            heapq.heappush(departures, (now + head.service, head.index, now, head))
            busy += head.service

    i = 0
    while i < len(order) or departures:
        if departures and (i == len(order) or departures[0][0] <= order[i].arrival):
            now, index, start, request = heapq.heappop(departures)
            running.remove((start, request))
            out = outcomes[index]
            out.finish = now
            out.status = "in_time" if now <= request.deadline else "late"
        else:
            request = order[i]
            i += 1
            now = request.arrival
            hopeless = [r for r in queue if policy.drop(r, now)]
            if hopeless:
                for r in hopeless:
                    drop(r, now)
                gone = {r.index for r in hopeless}
                queue = deque(r for r in queue if r.index not in gone)
            if policy.admit(request, QueueState(now, queue, running, servers)):
                queue.append(request)
            else:
                out = outcomes[request.index]
                out.status, out.ended, out.reason = "refused", now, policy.refuse_reason
        start_service(now)
        times.append(now)
        in_system.append(len(queue) + len(running))
    in_order = [outcomes[index] for index in sorted(outcomes)]
    return SimResult(policy.name, servers, in_order, times, in_system, busy)


# -- workloads --------------------------------------------------------------------------------

ServiceDraw = Callable[[np.random.Generator, int], np.ndarray]  # (rng, n) -> n service times


def poisson_requests(rate: float, count: int, service: ServiceDraw, seed: int = 0,
                     deadline: float = math.inf) -> list[Request]:
    """`count` Poisson arrivals at `rate` per second, service times from `service(rng, n)`."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, count))
    return make_requests(arrivals, service(rng, count), deadline)


def exponential_service(mean: float) -> ServiceDraw:
    return lambda rng, n: rng.exponential(mean, n)


def deterministic_service(value: float) -> ServiceDraw:
    return lambda rng, n: np.full(n, value)


def lognormal_service(mean: float, cv: float) -> ServiceDraw:
    """Log-normal service times with the given mean and coefficient of variation."""
    sigma2 = math.log1p(cv * cv)
    return lambda rng, n: rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), n)


@dataclass(frozen=True)
class Scenario:
    """The source's workload: `count` requests over `horizon` s, ~`service` s each."""
    count: int = 279
    horizon: float = 40.0     # s
    service: float = 0.3      # mean s per request (a 16-token request on the source's engine)
    service_cv: float = 0.1   # spread of the engine time around the mean
    deadline: float = 2.0     # s after arrival

    @property
    def load(self) -> float:
        """Offered work per second of server time (the source: about 2)."""
        return self.count * self.service / self.horizon


def scenario_requests(seed: int = 0, scenario: Scenario = Scenario()) -> list[Request]:
    """Poisson arrivals conditioned on `count` in `horizon` (sorted uniform times), with
    log-normal service times; the same requests for every policy given the seed."""
    rng = np.random.default_rng(seed)
    arrivals = np.sort(rng.uniform(0.0, scenario.horizon, scenario.count))
    service = lognormal_service(scenario.service, scenario.service_cv)(rng, scenario.count)
    return make_requests(arrivals, service, scenario.deadline)


def source_scenario(seed: int, policy: Policy | str, scenario: Scenario = Scenario(),
                    servers: int = 1) -> SimResult:
    """The source's 279 requests (for `seed`) through one policy (an object or a name)."""
    if isinstance(policy, str):
        policy = make_policy(policy)
    return simulate(scenario_requests(seed, scenario), policy, servers)


def source_policies(max_queue: int = 8, estimator: Estimator | None = None) -> list[Policy]:
    """The source's four policies, in its order."""
    return [make_policy(name, max_queue, estimator) for name in POLICIES]


def compare_policies(seed: int = 0, scenario: Scenario = Scenario(), max_queue: int = 8,
                     estimator: Estimator | None = None) -> list[Summary]:
    """The four policies on the same requests: one `Summary` each (`to_rows` for a table)."""
    return [source_scenario(seed, p, scenario).summary()
            for p in source_policies(max_queue, estimator)]
