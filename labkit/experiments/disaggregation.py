"""Chapter 29's verdicts from the disaggregation simulator, for any step costs.

Chapter 29 times its engine's steps on the reader's machine, fits a `StepTime` (base + per
prompt token + per decoding sequence), and asks the simulator (`labkit.sim.disaggregation`)
which pool of four workers keeps a latency objective to the higher offered rate: colocated
with 512-token steps, colocated with small (64-token) steps, or split into prefill and
decode workers. Which one wins is a fact about the machine's step costs, not a law: where a
small prompt chunk fits inside the gap bound of a few decode steps (cheap prompt tokens
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


def _gbs(x: float) -> str:
    return f"{x / 1e9:.2g}"


def rate_phrase(best: float, rates: Sequence[float]) -> str:
    """Where a pool kept the objective, in words that are true at the ends of the sweep too:
    "up to 5.32 requests per second", "only at the lowest rate swept, 0.137 requests per
    second", or "at no rate swept (not even 0.137 requests per second)"."""
    if best <= 0:
        return f"at no rate swept (not even {_rate(min(rates))} requests per second)"
    if best <= min(rates):
        return f"only at the lowest rate swept, {_rate(best)} requests per second"
    return f"up to {_rate(best)} requests per second"


# -- the step costs ------------------------------------------------------------------------------
def step_facts(per_prefill_token_s: tuple[float, float], prefill_tokens: tuple[int, int],
               per_decode_token_s: tuple[float, float], decode_seqs: tuple[int, int],
               step: dg.StepTime, weights_bytes: int, llc_bytes: int | None) -> dict[str, Fact]:
    """What the measured step costs say about the two phases, as facts.

    `per_prefill_token_s`: seconds per prompt token of the smallest and largest prefill-only
    steps (`prefill_tokens` tokens); `per_decode_token_s`: seconds per token of the decode-only
    steps with the fewest and most sequences (`decode_seqs`); `llc_bytes`: the last-level
    cache (None: unknown)."""
    share = step.base_s / step(0, 1)
    gbs = weights_bytes / step.base_s / 1e9
    mb = weights_bytes / 1e6
    in_cache = llc_bytes is not None and weights_bytes <= llc_bytes
    head = f"A decode step of one sequence is {share:.0%} base"
    reads = (f"the step reads the model's {mb:.0f} MB of weights once, at {gbs:.1f} GB/s, however "
             "many sequences share it")
    if share > 0.8 and not in_cache:
        base = Fact(True, f"A decode step of one sequence is almost all base ({share:.0%} of it): {reads}. "
                          "That is memory-bound.", "")
    elif share > 0.8:
        base = Fact(True, f"A decode step of one sequence is almost all base ({share:.0%} of it): {reads}. "
                          f"This machine's last-level cache ({llc_bytes / 2**20:.0f} MiB) can hold those "
                          "weights, so the base is a fixed cost per step more than a read from memory.", "")
    else:
        base = Fact(False, "", f"{head}, less than where reading the model's {mb:.0f} MB of weights "
                               f"dominates a step (it reads them at {gbs:.1f} GB/s): what each sequence "
                               "adds matters here too.")
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
    return {"base": base, "decode_fall": fall}


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
    def best_colocated(self) -> float:
        return max(self.best[s.name] for s in self.colocated)

    @property
    def best_colocated_system(self) -> dg.Colocated:
        """The better colocated pool (the smaller chunk where they tie)."""
        return max(reversed(self.colocated), key=lambda s: self.best[s.name])

    @property
    def best_split(self) -> float:
        return self.best[self.split.name]

    @property
    def outcome(self) -> str:
        """"split" (the split kept the SLO to a higher rate than either colocated pool),
        "tie" or "colocated"."""
        if self.best_split > self.best_colocated:
            return "split"
        return "tie" if self.best_split == self.best_colocated else "colocated"

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


def goodput_facts(g: GoodputStudy) -> dict[str, Fact]:
    """The goodput section's facts: the headline verdict, each pool's best rate in words, each
    mixed step against the gap bound, how the 512-token pool's attainment moved with the rate,
    and whose TTFT was longer at the highest rate."""
    best, better = g.best, g.best_colocated_system
    if g.outcome == "tie":
        other = (f"On these step costs the split did no better: the colocated pool with "
                 f"{_chunk(better)} kept the objective to the same rate.")
    else:
        other = (f"On these step costs the colocated pool with {_chunk(better)} kept the "
                 "objective to a higher rate than the split.")
    facts = {"headline": Fact(g.outcome == "split",
                              "On these step costs the split kept the objective to a higher rate "
                              "than either colocated pool.", other)}
    for key, system in (("col512", g.colocated[0]), ("col_small", g.colocated[1]),
                        ("colocated", better), ("disagg", g.split)):
        phrase = rate_phrase(best[system.name], g.rates)
        facts[f"{key}_phrase"] = Fact(best[system.name] > 0, phrase, phrase)
    bound = 1e3 * g.slo.itl_s
    for key, system in (("mixed_512", g.colocated[0]), ("mixed_small", g.colocated[1])):
        ms = 1e3 * g.step(system.batching.max_batched_tokens, 1)
        facts[key] = Fact(ms > bound, f"above the {bound:g} ms bound", f"within the {bound:g} ms bound")
    low, high = g.rates[0], g.rates[-1]
    at_low, at_high = g.at(low), g.at(high)
    col = g.colocated[0].name
    a_low, a_high = at_low[col]["attainment"], at_high[col]["attainment"]
    facts["col512_trend"] = Fact(
        a_high < a_low,
        f"At {high:.2g}, with more prompts landing on decodes, only {a_high:.0%} did.",
        f"At {high:.2g} it was {a_high:.0%}, no lower: on these step costs the prompts landing on "
        "decodes did not cost that pool more of its requests.")
    t_split, t_col = at_high[g.split.name]["ttft_p50_s"], at_high[col]["ttft_p50_s"]
    facts["ttft"] = Fact(
        t_split > t_col,
        f"The split pays elsewhere: only half of its workers prefill. At {high:.2g} requests per "
        f"second its median TTFT was {t_split:.2f} s, against {t_col:.2f} s colocated.",
        f"Only half of the split's workers prefill, yet at {high:.2g} requests per second its median "
        f"TTFT was {t_split:.2f} s, no longer than the {t_col:.2f} s of the colocated pool, whose "
        "prompts wait behind its decodes.")
    return facts


# -- the counterexample: a slow link --------------------------------------------------------------
@dataclass(frozen=True)
class LinkMode:
    """One way of releasing the first token, over the swept links (fastest first)."""

    first_token: str
    lead: bool               # on the fastest link swept the split's goodput beat the colocated floor
    fast_goodput: float      # the split's goodput on the fastest link swept
    kept_to: float | None    # slowest link at which (and on every faster one) it kept its level
    lost_at: float | None    # the next slower link swept (None: it kept the level on all of them)

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

    @property
    def saturating_bytes_s(self) -> float:
        """Mean bytes per second each prefill worker's link must carry at this rate."""
        return self.rate * self.mean_kv_bytes / self.prefill_workers

    def lost_ms(self, first_token: str) -> float | None:
        lost = self.modes[first_token].lost_at
        return None if lost is None else 1e3 * self.mean_kv_bytes / lost

    def utilization(self, first_token: str) -> float | None:
        lost = self.modes[first_token].lost_at
        return None if lost is None else self.saturating_bytes_s / lost


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


def link_study(g: GoodputStudy, decades: Sequence[float], *, attainment: float = 0.99) -> LinkStudy:
    """The split pool of `g` at the highest swept rate at which it met the SLO for
    `attainment` of requests (the lowest swept rate if none), with its link at `10 ** e`
    times the bandwidth on which a mean prompt cache takes one ITL bound, for each `e` in
    `decades`, and each way of releasing the first token. Per way: whether it beat the
    better colocated pool at that rate on the fastest link (its lead), and the slowest link
    down to which it kept that lead, or, without a lead, its own fast-link goodput."""
    split = g.split
    met = [r["rate_rps"] for r in g.rows_of(split) if r["attainment"] >= attainment]
    rate = max(met) if met else g.rates[0]
    requests = dg.poisson_requests(g.requests, rate, g.seed, **g.lengths)
    pivot = split.kv_bytes_per_token * g.mean_prompt / g.slo.itl_s
    bandwidths = [pivot * 10 ** e for e in decades]
    rows = dg.link_sweep(split, requests, rate, g.step, g.slo, bandwidths)
    floor = max(g.at(rate)[s.name]["goodput_rps"] for s in g.colocated)
    fastest = max(bandwidths)
    modes = {}
    for first in dg.FIRST_TOKEN:
        fast = next(r["goodput_rps"] for r in rows if r["first_token"] == first and r["bandwidth_bytes_s"] == fastest)
        lead = fast > floor
        kept, lost = kept_link(rows, first, floor if lead else fast, strict=lead)
        modes[first] = LinkMode(first, lead, fast, kept, lost)
    mean_kv = split.kv_bytes_per_token * statistics.fmean(r.prompt_tokens for r in requests)
    return LinkStudy(rate, bool(met), requests, floor, mean_kv, pivot, bandwidths, rows, modes, g.slo.itl_s,
                     split.prefill_workers)


def _vs(ms: float, bound_ms: float) -> str:
    if abs(ms / bound_ms - 1) < 0.05:
        return "about the same as"
    return "more than" if ms > bound_ms else "less than"


def link_facts(k: LinkStudy) -> dict[str, Fact]:
    """The link section's facts: which rate it ran at, what each way of releasing the first
    token kept down to which link, the order of the two, and one summary line."""
    bound = 1e3 * k.itl_s
    facts = {"rate": Fact(k.rate_met_99,
                          "the highest swept rate at which the split met the SLO for 99% of requests",
                          "the lowest swept rate (the split met the SLO for 99% of requests at none)")}
    s, h = k.modes["prefill"], k.modes["after_transfer"]
    floor = f"{k.floor:.2f} requests per second"
    if s.lead:
        first = f"With the first token streamed at once, the split beat the colocated pool ({floor})"
    else:
        first = (f"At this rate the split had no lead to lose: even on the fastest link its goodput, "
                 f"{s.fast_goodput:.2f} requests per second, was no higher than the colocated pool's "
                 f"({floor}). With the first token streamed at once, it kept that goodput")
    if s.lost_at is None:
        streamed = f"{first} on every link swept, down to {_gbs(s.kept_to)} GB/s."
    else:
        ms = k.lost_ms("prefill")
        kept = (f" down to {_gbs(s.kept_to)} GB/s" if s.kept_to is not None
                else " on none of the links swept")
        streamed = (f"{first}{kept}. At the next slower link, {_gbs(s.lost_at)} GB/s, moving an average "
                    f"cache took {ms:.0f} ms, {_vs(ms, bound)} the {bound:g} ms the SLO allows for any "
                    "gap, and the long prompts of the tail took longer still.")
    facts["streamed"] = Fact(s.lead, streamed, streamed)
    if h.lost_at is None:
        held = f"That version kept {h.level} on every link swept, down to {_gbs(h.kept_to)} GB/s."
    else:
        util = k.utilization("after_transfer")
        kept = (f"kept {h.level} down to {_gbs(h.kept_to)} GB/s and" if h.kept_to is not None
                else f"kept {h.level} on none of the links swept and")
        held = (f"That version {kept} fell below it at {h.lost_at / 1e6:.3g} MB/s. At this rate each of the "
                f"{k.prefill_workers} prefill workers must send {k.saturating_bytes_s / 1e6:.3g} MB/s on "
                f"average, so that link was {util:.0%} busy.")
        held += (" Transfers then queue behind each other, and the wait grows without bound once the "
                 "link is over 100%." if util > 1 else
                 " Below 100% the transfers still queue behind each other whenever two come close together.")
    facts["held"] = Fact(h.lead, held, held)
    s_kept = s.kept_to or float("inf")
    h_kept = h.kept_to or float("inf")
    facts["order"] = Fact(
        s_kept > h_kept,
        "Counted in the gap before the second token, the transfer cost more than in TTFT: the "
        "streamed version needed the faster link.",
        "Here holding the first token did not let the split use a slower link than streaming it.")
    def part(m: LinkMode, how: str) -> str:
        if m.lost_at is None:
            return f"kept {m.level} on every link swept with the first token {how}"
        if m.kept_to is None:
            return f"kept {m.level} on none of the links swept with the first token {how}"
        return f"kept {m.level} down to {_gbs(m.kept_to)} GB/s with the first token {how}"
    summary = (f"At {k.rate:.3g} requests per second the split {part(s, 'streamed')}, "
               f"and {part(h, 'held')}.")
    facts["summary"] = Fact(s.lead and h.lead, summary, summary)
    if s.lead and s.lost_at is not None:
        head = (f"When the first token streams at once from the prefill worker, the split lost its lead "
                f"over a link slower than {_gbs(s.kept_to or s.lost_at)} GB/s.")
    elif s.lead:
        head = (f"When the first token streams at once from the prefill worker, the split kept its lead "
                f"on every link swept, down to {_gbs(s.kept_to)} GB/s.")
    elif s.lost_at is not None:
        head = (f"At the rate where the link was tested the split had no lead to lose, and with the "
                f"first token streamed at once its goodput fell on links slower than "
                f"{_gbs(s.kept_to or s.lost_at)} GB/s.")
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
