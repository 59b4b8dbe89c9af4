"""The baseline's thread comparison and its memory-rate verdict (labkit.experiments.part_checks),
on synthetic samples: no model needed."""

import pytest

from labkit.experiments import part_checks as checks


def _row(scale: float, jitter: float = 0.01) -> dict:
    offsets = [0.0, jitter, -jitter, 2 * jitter, -2 * jitter]
    return {f"{stage}_samples_s": [scale * (1 + o) for o in offsets]
            for stage in checks.BASELINE_STAGES}


def test_thread_comparisons_ratio_is_the_speedup_of_two_threads():
    out = checks.thread_comparisons(_row(2.0), _row(1.0))  # two threads take half the time
    assert set(out) == set(checks.BASELINE_STAGES)
    for comparison in out.values():
        assert comparison.ratio == pytest.approx(2.0)
        assert comparison.verdict == "faster"


def test_thread_comparisons_calls_a_tie_within_the_noise_and_a_loss_slower():
    tie = checks.thread_comparisons(_row(1.0, jitter=0.05), _row(1.01, jitter=0.05))
    assert all(c.verdict == "within the noise" for c in tie.values())
    loss = checks.thread_comparisons(_row(1.0), _row(1.2))
    assert all(c.verdict == "slower" for c in loss.values())


def test_thread_comparisons_takes_extra_stages():
    one, two = _row(1.0), _row(0.5)
    one["memory_read_samples_s"], two["memory_read_samples_s"] = [1.0, 1.1, 0.9], [1.0, 1.1, 0.9]
    out = checks.thread_comparisons(one, two, stages=("memory_read",))
    assert list(out) == ["memory_read"] and out["memory_read"].verdict == "within the noise"


def test_memory_rate_verdict():
    assert "close to the memory's rate" in checks.memory_rate_verdict(9.0, 10.0)
    assert "did not set" in checks.memory_rate_verdict(3.0, 10.0)
    assert "did not set" in checks.memory_rate_verdict(7.9, 10.0)
    with pytest.raises(ValueError):
        checks.memory_rate_verdict(0.0, 10.0)


def test_comparison_rows():
    out = checks.thread_comparisons(_row(2.0), _row(1.0))
    rows = checks.comparison_rows(out, labels={"request": "whole request"})
    assert [r["stage"] for r in rows] == ["whole request", "prefill", "decode_step"]
    assert rows[0]["speedup_x"] == 2.0 and rows[0]["verdict"] == "faster"
    low, high = map(float, rows[0]["95% interval"].split("-"))
    assert low <= 2.0 <= high
