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
# a 64-token mixed step just fits the bound: both pools meet 90% of requests up to the same
# swept rate and cross 90% within 1% of each other between it and the next (a tie by the
# interpolated crossings, not only by the grid; 0.45e-3 per prompt token with 1.0e-3 per
# sequence tied on the grid but crossed 10% apart)
TIE = dg.StepTime(15e-3, 0.46e-3, 1.2e-3)
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
    cross_split, cross_col = g.crossing_split, g.crossing_colocated
    assert {"split": cross_split > cross_col * (1 + dx.RATE_MARGIN),
            "tie": max(cross_split, cross_col) <= min(cross_split, cross_col) * (1 + dx.RATE_MARGIN),
            "colocated": cross_col > cross_split * (1 + dx.RATE_MARGIN)}[outcome]
    # a crossing lies at or above its pool's best swept rate and below the next swept rate,
    # so a win on the crossings cannot be a loss on the grid
    assert {"split": best_split >= best_col, "tie": True,
            "colocated": best_split <= best_col}[outcome]
    for system in g.systems:
        best, cross = g.best[system.name], g.crossings[system.name]
        later = [r for r in g.rates if r > best]
        assert best <= cross and (not later or cross < min(later))
    head = v.facts["goodput_headline"]
    assert head.holds == (outcome == "split")
    assert ("higher rate than either colocated pool" in head.text) == (outcome == "split")
    assert ("same rate" in head.text) == (outcome == "tie")
    assert f"{cross_split:.3g}" in head.text and f"{cross_col:.3g}" in head.text
    assert v.facts["goodput_source_verdict"].holds == (outcome == "split")
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
    assert f["goodput_col512_trend"].holds == (high < low - dx.LEAD_MARGIN)
    # TTFT is compared with the pool that competed, at a rate where one of the two held the SLO
    better = g.best_colocated_system
    rate = max(g.best[g.split.name], g.best[better.name]) or g.rates[0]
    at = g.at(rate)
    ts, tc = at[g.split.name]["ttft_p50_s"], at[better.name]["ttft_p50_s"]
    assert f"At {rate:.3g} requests per second" in f["goodput_ttft"].text
    assert f["goodput_ttft"].holds == (ts > tc * (1 + dx.TTFT_MARGIN))
    assert f"{ts:.2f} s" in f["goodput_ttft"].text and f"{tc:.2f} s" in f["goodput_ttft"].text
    assert "half" not in f["goodput_ttft"].text   # the split's shape is read, not typed
    (gs, _), (gc, _) = g.peak_goodput(g.split), g.peak_goodput(better)
    assert f["goodput_peak"].holds == (gs > gc * (1 + dx.RATE_MARGIN))


def test_the_link_study_handles_a_lead_and_no_lead(run):
    outcome, v = run
    k = v.link
    assert k.rate in v.goodput.rates and k.bandwidths and len(k.rows) == 2 * len(DECADES)
    for first, mode in k.modes.items():
        assert mode.kept_to is not None           # the fastest link keeps its own level
        assert mode.lost_at is None or mode.lost_at < mode.kept_to
        assert mode.lead == (mode.fast_goodput > k.floor + k.margin_rps)
        if mode.behind_at is not None:   # behind: below the floor by more than the margin
            assert k.row(first, mode.behind_at)["goodput_rps"] < k.floor - k.margin_rps
            if mode.lead:                # then it fell behind only after losing the lead
                assert mode.lost_at is not None and mode.behind_at <= mode.lost_at
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


@pytest.mark.parametrize("read", [None, 30.0, 60.0])
@pytest.mark.parametrize("llc", [None, 32 << 20, 300 << 20, 1 << 30])
def test_step_facts_read_true_for_any_cache_and_any_costs(llc, read):
    weights = 538_000_000
    costs = dg.StepTime(14.8e-3, 0.68e-3, 1.1e-3)
    facts = dx.step_facts((1.69e-3, 0.72e-3), (16, 512), (13.9e-3, 1.57e-3), (1, 32), costs,
                          weights, llc, read)
    text = facts["base"].text
    in_cache = llc is not None and weights <= llc
    # memory-bound only against a measured read: 38.7 GB/s is 129% of 30 GB/s, 65% of 60
    bound = not in_cache and read is not None and weights / 13.9e-3 / 1e9 / read >= 0.8
    assert facts["base"].holds == bound == (read == 30.0 and not in_cache)
    assert ("the step is memory-bound" in text) == bound
    assert ("can hold those weights" in text) == in_cache
    assert ("cannot say" in text) == (read is None and not in_cache)
    # the model's miss on the measured one-sequence step is stated, not hidden
    assert f"{costs(0, 1) / 13.9e-3 - 1:+.0%}" in text and "93% base" in text
    # a 512-token prefill reads the weights at 1.5 GB/s: never near 30 or 60 GB/s
    assert facts["prefill_read"].holds and "1.5 GB/s" in facts["prefill_read"].text
    assert facts["decode_fall"].holds
    flat = dg.StepTime(2e-3, 0.5e-3, 3e-3)    # little base: a step is mostly per-sequence work
    facts = dx.step_facts((2.5e-3, 0.5e-3), (16, 512), (5e-3, 3.2e-3), (1, 32), flat, weights, llc,
                          read)
    # (its 5 ms one-sequence step would read the weights at 108 GB/s: "memory-bound" against
    # either read rate, which is what the read rate decides, not the base share)
    assert facts["base"].holds == (read is not None and not in_cache)
    assert not facts["decode_fall"].holds
    assert "What each sequence adds matters here too" in facts["base"].text
    assert "no more than prefill" in facts["decode_fall"].text
    assert all(math.isfinite(x) for x in (flat.base_s, flat.prefill_token_s))


def test_decode_fit_facts_name_the_misses_and_the_kernel_side():
    residuals = {1: 0.22, 2: 0.005, 4: -0.21, 8: -0.006, 16: 0.0}
    fact = dx.decode_fit_facts(residuals, 4)["fit_decode"]
    assert fact.holds
    assert "22% above the measured step at D = 1" in fact.text
    assert "21% below the measured step at D = 4" in fact.text
    assert "D = 8" not in fact.text and "D = 1 and 4 lie on the C kernel's side" in fact.text
    quiet = dx.decode_fit_facts({1: 0.05, 8: -0.02}, 0)["fit_decode"]
    assert not quiet.holds and "within 10%" in quiet.text and "No step here took" in quiet.text
    wide = dx.decode_fit_facts({1: 0.02, 8: 0.15}, 4)["fit_decode"].text
    assert "at D = 8" in wide and "C kernel's side" not in wide


def test_crossing_rate_interpolates_between_the_swept_rates():
    def rows(points):
        return [{"system": "s", "rate_rps": r, "attainment": a} for r, a in points]
    # chapter 29's recorded sweep near the crossings: both met 90% up to 7.03 requests/s (a
    # tie on the grid), but the split crosses at 7.43 and the 64-token pool at 7.08
    split = rows([(6.15, 0.991), (7.03, 0.944), (7.91, 0.848)])
    small = rows([(6.15, 0.964), (7.03, 0.908), (7.91, 0.761)])
    assert dg.best_rate(split, "s") == dg.best_rate(small, "s") == 7.03
    cs, cc = dx.crossing_rate(split, "s"), dx.crossing_rate(small, "s")
    assert cs == pytest.approx(7.03 + 0.88 * 0.044 / 0.096)
    assert cc == pytest.approx(7.03 + 0.88 * 0.008 / 0.147)
    assert dx.compare_rates(cs, cc) == 1 and dx.compare_rates(cc, cs) == -1
    assert dx.compare_rates(7.0, 7.2) == 0 and dx.compare_rates(7.0, 7.3) == -1   # 3% margin
    assert dx.crossing_rate(rows([(1, 0.95), (2, 0.93)]), "s") == 2   # beyond the sweep
    assert dx.crossing_rate(rows([(1, 0.5), (2, 0.3)]), "s") == 0


def _row(system, rate, met, ttft, gap):
    return {"system": system, "rate_rps": rate, "requests": 1000, "slo_met": met,
            "attainment": met / 1000, "goodput_rps": rate * met / 1000, "ttft_p50_s": ttft,
            "max_itl_p50_s": gap}


def test_the_recorded_grid_tie_reads_as_the_split_ahead_and_names_the_ttft_trade():
    """Chapter 29's recorded full-profile rows (SLO met of 1,000, median TTFT, median longest
    gap) at three rates: a tie on the grid of rates, the split ahead by the crossings, and
    the 64-token pool paying for its gaps in TTFT at the rate where both held the SLO."""
    step = dg.StepTime(31.05e-3, 0.685e-3, 1.152e-3)
    systems = (dg.Colocated(4), dg.Colocated(4, dg.Batching(64)),
               dg.Disaggregated(2, 2, kv_bytes_per_token=KV))
    table = {6.153: ((73, 0.2743, 0.3839), (964, 0.5898, 0.0786), (991, 0.3162, 0.0683)),
             7.032: ((50, 0.2876, 0.3853), (908, 0.71, 0.08), (944, 0.3816, 0.0719)),
             7.911: ((35, 0.317, 0.3872), (761, 0.94, 0.0814), (848, 0.4616, 0.0769))}
    rows = [_row(s.name, rate, *v) for rate, vs in table.items() for s, v in zip(systems, vs)]
    g = dx.GoodputStudy(step, dg.scaled_slo(step), 287.0, 17.58, list(table), systems, rows,
                        1000, dict(LENGTHS))
    assert g.best_split == g.best_colocated == 7.032
    assert g.outcome == "split" and g.best_colocated_system is systems[1]
    facts = dx.goodput_facts(g)
    head = facts["headline"]
    assert head.holds and "7.43" in head.text and "7.08" in head.text and "5% apart" in head.text
    ttft = facts["ttft"]
    assert not ttft.holds and "64-token steps pays in TTFT" in ttft.text
    assert "At 7.03 requests per second" in ttft.text
    assert "0.71 s" in ttft.text and "0.38 s" in ttft.text and "80 ms" in ttft.text
    assert facts["source_verdict"].holds and " held " in facts["source_verdict"].text
    assert facts["peak"].holds   # 6.71 against 6.39 requests/s of goodput
    assert facts["col512_trend"].holds and "At 7.91 requests per second" in facts["col512_trend"].text


def test_a_link_lead_counts_only_beyond_the_margin():
    """Chapter 29's recorded link sweep at 6.15 requests/s against a colocated floor of 964 of
    1,000 requests: streamed, 985 on the fastest link (a lead of 21 requests, beyond 2%), 955
    on the next (level), 907 after (behind); held, above the floor by more than 2% on all."""
    rate = 6.153
    floor = rate * 0.964
    bws = (4.31e9, 2.42e9, 1.36e9, 0.77e9)

    def rows(first, mets, gaps=(0.0693, 0.073, 0.0767, 0.0846),
             transfers=(0.0031, 0.0055, 0.0097, 0.0172)):
        return [{"first_token": first, "bandwidth_bytes_s": bw, "goodput_rps": rate * m / 1000,
                 "max_itl_p50_s": g, "transfer_p50_s": t}
                for bw, m, g, t in zip(bws, mets, gaps, transfers)]
    sweep = rows("prefill", (985, 955, 907, 770)) + rows("after_transfer", (997, 993, 995, 992))
    modes = dx.link_modes(sweep, floor, dx.LEAD_MARGIN * rate)
    s, h = modes["prefill"], modes["after_transfer"]
    assert s.lead and (s.kept_to, s.lost_at, s.behind_at) == (4.31e9, 2.42e9, 1.36e9)
    assert h.lead and h.lost_at is None and h.behind_at is None
    k = dx.LinkStudy(rate, True, [], floor, 13.2e6, 136e6, list(bws), sweep, modes, 0.097, 2)
    facts = dx.link_facts(k)
    streamed = facts["streamed"].text
    assert "only on the fastest link swept, 4.3 GB/s" in streamed
    assert "At 2.4 GB/s it was level" in streamed and "from 1.4 GB/s down it fell behind" in streamed
    assert "69 ms of the 97 ms" in streamed and "5.5 ms" in streamed
    assert "on every link swept, down to 770 MB/s" in facts["held"].text
    assert "GB/s" not in facts["held"].text      # one unit per range, not 0.77 GB/s
    # 15 requests more than the floor is inside the margin: no lead to lose
    narrow = rows("prefill", (979, 975, 960, 950)) + rows("after_transfer", (979,) * 4)
    assert not dx.link_modes(narrow, floor, dx.LEAD_MARGIN * rate)["prefill"].lead


def test_injected_step_costs_from_the_environment(monkeypatch):
    monkeypatch.delenv(dx.STEP_COSTS_ENV, raising=False)
    assert dx.injected_step_costs() is None
    monkeypatch.setenv(dx.STEP_COSTS_ENV, "0.0148, 0.00068,0.0011")
    assert dx.injected_step_costs() == dg.StepTime(0.0148, 0.00068, 0.0011)
    assert dx.injected_step_costs("") is None
    for bad in ("1,2", "a,b,c", "0.01,-1,0.1"):
        with pytest.raises(ValueError):
            dx.injected_step_costs(bad)
