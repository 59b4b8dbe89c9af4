"""The near-tie rule (`labkit.util.near_tie`): a divergence at a gap the two paths' rounding
can close is excused and ends the comparison; a wider one fails; both are counted."""

import math

import pytest
import torch

from labkit.util.near_tie import (assert_greedy_agree, compare_greedy, flip_tolerance, greedy_agreement,
                                  top_two_margins)


def scores_for(tokens, gaps, vocab=8):
    """Per-step logits whose best is tokens[i] and whose runner-up (token 7) is gaps[i] below."""
    out = torch.zeros(len(tokens), vocab)
    for i, (t, gap) in enumerate(zip(tokens, gaps)):
        out[i, t], out[i, 7] = 5.0, 5.0 - gap
    return out


def test_equal_tokens_agree_exactly():
    result = greedy_agreement([1, 2, 3], [1, 2, 3], scores_for([1, 2, 3], [1, 1, 1]), tolerance=0.01)
    assert result.exact and result.ok and not result.excused and result.compared == 3


def test_a_flip_at_a_near_tie_is_excused_and_ends_the_comparison():
    scores = scores_for([1, 2, 3, 4], [1.0, 0.004, 1.0, 1.0])
    # after the flip the candidate continues from another text: its later tokens are not read
    result = greedy_agreement([1, 2, 3, 4], [1, 7, 0, 0], scores, tolerance=0.01)
    assert result.excused and result.ok and result.diverged_at == 1 and result.compared == 2
    assert result.margin == pytest.approx(0.004, abs=1e-6)
    assert "excused" in result.describe()


def test_a_flip_at_a_wide_margin_fails():
    scores = scores_for([1, 2, 3], [1.0, 0.5, 1.0])
    result = greedy_agreement([1, 2, 3], [1, 7, 3], scores, tolerance=0.01)
    assert not result.ok and not result.excused and "NOT excused" in result.describe()
    with pytest.raises(AssertionError, match="NOT excused"):
        assert_greedy_agree(result)


def test_the_gap_is_to_the_candidates_token_not_to_the_runner_up():
    """A candidate that took a token far down the reference's list is not a rounding flip,
    even where the top two are tied."""
    scores = scores_for([1], [0.001])
    scores[0, 5] = 1.0  # token 5: 4 below the best
    assert greedy_agreement([1], [7], scores, tolerance=0.01).ok
    assert not greedy_agreement([1], [5], scores, tolerance=0.01).ok


def test_top_k_mappings_bound_a_missing_token_from_above():
    steps = [[(1, -0.1), (7, -0.105)]]  # the engine's top_logprobs shape
    assert greedy_agreement([1], [7], steps, tolerance=0.01).excused
    # token 3 is not among the top two: its gap is at least 0.005; excused only if that bound is
    missing = greedy_agreement([1], [3], steps, tolerance=0.01)
    assert missing.excused and missing.margin == pytest.approx(0.005)
    assert not greedy_agreement([1], [3], [[(1, -0.1), (7, -2.0)]], tolerance=0.01).ok


def test_lengths_that_differ_fail_without_a_divergence_to_excuse():
    result = greedy_agreement([1, 2, 3], [1, 2], scores_for([1, 2, 3], [1, 1, 1]), tolerance=10.0)
    assert not result.ok and result.diverged_at == 2 and "lengths differ" in result.describe()


def test_the_score_error_is_measured_on_the_shared_positions():
    ref = scores_for([1, 2, 3], [1.0, 0.002, 1.0])
    cand = ref.clone()
    cand[0, 1] += 3e-4  # the shared position: its error counts
    cand[2, 3] += 9.0   # after the divergence: never read
    result = greedy_agreement([1, 2, 3], [1, 7, 3], ref, flip_tolerance(1e-3), candidate_scores=cand)
    assert result.excused and result.max_score_error == pytest.approx(3e-4, rel=1e-3)


def test_a_summary_counts_exact_excused_and_failed_sequences():
    refs = [[1, 2], [1, 2], [1, 2]]
    cands = [[1, 2], [1, 7], [7, 2]]
    scores = [scores_for([1, 2], [1, 1]), scores_for([1, 2], [1, 0.001]), scores_for([1, 2], [1, 1])]
    summary = compare_greedy(refs, cands, scores, tolerance=0.01)
    assert (summary.exact, summary.excused, summary.failed, summary.ok) == (1, 1, 1, False)
    assert summary.tokens_compared == 2 + 1 + 0
    text = summary.describe()
    assert "1 parted at a near-tie (excused), 1 failed" in text and "sequence 2" in text
    assert compare_greedy(refs[:2], cands[:2], scores[:2], tolerance=0.01).ok


def test_margins_and_tolerances():
    logits = torch.tensor([[0.0, 3.0, 2.5], [1.0, 1.0, -1.0]])
    assert top_two_margins(logits) == pytest.approx([0.5, 0.0])
    assert flip_tolerance(2e-3) == pytest.approx(4e-3)
    with pytest.raises(ValueError):
        flip_tolerance(-1.0)
    with pytest.raises(ValueError):
        greedy_agreement([1], [1], scores_for([1], [1]), tolerance=math.nan)
    with pytest.raises(ValueError, match="scores"):
        greedy_agreement([1, 2], [1, 2], scores_for([1], [1]), tolerance=0.1)
