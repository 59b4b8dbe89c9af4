"""The distributed-inference study's arithmetic (fits, cost model, exactness) against closed
forms, and its torchrun micro-benchmark end to end."""

import math

import pytest
import torch

from labkit.experiments import distributed as dx


def test_threads_per_rank_never_ask_for_more_cores_than_there_are():
    assert [dx.threads_per_rank(n, cores=2) for n in (1, 2, 3, 6)] == [2, 1, 1, 1]
    assert [dx.threads_per_rank(n, cores=8) for n in (1, 2, 3, 4)] == [8, 4, 2, 2]


def test_linear_fit_recovers_a_closed_form():
    sizes = [8, 64, 512, 2304, 32_768, 262_144, 4_194_304]
    truth = dx.LinearCost(latency_s=80e-6, bytes_per_s=2.5e9)
    fit = dx.fit_linear_cost(sizes, [truth(b) for b in sizes])
    assert fit.latency_s == pytest.approx(80e-6, rel=1e-9)
    assert fit.bytes_per_s == pytest.approx(2.5e9, rel=1e-9)
    assert fit(1e6) == pytest.approx(80e-6 + 1e6 / 2.5e9)


def test_linear_fit_weights_relative_error():
    # noise of 10-20% on the large messages must not swamp the latency the small ones pin
    # down (an unweighted least-squares fit puts it near 180 us here)
    sizes = [8, 64, 512, 1_048_576, 2_097_152, 4_194_304]
    seconds = [100e-6 + b / 1e9 for b in sizes]
    seconds[3] *= 1.2
    seconds[5] *= 0.9
    fit = dx.fit_linear_cost(sizes, seconds)
    assert fit.latency_s == pytest.approx(100e-6, rel=0.05)
    assert fit.bytes_per_s == pytest.approx(1e9, rel=0.05)


def test_linear_fit_needs_two_sizes():
    with pytest.raises(ValueError):
        dx.fit_linear_cost([64, 64], [1e-4, 1.1e-4])


PROFILE = dx.ComputeProfile(step_s={1: 0.060, 2: 0.030}, head_s={1: 0.012, 2: 0.006})
ALL_REDUCE = dx.LinearCost(100e-6, 1e9)
LAYERS, HIDDEN = 30, 576


def test_tensor_parallel_cost_closed_form():
    one = dx.tensor_parallel_cost(1, PROFILE, ALL_REDUCE, LAYERS, HIDDEN, cores=2)
    assert (one.compute_s, one.comm_s) == (0.030, 0.0)  # one process: the plain model
    comm = 2 * LAYERS * (100e-6 + HIDDEN * 4 / 1e9)
    two = dx.tensor_parallel_cost(2, PROFILE, ALL_REDUCE, LAYERS, HIDDEN, cores=2)
    assert two.compute_s == pytest.approx((0.060 - 0.012) / 2 + 0.012)  # 1 thread, no turns
    assert two.comm_s == pytest.approx(comm)
    three = dx.tensor_parallel_cost(3, PROFILE, ALL_REDUCE, LAYERS, HIDDEN, cores=2)
    assert three.compute_s == pytest.approx(((0.060 - 0.012) / 3 + 0.012) * 1.5)  # 3 on 2 cores
    own = dx.tensor_parallel_cost(3, PROFILE, ALL_REDUCE, LAYERS, HIDDEN, cores=None)
    assert own.compute_s == pytest.approx((0.030 - 0.006) / 3 + 0.006)  # compute / N + head
    assert own.total_s == pytest.approx(own.compute_s + comm)


def test_pipeline_cost_closed_form():
    hop = dx.LinearCost(50e-6, 2e9)
    assert dx.pipeline_cost(1, PROFILE, hop, HIDDEN, cores=2).total_s == 0.030
    four = dx.pipeline_cost(4, PROFILE, hop, HIDDEN, cores=2)
    assert four.compute_s == 0.060  # one stage busy at a time, on one thread
    assert four.comm_s == pytest.approx(3 * (50e-6 + HIDDEN * 4 / 2e9) + 50e-6 + 8 / 2e9)
    assert dx.pipeline_cost(4, PROFILE, hop, HIDDEN, cores=None).compute_s == 0.030


def test_exactness_compares_logits_up_to_the_first_difference():
    ref = dx.Reference([1, 2, 3, 4], torch.zeros(4, 5))
    logits = torch.zeros(4, 5)
    logits[0, 1], logits[2, 0], logits[3, 0] = 1e-5, 2e-5, 9.0
    same = dx.exactness([1, 2, 3, 4], logits[:, :], dx.Reference([1, 2, 3, 4], torch.zeros(4, 5)))
    assert same.identical and same.first_difference is None
    assert same.prompt_logit_diff == pytest.approx(1e-5) and same.max_logit_diff == 9.0
    differs = dx.exactness([1, 2, 7, 4], logits, ref)
    assert not differs.identical and differs.first_difference == 2
    assert differs.max_logit_diff == pytest.approx(2e-5)  # step 3 saw another input: left out
    short = dx.exactness([1, 2], logits[:2], ref)
    assert not short.identical and short.first_difference == 2


@pytest.mark.slow
def test_comm_bench_runs_under_torchrun(tmp_path):
    samples = dx.run_comm_bench(2, [8, 4096], repeats=3, inner=2, warmup=1, workdir=tmp_path)
    assert sorted((s.op, s.nbytes) for s in samples) == [
        ("all_reduce", 8), ("all_reduce", 4096), ("ring_hop", 8), ("ring_hop", 4096)]
    assert all(s.procs == 2 and len(s.seconds) == 3 and s.median > 0 for s in samples)
    assert all(math.isfinite(x) for s in samples for x in s.seconds)


def _run(tokens, logits):
    return dx.RunResult("tensor", 2, "gloo", 1, list(tokens), True, logits, 0.0, [], [], 0.0)


def test_agreement_excuses_a_near_tie_and_reports_it():
    # the library's logits: token 1 ahead of token 2 by 1e-4 at step 1 (a near-tie), wide gaps elsewhere
    ref_logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 3.0001, 3.0], [4.0, 0.0, 0.0]])
    ref = dx.Reference([1, 1, 0], ref_logits)
    same = _run([1, 1, 0], ref_logits + 1e-5)
    flipped = _run([1, 2, 2], ref_logits)        # took the runner-up at the near-tie
    summary = dx.agreement([same, flipped], ref)
    assert summary.ok and summary.exact == 1 and summary.excused == 1
    text = dx.agreement_sentence(summary, 3)
    assert text.startswith("the split model produced the library model's 3 greedy tokens exactly in 1 of 2 runs")
    assert "1 parted from them at a near-tie" in text and "was excused" in text
    assert dx.agreement_sentence(dx.agreement([same], ref), 3).endswith("exactly in the one run")


def test_agreement_fails_a_divergence_no_rounding_explains():
    ref_logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 3.0, 2.0]])
    ref = dx.Reference([1, 1], ref_logits)
    summary = dx.agreement([_run([1, 2], ref_logits)], ref)  # a gap of 1 logit
    assert not summary.ok and summary.failed == 1
    assert "diverged beyond" in dx.agreement_sentence(summary, 2)


def test_measured_cost_reads_the_medians_and_interpolates_between_them():
    cost = dx.measured_cost([2304, 8, 512], [1.0e-3, 7e-5, 2.0e-4])  # any order
    assert cost.nbytes == (8.0, 512.0, 2304.0)
    assert cost(2304) == 1.0e-3 and cost(8) == 7e-5  # a measured size: its median, exactly
    assert cost(1408) == pytest.approx(2.0e-4 + 0.5 * (1.0e-3 - 2.0e-4))  # halfway
    with pytest.raises(ValueError):
        cost(4)  # no extrapolation below the smallest size ...
    with pytest.raises(ValueError):
        cost(4096)  # ... or above the largest
    with pytest.raises(ValueError):
        dx.measured_cost([64, 64], [1e-4, 1.1e-4])


def test_measured_cost_does_not_miss_points_a_relative_fit_misses():
    # flat medians with one cheap small message, as gloo's all-reduce on shared cores gave:
    # the relative-error fit follows the cheap point and sits far below the others
    sizes = [8, 64, 512, 2304, 8192, 2_097_152]
    seconds = [74e-6, 970e-6, 180e-6, 1046e-6, 1166e-6, 2471e-6]
    fit = dx.fit_linear_cost(sizes, seconds)
    assert fit(2304) < 0.5 * 1046e-6
    assert dx.measured_cost(sizes, seconds)(2304) == 1046e-6


def test_bytes_share_prices_bytes_by_the_rise_to_the_largest_message():
    cost = dx.measured_cost([8, 1000, 101_000], [1e-3, 1e-3, 2e-3])
    # 1e-3 s per 100,000 bytes: 1,000 bytes cost 1e-5 s of a 1e-3 s call
    assert cost.bytes_share(1000) == pytest.approx(0.01)
    flat = dx.measured_cost([8, 1000, 101_000], [1e-3, 2e-3, 1.5e-3])  # falls: no byte cost
    assert flat.bytes_share(1000) == 0.0
    with pytest.raises(ValueError):
        cost.bytes_share(101_000)


def test_measured_comm_groups_by_op_and_processes():
    samples = [dx.CommSample("all_reduce", 2, 8, [1e-4, 3e-4, 2e-4]),
               dx.CommSample("all_reduce", 2, 64, [5e-4]),
               dx.CommSample("ring_hop", 2, 8, [2e-5]), dx.CommSample("ring_hop", 2, 64, [3e-5])]
    costs = dx.measured_comm(samples)
    assert set(costs) == {("all_reduce", 2), ("ring_hop", 2)}
    assert costs[("all_reduce", 2)](8) == pytest.approx(2e-4)  # the median of the samples
    assert costs[("ring_hop", 2)](64) == pytest.approx(3e-5)


def test_ring_all_reduce_is_two_n_minus_one_hops_of_a_nth_of_the_message():
    hop = dx.LinearCost(20e-6, 1e9)
    ring = dx.RingAllReduce(hop, 3)
    assert ring(2304) == pytest.approx(4 * (20e-6 + 768 / 1e9))
    assert dx.RingAllReduce(hop, 1)(2304) == 0.0


def test_band_verdict_counts_a_ratio_inside_the_band_as_the_same():
    assert dx.band_verdict(1.0) == "within" and dx.band_verdict(1.4) == "within"
    assert dx.band_verdict(0.7) == "within"  # 1 / 1.5 = 0.67
    assert dx.band_verdict(1.6) == "above" and dx.band_verdict(0.6) == "below"
    assert dx.band_verdict(1.9, factor=2.0) == "within"
    with pytest.raises(ValueError):
        dx.band_verdict(1.0, factor=1.0)


def _timing(mode, procs):
    return {"mode": mode, "processes": procs, "median_ms": 50.0, "comm_ms_per_token": 1.0}


def test_cost_rows_price_a_machine_per_rank_by_the_own_hop_not_the_shared_all_reduce():
    shared_ar = dx.LinearCost(2e-3, 1e9)   # an all-reduce measured on shared cores: slow
    own_hop = dx.LinearCost(20e-6, 1e9)    # a hop between processes with a core each
    fits = {("all_reduce", 3): shared_ar, ("ring_hop", 3): dx.LinearCost(40e-6, 1e9)}
    timing = [_timing("tensor", 3), _timing("pipeline", 3)]
    rows = dx.cost_rows(timing, PROFILE, fits, LAYERS, HIDDEN, cores=2, own_hop=own_hop)
    tp, pp = rows
    assert tp["model_comm_ms"] == pytest.approx(1e3 * 2 * LAYERS * shared_ar(HIDDEN * 4))
    ring = dx.RingAllReduce(own_hop, 3)(HIDDEN * 4)
    assert tp["model_own_comm_ms"] == pytest.approx(1e3 * 2 * LAYERS * ring)
    own_compute = (0.030 - 0.006) / 3 + 0.006
    assert tp["model_own_cores_ms"] == pytest.approx(1e3 * (own_compute + 2 * LAYERS * ring))
    assert pp["model_own_comm_ms"] == pytest.approx(
        1e3 * (2 * own_hop(HIDDEN * 4) + own_hop(dx.TOKEN_BYTES)))
    # without a hop measured on a core of its own, a machine per rank is not priced
    unpriced = dx.cost_rows(timing + [_timing("tensor", 1)], PROFILE, fits, LAYERS, HIDDEN)
    assert all(math.isnan(r["model_own_cores_ms"]) for r in unpriced[:2])
    assert unpriced[2]["model_own_cores_ms"] == pytest.approx(30.0)  # one process: no comm
