"""Greedy tokens of two numerical paths, compared under the near-tie rule (chapters 13-18).

Chapters 14 to 18 run the same model two ways and ask whether the greedy tokens agree: the
paged engine against a plain loop over a contiguous cache, a preempted and recomputed
sequence against an uninterrupted one, a prefix-cache hit against a cold prefill, a
speculative verification of k + 1 tokens against one-token steps, compiled code against
eager code, three kernels for the matrix products. Each pair computes the same logits up to
rounding, in other orders, and the rounding differs from one CPU to the next. Where the
reference's two best tokens are closer than that rounding, either path may take either
token, on one machine and not on another. So these comparisons use the book's one rule,
:mod:`labkit.util.near_tie`: a divergence is excused when the reference's gap between its
token and the candidate's is at most twice the paths' logit error, and the count of excused
divergences is reported, never hidden.

:data:`LOGIT_ERROR` is the error this book states for two float32 paths of SmolLM2-135M on
the same tokens; :func:`check` holds every comparison that measures its error (from both
paths' scores of the chosen tokens) to it, so a tolerance that the paths outgrow fails
instead of excusing more than rounding can explain. Scores may be logits or
log-probabilities (:func:`log_probs`, or the engine's ``top_logprobs``): their gaps are the
same, and errors are only measured between two of the same kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from labkit.util.near_tie import AgreementSummary, GreedyAgreement, compare_greedy, flip_tolerance

LOGIT_ERROR = 1e-3
"""Stated bound on |difference| of one token's logit (or log-probability) between two float32
paths of SmolLM2-135M: other summation orders, other kernels, other ISAs. Measured between the
paged engine and the contiguous loop: about 1e-5 (chapter 14's run records it), a hundred
times below."""

BF16_LOGIT_ERROR = 0.5
"""The same bound for two paths that both compute in bfloat16. Its 8-bit mantissa spaces a
logit of 16 to 32 (SmolLM2's largest) 0.125 apart, so one rounding moves it by up to 0.0625
and a path's logits carry several; measured between compiled and eager bfloat16 code on two
layers of SmolLM2: 0.125 (one step of that spacing). Stated here: four steps."""


def tolerance(logit_error: float = LOGIT_ERROR) -> float:
    """The widest top-two gap a rounding difference of `logit_error` can close."""
    return flip_tolerance(logit_error)


def log_probs(logits: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """Each step's [vocab] logits as log-probabilities (float32), to compare with the engine's
    ``top_logprobs``."""
    rows = logits if not isinstance(logits, torch.Tensor) else list(logits.reshape(-1, logits.shape[-1]))
    return [torch.log_softmax(row.detach().float().reshape(-1), dim=-1) for row in rows]


def engine_scores(output: Any, sample: int = 0) -> list:
    """The per-step ``top_logprobs`` of one of an engine output's samples (the request must
    have asked for logprobs)."""
    got = output.samples[sample].top_logprobs
    if got is None:
        raise ValueError("the request did not ask for logprobs (SamplingParams(logprobs=k))")
    return list(got)


def compare(references: Sequence[Sequence[int]], candidates: Sequence[Sequence[int]],
            reference_scores: Sequence[Any], candidate_scores: Sequence[Any] | None = None,
            logit_error: float = LOGIT_ERROR) -> AgreementSummary:
    """:func:`labkit.util.near_tie.compare_greedy` at the tolerance of `logit_error`."""
    return compare_greedy(references, candidates, reference_scores, tolerance(logit_error),
                          candidate_scores)


def summary(agreements: Sequence[GreedyAgreement]) -> AgreementSummary:
    """Sequences compared one by one (:class:`GreedyAgreement`), as one summary."""
    return AgreementSummary(tuple(agreements))


def check(result: AgreementSummary | GreedyAgreement, logit_error: float = LOGIT_ERROR) -> AgreementSummary | GreedyAgreement:
    """Raise AssertionError unless every sequence agrees (equal, or parted at an excused
    near-tie) and the error measured between the paths' scores, where it was measured, is
    within the stated `logit_error`. Returns `result`."""
    if not result.ok:
        raise AssertionError(result.describe())
    seen = result.max_score_error
    if seen is not None and seen > logit_error:
        raise AssertionError(f"the two paths' scores differ by {seen:.3g}, more than the stated "
                             f"error {logit_error:.3g}: the near-tie tolerance does not hold")
    return result


def phrase(result: AgreementSummary, what: str = "sequences") -> str:
    """The outcome in words, for the prose: how many sequences (`what`, a plural noun) gave
    the same tokens throughout, and how many parted at an excused near-tie, with the widest
    excused gap against the tolerance."""
    total = len(result.sequences)
    parted = [a for a in result.sequences if a.excused]
    if total == 1:
        head = f"the {what[:-1] if what.endswith('s') else what} gave the same tokens throughout"
        if parted:
            head = f"the {what[:-1] if what.endswith('s') else what} parted at a near-tie"
    elif result.exact == total:
        head = f"all {total} {what} gave the same tokens throughout"
    else:
        head = f"{result.exact} of {total} {what} gave the same tokens throughout"
        if parted:
            head += f" and {len(parted)} parted at a near-tie"
    if parted:
        widest = max(a.margin for a in parted)
        head += (f" (a reference gap of {'at most ' if len(parted) > 1 else ''}{widest:.1e} logits, "
                 f"within the tolerance of {parted[0].tolerance:.1e}), which the rule excuses")
    else:
        head += " (none parted at a near-tie)"
    if result.failed:
        head += f"; {result.failed} diverged beyond the tolerance"
    return head


def error_text(result: AgreementSummary) -> str:
    """The largest score difference measured between the paths, or a note that none was."""
    seen = result.max_score_error
    return "not measured" if seen is None else f"{seen:.1e}"


__all__ = ["LOGIT_ERROR", "BF16_LOGIT_ERROR", "tolerance", "log_probs", "engine_scores",
           "compare", "summary", "check", "phrase", "error_text"]
