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
    low, high = ic.wilson_interval(successes, total)
    assert (low, high) == pytest.approx((expected.low, expected.high), abs=1e-9)
    assert low <= successes / total <= high  # a plotted error bar is never negative


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


def test_false_accepts_counts_the_wrong_answers_the_verifier_lets_through():
    rows = [sampled((8, 5), [13, 23, 12, None, 3]), sampled((1, 1), [2, 12, 2])]
    # wrong: 23, 12, 3 (first question), 12 (second); 23, 3 and 12 end in the right digit
    assert ic.false_accepts(rows, ic.last_digit_verifier) == (3, 4)
    assert ic.false_accepts(rows, ic.exact_verifier) == (0, 4)


def test_the_costs_count_only_the_samples_a_rule_reads():
    rows = [ic.Sampled(ic.Problem((1, 2), ""), [3, 3, 4], [2, 4, 3]),
            ic.Sampled(ic.Problem((2, 2), ""), [4, 1, 1], [4, 1, 1])]
    points = {p.method: p for p in ic.accuracy_curve(rows, [3], {"one": ("first", None),
                                                                 "vote": ("majority", None)})}
    assert points["one"].tokens_per_question == 3.0 and points["one"].steps_per_question == 3.0
    # the vote reads all three: tokens add up (9 and 6), steps are the longest sample (4 and 4)
    assert points["vote"].tokens_per_question == 7.5 and points["vote"].steps_per_question == 4.0
    assert ic.samples_read("first", 32) == 1 and ic.samples_read("best_of_n", 32) == 32


def test_within_budget_cuts_every_sample_and_reparses_it():
    row = ic.Sampled(ic.Problem((2, 3), ""), [5], [6], ["x"], [[1, 2, 3, 4, 5, 6]])
    texts = {(1, 2): " The", (1, 2, 3, 4): " The answer is 5"}
    (cut,) = ic.within_budget([row], 4, lambda ids: texts.get(tuple(ids), ""), ic.worked_answer)
    assert (cut.answers, cut.tokens, cut.token_ids) == ([5], [4], [[1, 2, 3, 4]])
    (short,) = ic.within_budget([row], 2, lambda ids: texts.get(tuple(ids), ""), ic.worked_answer)
    assert (short.answers, short.tokens) == ([None], [2])
    (whole,) = ic.within_budget([row], 99, lambda ids: "", ic.worked_answer)
    assert whole.tokens == [6]
    with pytest.raises(ValueError, match="token ids"):
        ic.within_budget([sampled((1, 1), [2])], 4, str, ic.worked_answer)


def test_the_direct_control_asks_in_the_same_format_as_the_worked_prompt():
    problem = ic.Problem((51, 8), "")
    worked, direct = ic.worked_prompt(problem), ic.worked_prompt(problem, ic.DIRECT_QA_SHOTS)
    assert worked.endswith("Q: 51 + 8\nA:") and direct.endswith("Q: 51 + 8\nA:")
    assert [ic.worked_answer(line) for line in ic.DIRECT_QA_SHOTS.splitlines()[1::2]] == [27, 65]
    assert ic.DIRECT_QA_SHOTS.count(ic.QA_STOP.strip()) == ic.WORKED_SHOTS.count(ic.QA_STOP.strip())


@pytest.mark.slow
def test_a_smaller_greedy_budget_is_the_first_tokens_of_a_larger_one_and_stops_at_the_next_question(model):
    from labkit.engine import LLMEngine

    engine = LLMEngine(model)
    problems = ic.addition_problems(3, seed=2)
    prompts = [ic.worked_prompt(p) for p in problems]
    run = dict(n=1, temperature=0.0, parse=ic.worked_answer, prompts=prompts, stop=[ic.QA_STOP])
    long = ic.sample_answers(engine, problems, max_tokens=64, **run)
    assert all(ic.QA_STOP not in s.texts[0] for s in long)
    assert any(s.tokens[0] < 64 for s in long)  # an answer ended at the next question
    for budget in (5, 20):
        alone = ic.sample_answers(engine, problems, max_tokens=budget, **run)
        cut = ic.within_budget(long, budget, model.tokenizer.decode, ic.worked_answer)
        assert [s.token_ids for s in cut] == [s.token_ids for s in alone]
        assert [s.answers for s in cut] == [s.answers for s in alone]


def test_every_question_gets_its_own_seed_and_two_base_seeds_do_not_overlap():
    seeds = ic.question_seeds(0, 200)
    assert len(set(seeds)) == 200 and seeds == ic.question_seeds(0, 200)
    assert not set(seeds) & set(ic.question_seeds(1, 200))  # seed + i would overlap in 199 places


@pytest.mark.slow
def test_the_same_prompt_asked_twice_draws_two_independent_samples(model):
    from labkit.engine import LLMEngine

    engine = LLMEngine(model)
    (problem,) = ic.addition_problems(1, seed=4)
    twice = ic.sample_answers(engine, [problem] * 6, n=1, temperature=1.5, max_tokens=4, seed=0)
    # one shared seed would give six identical texts: the draw depends only on seed and step
    assert len({s.texts[0] for s in twice}) > 1


def test_per_sample_accuracy_scores_each_index_alone():
    rows = [sampled((1, 2), [3, 4, 3]), sampled((2, 2), [1, 4, 4]), sampled((5, 5), [10, 10, 1, 9])]
    assert ic.per_sample_accuracy(rows) == pytest.approx([2 / 3, 2 / 3, 2 / 3])
    rows[0].answers[1] = 3
    assert ic.per_sample_accuracy(rows) == pytest.approx([2 / 3, 1.0, 2 / 3])


def test_the_clustered_interval_widens_when_answers_to_a_question_move_together():
    # 100 questions of 10 answers each, 30 questions wholly right: really 100 draws, not 1,000
    hits, totals = [10] * 30 + [0] * 70, [10] * 100
    low, high = ic.clustered_rate_interval(hits, totals)
    half = 1.96 * (0.3 * 0.7 / 100) ** 0.5  # the normal interval over 100 independent questions
    assert (low, high) == pytest.approx((0.3 - half, 0.3 + half), abs=0.02)
    # one answer per question: the same as the binomial interval over the answers
    low1, high1 = ic.clustered_rate_interval([1] * 30 + [0] * 70, [1] * 100)
    assert (low1, high1) == pytest.approx((0.3 - half, 0.3 + half), abs=0.02)
    with pytest.raises(ValueError):
        ic.clustered_rate_interval([1], [1, 2])


def test_false_accept_offsets_are_how_far_each_accepted_wrong_answer_is():
    rows = [sampled((8, 5), [13, 23, 12, None, 3, 3]), sampled((1, 1), [2, 12, 2, 1])]
    # accepted wrong answers: 23 (+10), 3 twice (-10) for 13; 12 (+10) for 2; 12 and 1 rejected
    offsets = ic.false_accept_offsets(rows, ic.last_digit_verifier)
    assert offsets == {10: 2, -10: 2}
    assert sum(offsets.values()) == ic.false_accepts(rows, ic.last_digit_verifier)[0]
    far = [sampled((59, 7), [126, 76, 56, 66])]  # 126 is the outlier a model wrote for 59 + 7
    assert ic.false_accept_offsets(far, ic.last_digit_verifier) == {60: 1, 10: 1, -10: 1}
    assert not ic.false_accept_offsets(far, ic.exact_verifier)


def test_false_accepts_by_question_adds_up_to_the_pooled_count():
    rows = [sampled((8, 5), [13, 23, 12, None, 3]), sampled((1, 1), [2, 12, 2])]
    assert ic.false_accepts_by_question(rows, ic.last_digit_verifier) == [(2, 3), (1, 1)]


def test_the_first_step_says_whose_digits_a_worked_answer_adds():
    question = ic.Problem((59, 7), "")
    assert ic.first_step(question, " 9 + 7 = 16, so the last digit is 6") == "its own digits"
    assert ic.first_step(question, " 8 + 7 = 15, so the last digit is 8") == "an example's digits"
    assert ic.first_step(question, " 3 + 4 = 7") == "an example's digits"
    assert ic.first_step(question, " 5 + 2 = 7") == "other digits"
    # one number in an example's place, the other the question's: a part copy
    assert ic.first_step(question, " 8 + 5 = 13") == "part an example's"
    assert ic.first_step(question, " 9 + 4 = 13") == "part an example's"
    # the whole operands, even where one of them is an example's number in its place
    assert ic.first_step(question, " 59 + 7 = 66") == "its whole operands"
    assert ic.first_step(ic.Problem((58, 7), ""), " 58 + 7 = 65") == "its whole operands"
    assert ic.first_step(question, " The answer is 66.") == "no digit sum"
    rows = [sampled((59, 7), [65]), sampled((58, 7), [65]), sampled((1, 2), [27]), sampled((1, 2), [None])]
    assert ic.copied_answers(rows) == 2  # 65 for 58 + 7 is right, not a copy


def test_a_serial_row_counts_each_first_sum_once_and_leaves_them_blank_without_working():
    question = ic.Problem((59, 7), "")
    texts = [" 9 + 7 = 16. The answer is 66.", " 8 + 7 = 15", " 8 + 5 = 13", " 59 + 7 = 66",
             " 5 + 2 = 7", " The answer is 65."]
    written = [ic.Sampled(question, [ic.worked_answer(t)], [len(t)], [t]) for t in texts]
    forced = [ic.Sampled(question, [66 if i < 4 else 65], [len(t) + 2], [t]) for i, t in enumerate(texts)]
    row = ic.serial_row("worked", written, forced)
    assert [row[f"first sum: {kind}"] for kind in ic.FIRST_STEPS] == [1, 1, 1, 1, 1, 1]
    assert sum(row[f"first sum: {kind}"] for kind in ic.FIRST_STEPS) == len(texts)
    assert (row["answered unforced"], row["right unforced"], row["right"]) == (2, 1, 4)
    low, high = ic.wilson_interval(4, 6)
    assert row["accuracy"] == "66.7%" and row["95% interval"] == f"{low:.1%}-{high:.1%}"
    at_once = ic.serial_row("at once", written, written, worked=False)
    assert all(at_once[f"first sum: {kind}"] == "" for kind in ic.FIRST_STEPS)
    assert at_once["right"] == 1


def test_successive_differences_find_where_a_curve_stops_rising():
    # the right answer first appears at sample 2 for 40 questions and never for 10 more
    rows = [sampled((1, 1), [3, 3, 2, 3])] * 40 + [sampled((1, 1), [3, 3, 3, 3])] * 10
    steps = ic.successive_differences(rows, [1, 2, 4], "best_of_n", ic.exact_verifier)
    assert [(a, b, d.verdict) for a, b, d in steps] == [(1, 2, "within the noise"), (2, 4, "better")]
    assert steps[1][2].difference == pytest.approx(0.8)
    assert ic.last_rise(steps) == (2, 4) and ic.last_rise(steps[:1]) is None


@pytest.mark.slow
def test_budget_forcing_answers_every_cut_row_and_keeps_the_ones_that_answered(model):
    from labkit.engine import LLMEngine

    engine = LLMEngine(model)
    problems = ic.addition_problems(3, seed=2)
    prompts = [ic.worked_prompt(p) for p in problems]
    run = ic.sample_answers(engine, problems, n=1, temperature=0.0, max_tokens=64, parse=ic.worked_answer,
                            prompts=prompts, stop=[ic.QA_STOP])
    cut = ic.within_budget(run, 6, model.tokenizer.decode, ic.worked_answer)
    assert all(r.answers[0] is None for r in cut)
    forced = ic.force_answers(LLMEngine(model), cut, prompts)
    # the reference: each prompt, its cut text and the forcing phrase, built here and run as one
    # batch on a fresh engine, as force_answers runs them: one numerical path, so exact equality
    refs = ic.sample_answers(LLMEngine(model), [r.problem for r in cut], n=1, temperature=0.0, max_tokens=4,
                             prompts=[p + r.texts[0] + ic.FORCE_ANSWER for p, r in zip(prompts, cut)],
                             stop=[ic.QA_STOP])
    for r, f, alone in zip(cut, forced, refs):
        assert f.answers == alone.answers and f.answers[0] is not None
        assert f.texts == [r.texts[0] + ic.FORCE_ANSWER + alone.texts[0]]
        assert f.tokens == [6 + alone.tokens[0]]
    answered = [ic.Sampled(r.problem, [r.answers[0] or 1], r.tokens, r.texts, r.token_ids) for r in cut]
    assert ic.force_answers(engine, answered, prompts) == answered
