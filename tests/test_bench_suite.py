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
    cont, serial = bench.runs["continuous"], bench.runs["serial"]
    assert cont.output_tokens == serial.output_tokens == 6 * 8
    assert max(serial.running_per_step) == 1 and max(cont.running_per_step) > 1
    assert figures[0].ratio == pytest.approx(cont.tokens_per_s / serial.tokens_per_s)


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

