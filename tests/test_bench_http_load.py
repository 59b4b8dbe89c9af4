"""The HTTP load generator's arithmetic against closed forms, and `labkit bench serve` end to end."""

from __future__ import annotations

import numpy as np
import pytest

from labkit.bench.http_load import HttpRecord, parse_server_timing, percentiles, summarize


def test_server_timing_headers_are_read_in_milliseconds():
    assert parse_server_timing("read;dur=0.125, parse;dur=2, queue;dur=10.5") == \
        {"read": 0.125, "parse": 2.0, "queue": 10.5}
    assert parse_server_timing(None) == {} and parse_server_timing("odd, x;desc=y") == {}


def test_percentiles_interpolate_as_numpy_does():
    values = [0.3, 0.1, 0.7, 0.2, 1.5, 0.9, 0.4]
    got = percentiles(values, qs=(0.5, 0.9, 0.99))
    for q in (0.5, 0.9, 0.99):
        assert got[f"p{round(q * 100)}"] == pytest.approx(np.percentile(values, q * 100))
    assert got["mean"] == pytest.approx(np.mean(values))


def test_summary_of_two_requests_by_hand():
    a = HttpRecord(0, 5, sent_s=0.0, token_s=[0.5, 0.6, 0.8], end_s=0.9, output_tokens=3, status=200)
    b = HttpRecord(1, 5, sent_s=0.2, token_s=[1.0, 1.1], end_s=1.2, output_tokens=2, status=200)
    bad = HttpRecord(2, 5, sent_s=0.1, end_s=0.15, status=400, error="bad request")
    s = summarize([a, b, bad], wall_s=2.0)
    assert (s["requests"], s["ok"], s["errors"], s["output_tokens"]) == (3, 2, 1, 5)
    assert s["output_tokens_per_s"] == pytest.approx(2.5)
    assert s["ttft_s"]["mean"] == pytest.approx((0.5 + 0.8) / 2)
    assert s["tpot_s"]["mean"] == pytest.approx(((0.9 - 0.5) / 2 + (1.2 - 1.0) / 1) / 2)
    assert s["itl_s"]["mean"] == pytest.approx((0.1 + 0.2 + 0.1) / 3)
    assert s["e2e_s"]["p50"] == pytest.approx(0.95)


@pytest.mark.slow
def test_bench_serve_runs_the_same_workload_both_ways(model):
    from labkit.bench.suite import Bench
    from labkit.eval import eval_text

    bench = Bench(model, model.tokenizer.encode(eval_text()), quick=True)
    throughput, ttft, added, same, naive_throughput = bench.serve()
    assert same.ratio == 1.0  # every streamed text equals the in-process run's
    assert throughput.baseline > 0 and throughput.value > 0
    assert ttft.ratio == pytest.approx((ttft.value - ttft.baseline) * 1e3)
    assert len(bench.records["serve_http"]["records"]) == len(bench.batch_workload())
    assert naive_throughput.details["naive_errors"] == 0 and naive_throughput.baseline > 0
    assert added.details["requests"] == len(bench.batch_workload()) and added.value > 0
