"""Do two numerical paths give the same greedy tokens? The near-tie rule.

Two correct implementations of one model (labkit's C kernels and PyTorch's, float32 and a
bfloat16 cache, one machine's oneDNN and another's) compute the same logits up to rounding:
they sum in other orders, round at other places. Greedy decoding takes the largest logit,
so wherever the reference's best and runner-up tokens are closer than that rounding, either
path may take either token, and from there on the two continue from different texts. A
test that asks for equal tokens then passes on one machine and fails on the next, for code
that is right on both.

The rule, used by the tests and the chapters alike: walk the two token lists together; at
the first position where they differ, look at the reference's scores there. The gap
between the reference's token and the candidate's (the reference's top-two margin when the
candidate took the runner-up, as a rounding flip does) must be at most `tolerance`: then
the divergence is *excused*, and the comparison ends there, since the texts that follow
are no longer the same input. A divergence at a wider gap fails: no rounding explains it.
The tolerance is not a free knob: each logit of either path is within some error `e` of
the exact value, so their gap can move by at most `2 e` (:func:`flip_tolerance`); a test
states the `e` it measured and checks it, and :attr:`GreedyAgreement.max_score_error`
reports the error actually seen on the positions both paths shared.

Scores are logits or log-probabilities (a log-softmax shifts every score of a step by the
same amount, so their gaps are the same): a [steps, vocab] tensor, one tensor a step, or
one mapping (or sequence of `(token, score)` pairs, the engine's `top_logprobs`) a step.
A candidate token missing from a step's mapping is at least as far below as the last score
given: a gap no smaller than that is used, so a flip to a token outside the reported top-k
is excused only when even that bound is within the tolerance.

Excused divergences are counted and reported (:meth:`AgreementSummary.describe`), never
hidden.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

StepScores = Union[torch.Tensor, Mapping[int, float], Sequence[tuple[int, float]]]


def flip_tolerance(max_logit_error: float) -> float:
    """The widest top-two gap a rounding difference can close: if every logit of either path
    is within `max_logit_error` of the exact value, their gap moves by at most twice that."""
    if not max_logit_error >= 0:
        raise ValueError(f"a logit error is a non-negative number, got {max_logit_error!r}")
    return 2.0 * max_logit_error


def top_two_margins(logits: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 score of every row of a [steps, vocab] tensor."""
    two = torch.topk(logits.detach().float().reshape(-1, logits.shape[-1]), 2, dim=-1).values
    return (two[:, 0] - two[:, 1]).tolist()


def _score(scores: StepScores, token: int) -> tuple[float, bool]:
    """(score of `token`, whether it was given). A token missing from a top-k mapping gets
    the smallest score given: an upper bound on its real score."""
    if isinstance(scores, torch.Tensor):
        return float(scores.reshape(-1)[token]), True
    table = dict(scores) if not isinstance(scores, Mapping) else scores
    if token in table:
        return float(table[token]), True
    return (min(float(v) for v in table.values()) if table else -math.inf), False


@dataclass(frozen=True)
class GreedyAgreement:
    """One sequence: where the candidate's greedy tokens left the reference's, and whether a
    near-tie excuses it."""

    length: int                    # tokens of the reference
    compared: int                  # positions walked: all, or up to and including the divergence
    diverged_at: int | None        # first position whose tokens differ (None: none did)
    reference_token: int | None
    candidate_token: int | None
    margin: float | None           # reference's score of its token minus that of the candidate's
    tolerance: float
    max_score_error: float | None  # largest |score difference| of the chosen tokens before it

    @property
    def exact(self) -> bool:
        return self.diverged_at is None

    @property
    def excused(self) -> bool:
        """Diverged, at a gap the two paths' rounding can close."""
        return self.diverged_at is not None and self.margin is not None and self.margin <= self.tolerance

    @property
    def ok(self) -> bool:
        return self.exact or self.excused

    def describe(self) -> str:
        if self.exact:
            return f"all {self.length} tokens equal"
        where = (f"position {self.diverged_at}: reference token {self.reference_token}, "
                 f"candidate {self.candidate_token}")
        if self.margin is None:
            return f"lengths differ at {where} (no near-tie can excuse a missing token)"
        verdict = "excused, a near-tie" if self.excused else "NOT excused"
        return (f"parted at {where}, reference gap {self.margin:.3g} against tolerance "
                f"{self.tolerance:.3g}: {verdict}")


def greedy_agreement(reference: Sequence[int], candidate: Sequence[int],
                     reference_scores: Sequence[StepScores] | torch.Tensor, tolerance: float,
                     candidate_scores: Sequence[StepScores] | torch.Tensor | None = None) -> GreedyAgreement:
    """Compare the candidate's greedy tokens with the reference's under the near-tie rule
    (module docstring). `reference_scores[i]` are the reference's scores at position i
    (from which it chose `reference[i]`). With `candidate_scores`, the largest difference
    between the two paths' scores of the chosen token on the positions they shared is
    reported as `max_score_error`."""
    if tolerance < 0 or math.isnan(tolerance):
        raise ValueError(f"the tolerance is a non-negative logit gap, got {tolerance!r}")
    reference, candidate = [int(t) for t in reference], [int(t) for t in candidate]
    if len(reference_scores) < len(reference):
        raise ValueError(f"{len(reference)} reference tokens but scores for {len(reference_scores)} steps")
    error = None
    for i, (want, got) in enumerate(zip(reference, candidate)):
        if want != got:
            high, _ = _score(reference_scores[i], want)
            low, _ = _score(reference_scores[i], got)
            return GreedyAgreement(len(reference), i + 1, i, want, got, high - low, tolerance, error)
        if candidate_scores is not None:
            seen = abs(_score(reference_scores[i], want)[0] - _score(candidate_scores[i], got)[0])
            error = seen if error is None else max(error, seen)
    shorter = min(len(reference), len(candidate))
    if len(reference) != len(candidate):
        ref_token = reference[shorter] if shorter < len(reference) else None
        cand_token = candidate[shorter] if shorter < len(candidate) else None
        return GreedyAgreement(len(reference), shorter, shorter, ref_token, cand_token, None, tolerance, error)
    return GreedyAgreement(len(reference), len(reference), None, None, None, None, tolerance, error)


@dataclass(frozen=True)
class AgreementSummary:
    """Many sequences compared under one tolerance."""

    sequences: tuple[GreedyAgreement, ...]

    @property
    def ok(self) -> bool:
        return all(a.ok for a in self.sequences)

    @property
    def exact(self) -> int:
        return sum(a.exact for a in self.sequences)

    @property
    def excused(self) -> int:
        return sum(a.excused for a in self.sequences)

    @property
    def failed(self) -> int:
        return sum(not a.ok for a in self.sequences)

    @property
    def tokens_compared(self) -> int:
        """Positions on which the two paths agree, summed over the sequences."""
        return sum(a.compared - (0 if a.exact else 1) for a in self.sequences)

    @property
    def max_score_error(self) -> float | None:
        errors = [a.max_score_error for a in self.sequences if a.max_score_error is not None]
        return max(errors) if errors else None

    def describe(self) -> str:
        head = (f"{len(self.sequences)} sequences: {self.exact} equal throughout, "
                f"{self.excused} parted at a near-tie (excused), {self.failed} failed")
        lines = [f"  sequence {i}: {a.describe()}" for i, a in enumerate(self.sequences) if not a.exact]
        return "\n".join([head, *lines])


def compare_greedy(references: Sequence[Sequence[int]], candidates: Sequence[Sequence[int]],
                   reference_scores: Sequence[Any], tolerance: float,
                   candidate_scores: Sequence[Any] | None = None) -> AgreementSummary:
    """:func:`greedy_agreement` for each sequence (`reference_scores[k]` holds sequence k's
    per-step scores)."""
    if not len(references) == len(candidates) == len(reference_scores):
        raise ValueError("one reference, one candidate and one score list per sequence")
    if candidate_scores is not None and len(candidate_scores) != len(references):
        raise ValueError("one candidate score list per sequence")
    return AgreementSummary(tuple(
        greedy_agreement(ref, cand, scores, tolerance,
                         None if candidate_scores is None else candidate_scores[k])
        for k, (ref, cand, scores) in enumerate(zip(references, candidates, reference_scores))))


def assert_greedy_agree(summary: AgreementSummary | GreedyAgreement) -> None:
    """Raise AssertionError, with the description, unless every sequence agrees (exactly or
    up to an excused near-tie)."""
    if not summary.ok:
        raise AssertionError(summary.describe())


__all__ = ["GreedyAgreement", "AgreementSummary", "flip_tolerance", "top_two_margins",
           "greedy_agreement", "compare_greedy", "assert_greedy_agree"]
