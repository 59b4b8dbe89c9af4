"""Chapter 29's verdicts from the disaggregation simulator, for any step costs.

Chapter 29 times its engine's steps on the reader's machine, fits a `StepTime` (base + per
prompt token + per decoding sequence), and asks the simulator (`labkit.sim.disaggregation`)
which pool of four workers keeps a latency objective to the higher offered rate (the rate,
interpolated between the swept ones, at which the share of requests that meet it falls
through 90%; closer than `RATE_MARGIN` is a tie): colocated with 512-token steps, colocated
with small (64-token) steps, or split into prefill and decode workers. Which one wins is a
fact about the machine's step costs, not a law: where a small prompt chunk fits inside the gap bound of a few decode steps (cheap prompt tokens
against a large base, as on a CPU with wide vector units), the small-step colocated pool
keeps up with the split or beats it; where it does not, the split wins.

So nothing here assumes an outcome. :func:`goodput_study` and :func:`link_study` run the
chapter's two sweeps from a step-cost model passed in (the measured fit, or costs injected
by a test, or by ``$LABKIT_STEP_COSTS`` through :func:`injected_step_costs`), and the ``*_facts`` functions write
the sentence for the outcome the run had, as :class:`Fact` values the chapter records with
``Results.fact`` (which glues ``if_true`` or ``if_false``). :func:`verdicts` runs all of
it; `tests/test_experiments_disaggregation.py` runs it with step costs under which the
colocated pool wins, ties and loses.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence

from labkit.sim import disaggregation as dg

OUTCOMES = ("split", "tie", "colocated")
STEP_COSTS_ENV = "LABKIT_STEP_COSTS"

# Two pools whose 90%-attainment crossings (`crossing_rate`) lie within 3% of each other
# are a tie. One seed of 1,000 requests fixes an attainment near 90% to about +-1 point
# (binomial standard error 0.95 points), which moves a crossing by about 1% of the rate on
# the slopes of chapter 29's recorded sweep (10 to 20 points per request/s), for each pool; the
# linear interpolation between rates 5% of capacity apart adds its own error. 3% covers two
# such errors; it is a line drawn for this sweep, not a measured confidence interval.
RATE_MARGIN = 0.03
# At one offered rate, a pool leads another only where its goodput is higher by more than
# 2% of the offered rate (20 of 1,000 requests): about twice the standard error of the
# difference of two attainments near 96% on 1,000 requests.
LEAD_MARGIN = 0.02
# Two median TTFTs within 10% of each other are "about the same": a line drawn for one
# seed's medians of 1,000 requests, not an interval.
TTFT_MARGIN = 0.10
# A decode-only grid point whose fitted time is off the measured one by more than this is
# named as a miss of the step model.
FIT_MARGIN = 0.10


def injected_step_costs(text: str | None = None) -> dg.StepTime | None:
    """Step costs to simulate instead of the measured ones: `text` (default: the environment
    variable ``LABKIT_STEP_COSTS``) as "base_s,prefill_token_s,decode_seq_s", e.g.
    "0.0148,0.00068,0.0011"; None where it is unset or empty (simulate the measured costs)."""
    import os

    text = os.environ.get(STEP_COSTS_ENV, "") if text is None else text
    if not text.strip():
        return None
    parts = [p for p in text.replace(" ", "").split(",") if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3 or not all(v > 0 for v in values):
        raise ValueError(f"{STEP_COSTS_ENV}: {text!r} is not three positive seconds "
                         "'base_s,prefill_token_s,decode_seq_s'")
    return dg.StepTime(*values)


@dataclass(frozen=True)
class Fact:
    """A fact about this run and the sentence for each outcome (for ``Results.fact``)."""

    holds: bool
    if_true: str
    if_false: str

    @property
    def text(self) -> str:
        return self.if_true if self.holds else self.if_false


def _rate(x: float) -> str:
    return f"{x:.3g}"


def _bw(x: float) -> str:
    """A link's bandwidth in one unit per range: GB/s from 1 GB/s up, MB/s below."""
    return f"{x / 1e9:.2g} GB/s" if x >= 1e9 else f"{x / 1e6:.3g} MB/s"


def rate_phrase(best: float, rates: Sequence[float]) -> str:
    """Where a pool kept the objective, in words that are true at the ends of the sweep too:
    "up to 5.32 requests per second", "only at the lowest rate swept, 0.137 requests per
    second", or "at no rate swept (not even 0.137 requests per second)"."""
    if best <= 0:
        return f"at no rate swept (not even {_rate(min(rates))} requests per second)"
    if best <= min(rates):
        return f"only at the lowest rate swept, {_rate(best)} requests per second"
    return f"up to {_rate(best)} requests per second"


def crossing_rate(rows: Sequence[dict], system: str, attainment: float = 0.9) -> float:
    """The offered rate at which `system`'s share of requests that met the SLO falls through
    `attainment`, interpolated linearly between the highest swept rate that met it
    (`dg.best_rate`) and the next swept rate (which did not). Where the highest rate swept
    met it, that rate (the crossing lies beyond the sweep: a lower bound); 0 where no swept
    rate met it. Finer than the grid of rates, which ties pools that cross between the same
    two swept rates."""
    points = sorted((r["rate_rps"], r["attainment"]) for r in rows if r["system"] == system)
    best = dg.best_rate(rows, system, attainment)
    if best <= 0:
        return 0.0
    i = next(i for i, (rate, _) in enumerate(points) if rate == best)
    if i + 1 == len(points):
        return best
    (r0, a0), (r1, a1) = points[i], points[i + 1]   # a0 >= attainment > a1
    return r0 + (r1 - r0) * (a0 - attainment) / (a0 - a1)


def compare_rates(a: float, b: float, margin: float = RATE_MARGIN) -> int:
    """1 where rate `a` is higher than `b` by more than `margin` (relative), -1 where lower by
    more than that, 0 within it (a tie at the sweep's resolution)."""
    if a > b * (1 + margin):
        return 1
    if b > a * (1 + margin):
        return -1
    return 0


def _apart(a: float, b: float) -> str:
    low, high = sorted((a, b))
    if low > 0:
        return f"{high / low - 1:.0%} apart"
    return "both at zero" if high <= 0 else "one of them at zero"


# -- the step costs ------------------------------------------------------------------------------
def step_facts(per_prefill_token_s: tuple[float, float], prefill_tokens: tuple[int, int],
               per_decode_token_s: tuple[float, float], decode_seqs: tuple[int, int],
               step: dg.StepTime, weights_bytes: int, llc_bytes: int | None,
               read_gb_s: float | None = None, *, close: float | None = None) -> dict[str, Fact]:
    """What the measured step costs say about the two phases, as facts.

    `per_prefill_token_s`: seconds per prompt token of the smallest and largest prefill-only
    steps (`prefill_tokens` tokens); `per_decode_token_s`: seconds per token of the decode-only
    steps with the fewest and most sequences (`decode_seqs`); `llc_bytes`: the last-level
    cache (None: unknown); `read_gb_s`: the machine line's plain read from memory
    (`labkit.util.machine.memory_read_gb_s`; None: not measured).

    A step is memory-bound when reading its bytes sets its time: here, where the measured
    step reads the weights at `close` (default `part_checks.MEMORY_BOUND_SHARE`, 80%) of the
    plain read or more, and the weights do not fit the last-level cache. Without a read rate
    the fact says so and decides nothing. The base share is the fitted model's, and the
    sentence states the model's miss on the measured step it describes."""
    if close is None:
        from labkit.experiments.part_checks import MEMORY_BOUND_SHARE as close
    d0 = decode_seqs[0]
    one_s = per_decode_token_s[0] * d0                 # the measured decode-only step
    model_s = step(0, d0)
    share = step.base_s / model_s
    gbs = weights_bytes / one_s / 1e9
    mb = weights_bytes / 1e6
    in_cache = llc_bytes is not None and weights_bytes <= llc_bytes
    seqs = "one sequence" if d0 == 1 else f"{d0} sequences"
    fit = (f"On the fitted model a decode step of {seqs} is {share:.0%} base, though the model "
           f"puts that step at {1e3 * model_s:.1f} ms against {1e3 * one_s:.1f} ms measured "
           f"({model_s / one_s - 1:+.0%}).")
    if share <= 0.8:
        fit += " What each sequence adds matters here too."
    reads = (f" The measured step reads the model's {mb:.0f} MB of weights once, however many "
             f"sequences share it: {gbs:.1f} GB/s")
    memory_bound = False
    if in_cache:
        reads += (f". This machine's last-level cache ({llc_bytes / 2**20:.0f} MiB) can hold those "
                  "weights, so the step need not read them from memory at all.")
    elif read_gb_s is None or read_gb_s <= 0:
        reads += (". No plain read from memory was measured here to set it against, so this run "
                  "cannot say whether memory bandwidth set the step's time.")
    else:
        ratio = gbs / read_gb_s
        memory_bound = ratio >= close
        reads += f", {ratio:.0%} of the {read_gb_s:.1f} GB/s of the machine line's plain read."
        reads += (" That is close to the memory's rate: the step is memory-bound."
                  if memory_bound else
                  f" That is below the {close:.0%} at which this book calls a step memory-bound: "
                  "memory bandwidth alone did not set its time, and this run does not break "
                  "down where the rest of it went.")
    base = Fact(memory_bound, fit + reads, fit + reads)
    p1 = prefill_tokens[1]
    pre_s = per_prefill_token_s[1] * p1
    pre_gbs = weights_bytes / pre_s / 1e9
    pre = (f"A prefill step of {p1} tokens reads the same weights once in {1e3 * pre_s:.0f} ms, "
           f"{pre_gbs:.1f} GB/s")
    pre_memory = False
    if in_cache or read_gb_s is None or read_gb_s <= 0:
        pre += ": its time grows with its tokens, not with the bytes it reads."
    else:
        pre_memory = pre_gbs / read_gb_s >= close
        pre += (f", {pre_gbs / read_gb_s:.0%} of the plain read: "
                + ("even a step of this size ran near the memory's rate." if pre_memory else
                   "memory bandwidth does not set its time."))
    prefill = Fact(not pre_memory, pre, pre)
    dec_fall = per_decode_token_s[0] / per_decode_token_s[1]
    pre_fall = per_prefill_token_s[0] / per_prefill_token_s[1]
    falls = dec_fall > 2 and dec_fall > pre_fall
    fall = Fact(falls,
                f"{dec_fall:.1f} times less: sharing a step's base cuts a decode token's cost further "
                f"than a prompt token's ({pre_fall:.1f} times from {prefill_tokens[0]} to "
                f"{prefill_tokens[1]} prompt tokens).",
                f"{dec_fall:.1f} times less, against {pre_fall:.1f} times for a prompt token from "
                f"{prefill_tokens[0]} to {prefill_tokens[1]} prompt tokens: on these costs sharing "
                "a step helps decode no more than prefill.")
    return {"base": base, "prefill_read": prefill, "decode_fall": fall}


def decode_fit_facts(residuals: dict[int, float], c_rows: int,
                     margin: float = FIT_MARGIN) -> dict[str, Fact]:
    """Where the step model misses on decode-only steps: `residuals` maps D (decoding
    sequences) to (model - measured) / measured; `c_rows` is the most rows a step may hold
    and still take labkit's C matrix-vector kernel here (`labkit.kernels.native.gemv_max_rows()`
    where it built, 0 where no step does). A miss is more than `margin`."""
    misses = {d: r for d, r in sorted(residuals.items()) if abs(r) > margin}
    if misses:
        each = ", ".join(f"{abs(r):.0%} {'above' if r > 0 else 'below'} the measured step at "
                         f"D = {d}" for d, r in misses.items())
        text = f"On decode-only steps the model misses by more than {margin:.0%}: its time is {each}."
    else:
        text = f"On decode-only steps the model is within {margin:.0%} of every measured step."
    if c_rows:
        on_c = [d for d in misses if d <= c_rows]
        text += (f" Steps of at most {c_rows} rows run labkit's C matrix-vector kernel and wider "
                 "ones oneDNN's, so one straight line spans two kernels")
        if on_c:
            several = len(on_c) > 1
            ds = ", ".join(map(str, on_c[:-1])) + " and " + str(on_c[-1]) if several else str(on_c[0])
            text += (f"; the miss{'es' if several else ''} at D = {ds} "
                     f"lie{'' if several else 's'} on the C kernel's side.")
        else:
            text += "."
    else:
        text += " No step here took labkit's C matrix-vector kernel."
    return {"fit_decode": Fact(bool(misses), text, text)}


# -- goodput: colocated against disaggregated -----------------------------------------------------
@dataclass
class GoodputStudy:
    """Every pool at every offered rate, on one step-cost model."""

    step: dg.StepTime
    slo: dg.SLO
    mean_prompt: float
    capacity: float          # requests/s the workers could prefill if they did nothing else
    rates: list[float]
    systems: tuple           # (colocated 512-token, colocated small-step, disaggregated)
    rows: list[dict]
    requests: int            # simulated requests at every rate
    lengths: dict            # their lengths (`poisson_requests`'s keywords)
    seed: int = 0
    margin: float = RATE_MARGIN  # crossings closer than this (relative) are a tie

    @property
    def split(self) -> dg.Disaggregated:
        return self.systems[-1]

    @property
    def colocated(self) -> tuple:
        return self.systems[:-1]

    @property
    def best(self) -> dict[str, float]:
        """Per system: the highest swept rate at which it met the SLO for 90% of requests."""
        return {s.name: dg.best_rate(self.rows, s.name) for s in self.systems}

    @property
    def crossings(self) -> dict[str, float]:
        """Per system: the interpolated rate at which its attainment falls through 90%
        (:func:`crossing_rate`)."""
        return {s.name: crossing_rate(self.rows, s.name) for s in self.systems}

    @property
    def best_colocated(self) -> float:
        return max(self.best[s.name] for s in self.colocated)

    @property
    def best_colocated_system(self) -> dg.Colocated:
        """The better colocated pool: the later 90% crossing (the smaller chunk where equal)."""
        crossings = self.crossings
        return max(reversed(self.colocated), key=lambda s: crossings[s.name])

    @property
    def best_split(self) -> float:
        return self.best[self.split.name]

    @property
    def crossing_split(self) -> float:
        return self.crossings[self.split.name]

    @property
    def crossing_colocated(self) -> float:
        return self.crossings[self.best_colocated_system.name]

    @property
    def outcome(self) -> str:
        """"split" (the split's 90% crossing lies more than `margin` above the better
        colocated pool's), "colocated" (more than `margin` below) or "tie" (within it). Not
        the swept rates themselves: two pools that cross 90% between the same two swept
        rates would tie on the grid whatever lies between them."""
        return {1: "split", 0: "tie", -1: "colocated"}[
            compare_rates(self.crossing_split, self.crossing_colocated, self.margin)]

    def peak_goodput(self, system) -> tuple[float, float]:
        """(highest goodput over the swept rates, the offered rate it came at) of `system`."""
        row = max(self.rows_of(system), key=lambda r: r["goodput_rps"])
        return row["goodput_rps"], row["rate_rps"]

    def at(self, rate: float) -> dict[str, dict]:
        """The rows of one swept rate, by system name."""
        return {r["system"]: r for r in self.rows if r["rate_rps"] == rate}

    def rows_of(self, system) -> list[dict]:
        return [r for r in self.rows if r["system"] == system.name]


def goodput_study(step: dg.StepTime, kv_bytes_per_token: int, *, loads: Sequence[float],
                  requests: int, lengths: dict, workers: int = 4, split: tuple[int, int] = (2, 2),
                  small_step: int = 64, link: dg.Link = dg.Link(1e10, 1e-4),
                  slo: dg.SLO | None = None, seed: int = 0) -> GoodputStudy:
    """Chapter 29's goodput sweep on the step costs `step` (measured or injected): offered
    rates at `loads` times the pool's prefill capacity, a colocated pool with 512-token steps,
    one with `small_step`-token steps and a `split` pool on `link`, all of `workers` workers,
    on the same `requests` Poisson requests (`lengths`: `poisson_requests`'s keywords) at
    every rate. The SLO is in the step model's units (`scaled_slo`) unless given."""
    slo = slo or dg.scaled_slo(step)
    mean_prompt = statistics.fmean(r.prompt_tokens for r in dg.poisson_requests(requests, 1.0, seed, **lengths))
    capacity = workers / step(round(mean_prompt), 0)
    rates = [round(f * capacity, 3) for f in loads]
    disagg = dg.Disaggregated(*split, kv_bytes_per_token=kv_bytes_per_token, link=link)
    systems = (dg.Colocated(workers), dg.Colocated(workers, dg.Batching(small_step)), disagg)
    rows = dg.rate_sweep(systems, rates, requests, step, slo, seed, **lengths)
    return GoodputStudy(step, slo, mean_prompt, capacity, rates, systems, rows, requests, dict(lengths), seed)


def _chunk(system: dg.Colocated) -> str:
    return f"{system.batching.max_batched_tokens}-token steps"


def crossing_phrase(crossing: float, rates: Sequence[float]) -> str:
    """What a pool's share of requests within the SLO did, for :func:`crossing_rate`'s value."""
    if crossing <= 0:
        return "was under 90% at every rate swept"
    if crossing >= max(rates):
        return f"stayed at 90% or more up to the highest rate swept, {_rate(crossing)} requests per second"
    return f"fell through 90% at about {_rate(crossing)} requests per second"


def goodput_facts(g: GoodputStudy) -> dict[str, Fact]:
    """The goodput section's facts: the headline verdict (from the interpolated 90% crossings,
    with `g.margin`), each pool's best swept rate in words, the peak goodputs, each mixed step
    against the gap bound, how the 512-token pool's attainment moved with the rate, the TTFT
    and gaps of the split against the better colocated pool at the highest rate where one of
    them kept the SLO, and the source's claim."""
    best, better = g.best, g.best_colocated_system
    chunk, margin = _chunk(better), f"{g.margin:.0%}"
    cs, cc = g.crossing_split, g.crossing_colocated
    ps, pc = crossing_phrase(cs, g.rates), crossing_phrase(cc, g.rates)
    apart = _apart(cs, cc)
    if g.outcome == "split":
        head = (f"On these step costs the split kept the objective to a higher rate than either "
                f"colocated pool. Interpolated between the swept rates, its share of requests "
                f"within the SLO {ps}, and that of the colocated pool with {chunk} {pc}: {apart}, "
                f"more than the {margin} margin below which this sweep calls two rates a tie.")
    elif g.outcome == "tie":
        head = (f"On these step costs the split and the colocated pool with {chunk} kept the "
                f"objective to about the same rate. Interpolated between the swept rates, the "
                f"split's share of requests within the SLO {ps}, and that pool's {pc}: {apart}, "
                f"within the {margin} margin below which this sweep calls two rates a tie.")
    else:
        head = (f"On these step costs the colocated pool with {chunk} kept the objective to a "
                f"higher rate than the split. Interpolated between the swept rates, its share of "
                f"requests within the SLO {pc}, and the split's {ps}: {apart}, more than the "
                f"{margin} margin below which this sweep calls two rates a tie.")
    facts = {"headline": Fact(g.outcome == "split", head, head)}
    for key, system in (("col512", g.colocated[0]), ("col_small", g.colocated[1]),
                        ("colocated", better), ("disagg", g.split)):
        phrase = rate_phrase(best[system.name], g.rates)
        facts[f"{key}_phrase"] = Fact(best[system.name] > 0, phrase, phrase)
    (gs, rs), (gc, rc) = g.peak_goodput(g.split), g.peak_goodput(better)
    order = compare_rates(gs, gc, g.margin)
    relation = {1: f"higher for the split by more than {margin}",
                0: f"within {margin} of each other",
                -1: f"higher for the colocated pool by more than {margin}"}[order]
    facts["peak"] = Fact(
        order > 0,
        f"Goodput itself, the rate of requests that met the SLO in panel (a), peaked at "
        f"{gs:.2f} requests per second for the split (offered {_rate(rs)}) and at {gc:.2f} for "
        f"the colocated pool with {chunk} (offered {_rate(rc)}): {relation}.",
        f"Goodput itself, the rate of requests that met the SLO in panel (a), peaked at "
        f"{gs:.2f} requests per second for the split (offered {_rate(rs)}) and at {gc:.2f} for "
        f"the colocated pool with {chunk} (offered {_rate(rc)}): {relation}.")
    bound = 1e3 * g.slo.itl_s
    for key, system in (("mixed_512", g.colocated[0]), ("mixed_small", g.colocated[1])):
        ms = 1e3 * g.step(system.batching.max_batched_tokens, 1)
        facts[key] = Fact(ms > bound, f"above the {bound:g} ms bound", f"within the {bound:g} ms bound")
    low, high = g.rates[0], g.rates[-1]
    at_low, at_high = g.at(low), g.at(high)
    col = g.colocated[0].name
    a_low, a_high = at_low[col]["attainment"], at_high[col]["attainment"]
    share = ("none did" if at_high[col]["slo_met"] == 0 else
             "fewer than 1% did" if a_high < 0.01 else f"only {a_high:.0%} did")
    facts["col512_trend"] = Fact(
        a_high < a_low - LEAD_MARGIN,
        f"At {_rate(high)} requests per second, with more prompts landing on decodes, {share}.",
        f"At {_rate(high)} requests per second it was {a_high:.0%}, no lower: on these step costs "
        "the prompts landing on decodes did not cost that pool more of its requests.")
    # the TTFT and gaps of the two pools that competed, where the SLO still held for one
    held = max(best[g.split.name], best[better.name])
    rate = held or g.rates[0]
    row_s, row_c = g.at(rate)[g.split.name], g.at(rate)[better.name]
    ts, tc = row_s["ttft_p50_s"], row_c["ttft_p50_s"]
    gap_s, gap_c = 1e3 * row_s["max_itl_p50_s"], 1e3 * row_c["max_itl_p50_s"]
    where = (f"At {_rate(rate)} requests per second, the highest rate swept at which either "
             "pool met the SLO for 90% of requests," if held > 0 else
             f"At {_rate(rate)} requests per second, the lowest rate swept (neither pool met "
             "the SLO for 90% of requests at any),")
    gaps = f"its median longest gap between tokens {gap_c:.0f} ms against the split's {gap_s:.0f} ms"
    workers = g.split.prefill_workers + g.split.decode_workers
    if ts > tc * (1 + TTFT_MARGIN):
        ttft = (f"The split pays in TTFT: only {g.split.prefill_workers} of its {workers} workers "
                f"prefill. {where} its median TTFT was {ts:.2f} s against {tc:.2f} s for the "
                f"colocated pool with {chunk}, and that pool's median longest gap between tokens "
                f"was {gap_c:.0f} ms against the split's {gap_s:.0f} ms.")
    elif tc > ts * (1 + TTFT_MARGIN):
        ttft = (f"The colocated pool with {chunk} pays in TTFT instead: its prompts share every "
                f"step with decodes, {better.batching.max_batched_tokens} tokens at a time. "
                f"{where} its median TTFT was {tc:.2f} s against the split's {ts:.2f} s, and "
                f"{gaps}.")
    else:
        ttft = (f"{where} the split and the colocated pool with {chunk} had about the same median "
                f"TTFT, {ts:.2f} s and {tc:.2f} s (within {TTFT_MARGIN:.0%}); the colocated pool's "
                f"median longest gap between tokens was {gap_c:.0f} ms against the split's "
                f"{gap_s:.0f} ms.")
    facts["ttft"] = Fact(ts > tc * (1 + TTFT_MARGIN), ttft, ttft)
    claim = "The source's claim that sharing hardware forces a compromise"
    not_split = (f"{claim} did not show in the rate that kept the SLO on these step costs: a "
                 f"colocated pool kept it to within {margin} of the split's rate."
                 if g.outcome == "tie" else
                 f"{claim} did not hold on these step costs: a colocated pool kept the SLO to a "
                 "higher rate than the split.")
    facts["source_verdict"] = Fact(
        g.outcome == "split",
        f"{claim} held on these step costs, in the simulator: the better colocated pool kept "
        f"the SLO for 90% of requests to a rate lower than the split's by more than {margin}.",
        not_split)
    return facts


# -- the counterexample: a slow link --------------------------------------------------------------
@dataclass(frozen=True)
class LinkMode:
    """One way of releasing the first token, over the swept links (fastest first)."""

    first_token: str
    lead: bool               # on the fastest link swept the split's goodput beat the colocated
                             # floor by more than the study's margin
    fast_goodput: float      # the split's goodput on the fastest link swept
    kept_to: float | None    # slowest link at which (and on every faster one) it kept its level
    lost_at: float | None    # the next slower link swept (None: it kept the level on all of them)
    behind_at: float | None = None  # fastest link on which it fell below the floor by more
                                    # than the margin (None: on none)

    @property
    def level(self) -> str:
        return "its lead" if self.lead else "its fast-link goodput"


@dataclass
class LinkStudy:
    """The split pool at one offered rate, with its link at every swept bandwidth."""

    rate: float
    rate_met_99: bool        # whether the split met the SLO for 99% of requests at some swept rate
    requests: list           # the simulated requests at that rate
    floor: float             # the better colocated pool's goodput at that rate
    mean_kv_bytes: float     # a request's prompt cache, on average
    pivot_bytes_s: float     # the link on which a mean cache takes one whole ITL bound
    bandwidths: list[float]
    rows: list[dict]
    modes: dict[str, LinkMode]
    itl_s: float
    prefill_workers: int
    margin: float = LEAD_MARGIN  # a lead: goodput above the floor by more than this x rate

    @property
    def margin_rps(self) -> float:
        """The smallest goodput difference that counts at this rate (requests per second)."""
        return self.margin * self.rate

    @property
    def saturating_bytes_s(self) -> float:
        """Mean bytes per second each prefill worker's link must carry at this rate."""
        return self.rate * self.mean_kv_bytes / self.prefill_workers

    def row(self, first_token: str, bandwidth: float) -> dict:
        return next(r for r in self.rows
                    if r["first_token"] == first_token and r["bandwidth_bytes_s"] == bandwidth)

    def lost_ms(self, first_token: str) -> float | None:
        lost = self.modes[first_token].lost_at
        return None if lost is None else 1e3 * self.mean_kv_bytes / lost

    def utilization(self, first_token: str, bandwidth: float | None = None) -> float | None:
        """How busy a prefill worker's link is at this rate: at `bandwidth`, or by default
        at the link where `first_token`'s mode lost its level (None if it never did)."""
        bw = self.modes[first_token].lost_at if bandwidth is None else bandwidth
        return None if bw is None else self.saturating_bytes_s / bw


def kept_link(rows: Sequence[dict], first_token: str, level: float, strict: bool) -> tuple[float | None, float | None]:
    """(slowest bandwidth at which, and at every faster one, goodput stayed above `level`
    (at or above it unless `strict`), the next slower bandwidth swept or None)."""
    ordered = sorted((r for r in rows if r["first_token"] == first_token), key=lambda r: -r["bandwidth_bytes_s"])
    kept = None
    for row in ordered:
        ok = row["goodput_rps"] > level if strict else row["goodput_rps"] >= level
        if not ok:
            return kept, row["bandwidth_bytes_s"]
        kept = row["bandwidth_bytes_s"]
    return kept, None


def link_modes(rows: Sequence[dict], floor: float, margin_rps: float) -> dict[str, LinkMode]:
    """Per way of releasing the first token (`dg.FIRST_TOKEN`), from `link_sweep` rows: its
    lead over `floor` (a colocated goodput) on the fastest link, by more than `margin_rps`;
    the links down to which it kept that lead (or, without one, its fast-link goodput within
    the margin); and the fastest link on which it fell below `floor` by more than the margin."""
    modes = {}
    for first in dg.FIRST_TOKEN:
        mine = [r for r in rows if r["first_token"] == first]
        fast = max(mine, key=lambda r: r["bandwidth_bytes_s"])["goodput_rps"]
        lead = fast > floor + margin_rps
        kept, lost = kept_link(mine, first, floor + margin_rps if lead else fast - margin_rps,
                               strict=lead)
        behind = max((r["bandwidth_bytes_s"] for r in mine if r["goodput_rps"] < floor - margin_rps),
                     default=None)
        modes[first] = LinkMode(first, lead, fast, kept, lost, behind)
    return modes


def link_study(g: GoodputStudy, decades: Sequence[float], *, attainment: float = 0.99,
               margin: float = LEAD_MARGIN) -> LinkStudy:
    """The split pool of `g` at the highest swept rate at which it met the SLO for
    `attainment` of requests (the lowest swept rate if none), with its link at `10 ** e`
    times the bandwidth on which a mean prompt cache takes one ITL bound, for each `e` in
    `decades`, and each way of releasing the first token. Per way: whether it beat the
    better colocated pool at that rate on the fastest link by more than `margin` of the
    offered rate (its lead), and the slowest link down to which it kept that lead, or,
    without a lead, its own fast-link goodput (within the same margin); and the fastest link
    on which it fell below the colocated pool by more than the margin."""
    split = g.split
    met = [r["rate_rps"] for r in g.rows_of(split) if r["attainment"] >= attainment]
    rate = max(met) if met else g.rates[0]
    requests = dg.poisson_requests(g.requests, rate, g.seed, **g.lengths)
    pivot = split.kv_bytes_per_token * g.mean_prompt / g.slo.itl_s
    bandwidths = [pivot * 10 ** e for e in decades]
    rows = dg.link_sweep(split, requests, rate, g.step, g.slo, bandwidths)
    floor = max(g.at(rate)[s.name]["goodput_rps"] for s in g.colocated)
    modes = link_modes(rows, floor, margin * rate)
    mean_kv = split.kv_bytes_per_token * statistics.fmean(r.prompt_tokens for r in requests)
    return LinkStudy(rate, bool(met), requests, floor, mean_kv, pivot, bandwidths, rows, modes, g.slo.itl_s,
                     split.prefill_workers, margin)


def link_facts(k: LinkStudy) -> dict[str, Fact]:
    """The link section's facts: which rate it ran at, what each way of releasing the first
    token kept down to which link (a lead counts only beyond `k.margin` of the offered rate),
    why the streamed version lost it (the gap before the second token: transfer, then a
    decode worker's wait and step), the order of the two, and one summary line."""
    bound = 1e3 * k.itl_s
    facts = {"rate": Fact(k.rate_met_99,
                          "the highest swept rate at which the split met the SLO for 99% of requests",
                          "the lowest swept rate (the split met the SLO for 99% of requests at none)")}
    s, h = k.modes["prefill"], k.modes["after_transfer"]
    floor = f"{k.floor:.2f} requests per second"
    by = f"{k.margin:.0%} of requests"
    fastest, slowest = max(k.bandwidths), min(k.bandwidths)

    def where(m: LinkMode) -> str:
        if m.kept_to is None:
            return "on none of the links swept"
        if m.lost_at is None:
            return f"on every link swept, down to {_bw(m.kept_to)}"
        if m.kept_to == fastest:
            return f"only on the fastest link swept, {_bw(fastest)}"
        return f"down to {_bw(m.kept_to)}"

    def after(m: LinkMode) -> str:
        """What the mode did on the links slower than it kept its level on."""
        if m.lost_at is None:
            return ""
        if not m.lead:
            text = f" At {_bw(m.lost_at)} its goodput fell by more than {by}"
        elif m.behind_at == m.lost_at:
            text = f" At {_bw(m.lost_at)} it fell behind the colocated pool by more than {by}"
        else:
            text = f" At {_bw(m.lost_at)} it was level with the colocated pool (within {by})"
        if m.behind_at is not None and m.behind_at < m.lost_at:
            text += f", and from {_bw(m.behind_at)} down it fell behind by more than that"
        return text + "."

    if s.lead:
        first = (f"With the first token streamed at once, the split's goodput beat the colocated "
                 f"pool's ({floor}) by more than {by} {where(s)}.")
    else:
        trails = s.fast_goodput < k.floor - k.margin_rps
        first = (f"At this rate the split had no lead to lose: even on the fastest link its goodput, "
                 f"{s.fast_goodput:.2f} requests per second, was "
                 f"{'below' if trails else 'not above'} the colocated pool's ({floor}) by more "
                 f"than {by}. With the first token streamed at once, it kept that goodput (within "
                 f"{by}) {where(s)}.")
    streamed = first + after(s)
    if s.lost_at is not None:
        fast_row, lost_row = k.row("prefill", fastest), k.row("prefill", s.lost_at)
        streamed += (f" The gap before the second token holds the transfer, then a decode worker's "
                     f"wait for its next step and that step. On the fastest link the median "
                     f"request's longest gap was already {1e3 * fast_row['max_itl_p50_s']:.0f} ms "
                     f"of the {bound:g} ms the SLO allows, with a median transfer of "
                     f"{1e3 * fast_row['transfer_p50_s']:.1f} ms; at {_bw(s.lost_at)} the median "
                     f"transfer took {1e3 * lost_row['transfer_p50_s']:.1f} ms and the median longest "
                     f"gap was {1e3 * lost_row['max_itl_p50_s']:.0f} ms, " + (
                         "so the median transfer alone was over the bound."
                         if 1e3 * lost_row["transfer_p50_s"] > bound else
                         "so more of the requests near the bound went over it."))
    facts["streamed"] = Fact(s.lead, streamed, streamed)
    if h.lead:
        held = f"That version beat the colocated pool by more than {by} {where(h)}.{after(h)}"
    else:
        held = f"That version kept its fast-link goodput (within {by}) {where(h)}.{after(h)}"
    worst = h.behind_at or h.lost_at
    if worst is not None:
        util = k.utilization("after_transfer", worst)
        held += (f" At this rate each of the {k.prefill_workers} prefill workers must send "
                 f"{_bw(k.saturating_bytes_s)} on average, so the {_bw(worst)} link was "
                 f"{util:.0%} busy.")
        held += (" Transfers then queue behind each other, and the wait grows without bound once the "
                 "link is over 100%." if util > 1 else
                 " Below 100% the transfers still queue behind each other whenever two come close "
                 "together.")
    facts["held"] = Fact(h.lead, held, held)
    s_kept = s.kept_to or float("inf")
    h_kept = h.kept_to or float("inf")
    facts["order"] = Fact(
        s_kept > h_kept,
        "Counted in the gap before the second token, the transfer cost more than in TTFT: the "
        "streamed version needed the faster link.",
        "Here holding the first token did not let the split use a slower link than streaming it.")

    def what(m: LinkMode) -> str:
        return (f"beat the colocated pool by more than {by}" if m.lead else
                f"kept its fast-link goodput (within {by})")
    summary = (f"At {k.rate:.3g} requests per second, on links from {_bw(fastest)} down to "
               f"{_bw(slowest)}: with the first token streamed, the split {what(s)} {where(s)}; "
               f"with it held, it {what(h)} {where(h)}.")
    facts["summary"] = Fact(s.lead and h.lead, summary, summary)
    if s.lead and s.lost_at is not None:
        head = (f"When the first token streams at once from the prefill worker, the split beat the "
                f"colocated pool by more than {by} {where(s)}, and lost its lead over slower links.")
    elif s.lead:
        head = (f"When the first token streams at once from the prefill worker, the split beat the "
                f"colocated pool by more than {by} {where(s)}.")
    elif s.lost_at is not None:
        head = (f"At the rate where the link was tested the split had no lead to lose, and with the "
                f"first token streamed at once its goodput fell on links slower than "
                f"{_bw(s.kept_to or s.lost_at)}.")
    else:
        head = ("At the rate where the link was tested the split had no lead to lose, and with the "
                "first token streamed at once it kept its goodput on every link swept.")
    facts["headline"] = Fact(s.lead, head, head)
    return facts


# -- everything the chapter concludes --------------------------------------------------------------
@dataclass
class Verdicts:
    goodput: GoodputStudy
    link: LinkStudy
    facts: dict[str, Fact] = field(default_factory=dict)


def verdicts(step: dg.StepTime, kv_bytes_per_token: int, *, loads: Sequence[float], requests: int,
             lengths: dict, link_decades: Sequence[float], **kw) -> Verdicts:
    """:func:`goodput_study`, :func:`link_study` and all their facts on the step costs `step`:
    the chapter's verdict logic, for any machine (or injected costs)."""
    g = goodput_study(step, kv_bytes_per_token, loads=loads, requests=requests, lengths=lengths, **kw)
    k = link_study(g, link_decades)
    facts = {f"goodput_{n}": f for n, f in goodput_facts(g).items()}
    facts |= {f"link_{n}": f for n, f in link_facts(k).items()}
    return Verdicts(g, k, facts)
