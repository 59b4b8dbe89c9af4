"""The `labkit bench` plumbing on a tiny model: every figure is computed from its own runs,
records add up, and the logical claims hold (identity with solo runs, paging holds more
sequences than reservation, a prefix is found). Timing claims are checked by the bench
itself on the real model, never here."""

import math

import pytest
import torch

from conftest import make_tiny_llama
from labkit.bench.suite import Bench, Figure, _meets
from labkit.bench.workloads import chat_lengths, poisson_arrivals, text_prompts


@pytest.fixture(scope="module")
def bench():
    model = make_tiny_llama(vocab=97, max_len=1024)
    ids = torch.randint(0, 97, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    return Bench(model, ids, reference=None, quick=True)


def test_targets():
    assert _meets(2.1, ">= 2") and not _meets(1.9, ">= 2")
    assert _meets(0.1, "<= 0.2") and not _meets(0.3, "<= 0.2")


def test_workloads_are_reproducible_and_shaped():
    ids = list(range(1000))
    a, b = text_prompts(ids, 20, 16, 64, seed=5), text_prompts(ids, 20, 16, 64, seed=5)
    assert a == b and all(16 <= len(p) <= 64 for p in a)
    assert all(p == list(range(p[0], p[0] + len(p))) for p in a)  # contiguous slices of the text
    lengths = chat_lengths(500, seed=1, cap=1024)
    assert all(p + o <= 1024 and p >= 4 and o >= 4 for p, o in lengths)
    times = poisson_arrivals(2000, rate=4.0, seed=0)
    assert times == sorted(times) and abs(len(times) / times[-1] - 4.0) < 0.4


def test_batch_figures_and_records(bench):
    figures = bench.batch()
    assert [f.target for f in figures] == [">= 5", ">= 1"]  # no reference: no transformers figure
    same = figures[-1]
    assert same.value == same.baseline == 6 and same.passed
    assert same.details["equal"] + same.details["excused"] == 6
    cont, serial = bench.runs["continuous"], bench.runs["serial"]
    assert cont.output_tokens == serial.output_tokens == 6 * 8
    assert max(serial.running_per_step) == 1 and max(cont.running_per_step) > 1
    assert figures[0].ratio == pytest.approx(cont.tokens_per_s / serial.tokens_per_s)


def test_agreement_with_solo_excuses_only_a_near_tie(bench):
    """A batched request that parts from its solo run is judged by the solo run's own top
    log-probabilities at the divergence: the runner-up within the tolerance is excused; a
    token far below it is not, nor is a run short of tokens."""
    from dataclasses import replace

    from labkit.bench.serving import agreement_with_solo, run_engine
    from labkit.engine.llm_engine import LLMEngine
    from labkit.sampling import SamplingParams

    work = bench.batch_workload()
    config = bench.continuous_config(max_num_seqs=1)
    solo = run_engine(bench.model, work, config, "solo")
    alone = LLMEngine(bench.model, config).generate(
        [work.prompts[0]], SamplingParams(temperature=0.0, max_tokens=work.max_tokens[0], ignore_eos=True, logprobs=20))
    top = alone[0].samples[0].top_logprobs[2]  # step 2's tokens, best first
    gap_second, gap_last = top[0][1] - top[1][1], top[0][1] - top[-1][1]

    def parted(token, keep=None):
        first = solo.records[0]
        ids = first.token_ids[:2] + [token] + first.token_ids[3:]
        return replace(solo, records=[replace(first, token_ids=ids[:keep])] + solo.records[1:])

    assert agreement_with_solo(bench.model, work, solo, solo, config, 0.0).exact == len(work)
    near = agreement_with_solo(bench.model, work, parted(top[1][0]), solo, config, gap_second / 2)
    assert (near.exact, near.excused, near.failed) == (len(work) - 1, 1, 0)
    assert agreement_with_solo(bench.model, work, parted(top[1][0]), solo, config, gap_second / 2.5).failed == 1
    assert agreement_with_solo(bench.model, work, parted(top[-1][0]), solo, config, gap_second / 2).failed == 1
    assert gap_last > gap_second
    assert agreement_with_solo(bench.model, work, parted(top[0][0], keep=4), solo, config, 10.0).failed == 1


def test_ttft_paging_prefix_and_decode(bench):
    t = bench.ttft()
    assert t.details["offered_rps"] == pytest.approx(t.details["capacity_rps"] / 2)
    assert all(r.ttft_s is not None and r.ttft_s >= 0 for r in bench.runs["ttft_static"].records)
    p = bench.paging()
    assert p.baseline == pytest.approx(512 / 128, abs=0.5) and p.ratio > 1.5
    x = bench.prefix()
    assert x.details["prefix_hits"] >= 2 * 64 // 16
    d = bench.decode()
    assert d.value > 0 and math.isnan(d.baseline) and isinstance(d, Figure)


def test_a_figure_that_could_not_run_says_why_and_is_no_miss():
    from labkit.bench.suite import figure

    f = figure("lowbit", "decode vs a peer", 10.0, float("nan"), "tokens/s", float("nan"), ">= 1.25",
               not_run="the peer is not installed")
    assert f.passed is None and f.line().startswith("[NOT_RUN]") and "not installed" in f.line()
    assert figure("lowbit", "x", 1.0, 1.0, "s", 1.3, ">= 1.25").passed is True

