"""The timing helpers: repeats, warm-up, quantiles, threads, peak memory."""

import subprocess
import sys
import time

import pytest
import torch

from labkit.util.environment import capture
from labkit.util.timing import PeakMemory, Timing, measure, measure_interleaved, num_threads


def test_measure_calls_warmup_plus_repeats():
    calls = []
    timing = measure(lambda: calls.append(1), repeats=5, warmup=3)
    assert len(calls) == 8 and len(timing.samples) == 5 and timing.warmup == 3


def test_min_seconds_extends_the_run():
    timing = measure(lambda: time.sleep(0.002), repeats=2, warmup=0, min_seconds=0.05)
    assert len(timing.samples) >= 10


def test_samples_cover_the_call():
    timing = measure(lambda: time.sleep(0.01), repeats=3, warmup=0)
    assert timing.min >= 0.01


def test_quantiles_match_closed_form():
    t = Timing("x", [4.0, 1.0, 3.0, 2.0, 5.0], warmup=0, threads=1)
    assert t.median == 3.0 and t.quantile(0.25) == 2.0 and t.quantile(0.75) == 4.0
    assert t.quantile(0.1) == pytest.approx(1.4)
    assert t.spread == pytest.approx(2.0 / 3.0)


def test_threads_are_set_and_restored():
    before = torch.get_num_threads()
    with num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    assert measure(lambda: None, repeats=1, warmup=0, threads=1).threads == 1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        measure(lambda: None, repeats=0)


def test_peak_memory_sees_a_large_allocation():
    # In a fresh process: after a long test session the allocator may hand back pages that
    # are already resident, and a new allocation then raises the RSS by nothing.
    code = """
import time, torch
from labkit.util.timing import PeakMemory
with PeakMemory() as peak:
    block = torch.ones(64, 1024, 1024)  # 256 MiB, touched
    time.sleep(0.2)
    del block
print(peak.rss_delta_bytes)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) > 200 * 2**20


def test_peak_memory_of_nothing_is_small():
    with PeakMemory() as peak:
        time.sleep(0.01)
    assert peak.rss_delta_bytes < 32 * 2**20


def test_interleaved_timing_takes_turns():
    calls = []
    timings = measure_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                  rounds=3, warmup=1, threads=1, note="x")
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert {name: len(t.samples) for name, t in timings.items()} == {"a": 3, "b": 3}
    assert timings["a"].meta == {"note": "x"} and timings["a"].threads == 1


def test_the_environment_record_carries_the_load():
    load = capture()["cpu"]["load_average"]
    assert len(load) == 3 and all(x >= 0 for x in load)


def test_the_quantile_function_is_numpys_default_rule():
    import math
    import random

    import numpy as np

    from labkit.util.timing import quantile

    rng = random.Random(0)
    for size in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(size)]
        for q in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0):
            assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)), rel=1e-12)
    assert math.isnan(quantile([], 0.5))
