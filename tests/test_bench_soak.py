"""`labkit bench soak`: its verdicts from hand-made outcomes, then a few seconds of a real one."""

from __future__ import annotations

import pytest

from labkit.bench.soak import SoakConfig, run_soak, summary_line, verdicts
from labkit.experiments.fault_client import Outcome

IDLE = {"labkit:num_requests_running": 0, "labkit:num_requests_waiting": 0, "labkit:kv_blocks_used": 0}


def outcome(kind="whole", status=200, ended="answer", code=None, shape_ok=None) -> Outcome:
    out = Outcome("r", kind, status=status, ended=ended, code=code)
    out.shape_ok = shape_ok
    return out


def test_documented_errors_and_departures_pass():
    seen = [outcome(), outcome("stream", 200, "error", "engine_died", True),
            outcome("whole", 503, "error", "engine_unavailable", True), outcome("leave", 200, "left"),
            outcome("bad", 400, "error", "invalid_type", True)]
    assert verdicts(seen, IDLE)["passed"]


@pytest.mark.parametrize("bad, check", [
    (outcome("whole", 500, "error", "internal_error", True), "undocumented_5xx"),
    (outcome("stream", 200, "error", "mystery", True), "undocumented_5xx"),
    (outcome("bad", 400, "error", "invalid_type", False), "errors_not_in_the_one_shape"),
    (outcome("whole", None, "lost", "ReadError"), "requests_without_an_end"),
])
def test_each_kind_of_failure_fails_the_soak(bad, check):
    result = verdicts([outcome(), bad], IDLE)
    assert result[check] == 1 and not result["passed"]


def test_a_block_held_afterwards_fails_the_soak():
    result = verdicts([outcome()], IDLE | {"labkit:kv_blocks_used": 3})
    assert result["leaked_kv_blocks"] == 3 and not result["passed"]


@pytest.mark.slow
def test_a_short_soak_with_a_worker_kill_passes(tmp_path):
    record = run_soak(SoakConfig(minutes=0.25, clients=3, seed=1, threads=1), tmp_path)
    assert (tmp_path / "soak.json").exists()
    assert len(record["killed_workers"]) == 1 and record["requests"] > 10
    kinds = {row["kind"] for row in record["outcomes_by_kind"]}
    assert {"whole", "stream", "bad"} <= kinds
    assert record["verdicts"]["passed"], summary_line(record) + str(record["verdicts"]["examples"])
    assert record["environment"]["git"]["revision"]
