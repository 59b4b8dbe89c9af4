"""The admission-control simulator against queueing theory, an independent recursion, and
the source's claims as properties.

Closed forms (lambda arrivals/s, mu services/s, rho = lambda/mu):
  M/M/1   Wq = rho/(mu - lambda), L = rho/(1 - rho), P(Wq > t) = rho exp(-(mu - lambda) t)
  M/D/1   Wq = rho/(2 mu (1 - rho))                         (Pollaczek-Khinchine)
  M/M/1/K P(blocked) = (1 - rho) rho^K / (1 - rho^(K+1))
  M/M/c   Wq = C(c, a)/(c mu - lambda), C the Erlang C probability of waiting, a = lambda/mu
Each simulated value is a batch-means estimate from one long seeded run (warm-up dropped,
30 batches; 200,000 requests at rho = 0.5, 600,000 at 0.8, where waits stay correlated for
longer); the closed form must lie within t(0.9985, 29) ~ 3.2 standard errors of it, and
the interval must be tight (a few percent) so that the check has teeth.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from scipy import stats

from labkit.sim.admission import (POLICIES, AdmitByEstimate, Bounded, DropExpired, ExactEstimator,
                                  MeanEstimator, NoisyEstimator, QueueState, Scenario,
                                  StaleEstimator, Unbounded, compare_policies,
                                  deterministic_service, exponential_service, make_policy,
                                  make_requests, poisson_requests, predicted_finish,
                                  scenario_requests, simulate, source_scenario, to_rows)

BATCHES = 30
T_CRIT = stats.t.ppf(0.9985, BATCHES - 1)


def batch_interval(values: np.ndarray, warmup: float = 0.02) -> tuple[float, float]:
    """(mean, half-width) by batch means over `values` after dropping the first `warmup`."""
    values = np.asarray(values, dtype=float)[int(len(values) * warmup):]
    means = np.array([b.mean() for b in np.array_split(values, BATCHES)])
    return float(means.mean()), float(T_CRIT * means.std(ddof=1) / math.sqrt(BATCHES))


def assert_within(values, expected: float, rel_width: float = 0.08):
    mean, half = batch_interval(values)
    message = f"simulated {mean:.4f} +- {half:.4f}, theory {expected:.4f}"
    assert abs(mean - expected) <= half, message
    assert half <= rel_width * expected, f"interval too wide: +- {half:.4f} around {mean:.4f}"


@lru_cache(maxsize=None)
def run(rho: float, kind: str, servers: int = 1, max_queue: int | None = None, seed: int = 1,
        count: int | None = None):
    """One long run at mu = 1 per server (lambda = rho * servers)."""
    service = exponential_service(1.0) if kind == "M" else deterministic_service(1.0)
    count = count or (200_000 if rho < 0.7 else 600_000)
    reqs = poisson_requests(rho * servers, count, service, seed=seed)
    policy = Unbounded() if max_queue is None else Bounded(max_queue)
    return simulate(reqs, policy, servers)


def time_batches(result, warmup: float = 0.02) -> np.ndarray:
    """Time-average number in system over BATCHES equal windows after the warm-up."""
    end = result.times[-1]
    edges = np.linspace(warmup * end, end, BATCHES + 1)
    return result.window_means_in_system(edges)


# -- closed forms --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_mm1_mean_wait(rho):
    mu, lam = 1.0, rho
    assert_within(run(rho, "M").waits(), rho / (mu - lam))


@pytest.mark.slow
@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_mm1_mean_number_in_system(rho):
    batches = time_batches(run(rho, "M"))
    mean = batches.mean()
    half = T_CRIT * batches.std(ddof=1) / math.sqrt(BATCHES)
    assert abs(mean - rho / (1 - rho)) <= half, f"simulated {mean:.4f} +- {half:.4f}"
    assert half <= 0.08 * rho / (1 - rho)


@pytest.mark.slow
@pytest.mark.parametrize("rho", [0.5, 0.8])
@pytest.mark.parametrize("t_mean", [0.0, 1.0, 2.0])
def test_mm1_wait_tail(rho, t_mean):
    """P(Wq > t) at t = 0, 1 and 2 mean sojourn times 1/(mu - lambda)."""
    mu, lam = 1.0, rho
    t = t_mean / (mu - lam)
    waits = run(rho, "M").waits()
    assert_within((waits > t).astype(float), rho * math.exp(-(mu - lam) * t), rel_width=0.12)


@pytest.mark.slow
@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_md1_mean_wait_pollaczek_khinchine(rho):
    mu = 1.0
    assert_within(run(rho, "D").waits(), rho / (2 * mu * (1 - rho)))


@pytest.mark.slow
@pytest.mark.parametrize("rho,max_queue", [(0.5, 2), (0.8, 4), (1.5, 4)])
def test_mm1k_blocking(rho, max_queue):
    """Bounded(q) on one server holds q waiting + 1 in service: M/M/1/K with K = q + 1."""
    k = max_queue + 1
    result = run(rho, "M", max_queue=max_queue, count=200_000)
    refused = np.array([o.status == "refused" for o in result.outcomes])
    assert_within(refused.astype(float), (1 - rho) * rho ** k / (1 - rho ** (k + 1)))


def erlang_c(c: int, a: float) -> float:
    top = a ** c / math.factorial(c) * c / (c - a)
    return top / (sum(a ** n / math.factorial(n) for n in range(c)) + top)


@pytest.mark.slow
def test_mmc_mean_wait_erlang_c():
    c, rho = 3, 0.8
    lam, mu = rho * c, 1.0
    assert_within(run(rho, "M", servers=c).waits(), erlang_c(c, lam / mu) / (c * mu - lam))


@pytest.mark.slow
def test_littles_law_between_the_two_accountings():
    """Time-average number in system (event trace) = lambda x mean response (per request)."""
    result = run(0.8, "M")
    responses = [o.response for o in result.outcomes]
    lam = len(responses) / result.outcomes[-1].request.arrival
    assert result.time_average_in_system() == pytest.approx(lam * np.mean(responses), rel=0.01)


# -- exact references on small inputs ------------------------------------------------------------

def lindley_waits(arrivals, services):
    """FIFO single-server waits by Lindley's recursion W' = max(0, W + S - (A' - A))."""
    waits = [0.0]
    for n in range(1, len(arrivals)):
        waits.append(max(0.0, waits[-1] + services[n - 1] - (arrivals[n] - arrivals[n - 1])))
    return np.array(waits)


def test_unbounded_waits_match_lindley_recursion():
    reqs = poisson_requests(0.9, 5000, exponential_service(1.0), seed=4)
    waits = simulate(reqs, Unbounded()).waits()
    ref = lindley_waits([r.arrival for r in reqs], [r.service for r in reqs])
    np.testing.assert_allclose(waits, ref, atol=1e-9)


def test_occupancy_trace_matches_the_sojourns():
    """The event trace's time-average = the sum of each admitted request's time in system
    (arrival to finish or drop) over the window, counted per request."""
    reqs = poisson_requests(1.5, 400, exponential_service(1.0), seed=3, deadline=3.0)
    result = simulate(reqs, DropExpired(max_queue=5))
    for a, b in [(0.0, 50.0), (20.0, 120.0), (100.0, result.times[-1])]:
        spans = [(o.request.arrival, o.finish if o.finish is not None else o.ended)
                 for o in result.outcomes if o.status != "refused"]
        area = sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)
        assert result.time_average_in_system(a, b) == pytest.approx(area / (b - a), rel=1e-9)


def test_hand_worked_bounded_queue():
    # one server, 1 s each; arrivals at 0, 0.1, 0.2, 0.3: the first runs, one waits, two refused
    reqs = make_requests([0.0, 0.1, 0.2, 0.3, 1.5], [1.0] * 5, deadline=10.0)
    result = simulate(reqs, Bounded(max_queue=1))
    statuses = [o.status for o in result.outcomes]
    assert statuses == ["in_time", "in_time", "refused", "refused", "in_time"]
    assert result.outcomes[1].start == 1.0 and result.outcomes[4].start == 2.0
    assert result.outcomes[2].reason == "queue full" and result.outcomes[2].ended == 0.2


def test_hand_worked_drop_expired():
    # the second request waits until 1.0, when 1.0 + 1.0 > its deadline 0.1 + 1.5: dropped
    reqs = make_requests([0.0, 0.1, 1.2], [1.0, 1.0, 0.5], deadline=1.5)
    out = simulate(reqs, DropExpired(max_queue=8)).outcomes
    assert [o.status for o in out] == ["in_time", "dropped", "in_time"]
    assert out[1].ended == 1.0 and out[1].waited == pytest.approx(0.9)
    assert out[2].start == 1.2


def test_service_time_function_of_size():
    reqs = make_requests([0.0, 0.0], lambda tokens: 0.02 * tokens, sizes=[16, 64])
    assert [r.service for r in reqs] == pytest.approx([0.32, 1.28])


def test_predicted_finish_spreads_work_over_servers():
    running = [(0.0, make_requests([0.0], [4.0])[0])]
    queue = make_requests([0.0, 0.0], [1.0, 1.0])
    state = QueueState(now=1.0, queue=queue, running=running, servers=2)
    new = make_requests([1.0], [1.0])[0]
    # server A busy to 4.0; server B free at 1.0 takes both queued (to 3.0); new starts at 3.0
    assert predicted_finish(new, state, ExactEstimator()) == 4.0
    assert predicted_finish(new, state, MeanEstimator(2.0)) == 5.0  # B: 1 -> 3 -> 5, A at 2


# -- the source's scenario and its claims as properties -----------------------------------------

def test_source_scenario_load_is_about_twice_capacity():
    assert Scenario().load == pytest.approx(279 * 0.3 / 40)
    assert 2.0 < Scenario().load < 2.2


def test_source_scenario_is_deterministic_and_counts_add_up():
    a, b = compare_policies(seed=0), compare_policies(seed=0)
    assert a == b and compare_policies(seed=1) != a
    assert [s.policy for s in a] == list(POLICIES)
    for s in a:
        assert s.in_time + s.late + s.refused + s.dropped == s.requests == 279
    rows = to_rows(a)
    assert rows[0]["policy"] == "unbounded" and rows[0]["refused"] == 0 == rows[0]["dropped"]


def test_source_ordering_of_policies():
    by = {s.policy: s for s in compare_policies(seed=0)}
    assert by["unbounded"].in_time < by["bounded"].in_time <= by["drop-expired"].in_time
    assert by["drop-expired"].in_time <= by["admit-by-estimate"].in_time
    assert by["admit-by-estimate"].late == 0 == by["drop-expired"].late


def test_stale_estimate_lets_late_requests_in():
    """Estimating with the mean of an engine 1.5x faster than today's admits too much."""
    exact = source_scenario(0, AdmitByEstimate(ExactEstimator())).summary()
    stale = source_scenario(0, AdmitByEstimate(StaleEstimator(0.2))).summary()
    assert exact.late == 0 and stale.late > 0 and stale.refused < exact.refused


def test_noisy_estimator_is_repeatable():
    est = NoisyEstimator(ExactEstimator(), sigma=0.3, seed=2)
    req = scenario_requests(0)[5]
    assert est.service(req) == est.service(req) != req.service


request_lists = st.lists(
    st.tuples(st.floats(0.0, 10.0), st.floats(0.01, 2.0), st.floats(0.0, 4.0)),
    min_size=1, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_lists, st.integers(1, 3), st.sampled_from(POLICIES))
def test_properties_of_every_policy(spec, servers, name):
    arrivals, services, budgets = zip(*sorted(spec))
    reqs = make_requests(arrivals, services, budgets)
    result = simulate(reqs, make_policy(name, max_queue=2), servers)
    statuses = [o.status for o in result.outcomes]
    assert all(s in ("in_time", "late", "refused", "dropped") for s in statuses)
    for o in result.outcomes:
        if o.start is not None:
            assert o.start >= o.request.arrival
            assert o.finish == pytest.approx(o.start + o.request.service)
    # never more than `servers` in service at once
    events = sorted([(o.start, 1) for o in result.outcomes if o.start is not None]
                    + [(o.finish, -1) for o in result.outcomes if o.finish is not None],
                    key=lambda e: (e[0], e[1]))
    assert max(np.cumsum([d for _, d in events]), default=0) <= servers
    if name in ("admit-by-estimate", "drop-expired"):  # exact estimators: the source's claim
        assert "late" not in statuses
    if name == "unbounded":
        assert statuses.count("refused") == statuses.count("dropped") == 0
    if servers == 1:  # FIFO: served requests start in arrival order
        starts = [o.start for o in result.outcomes if o.start is not None]
        assert starts == sorted(starts)
