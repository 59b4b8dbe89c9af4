"""labkit.util.paired: the direction of the verdict, that pairing removes the spread the
pairs share, and that a noise-only difference is called noise."""

import pytest
import torch

from labkit.util.compare import compare
from labkit.util.paired import compare_paired


def test_a_consistent_shift_is_higher_and_its_reverse_lower():
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(40, generator=g) * 2).tolist()  # a wide spread both sides share
    shifted = [x + 0.1 + 0.01 * float(e) for x, e in zip(base, torch.randn(40, generator=g))]
    up = compare_paired(base, shifted)
    assert up.verdict == "higher" and up.mean == pytest.approx(0.1, abs=0.01)
    assert up.low > 0 and up.low < up.mean < up.high
    assert compare_paired(shifted, base).verdict == "lower"
    # the unpaired comparison cannot see the shift under the shared spread
    assert compare([x + 10 for x in base], [x + 10 for x in shifted]).verdict == "within the noise"


def test_noise_alone_is_within_the_noise():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(30, generator=g).tolist()
    b = [x + float(e) for x, e in zip(a, torch.randn(30, generator=g) * 0.5)]
    b = [x - (sum(b) - sum(a)) / len(b) for x in b]  # mean difference exactly zero
    result = compare_paired(a, b)
    assert result.verdict == "within the noise" and result.low < 0 < result.high


def test_it_refuses_unpaired_or_too_few_samples():
    with pytest.raises(ValueError):
        compare_paired([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        compare_paired([1.0, 2.0], [1.0, 2.0])
