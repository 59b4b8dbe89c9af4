"""Chapter 29's verdict logic on injected step costs: which pool keeps the SLO to the higher
rate is a fact about the machine, so the chapter's sentences and every later step must hold
for each outcome (colocated wins, ties, loses), with no crash."""

import math

import pytest

from labkit.experiments import disaggregation as dx
from labkit.sim import disaggregation as dg

LENGTHS = dict(prompt_median=256, output_median=64, sigma=0.8, cap=1024)
LOADS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]   # the chapter's ci profile
DECADES = [1.5, 0.5, -0.5, -1.5]
KV = dg.kv_bytes_per_token(30, 3, 64, 4)

# (base, per prompt token, per decoding sequence) in seconds
SPLIT_WINS = dg.StepTime(14.8e-3, 0.68e-3, 1.1e-3)   # the AVX2 EPYC the book was recorded on
TIE = dg.StepTime(15e-3, 0.45e-3, 1.0e-3)            # a 64-token mixed step just fits the bound
COLOCATED_WINS = dg.StepTime(15e-3, 0.3e-3, 1.0e-3)  # cheaper prompt tokens: it fits with room
CASES = {"split": SPLIT_WINS, "tie": TIE, "colocated": COLOCATED_WINS}


@pytest.fixture(scope="module", params=list(CASES))
def run(request):
    outcome = request.param
    return outcome, dx.verdicts(CASES[outcome], KV, loads=LOADS, requests=120, lengths=LENGTHS,
                                link_decades=DECADES)


def test_each_step_model_gives_its_outcome_and_a_true_headline(run):
    outcome, v = run
    g = v.goodput
    assert g.outcome == outcome
    best_split, best_col = g.best_split, g.best_colocated
    assert {"split": best_split > best_col, "tie": best_split == best_col,
            "colocated": best_split < best_col}[outcome]
    head = v.facts["goodput_headline"]
    assert head.holds == (outcome == "split")
    assert ("higher rate than either colocated pool" in head.text) == (outcome == "split")
    assert ("same rate" in head.text) == (outcome == "tie")
    assert ("higher rate than the split" in head.text) == (outcome == "colocated")
    # the best rates in words carry the numbers the sweep found
    assert dx.rate_phrase(best_split, g.rates) == v.facts["goodput_disagg_phrase"].text
    assert f"{best_split:.3g}" in v.facts["goodput_disagg_phrase"].text


def test_every_fact_is_a_sentence_without_a_missing_number(run):
    _, v = run
    for name, fact in v.facts.items():
        for text in (fact.text,):
            assert text.strip(), name
            assert "None" not in text and "nan" not in text and "inf" not in text, (name, text)


def test_the_comparisons_the_prose_reads_match_the_rows(run):
    _, v = run
    g, f = v.goodput, v.facts
    bound = g.slo.itl_s
    for key, system in (("goodput_mixed_512", g.colocated[0]), ("goodput_mixed_small", g.colocated[1])):
        above = g.step(system.batching.max_batched_tokens, 1) > bound
        assert f[key].holds == above and ("above" in f[key].text) == above
    col = g.colocated[0].name
    low, high = g.at(g.rates[0])[col]["attainment"], g.at(g.rates[-1])[col]["attainment"]
    assert f["goodput_col512_trend"].holds == (high < low)
    at = g.at(g.rates[-1])
    assert f["goodput_ttft"].holds == (at[g.split.name]["ttft_p50_s"] > at[col]["ttft_p50_s"])


def test_the_link_study_handles_a_lead_and_no_lead(run):
    outcome, v = run
    k = v.link
    assert k.rate in v.goodput.rates and k.bandwidths and len(k.rows) == 2 * len(DECADES)
    for first, mode in k.modes.items():
        assert mode.kept_to is not None           # the fastest link keeps its own level
        assert mode.lost_at is None or mode.lost_at < mode.kept_to
        assert mode.lead == (mode.fast_goodput > k.floor)
        if mode.lost_at is not None:
            assert k.lost_ms(first) > 0 and k.utilization(first) > 0
    streamed = v.facts["link_streamed"].text
    assert ("had no lead to lose" in streamed) == (not k.modes["prefill"].lead)
    if outcome == "split":  # where the split wins at the fast link, it had a lead to lose
        assert k.modes["prefill"].lead and "lost its lead" in v.facts["link_headline"].text
    else:
        assert not k.modes["prefill"].lead


def test_rate_phrase_is_true_at_both_ends_of_the_sweep():
    rates = [0.5, 1.0, 2.0]
    assert dx.rate_phrase(0.0, rates) == "at no rate swept (not even 0.5 requests per second)"
    assert dx.rate_phrase(0.5, rates).startswith("only at the lowest rate swept")
    assert dx.rate_phrase(2.0, rates) == "up to 2 requests per second"


def test_kept_link_strict_and_not():
    rows = [{"first_token": "prefill", "bandwidth_bytes_s": b, "goodput_rps": g}
            for b, g in ((1e10, 2.0), (1e9, 2.0), (1e8, 1.5), (1e7, 2.0))]
    assert dx.kept_link(rows, "prefill", 1.0, strict=True) == (1e7, None)
    assert dx.kept_link(rows, "prefill", 2.0, strict=False) == (1e9, 1e8)
    assert dx.kept_link(rows, "prefill", 2.0, strict=True) == (None, 1e10)


@pytest.mark.parametrize("llc", [None, 32 << 20, 300 << 20, 1 << 30])
def test_step_facts_read_true_for_any_cache_and_any_costs(llc):
    weights = 538_000_000
    memory_bound = dg.StepTime(14.8e-3, 0.68e-3, 1.1e-3)
    facts = dx.step_facts((1.69e-3, 0.72e-3), (16, 512), (13.9e-3, 1.57e-3), (1, 32), memory_bound,
                          weights, llc)
    assert facts["base"].holds and facts["decode_fall"].holds
    in_cache = llc is not None and weights <= llc
    assert ("memory-bound" in facts["base"].text) == (not in_cache)
    assert ("can hold those weights" in facts["base"].text) == in_cache
    flat = dg.StepTime(2e-3, 0.5e-3, 3e-3)    # little base: a step is mostly per-sequence work
    facts = dx.step_facts((2.5e-3, 0.5e-3), (16, 512), (5e-3, 3.2e-3), (1, 32), flat, weights, llc)
    assert not facts["base"].holds and not facts["decode_fall"].holds
    assert "less than where reading" in facts["base"].text
    assert "no more than prefill" in facts["decode_fall"].text
    assert all(math.isfinite(x) for x in (flat.base_s, flat.prefill_token_s))


def test_injected_step_costs_from_the_environment(monkeypatch):
    monkeypatch.delenv(dx.STEP_COSTS_ENV, raising=False)
    assert dx.injected_step_costs() is None
    monkeypatch.setenv(dx.STEP_COSTS_ENV, "0.0148, 0.00068,0.0011")
    assert dx.injected_step_costs() == dg.StepTime(0.0148, 0.00068, 0.0011)
    assert dx.injected_step_costs("") is None
    for bad in ("1,2", "a,b,c", "0.01,-1,0.1"):
        with pytest.raises(ValueError):
            dx.injected_step_costs(bad)
