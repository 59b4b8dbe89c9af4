"""Chapter 33's voting, verifiers and intervals, against closed forms and scipy; one engine run."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import binomtest

from labkit.experiments import inference_compute as ic


def sampled(operands, answers):
    problem = ic.Problem(tuple(operands), "")
    return ic.Sampled(problem, list(answers), [1] * len(answers))


def test_majority_takes_the_most_common_answer_and_the_first_seen_on_a_tie():
    assert ic.majority([3, 5, 5, None, 3, 5]) == 5
    assert ic.majority([7, 4, 4, 7]) == 7
    assert ic.majority([None, None]) is None


def test_best_of_n_votes_among_what_the_verifier_accepts():
    problem = ic.Problem((8, 5), "")
    # 13 is right; 23 passes the last-digit check; 12 does not.
    assert ic.best_of_n(problem, [12, 12, 12, 23, 13, 13], ic.last_digit_verifier) == 13
    assert ic.best_of_n(problem, [12, 12, 23], ic.last_digit_verifier) == 23
    assert ic.best_of_n(problem, [12, 12, 11], ic.last_digit_verifier) == 12  # none accepted: plain vote


@given(st.lists(st.integers(0, 99), min_size=1, max_size=3), st.integers(-200, 200))
def test_the_last_digit_verifier_accepts_every_right_sum_and_rejects_a_wrong_last_digit(operands, other):
    problem = ic.Problem(tuple(operands), "")
    assert ic.last_digit_verifier(problem, problem.answer)
    assert ic.last_digit_verifier(problem, other) == ((other - problem.answer) % 10 == 0)


def test_best_of_n_with_the_exact_verifier_is_pass_at_n():
    rows = [sampled((2, 3), [4, 6, 5]), sampled((1, 1), [3, 3, 3]), sampled((4, 4), [8, 1, 1])]
    for n in (1, 2, 3):
        oracle = ic.correct_at(rows, n, "best_of_n", ic.exact_verifier)
        assert oracle == [r.problem.answer in r.answers[:n] for r in rows]
    assert ic.correct_at(rows, 3, "majority") == [False, False, False]  # 4, 3, 1 win the votes
    assert ic.correct_at(rows, 1, "first") == [False, False, True]


def test_answers_are_read_from_the_completion_and_from_a_worked_reply():
    assert ic.first_integer(" 12\n3 + 4 = 7") == 12
    assert ic.first_integer(" twelve") is None
    assert ic.final_integer("7 + 5: 7 + 3 = 10, plus 2 is 12. Answer: 12") == 12
    assert ic.final_integer("first 3, then 9") == 9
    assert ic.worked_answer(" 8 + 3 = 11, so ... The answer is 61.\nQ: 2 + 2\nA: The answer is 4.") == 61
    assert ic.worked_answer(" 8 + 3 = 11, so the last digit is 1\nQ: 5 + 1\nA: The answer is 6.") is None
    assert ic.worked_prompt(ic.Problem((51, 8), "")).endswith("Q: 51 + 8\nA:")


@pytest.mark.parametrize("successes,total", [(0, 10), (7, 20), (20, 20), (33, 120)])
def test_wilson_interval_matches_scipy(successes, total):
    expected = binomtest(successes, total).proportion_ci(method="wilson")
    assert ic.wilson_interval(successes, total) == pytest.approx((expected.low, expected.high), abs=1e-9)


def test_paired_difference_is_signed_and_says_noise_when_the_two_agree():
    same = [True, False] * 20
    assert ic.paired_difference(same, same).verdict == "within the noise"
    better = ic.paired_difference([False] * 30, [True] * 30)
    assert (better.difference, better.low, better.high, better.verdict) == (1.0, 1.0, 1.0, "better")
    mixed = ic.paired_difference([True] * 10 + [False] * 30, [True] * 12 + [False] * 28)
    assert mixed.difference == pytest.approx(0.05) and mixed.low <= 0 <= mixed.high


def test_problems_are_seeded_and_the_prompt_ends_where_the_answer_goes():
    first, again = ic.addition_problems(5, seed=3), ic.addition_problems(5, seed=3)
    assert first == again
    assert all(p.prompt.endswith(f"{p.operands[0]} + {p.operands[1]} =") for p in first)
    assert all(10 <= p.operands[0] <= 99 for p in ic.addition_problems(20, first_digits=2))


@pytest.mark.slow
def test_greedy_samples_all_agree_and_seeded_samples_repeat(model):
    from labkit.engine import LLMEngine

    engine = LLMEngine(model)
    problems = ic.addition_problems(4, seed=1)
    greedy = ic.sample_answers(engine, problems, n=3, temperature=0.0, max_tokens=3)
    assert all(len(set(s.answers)) == 1 for s in greedy)
    assert ic.correct_at(greedy, 3, "majority") == ic.correct_at(greedy, 1, "first")
    hot = [ic.sample_answers(engine, problems, n=4, temperature=1.0, max_tokens=3, seed=5)
           for _ in range(2)]
    assert [s.texts for s in hot[0]] == [s.texts for s in hot[1]]
    assert all(1 <= t <= 3 for s in hot[0] for t in s.tokens)
