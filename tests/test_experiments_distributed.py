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
