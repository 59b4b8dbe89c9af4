"""Is B higher than A, sample by sample? A paired comparison that says so only when the data do.

Two models scored on the same held-out windows, two runs on the same seeds: each sample of
A has a partner in B measured on the same thing, and most of the spread between samples is
the thing measured (a hard window is hard for both). `compare_paired(a, b)` bootstraps the
mean of the differences ``b[i] - a[i]``, resampling the pairs, not each side alone, so that
spread cancels; the unpaired `labkit.util.compare.compare` would count it as noise. Its
`verdict` is "higher" (b above a) or "lower" only when the whole interval lies on one side
of 0, and "within the noise" otherwise. The resampling is seeded: the same pairs give the
same interval. It needs at least `MIN_PAIRS` pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_PAIRS = 3


@dataclass(frozen=True)
class PairedDifference:
    """`mean` = mean of b[i] - a[i], with its bootstrap interval `low`..`high`."""

    mean: float
    low: float
    high: float
    confidence: float
    pairs: int

    @property
    def verdict(self) -> str:
        """"higher" (b above a beyond the noise), "lower", or "within the noise"."""
        if self.low > 0.0:
            return "higher"
        if self.high < 0.0:
            return "lower"
        return "within the noise"

    def interval_text(self, fmt: str = "{:+.3f}") -> str:
        """'+0.062 (95% interval +0.051 to +0.073)'."""
        return (f"{fmt.format(self.mean)} ({self.confidence:.0%} interval {fmt.format(self.low)} "
                f"to {fmt.format(self.high)})")


def compare_paired(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95,
                   resamples: int = 2000, seed: int = 0) -> PairedDifference:
    """Percentile-bootstrap interval of mean(b - a) over pairs resampled with replacement."""
    if len(a) != len(b):
        raise ValueError(f"paired samples must have equal lengths, got {len(a)} and {len(b)}")
    if len(a) < MIN_PAIRS:
        raise ValueError(f"compare_paired needs at least {MIN_PAIRS} pairs, got {len(a)}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    diffs = torch.tensor(list(b), dtype=torch.float64) - torch.tensor(list(a), dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(diffs), (resamples, len(diffs)), generator=generator)
    means = diffs[picks].mean(dim=1)
    tail = (1.0 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64))
    return PairedDifference(float(diffs.mean()), float(low), float(high), confidence, len(diffs))
