"""Chapter 15's analysis helpers on hand-made records with known answers, and the load
sweep plumbing on a tiny random model."""

import math

import pytest
import torch

from conftest import make_tiny_llama
from labkit.experiments import batching as b
from labkit.bench.serving import RequestRecord, RunResult
from labkit.bench.workloads import Workload, text_prompts
from labkit.engine.llm_engine import EngineConfig
from labkit.engine.scheduler import SchedulerConfig


def rec(i, arrival, first, finish, out=11, prompt=10):
    return RequestRecord(i, prompt, out, arrival, first, finish)


def test_latencies():
    r = rec(0, 1.0, 1.5, 3.5, out=11)
    assert b.ttft_s(r) == pytest.approx(0.5)
    assert b.tpot_s(r) == pytest.approx(0.2)        # 2.0 s over 10 tokens after the first
    assert b.e2e_s(r) == pytest.approx(2.5)
    assert b.tpot_s(rec(1, 0, 1, 1, out=1)) == 0.0
    assert math.isinf(b.ttft_s(rec(2, 0, None, 1, out=0)))
    assert b.quantile([3, 1, 2], 0.5) == 2 and b.quantile([0, 10], 0.99) == pytest.approx(9.9)
    assert math.isnan(b.quantile([], 0.5))


def test_goodput_counts_requests_meeting_both_objectives():
    slo = b.SLO(ttft_s=1.0, tpot_s=0.25)
    records = [rec(0, 0, 0.5, 2.5),    # ttft 0.5, tpot 0.2: met
               rec(1, 0, 1.5, 3.5),    # ttft 1.5: missed
               rec(2, 0, 0.2, 4.2),    # tpot 0.4: missed
               rec(3, 0, 1.0, 3.5)]    # ttft 1.0, tpot 0.25: met (bounds inclusive)
    g = b.goodput(records, wall_s=4.0, slo=slo)
    assert (g.met, g.requests) == (2, 4) and g.fraction == 0.5 and g.rps == pytest.approx(0.5)
    assert "TTFT <= 1 s" in slo.describe() and "250 ms" in slo.describe()
    with pytest.raises(ValueError):
        b.goodput(records, 0.0, slo)


def test_padding_waste_known_answer():
    # batch 1: 3 sequences with outputs 2, 4, 4 steps -> running after steps 3, 2, 2, 0
    # batch 2: 2 sequences with outputs 3, 3 -> 2, 2, 0
    running = [3, 2, 2, 0, 2, 2, 0]
    w = b.padding_waste(running)
    assert w.batches == [3, 2] and w.steps == [4, 3]
    assert w.wasted == (0 + 1 + 1) + 0 == 2
    assert w.wasted == b.padding_waste_from_lengths([[2, 4, 4], [3, 3]])
    assert w.held == 3 * 4 + 2 * 3 and w.fraction == pytest.approx(2 / 18)
    assert b.padding_waste([]).fraction == 0.0


def test_group_summary_and_jain():
    records = [rec(0, 0, 0.1, 1.0), rec(1, 0, 0.3, 1.0), rec(2, 0, 2.0, 3.0)]
    g = b.group_summary(records, lambda r: "long" if r.request == 2 else "short")
    assert g["short"]["requests"] == 2 and g["short"]["ttft_median_s"] == pytest.approx(0.2)
    assert g["long"]["ttft_max_s"] == pytest.approx(2.0) and g["long"]["e2e_max_s"] == pytest.approx(3.0)
    assert b.jain_index([1, 1, 1]) == pytest.approx(1.0)
    assert b.jain_index([1, 0, 0, 0]) == pytest.approx(0.25)


def test_workload_helpers():
    outs = b.varied_outputs(50, 4, 8, seed=1)
    assert outs == b.varied_outputs(50, 4, 8, seed=1) and min(outs) >= 4 and max(outs) <= 8
    prompts, is_long = b.mixed_prompts([[1]] * 6, [[2, 2]] * 2, every=3)
    assert len(prompts) == 8 and sum(is_long) == 2 and is_long[1] and is_long[4]
    assert all((len(p) == 2) == l for p, l in zip(prompts, is_long))
    w = b.with_arrivals(Workload([[1], [2]], [3, 3]), rate=2.0, seed=0)
    slow = b.with_arrivals(Workload([[1], [2]], [3, 3]), rate=1.0, seed=0)
    assert w.arrivals == pytest.approx([t / 2 for t in slow.arrivals])


def test_summarize():
    run = RunResult("x", 4.0, [rec(0, 0, 0.5, 2.5), rec(1, 0, 1.5, 3.5)], [2, 2, 0])
    row = b.summarize(run, b.SLO(), load=0.5)
    assert row["load"] == 0.5 and row["slo_met"] == 1 and row["goodput_rps"] == pytest.approx(0.25)
    assert row["ttft_median_s"] == pytest.approx(1.0) and row["tokens_per_s"] == pytest.approx(22 / 4)


def test_sweep_plumbing_on_tiny_model():
    model = make_tiny_llama(vocab=97, max_len=256)
    ids = torch.randint(0, 97, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    work = Workload(text_prompts(ids, 4, 4, 12, seed=0), b.varied_outputs(4, 2, 5, seed=0))
    systems = {"continuous": EngineConfig(kv_cache_tokens=1024),
               "static": EngineConfig(kv_cache_tokens=1024, scheduler=SchedulerConfig(
                   batching="static", static_batch_size=2, chunked_prefill=False))}
    cap, run = b.capacity(model, work, systems["continuous"])
    assert cap > 0 and len(run.records) == 4 and run.output_tokens == sum(work.max_tokens)
    points = b.load_sweep(model, work, cap, [0.5, 1.0], systems, seed=3)
    assert [(p.load, p.system) for p in points] == [(0.5, "continuous"), (0.5, "static"),
                                                     (1.0, "continuous"), (1.0, "static")]
    assert {p.repeat for p in points} == {0}
    assert points[0].rate == pytest.approx(cap / 2)
    for p in points:
        assert [r.output_tokens for r in p.run.records] == work.max_tokens
        assert all(b.ttft_s(r) >= 0 for r in p.run.records)
    static = [p for p in points if p.system == "static"]
    for p in static:
        w = b.padding_waste(p.run.running_per_step)
        assert max(w.batches) <= 2 and sum(w.batches) == 4
        assert w.wasted >= 0 and w.held == sum(s * n for s, n in zip(w.batches, w.steps))


# -- the chapter's verdicts on TTFT ------------------------------------------------------------

def test_lower_or_higher_follows_the_interval():
    from labkit.experiments.batching import lower_or_higher, ttft_comparison

    fast, slow = [0.10, 0.11, 0.12, 0.10, 0.11], [0.30, 0.31, 0.29, 0.32, 0.30]
    assert lower_or_higher(ttft_comparison(fast, slow)).startswith("lower")
    assert lower_or_higher(ttft_comparison(slow, fast)).startswith("higher")
    noisy_a, noisy_b = [0.1, 0.3, 0.2, 0.25, 0.15], [0.12, 0.28, 0.21, 0.24, 0.16]
    assert lower_or_higher(ttft_comparison(noisy_a, noisy_b)).startswith("within the noise")
    higher = lower_or_higher(ttft_comparison(slow, fast))
    low, high = (float(x) for x in higher.split("interval ")[1].rstrip(")").split("-"))
    assert 1 < low < high  # the interval is of the same ratio as the number before it


def test_ttft_verdict_refuses_too_few_requests():
    from labkit.experiments.batching import ttft_verdict

    assert ttft_verdict([0.1], [0.2, 0.3, 0.4]).startswith("not compared (1 request(s)")
    assert ttft_verdict([0.1, 0.11, 0.12], [0.3, 0.31, 0.32]).startswith("lower")


def test_a_small_group_is_compared_request_by_request_without_an_interval():
    from labkit.experiments.batching import MIN_INTERVAL_REQUESTS, paired_verdict, ttft_verdict

    slow, fast = [0.4, 0.9, 1.2, 2.0], [0.2, 0.3, 0.6, 0.5]
    small = ttft_verdict(slow, fast)
    # 4 requests: each one's ratio, no bootstrap "95% interval" of a median of 4
    assert small == paired_verdict(slow, fast) and "interval" not in small
    assert small.startswith("higher for each of the 4 requests")
    assert "2.00-4.00 times" in small                      # ratios 2, 3, 2, 4
    assert paired_verdict(fast, slow).startswith("lower for each of the 4 requests")
    assert "2.00-4.00 times" in paired_verdict(fast, slow)
    # one request going the other way: no direction is claimed
    mixed = paired_verdict([0.4, 0.9, 1.2, 0.4], fast)
    assert mixed.startswith("higher for some of the 4 requests and not for others")
    # the pairing is by position: the same values in another order are another verdict
    assert paired_verdict([0.4, 0.9, 1.2, 2.0], [0.5, 0.3, 0.6, 0.2]).startswith("higher for some")
    with pytest.raises(ValueError):
        paired_verdict([0.1, 0.2, 0.3], [0.1, 0.2])
    # small groups of different sizes cannot be paired
    assert ttft_verdict([0.1, 0.2, 0.3], [0.2, 0.3, 0.4, 0.5]).startswith("not compared (3 and 4")
    # from MIN_INTERVAL_REQUESTS on, the bootstrap interval of the medians
    n = MIN_INTERVAL_REQUESTS
    large = ttft_verdict([0.1 + 0.001 * i for i in range(n)], [0.3 + 0.001 * i for i in range(n)])
    assert large.startswith("lower (") and "95% interval" in large


def test_group_ttfts_keeps_request_order_and_group():
    from types import SimpleNamespace

    from labkit.experiments.batching import group_ttfts

    records = [SimpleNamespace(request=i, arrival_s=0.0, first_token_s=0.1 * (i + 1))
               for i in (2, 0, 1)]
    assert group_ttfts(records, lambda r: "even" if r.request % 2 == 0 else "odd", "even") \
        == pytest.approx([0.1, 0.3])


def test_times_phrase_and_range_words():
    from labkit.experiments.batching import against_range, times_phrase

    assert times_phrase(3.0, 1.0) == "3.0 times as long"
    assert times_phrase(1.0, 4.0) == "4.0 times shorter"
    assert against_range(10, 17, 27) == "smaller than the source's"
    assert against_range(30, 17, 27) == "larger than the source's"
    assert against_range(20, 17, 27) == "within the source's range"


# -- repeats of the load sweep ------------------------------------------------------------------

def test_repeats_draw_new_arrivals_and_every_system_meets_the_same_ones():
    seen = []

    def runner(model, work, config, name):
        seen.append((name, tuple(work.arrivals)))
        return name

    points = b.load_sweep(None, Workload([[1], [2], [3]], [2, 2, 2]), 2.0, [0.5, 1.0],
                          {"a": None, "b": None}, seed=7, runner=runner, repeats=2)
    assert [(p.repeat, p.load, p.system) for p in points] == [
        (r, load, s) for r in (0, 1) for load in (0.5, 1.0) for s in "ab"]
    arrivals = [a for _, a in seen]
    assert arrivals[0] == arrivals[1] and arrivals[4] == arrivals[5]  # same for both systems
    assert arrivals[0] != arrivals[4]  # a new pattern in the second repeat
    with pytest.raises(ValueError):
        b.load_sweep(None, Workload([[1]], [2]), 1.0, [1.0], {}, repeats=0)


def test_ratio_spread_pairs_systems_within_each_repeat():
    rows = [{"load": 0.3, "repeat": r, "system": s, "ttft": t}
            for r, (st, ct) in enumerate([(0.6, 0.1), (0.9, 0.1), (0.8, 0.2)])
            for s, t in (("static", st), ("continuous", ct))]
    rows.append({"load": 1.0, "repeat": 0, "system": "static", "ttft": 5.0})
    got = b.ratio_spread(rows, "ttft", "static", "continuous", 0.3)
    assert (got.low, got.median, got.high, got.runs) == pytest.approx((4.0, 6.0, 9.0, 3))
    assert got.range_text("{:.0f}") == "4-9 over 3 runs"


def test_waited_phrase_claims_a_direction_only_when_every_run_agrees():
    assert b.waited_phrase(b.spread([5.0, 6.0, 7.0])) == "6.0 times as long (5.0-7.0 over 3 runs)"
    assert b.waited_phrase(b.spread([0.5, 0.25, 0.4])).startswith("2.5 times shorter (2.0-4.0")
    assert b.waited_phrase(b.spread([0.9, 1.3, 1.1])).startswith(
        "no different beyond the run-to-run spread")
    assert "one run" in b.waited_phrase(b.spread([3.0]))


def test_a_system_named_in_only_at_runs_only_at_its_loads_beside_the_others():
    seen = []

    def runner(model, work, config, name):
        seen.append((name, tuple(work.arrivals)))
        return name

    points = b.load_sweep(None, Workload([[1], [2], [3]], [2, 2, 2]), 2.0, [0.5, 1.0],
                          {"a": None, "b": None, "c": None}, seed=7, runner=runner, repeats=2,
                          only_at={"c": [1.0]})
    assert [(p.repeat, p.load, p.system) for p in points] == [
        (0, 0.5, "a"), (0, 0.5, "b"), (0, 1.0, "a"), (0, 1.0, "b"), (0, 1.0, "c"),
        (1, 0.5, "a"), (1, 0.5, "b"), (1, 1.0, "a"), (1, 1.0, "b"), (1, 1.0, "c")]
    assert seen[2][1] == seen[4][1]  # c meets the arrivals a and b met at that load
    with pytest.raises(ValueError):
        b.load_sweep(None, Workload([[1]], [2]), 1.0, [1.0], {"a": None}, only_at={"z": [1.0]})


def test_capacities_interleave_every_system_with_all_requests_queued():
    seen = []

    def runner(model, work, config, name):
        seen.append((name, work.arrivals))
        return name

    runs = b.capacities(None, Workload([[1], [2]], [2, 2], [0.0, 5.0]), {"a": 1, "b": 2}, 3,
                        runner=runner)
    assert [n for n, _ in seen] == ["a", "b"] * 3
    assert all(not arrivals for _, arrivals in seen)  # queued at once: no arrival times
    assert runs == {"a": ["a"] * 3, "b": ["b"] * 3}
    with pytest.raises(ValueError):
        b.capacities(None, Workload([[1]], [2]), {"a": 1}, 0, runner=runner)


def test_runs_comparison_takes_one_value_per_run_and_keeps_the_direction():
    rows = [{"load": 1.0, "repeat": r, "system": s, "ttft": t}
            for r, (slow, fast) in enumerate([(2.0, 1.0), (2.2, 1.1), (1.9, 0.9), (2.1, 1.0)])
            for s, t in (("static", slow), ("continuous", fast))]
    rows.append({"load": 0.5, "repeat": 0, "system": "static", "ttft": 100.0})  # another load
    got = b.runs_comparison(rows, "ttft", "continuous", "static", 1.0)
    assert got.samples_a == got.samples_b == 4
    assert got.ratio == pytest.approx(2.05 / 1.0) and got.verdict == "faster"
    assert b.lower_or_higher(got).startswith("lower")
    assert b.runs_comparison(rows, "ttft", "static", "continuous", 1.0).verdict == "slower"
    mixed = [dict(row, ttft=1.0 + 0.1 * (row["repeat"] % 2) * (row["system"] == "static"))
             for row in rows if row["load"] == 1.0]
    assert b.runs_comparison(mixed, "ttft", "continuous", "static", 1.0).verdict == "within the noise"
