"""The timing comparison: its verdicts follow the data, and its bootstrap intervals agree
with scipy's percentile bootstrap on the same samples."""

import numpy as np
import pytest
from scipy import stats

from labkit.util.compare import compare, median_interval


def samples(center, spread, n, seed):
    return list(np.random.default_rng(seed).normal(center, spread, n))


def test_verdicts_follow_the_data():
    fast, slow = samples(1.0, 0.02, 9, 1), samples(2.0, 0.04, 9, 2)
    assert compare(fast, slow).verdict == "faster"
    assert compare(slow, fast).verdict == "slower"
    same = compare(samples(1.0, 0.05, 9, 3), samples(1.0, 0.05, 9, 4))
    assert same.verdict == "within the noise" and same.low < 1.0 < same.high
    # a 1% difference inside a 5% spread is noise, however the medians fall
    assert compare(samples(1.0, 0.05, 7, 5), samples(1.01, 0.05, 7, 6)).verdict == "within the noise"


def test_ratio_is_b_over_a_and_the_interval_holds_it():
    a, b = [1.0, 1.1, 0.9, 1.05], [3.0, 3.3, 2.7, 3.1]
    c = compare(a, b, name_a="cached", name_b="uncached")
    assert c.ratio == pytest.approx(np.median(b) / np.median(a))
    assert c.low <= c.ratio <= c.high
    assert c.interval_text().startswith(f"{c.ratio:.2f}x (")


def test_intervals_match_scipy():
    a, b = samples(1.0, 0.1, 15, 7), samples(1.5, 0.2, 15, 8)
    ours = median_interval(a, resamples=20000)
    ref = stats.bootstrap((a,), np.median, method="percentile", n_resamples=20000, random_state=0).confidence_interval
    assert ours == pytest.approx((ref.low, ref.high), rel=0.02)
    c = compare(a, b, resamples=20000)
    ref = stats.bootstrap((b, a), lambda x, y: np.median(x) / np.median(y), method="percentile",
                          n_resamples=20000, random_state=0, vectorized=False).confidence_interval
    assert (c.low, c.high) == pytest.approx((ref.low, ref.high), rel=0.02)


def test_seeded_and_refuses_too_few_samples():
    a, b = samples(1.0, 0.1, 5, 9), samples(1.2, 0.1, 5, 10)
    assert compare(a, b) == compare(a, b)
    with pytest.raises(ValueError, match="at least 3"):
        compare([1.0, 1.1], [2.0, 2.1, 2.2])
    with pytest.raises(ValueError):
        compare(a, b, confidence=1.0)


def test_phrases_claim_no_more_than_the_interval():
    fast, slow = samples(1.0, 0.02, 9, 11), samples(2.0, 0.04, 9, 12)
    assert compare(fast, slow).phrase().startswith(f"{compare(fast, slow).ratio:.2f} times faster (95% interval ")
    assert compare(slow, fast).phrase().startswith("slower: ")
    assert compare(fast, samples(1.0, 0.02, 9, 13)).phrase().startswith("no faster beyond the noise (ratio ")
    assert compare(fast, slow).phrase_than("eager").startswith(
        f"{compare(fast, slow).ratio:.2f} times faster than eager (95% interval ")
    assert compare(slow, fast).phrase_than("eager").startswith("slower than eager: ")
    assert compare(fast, samples(1.0, 0.02, 9, 13)).phrase_than("eager").startswith(
        "no faster than eager beyond the noise (ratio ")


def test_phrases_write_the_ratio_and_its_bounds_with_the_format_given():
    c = compare(samples(1.0, 0.02, 9, 11), samples(2.0, 0.04, 9, 12))
    assert c.phrase_than("eager", fmt="{:.1f}") == (
        f"{c.ratio:.1f} times faster than eager (95% interval {c.low:.1f}-{c.high:.1f})")
    assert c.phrase(fmt="{:.0f}") == f"{c.ratio:.0f} times faster (95% interval {c.low:.0f}-{c.high:.0f})"
