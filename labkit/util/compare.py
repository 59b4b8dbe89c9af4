"""Is A faster than B? A comparison of two timings that says so only when the data do.

Two medians always differ; whether the difference means anything depends on the spread of
the samples behind them. `compare(a, b)` bootstraps the ratio of medians (b over a, so a
ratio above 1 means `a` took less time): it resamples each set of samples with replacement,
takes the ratio of the two resampled medians, and reports the central `confidence` share of
those ratios as the interval. Its `verdict` is "faster" or "slower" only when the whole
interval lies on one side of 1, and "within the noise" otherwise, so a prose sentence glued
from it cannot claim more than the measurement shows. The resampling is seeded: the same
samples give the same interval.

With very few samples no interval can exclude much: two samples of each can never give
more than their own range. `compare` needs at least `MIN_SAMPLES` per side and raises
ValueError below that, rather than return an interval that looks tighter than it is.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_SAMPLES = 3


@dataclass(frozen=True)
class Comparison:
    """`ratio` = median(b) / median(a): how many times longer `b` took than `a`."""

    name_a: str
    name_b: str
    ratio: float
    low: float
    high: float
    confidence: float
    samples_a: int
    samples_b: int

    @property
    def verdict(self) -> str:
        """"faster" (a took less time than b beyond the noise), "slower", or "within the noise"."""
        if self.low > 1.0:
            return "faster"
        if self.high < 1.0:
            return "slower"
        return "within the noise"

    @property
    def separated(self) -> bool:
        return self.verdict != "within the noise"

    def phrase(self, fmt: str = "{:.2f}") -> str:
        """`a` against `b` in words that claim no more than the interval: "2.31 times faster
        (95% interval 2.20-2.45)", "slower: 0.80 times the speed (...)", or "no faster beyond
        the noise (ratio 1.01, 95% interval 0.98-1.04)". `fmt` writes the ratio and its bounds
        (fewer digits where few samples make more of them false precision)."""
        return self._words(None, fmt)

    def phrase_than(self, other: str, fmt: str = "{:.2f}") -> str:
        """The same claim as :meth:`phrase`, naming what `a` was measured against: "2.31 times
        faster than F.linear (95% interval 2.20-2.45)", "slower than F.linear: 0.80 times its
        speed (...)", or "no faster than F.linear beyond the noise (ratio 1.01, ...)"."""
        return self._words(other, fmt)

    def _words(self, other: str | None, fmt: str) -> str:
        ratio = fmt.format(self.ratio)
        interval = f"{self.confidence:.0%} interval {fmt.format(self.low)}-{fmt.format(self.high)}"
        than = f" than {other}" if other else ""
        if self.verdict == "faster":
            return f"{ratio} times faster{than} ({interval})"
        if self.verdict == "slower":
            return f"slower{than}: {ratio} times {'its' if other else 'the'} speed ({interval})"
        return f"no faster{than} beyond the noise (ratio {ratio}, {interval})"

    def interval_text(self, fmt: str = "{:.2f}") -> str:
        """'4.07x (3.95-4.21x, 95% interval)'."""
        return (f"{fmt.format(self.ratio)}x ({fmt.format(self.low)}-{fmt.format(self.high)}x, "
                f"{self.confidence:.0%} interval)")


def median_interval(samples: Sequence[float], confidence: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of `samples`."""
    medians = _resampled_medians(samples, resamples, torch.Generator().manual_seed(seed))
    return _central(medians, confidence)


def compare(a: Sequence[float], b: Sequence[float], *, name_a: str = "a", name_b: str = "b",
            confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> Comparison:
    """Bootstrap interval of median(b) / median(a) from the two sets of timing samples."""
    if len(a) < MIN_SAMPLES or len(b) < MIN_SAMPLES:
        raise ValueError(f"compare needs at least {MIN_SAMPLES} samples of each, got {len(a)} and {len(b)}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    generator = torch.Generator().manual_seed(seed)
    ratios = _resampled_medians(b, resamples, generator) / _resampled_medians(a, resamples, generator)
    low, high = _central(ratios, confidence)
    return Comparison(name_a, name_b, statistics.median(b) / statistics.median(a), low, high,
                      confidence, len(a), len(b))


def _resampled_medians(samples: Sequence[float], resamples: int, generator: torch.Generator) -> torch.Tensor:
    values = torch.tensor(list(samples), dtype=torch.float64)
    picks = torch.randint(0, len(values), (resamples, len(values)), generator=generator)
    # statistics.median's convention (mean of the two middle values), not torch.median's lower one
    ordered = values[picks].sort(dim=1).values
    n = len(values)
    return (ordered[:, (n - 1) // 2] + ordered[:, n // 2]) / 2


def _central(values: torch.Tensor, confidence: float) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2
    low, high = torch.quantile(values, torch.tensor([tail, 1.0 - tail], dtype=torch.float64))
    return float(low), float(high)
