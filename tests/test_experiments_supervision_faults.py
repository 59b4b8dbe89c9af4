"""Chapter 30's supervision faults (labkit.experiments.supervision_faults): the pure readings of
what the scenarios sample (fast), then each scenario against a live `labkit serve` with short
timeouts (slow). References: the closed form of the backoff (written here, not taken from
labkit.serve.supervision), the kernel's view of a process (os.kill, /proc), and the service's
own /health counters."""

from __future__ import annotations

import subprocess
import sys

import pytest

from labkit.experiments import fault_client as fc
from labkit.experiments import faults as fx
from labkit.experiments import supervision_faults as sf

# -- pure parts ------------------------------------------------------------------------------------


def test_the_closed_form_doubles_from_the_first_wait_up_to_its_cap():
    assert [sf.closed_form_backoff(k, 0.2, 0.5) for k in range(5)] == [0.0, 0.2, 0.4, 0.5, 0.5]
    assert sf.closed_form_backoff(1, 0.5, 30.0) == 0.5 and sf.closed_form_backoff(7, 0.5, 30.0) == 30.0


def test_rises_gives_each_new_value_at_the_first_sample_that_shows_it():
    samples = [{"t_s": 0.0, "n": 0}, {"t_s": 0.1, "n": 0}, {"t_s": 0.2, "n": 1}, {"t_s": 0.3, "n": 1},
               {"t_s": 0.4, "n": 3}]
    assert sf.rises(samples, "n") == [(0.2, 1), (0.4, 2), (0.4, 3)]   # 2 and 3 between two samples
    assert sf.rises([], "n") == [] and sf.rises(samples[:2], "n") == []


def test_backoff_gaps_run_from_a_failure_to_the_next_start():
    # starts at 0.05, 1.35, 2.95; each took 1.0 s to fail; waits 0.3 and 0.6 (first 0.3, cap 0.5)
    rows = sf.backoff_gaps([0.05, 1.35, 2.95], [1.05, 2.35, 3.95], 0.3, 0.5)
    assert [r["start"] for r in rows] == [1, 2, 3]
    assert [round(r["start_took_s"], 6) for r in rows] == [1.0, 1.0, 1.0]
    assert [round(r["gap_s"], 6) for r in rows[:2]] == [0.3, 0.6]
    assert [r["closed_form_s"] for r in rows[:2]] == [0.3, 0.5]
    assert round(rows[1]["gap_minus_closed_form_s"], 6) == 0.1
    assert "gap_s" not in rows[2]      # the last failure had no next start: it gave up


def test_process_gone_sees_a_running_a_reaped_and_a_zombie_process():
    import os

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not sf.process_gone(child.pid)
        assert not sf.process_gone(os.getpid())
    finally:
        child.kill()
    # killed, not yet collected: a zombie, which runs no more
    assert sf.wait_gone(child.pid, timeout=5)
    child.wait()
    assert sf.process_gone(child.pid)


# -- the scenarios, each against a live service --------------------------------------------------------

SERVE = ["--max-num-seqs", "4", "--threads", "1", "--weights", "f32"]
HANG_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def pool():
    return fx.prompt_pool(6, 32, first=40)


@pytest.mark.slow
def test_a_hung_worker_is_replaced_and_its_waiting_request_answered(pool):
    with fc.LiveService(*SERVE, "--kv-cache-tokens", 1024, "--hang-timeout", HANG_TIMEOUT) as service:
        record = sf.hung_worker(service.url, pool[0], pool[1], hang_timeout=HANG_TIMEOUT)
        probe = fx.Probe("The capital of France is", 8, fx.solo_texts(service.url, ["The capital of France is"], 8)[0])
        record.after = fx.after_scenario(service.url, probe)
    assert record.ok, (record.checks, record.after, record.rows())
    # declared hung about HANG_TIMEOUT after the freeze: a poll (0.1 s) and a kill later, not never
    assert record.timings["detect_over_timeout_s"] < 2.0, record.timings
    assert record.timings["ready_s"] > record.timings["detect_s"]
    assert record.after["kv_blocks_used"] == 0


@pytest.mark.slow
def test_a_crash_loop_backs_off_as_configured_then_says_failed():
    record = sf.crash_loop(SERVE, first_backoff=0.2, max_backoff=0.4, max_failed_starts=3)
    assert record.ok, (record.checks, record.timings, record.counters)
    assert record.timings["closed_form_s"] == [0.2, 0.4]
    for gap, wait in zip(record.timings["gaps_s"], record.timings["closed_form_s"]):
        assert wait - 0.02 <= gap < wait + 0.5, record.timings
    assert record.timings["first_start_after_kill_s"] < 1.0   # a worker that had served: no wait
    # a failed start's sockets were once left open and a failed server then never exited
    assert record.counters["exit_code"] == 0 and record.timings["exit_after_term_s"] < 15


@pytest.mark.slow
def test_a_drain_answers_the_short_ends_the_long_and_exits_zero(pool):
    # 8 s: room for the 24-token request on a slow or busy machine (it took over 3 s on two
    # cores running other work); the 4,000-token stream still outlasts it
    drain_s = 8.0
    record = sf.drain(SERVE + ["--kv-cache-tokens", 4096], pool[2], pool[3], pool[4], drain_timeout=drain_s)
    assert record.ok, (record.checks, record.timings, record.counters, record.rows())
    assert drain_s <= record.timings["long_ended_after_term_s"] < drain_s + 2.0, record.timings
    assert record.timings["exit_after_term_s"] < drain_s + 15, record.timings
