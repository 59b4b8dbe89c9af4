"""Which thread did the work: per-thread CPU times, the paths of a product, and the words
chapters 6 and 7 glue from them."""

import math
import os
import threading

import pytest
import torch

from labkit.experiments import thread_use as tu
from labkit.kernels import native

LINUX = os.path.isdir("/proc/self/task")


def spin(seconds: float) -> None:
    """Burn CPU in the calling thread for `seconds` of its own CPU time."""
    import time

    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Worker:
    """A thread that burns CPU on request while the caller sleeps on an event: the
    independent reference for work done by a thread other than the caller."""

    def __init__(self):
        self.go, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while True:
            self.go.wait()
            self.go.clear()
            spin(0.02)
            self.done.set()

    def __call__(self):
        self.done.clear()
        self.go.set()
        self.done.wait()


@pytest.mark.skipif(not LINUX, reason="per-thread CPU times are read from /proc")
def test_thread_cpu_seconds_sees_the_caller_work():
    caller = threading.get_native_id()
    before = tu.thread_cpu_seconds()
    spin(0.1)
    after = tu.thread_cpu_seconds()
    assert caller in before and caller in after
    assert after[caller] - before[caller] >= 0.05  # ticks of 10 ms: 0.1 s reads 0.09-0.11


@pytest.mark.skipif(not LINUX, reason="per-thread CPU times are read from /proc")
def test_work_in_the_caller_leaves_the_helper_share_near_zero():
    use = tu.measure_thread_use(lambda: spin(0.02), min_seconds=0.3, settle_s=0.05)
    assert use.caller_cpu_s >= 0.01 * use.calls  # each call spins 0.02 s (ticks of 0.01 s)
    assert use.helper_share < tu.IDLE_SHARE
    assert "stayed idle" in tu.helper_words(use.helper_share)


@pytest.mark.skipif(not LINUX, reason="per-thread CPU times are read from /proc")
def test_work_in_another_thread_is_counted_as_the_helper():
    worker = Worker()
    use = tu.measure_thread_use(worker, min_seconds=0.3, settle_s=0.05)
    assert use.helper_cpu_s >= 0.01 * use.calls
    assert use.helper_share >= tu.BUSY_SHARE  # the caller only waits on an event
    assert "worked alongside" in tu.helper_words(use.helper_share)


@pytest.mark.skipif(not LINUX or (os.cpu_count() or 1) < 2, reason="needs two cores and /proc")
def test_a_large_gemm_hands_work_to_the_second_thread():
    a = torch.randn(384, 384)
    use = tu.measure_thread_use(lambda: a @ a, threads=2, min_seconds=0.3)
    assert use.threads == 2 and use.helper_share >= tu.IDLE_SHARE


def test_measure_thread_use_needs_two_threads():
    with pytest.raises(ValueError):
        tu.measure_thread_use(lambda: None, threads=1)


def test_measure_thread_use_is_none_without_proc(monkeypatch):
    monkeypatch.setattr(tu, "thread_cpu_seconds", lambda: None)
    assert tu.measure_thread_use(lambda: None) is None


def test_helper_share_is_a_ratio_of_cpu_times():
    use = tu.ThreadUse("x", 2, 10, wall_s=4.0, caller_cpu_s=1.0, helper_cpu_s=0.5)
    assert use.helper_share == 0.5  # of the caller's CPU time, not of the wall time
    assert tu.ThreadUse("x", 2, 1, 1.0, caller_cpu_s=0.0, helper_cpu_s=0.3).helper_share == 1.0
    assert math.isnan(tu.ThreadUse("x", 2, 1, 1.0, 0.0, 0.0).helper_share)


def test_helper_words_direction():
    assert "stayed idle" in tu.helper_words(0.0)
    assert "stayed idle" in tu.helper_words(tu.IDLE_SHARE - 0.01)
    assert "part of the time" in tu.helper_words(tu.IDLE_SHARE)
    assert "worked alongside" in tu.helper_words(tu.BUSY_SHARE)
    assert "too short" in tu.helper_words(float("nan"))
    with pytest.raises(ValueError):
        tu.helper_words(-0.1)


def test_engine_kernel_name_follows_the_rows_and_the_build(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: object())
    assert tu.engine_kernel_name(1) == "labkit's C gemv"
    monkeypatch.setenv(native.GEMV_ROWS_ENV, "3")  # the engine's cutoff, not the block kernels'
    assert tu.engine_kernel_name(3) == "labkit's C gemv"
    assert tu.engine_kernel_name(4) == "oneDNN with packed weights"
    monkeypatch.setattr(native, "load", lambda: None)
    assert tu.engine_kernel_name(1) == "oneDNN with packed weights"


def test_every_path_computes_the_product_of_its_rows():
    paths = tu.product_paths(32, 48, many_rows=5, copies=2, seed=3)
    g = torch.Generator().manual_seed(3)  # the same draws as product_paths makes
    weights = [torch.randn(48, 32, generator=g) for _ in range(2)]
    one, many = torch.randn(1, 32, generator=g), torch.randn(5, 32, generator=g)
    assert {"F.linear(x, W) on 1 row", "x @ W_t on 1 row", "F.linear(x, W) on 5 rows"} <= set(paths)
    assert f"{tu.engine_kernel_name(1)} on 1 row" in paths  # oneDNN is in the PyPI wheels
    for name, fn in paths.items():
        x = many if name.endswith("5 rows") else one
        for call in range(4):  # the calls cycle through the copies: 1, 0, 1, 0
            w = weights[(call + 1) % 2].double()
            expected = (x.double() @ w.t()).float()
            torch.testing.assert_close(fn(), expected, rtol=1e-4, atol=1e-4, msg=name)


def records(speedup, low, high, name="p"):
    one = {"name": name, "threads": 1, "median_s": 0.004, "repeats": 5,
           "speedup": 1.0, "speedup_low": 1.0, "speedup_high": 1.0}
    two = {"name": name, "threads": 2, "median_s": 0.004 / speedup, "repeats": 5,
           "speedup": speedup, "speedup_low": low, "speedup_high": high}
    return [one, two]


def test_path_records_rates_and_verdicts():
    use = tu.ThreadUse("p", 2, 10, 1.0, 1.0, 0.02)
    [row] = tu.path_records(records(2.0, 1.9, 2.1), {"p": use}, bytes_read=4_000_000)
    assert row["one_thread_ms"] == pytest.approx(4.0) and row["two_threads_ms"] == pytest.approx(2.0)
    assert row["one_thread_gb_s"] == pytest.approx(1.0) and row["two_threads_gb_s"] == pytest.approx(2.0)
    assert row["verdict"] == "faster" and row["phrase"].startswith("2.00 times faster")
    assert row["second_thread_cpu_share"] == pytest.approx(0.02)
    [flat] = tu.path_records(records(1.0, 0.95, 1.05), {}, bytes_read=4_000_000)
    assert flat["verdict"] == "within the noise" and math.isnan(flat["second_thread_cpu_share"])


def test_split_words_names_the_idle_and_the_working_paths():
    idle = {"path": "F.linear(x, W) on 1 row", "speedup": 1.01, "second_thread_cpu_share": 0.0}
    busy = {"path": "engine", "speedup": 1.9, "second_thread_cpu_share": 0.95}
    mixed = tu.split_words([idle, busy])
    assert mixed.startswith("F.linear(x, W) on 1 row (1.01x) left the second thread idle")
    assert mixed.endswith("engine (1.90x) handed it work")
    assert tu.split_words([busy]).startswith("every path handed")
    assert tu.split_words([idle]).startswith("no path handed")
    assert "could not be read" in tu.split_words([idle, {**busy, "second_thread_cpu_share": math.nan}])


def test_shortfall_splits_the_missing_half():
    gap = tu.shortfall({1: 40.0, 2: 30.0}, {1: 32.0, 2: 21.0})
    assert gap.total_s == pytest.approx(10.0)      # 30 - 40 / 2
    assert gap.matmuls_s == pytest.approx(5.0)     # 21 - 32 / 2
    assert gap.rest_s == pytest.approx(5.0)        # (30 - 21) - (40 - 32) / 2
    assert gap.where.startswith("it was shared") and gap.measurable
    assert not tu.shortfall({1: 40.0, 2: 30.0}, {1: 41.0, 2: 21.0}).measurable  # a rest < 0
    assert tu.shortfall({1: 40.0, 2: 30.0}, {1: 32.0, 2: 17.0}).where.endswith("outside the weight matmuls")
    assert tu.shortfall({1: 40.0, 2: 30.0}, {1: 32.0, 2: 25.0}).where.endswith("in the weight matmuls")
    assert tu.shortfall({1: 40.0, 2: 20.0}, {1: 32.0, 2: 16.0}).where.startswith("the step took no more")


def test_gain_order_words_takes_a_side_only_apart():
    low = {"speedup_low": 0.98, "speedup_high": 1.03}
    high = {"speedup_low": 1.85, "speedup_high": 1.95}
    assert "gained less" in tu.gain_order_words(low, high)
    assert "gained more" in tu.gain_order_words(high, low)
    assert "overlap" in tu.gain_order_words(low, {"speedup_low": 1.0, "speedup_high": 1.9})
