"""Static vs continuous batching: the analysis of chapter 15.

`run_engine` (labkit.bench.serving) gives one record per request (arrival, first token,
finish) and the number of running sequences after every engine step. This module turns
those into the quantities a serving system is judged by:

- per-request latencies: time to first token (TTFT), time per output token (TPOT),
  end-to-end latency;
- goodput: requests per second that met a latency objective (an `SLO`), not just
  requests per second;
- padding waste of static batching: slot-steps a batch holds for sequences that have
  already finished while the batch still runs;
- fairness: the same latencies split into groups (short vs long prompts);

and runs the experiments: the capacity of a configuration (all requests queued at once)
and a sweep of offered loads (Poisson arrivals at fractions of that capacity), every
system on the same workload and the same arrival times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from labkit.bench.serving import RequestRecord, RunResult, run_engine
from labkit.bench.workloads import Workload, poisson_arrivals
from labkit.util.compare import MIN_SAMPLES, Comparison, compare
from labkit.util.timing import quantile


# -- per-request latencies ----------------------------------------------------------------------
def ttft_s(record: RequestRecord) -> float:
    """Time to first token: first token minus arrival (inf if no token came)."""
    return math.inf if record.first_token_s is None else record.first_token_s - record.arrival_s


def tpot_s(record: RequestRecord) -> float:
    """Time per output token after the first: (finish - first token) / (output tokens - 1);
    0 for a request of one token, inf if no token came."""
    if record.first_token_s is None:
        return math.inf
    if record.output_tokens < 2:
        return 0.0
    return (record.finish_s - record.first_token_s) / (record.output_tokens - 1)


def e2e_s(record: RequestRecord) -> float:
    """End-to-end latency: finish minus arrival."""
    return record.finish_s - record.arrival_s


# -- goodput ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SLO:
    """A latency objective per request: TTFT <= ttft_s and TPOT <= tpot_s."""
    ttft_s: float = 1.0
    tpot_s: float = 0.25

    def met(self, record: RequestRecord) -> bool:
        return ttft_s(record) <= self.ttft_s and tpot_s(record) <= self.tpot_s

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_s:g} s and TPOT <= {1e3 * self.tpot_s:g} ms"


@dataclass(frozen=True)
class Goodput:
    met: int            # requests that met the SLO
    requests: int
    wall_s: float       # duration of the run

    @property
    def fraction(self) -> float:
        return self.met / self.requests if self.requests else math.nan

    @property
    def rps(self) -> float:
        """Goodput: requests that met the SLO per second of the run."""
        return self.met / self.wall_s


def goodput(records: Sequence[RequestRecord], wall_s: float, slo: SLO) -> Goodput:
    """How many requests met `slo`, and that count per second of a run lasting `wall_s`."""
    if wall_s <= 0:
        raise ValueError("wall_s must be positive")
    return Goodput(sum(slo.met(r) for r in records), len(records), wall_s)


# -- padding waste ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PaddingWaste:
    batches: list[int]      # size of each static batch at admission
    steps: list[int]        # engine steps each batch ran
    wasted: int             # slot-steps held for sequences that had already finished
    held: int               # slot-steps the batches held in all: sum of size x steps

    @property
    def fraction(self) -> float:
        return self.wasted / self.held if self.held else 0.0


def static_batches(running_per_step: Sequence[int]) -> list[list[int]]:
    """Split a static-batching run's `running_per_step` (sequences still running after each
    step) into its batches. A static batch admits nothing until it has finished, so each
    batch ends with a step after which nothing runs (a 0)."""
    batches, current = [], []
    for r in running_per_step:
        current.append(r)
        if r == 0:
            batches.append(current)
            current = []
    if current:
        batches.append(current)  # a run cut off before its last batch finished
    return batches


def padding_waste(running_per_step: Sequence[int]) -> PaddingWaste:
    """Padding waste of static batching from the running count after every step.

    For a batch admitted with B sequences that runs steps a..b, the sequences computed at
    step t > a are the r_{t-1} still running after the step before, so

        waste = sum over batches of  sum_{t=a}^{b-1} (B - r_t)

    slot-steps held by sequences that have finished while the batch runs (equal, for one
    batch, to sum_i (L_max - L_i) over its output lengths L_i). B is read as the first
    count of the batch, which assumes no sequence finishes in its prefill step (outputs of
    at least 2 tokens)."""
    sizes, lengths, wasted, held = [], [], 0, 0
    for batch in static_batches(running_per_step):
        size = batch[0]
        if size == 0:
            continue
        sizes.append(size)
        lengths.append(len(batch))
        wasted += sum(size - r for r in batch[:-1])
        held += size * len(batch)
    return PaddingWaste(sizes, lengths, wasted, held)


def padding_waste_from_lengths(batches: Sequence[Sequence[int]]) -> int:
    """The same waste from the output lengths of each batch: sum_i (max_j L_j - L_i)."""
    return sum(max(b) * len(b) - sum(b) for b in batches if b)


# -- summaries ------------------------------------------------------------------------------------
def summarize(run: RunResult, slo: SLO, **extra) -> dict:
    """One row of latency, throughput and goodput figures for a run (plus `extra` columns)."""
    recs = run.records
    ttft = [ttft_s(r) for r in recs]
    good = goodput(recs, run.wall_s, slo)
    return {**extra, "system": run.system, "requests": len(recs), "wall_s": run.wall_s,
            "ttft_median_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
            "tpot_median_s": quantile([tpot_s(r) for r in recs], 0.5),
            "e2e_median_s": quantile([e2e_s(r) for r in recs], 0.5),
            "e2e_p99_s": quantile([e2e_s(r) for r in recs], 0.99),
            "requests_per_s": len(recs) / run.wall_s, "tokens_per_s": run.tokens_per_s,
            "slo_met": good.met, "slo_fraction": good.fraction, "goodput_rps": good.rps}


def group_summary(records: Sequence[RequestRecord], group: Callable[[RequestRecord], str]) -> dict[str, dict]:
    """Latencies per group of requests (e.g. "short" and "long" prompts): who waits."""
    out: dict[str, dict] = {}
    for name in sorted({group(r) for r in records}):
        rs = [r for r in records if group(r) == name]
        ttft, e2e = [ttft_s(r) for r in rs], [e2e_s(r) for r in rs]
        out[name] = {"requests": len(rs), "ttft_median_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
                     "ttft_max_s": max(ttft), "e2e_median_s": quantile(e2e, 0.5), "e2e_max_s": max(e2e)}
    return out


def group_ttfts(records: Sequence[RequestRecord], group: Callable[[RequestRecord], str],
                name: str) -> list[float]:
    """Every request's TTFT in one group, in request order."""
    return [ttft_s(r) for r in sorted(records, key=lambda r: r.request) if group(r) == name]


def ttft_comparison(ours: Sequence[float], theirs: Sequence[float], *, name_ours: str = "ours",
                    name_theirs: str = "theirs") -> Comparison:
    """Median TTFT of one scheduler's requests against another's on the same requests, with a
    bootstrap interval over the requests (`labkit.util.compare`): the ratio is how many times
    longer `theirs` waited. The interval is the spread across requests within one run, not
    across runs."""
    return compare(ours, theirs, name_a=name_ours, name_b=name_theirs)


def lower_or_higher(comparison: Comparison) -> str:
    """`ours` against `theirs` in words that claim no more than the interval: "lower (the
    other waited 1.8 times as long; 95% interval 1.5-2.1)", "higher (...)", or "within the
    noise (ratio 1.02, 95% interval 0.9-1.1)"."""
    interval = f"{comparison.confidence:.0%} interval {comparison.low:.2f}-{comparison.high:.2f}"
    if comparison.verdict == "faster":
        return f"lower (the other waited {comparison.ratio:.2f} times as long; {interval})"
    if comparison.verdict == "slower":
        inverse = f"{comparison.confidence:.0%} interval {1 / comparison.high:.2f}-{1 / comparison.low:.2f}"
        return f"higher (it waited {1 / comparison.ratio:.2f} times as long as the other; {inverse})"
    return f"within the noise (ratio {comparison.ratio:.2f}, {interval})"


# Fewest requests in a group for a bootstrap interval of its median to mean something: with
# 4 values a resample has only a handful of distinct medians, and the "95% interval" is little
# more than the sample's own range. Smaller groups are compared request by request instead.
MIN_INTERVAL_REQUESTS = 10


def paired_verdict(ours: Sequence[float], theirs: Sequence[float]) -> str:
    """`ours` against `theirs` for the same requests in the same order (one scheduler's TTFTs
    against another's), request by request and with no interval: "higher for each of the 4
    requests (each waited 1.60-4.20 times as long as under the other)", "lower for each of
    ...", or "higher for some of the 4 requests and not for others (...)". A direction is
    claimed only when every request agrees."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"pairs need the same requests on both sides, got {len(ours)} and {len(theirs)}")
    if min(*ours, *theirs) <= 0:
        raise ValueError("a time to first token is positive")
    ratios = [o / t for o, t in zip(ours, theirs)]
    n, low, high = len(ratios), min(ratios), max(ratios)
    if low > 1.0:
        return (f"higher for each of the {n} requests (each waited {low:.2f}-{high:.2f} times "
                f"as long as under the other)")
    if high < 1.0:
        return (f"lower for each of the {n} requests (under the other each waited "
                f"{1 / high:.2f}-{1 / low:.2f} times as long)")
    return (f"higher for some of the {n} requests and not for others (ratios {low:.2f}-"
            f"{high:.2f}, request by request)")


def ttft_verdict(ours: Sequence[float], theirs: Sequence[float],
                 min_interval: int = MIN_INTERVAL_REQUESTS) -> str:
    """:func:`lower_or_higher` of :func:`ttft_comparison` (a bootstrap interval of the ratio of
    medians) for groups of at least `min_interval` requests; :func:`paired_verdict` for
    smaller groups of the same requests; "not compared (...)" when a group has fewer than
    `MIN_SAMPLES` requests (the ci profile's single long request) or a small group's two
    sides are not the same requests."""
    fewest = min(len(ours), len(theirs))
    if fewest < MIN_SAMPLES:
        return (f"not compared ({fewest} request(s) in the group; a comparison needs at least "
                f"{MIN_SAMPLES})")
    if fewest >= min_interval:
        return lower_or_higher(ttft_comparison(ours, theirs))
    if len(ours) != len(theirs):
        return (f"not compared ({len(ours)} and {len(theirs)} requests: too few for an "
                f"interval, and not the same requests to pair)")
    return paired_verdict(ours, theirs)


def times_phrase(a: float, b: float) -> str:
    """`a` against `b` as "r times as long" or "r times shorter", reading right whichever is
    larger."""
    r = a / b
    return f"{r:.1f} times as long" if r >= 1 else f"{1 / r:.1f} times shorter"


def against_range(value: float, low: float, high: float, what: str = "the source's") -> str:
    """Where `value` falls against a cited range [low, high]: "smaller than the source's",
    "larger than ...", or "within the source's range"."""
    if value < low:
        return f"smaller than {what}"
    if value > high:
        return f"larger than {what}"
    return f"within {what} range"


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all equal, 1/n when one takes all."""
    if not values:
        return math.nan
    s, s2 = sum(values), sum(v * v for v in values)
    return s * s / (len(values) * s2) if s2 else 1.0


# -- workloads and experiments --------------------------------------------------------------------
def varied_outputs(count: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    """Output lengths uniform in [shortest, longest] from a seed."""
    rng = random.Random(seed)
    return [rng.randint(shortest, longest) for _ in range(count)]


def with_arrivals(workload: Workload, rate: float, seed: int = 0) -> Workload:
    """The same prompts and output lengths, arriving as a Poisson process at `rate`/s."""
    return Workload(workload.prompts, workload.max_tokens, poisson_arrivals(len(workload), rate, seed))


def mixed_prompts(short: Sequence[Sequence[int]], long: Sequence[Sequence[int]], every: int) -> tuple[list[list[int]], list[bool]]:
    """Interleave long prompts among short ones: request k*every + every//2 is long while
    long prompts last. Returns (prompts, is_long)."""
    prompts, is_long = [], []
    longs, shorts = list(long), list(short)
    k = 0
    while shorts or longs:
        take_long = longs and (k % every == every // 2 or not shorts)
        prompts.append(list(longs.pop(0) if take_long else shorts.pop(0)))
        is_long.append(bool(take_long))
        k += 1
    return prompts, is_long


def capacity(model, workload: Workload, config, system: str = "capacity") -> tuple[float, RunResult]:
    """Requests per second with every request of `workload` queued at once."""
    run = run_engine(model, Workload(workload.prompts, workload.max_tokens), config, system)
    return len(workload) / run.wall_s, run


def capacities(model, workload: Workload, systems: dict, repeats: int,
               runner: Callable = run_engine) -> dict[str, list[RunResult]]:
    """Every system (name -> EngineConfig) run `repeats` times with all of `workload` queued
    at once, interleaved (A B C A B C ...) so that a slow spell of the machine falls on
    every system: name -> its runs in order. A run's requests per second is its capacity."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    queued = Workload(workload.prompts, workload.max_tokens)
    runs: dict[str, list[RunResult]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, config in systems.items():
            runs[name].append(runner(model, queued, config, name))
    return runs


@dataclass
class SweepPoint:
    load: float          # offered load as a fraction of capacity
    rate: float          # requests per second offered
    system: str
    run: RunResult
    repeat: int = 0      # which run of the sweep (its arrivals are drawn from seed + repeat)


def load_sweep(model, workload: Workload, capacity_rps: float, loads: Sequence[float], systems: dict,
               seed: int = 0, runner: Callable = run_engine, repeats: int = 1,
               only_at: dict[str, Sequence[float]] | None = None) -> list[SweepPoint]:
    """Run every system (name -> EngineConfig) at every offered load (fraction of
    `capacity_rps`), on the same prompts, `repeats` times; a system named in `only_at` runs
    only at the loads listed there (still beside the others, on the same arrivals). Within
    a repeat all loads share
    one seed, so their Poisson arrival times are the same pattern compressed or stretched in
    time, and every system meets the same arrivals; repeat r draws its pattern from
    `seed + r`, so the spread over repeats holds both the machine's noise and the luck of
    the arrivals. Repeats run one after another, each through every load, so a slow spell
    of the machine falls on one repeat rather than on one load."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    only_at = only_at or {}
    unknown = set(only_at) - set(systems)
    if unknown:
        raise ValueError(f"only_at names systems not in the sweep: {sorted(unknown)}")
    points = []
    for repeat in range(repeats):
        for load in loads:
            rate = load * capacity_rps
            work = with_arrivals(workload, rate, seed + repeat)
            for name, config in systems.items():
                if name in only_at and load not in only_at[name]:
                    continue
                points.append(SweepPoint(load, rate, name, runner(model, work, config, name), repeat))
    return points


@dataclass(frozen=True)
class RunSpread:
    """One quantity over the repeats of a sweep: its median, lowest and highest value."""
    median: float
    low: float
    high: float
    runs: int

    def range_text(self, fmt: str = "{:.2f}") -> str:
        """'0.11-0.13 over 5 runs', or 'one run' when there is nothing to spread."""
        if self.runs == 1:
            return "one run"
        return f"{fmt.format(self.low)}-{fmt.format(self.high)} over {self.runs} runs"


def spread(values: Sequence[float]) -> RunSpread:
    """The median, lowest and highest of per-run values."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no runs")
    return RunSpread(quantile(values, 0.5), min(values), max(values), len(values))


def ratio_spread(rows: Sequence[dict], column: str, numerator: str, denominator: str,
                 load: float) -> RunSpread:
    """`column` of system `numerator` over that of `denominator` at one load, a ratio per
    repeat (both systems met the same arrivals in a repeat), spread over the repeats.
    `rows` are `summarize` rows with `load`, `repeat` and `system`."""
    by_run: dict[int, dict[str, float]] = {}
    for row in rows:
        if row["load"] == load:
            by_run.setdefault(row.get("repeat", 0), {})[row["system"]] = row[column]
    ratios = [run[numerator] / run[denominator] for run in by_run.values()
              if numerator in run and denominator in run]
    return spread(ratios)


def runs_comparison(rows: Sequence[dict], column: str, ours: str, theirs: str,
                    load: float) -> Comparison:
    """`column` of system `ours` against system `theirs` at one load, one value per run of the
    sweep (`summarize` rows with `load`, `repeat` and `system`): `compare`'s bootstrap
    interval of median(theirs) / median(ours) over the runs, so its verdict says whether the
    runs separate the two systems (for a time, "faster": `ours` took less)."""
    def values(system: str) -> list[float]:
        return [row[column] for row in sorted(rows, key=lambda row: row.get("repeat", 0))
                if row["load"] == load and row["system"] == system]

    return compare(values(ours), values(theirs), name_a=ours, name_b=theirs)


def waited_phrase(ratio: RunSpread) -> str:
    """How many times as long the numerator's requests waited, claiming a direction only when
    every run agrees: "6.1 times as long (5.2-7.0 over 5 runs)", "2.0 times shorter (...)",
    or "no different beyond the run-to-run spread (ratios 0.9-1.2 over 5 runs)". With one run
    there is no spread to judge by, and the phrase says so."""
    if ratio.runs == 1:
        return times_phrase(ratio.median, 1.0) + " (one run, so no spread to judge it by)"
    if ratio.low > 1.0:
        return f"{ratio.median:.1f} times as long ({ratio.range_text('{:.1f}')})"
    if ratio.high < 1.0:
        return (f"{1 / ratio.median:.1f} times shorter "
                f"({1 / ratio.high:.1f}-{1 / ratio.low:.1f} over {ratio.runs} runs)")
    return f"no different beyond the run-to-run spread (ratios {ratio.range_text()})"
