"""Inference-time compute on a task a program checks: serial budget, majority vote, best-of-N.

Chapter 33 spends more tokens on the same questions in three ways and asks what each buys:

- **serial**: one answer, with a larger token budget (room to "think" before answering),
  beside a control that answers at once in the same Q:/A: format, so that the format and the
  budget are not confounded;
- **parallel + majority vote**: N samples at a temperature, the most common answer wins;
- **best-of-N with a verifier**: N samples, a verifier filters them, majority vote among
  those it accepts. The verifier here is a program: an exact one (an oracle, the ceiling of
  any verifier) and a partial one that checks only the last digit of a sum, as a real
  verifier checks some properties of an answer and not all.

The task is addition with a few-shot prompt: these small models get a useful fraction right,
and a program knows the answer. Everything is counted per question, so accuracies come with
a Wilson interval and two methods on the same questions with a paired bootstrap of their
difference (`paired_difference`), never a bare comparison of two percentages.

Two costs are counted, not timed: output tokens (what the spending adds) and sequential decode
steps (a count of the engine steps a question needs before its last sample ends: N forked samples
of 4 tokens cost 4N tokens but only 4 steps, though a step of many rows costs more than one of one).

Each question gets its own seed (`question_seeds`): the engine's draw depends only on the seed and
the step, so questions that shared one seed would share their uniforms and their outcomes would not
be independent, which the intervals assume.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

FEW_SHOT = {1: "3 + 4 = 7\n5 + 2 = 7\n", 2: "23 + 4 = 27\n58 + 7 = 65\n"}
# The serial method's prompt: two worked answers that spell out the digit sums, so a larger
# token budget gives the model room to work before it states "The answer is N."
WORKED_SHOTS = ("Q: 23 + 4\nA: 3 + 4 = 7, so the last digit is 7 and the tens stay 2. The answer is 27.\n"
                "Q: 58 + 7\nA: 8 + 7 = 15, so the last digit is 5 and we carry 1: 5 + 1 = 6. "
                "The answer is 65.\n")
# The serial method's control: the same questions and format, answered at once.
DIRECT_QA_SHOTS = "Q: 23 + 4\nA: The answer is 27.\nQ: 58 + 7\nA: The answer is 65.\n"
# Where a Q:/A: answer ends: past it the model invents the next question.
QA_STOP = "\nQ:"
INTEGER = re.compile(r"-?\d+")
ANSWER_IS = re.compile(r"The answer is (-?\d+)")
# Budget forcing (as in s1): where the budget ran out before an answer, append this and let the
# model name a number, so that every budget yields an answer.
FORCE_ANSWER = " The answer is"
# The digit sums the worked examples spell out first (3 + 4 for 23 + 4, 8 + 7 for 58 + 7) and
# their answers: a worked answer that starts from these copied the example, not its question.
SHOT_STEPS = ((3, 4), (8, 7))
SHOT_ANSWERS = (27, 65)
DIGIT_SUM = re.compile(r"(\d+) \+ (\d+) =")


@dataclass(frozen=True)
class Problem:
    operands: tuple[int, ...]
    prompt: str

    @property
    def answer(self) -> int:
        return sum(self.operands)


def addition_problems(count: int, *, seed: int = 0, first_digits: int = 1) -> list[Problem]:
    """`count` few-shot addition prompts "a + b =" where `a` has `first_digits` digits (1 or
    2) and `b` is one digit. Seeded, so a chapter and its test see the same questions."""
    if first_digits not in FEW_SHOT:
        raise ValueError(f"first_digits must be one of {sorted(FEW_SHOT)}, got {first_digits}")
    rng = random.Random(seed)
    low, high = (1, 9) if first_digits == 1 else (10, 99)
    problems = []
    for _ in range(count):
        a, b = rng.randint(low, high), rng.randint(1, 9)
        problems.append(Problem((a, b), f"{FEW_SHOT[first_digits]}{a} + {b} ="))
    return problems


def first_integer(text: str) -> int | None:
    """The answer a few-shot completion gives: the first integer in it (None if there is none)."""
    found = INTEGER.search(text)
    return int(found.group()) if found else None


def worked_prompt(problem: Problem, shots: str = WORKED_SHOTS) -> str:
    """The question in the Q:/A: format after `shots` (worked answers by default;
    `DIRECT_QA_SHOTS` for the control that answers at once)."""
    return shots + f"Q: {' + '.join(map(str, problem.operands))}\nA:"


def worked_answer(text: str) -> int | None:
    """The N of "The answer is N" in the model's own answer (cut at the next "Q:", where it
    starts inventing questions); None when the budget ran out before it said so."""
    found = ANSWER_IS.search(text.split("\nQ:")[0])
    return int(found.group(1)) if found else None


def final_integer(text: str) -> int | None:
    """The answer of a worked reply: the integer after the last "Answer:", else the last one."""
    tail = text.rpartition("Answer:")[2] if "Answer:" in text else text
    found = INTEGER.findall(tail) or INTEGER.findall(text)
    return int(found[-1]) if found else None


# -- voting --------------------------------------------------------------------------------
def majority(answers: Sequence[int | None]) -> int | None:
    """The most common answer; ties go to the one seen first (so the rule is deterministic)."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


Verifier = Callable[[Problem, int], bool]


def exact_verifier(problem: Problem, answer: int) -> bool:
    """An oracle: accepts the right answer only. Best-of-N with it is pass@N."""
    return answer == problem.answer


def last_digit_verifier(problem: Problem, answer: int) -> bool:
    """A partial check, as a unit test is: the sum's last digit, from the operands' last digits.
    Wrong answers spread evenly over last digits would pass one time in ten; a model's errors
    are not spread evenly, so `false_accepts` counts how many of its own wrong answers pass."""
    return answer % 10 == sum(x % 10 for x in problem.operands) % 10


def best_of_n(problem: Problem, answers: Sequence[int | None], verifier: Verifier) -> int | None:
    """Majority vote among the answers the verifier accepts; among all if it accepts none."""
    accepted = [a for a in answers if a is not None and verifier(problem, a)]
    return majority(accepted) if accepted else majority(answers)


def false_accepts_by_question(sampled: Sequence["Sampled"], verifier: Verifier) -> list[tuple[int, int]]:
    """Per question, (its wrong answers the verifier accepts, its wrong answers); answers that
    are not a number are not counted (a verifier never sees them)."""
    rows = []
    for s in sampled:
        wrong = [a for a in s.answers if a is not None and a != s.problem.answer]
        rows.append((sum(verifier(s.problem, a) for a in wrong), len(wrong)))
    return rows


def false_accepts(sampled: Sequence["Sampled"], verifier: Verifier) -> tuple[int, int]:
    """(wrong answers the verifier accepts, wrong answers) over every sample of every question."""
    rows = false_accepts_by_question(sampled, verifier)
    return sum(r[0] for r in rows), sum(r[1] for r in rows)


def false_accept_offsets(sampled: Sequence["Sampled"], verifier: Verifier) -> Counter[int]:
    """How far each wrong answer the verifier accepts is from the right one (answer - right
    answer), counted over every sample. For the last-digit check every offset is a multiple of
    ten: this says how many are a single carry (±10) and how many lie further out."""
    return Counter(a - s.problem.answer for s in sampled for a in s.answers
                   if a is not None and a != s.problem.answer and verifier(s.problem, a))


# -- what a worked answer did ---------------------------------------------------------------
def first_step(problem: Problem, text: str) -> str:
    """Where a worked answer's first sum "x + y =" comes from: "its own digits" (the question's
    last digits), "an example's digits" (`SHOT_STEPS`), "part an example's" (one of the two is
    an example's number in its place, as 8 + 5 for 49 + 5), "its whole operands" (59 + 7 for
    59 + 7: the sum without the digit method), "other digits", or "no digit sum". A model that
    copies the worked examples writes their sums, whatever it is asked."""
    found = DIGIT_SUM.search(text)
    if not found:
        return "no digit sum"
    step = (int(found.group(1)), int(found.group(2)))
    if step == (problem.operands[0] % 10, problem.operands[1] % 10):
        return "its own digits"
    if step in SHOT_STEPS:
        return "an example's digits"
    if step == tuple(problem.operands):
        return "its whole operands"
    if any(step[0] == shot[0] or step[1] == shot[1] for shot in SHOT_STEPS):
        return "part an example's"
    return "other digits"


def copied_answers(sampled: Sequence["Sampled"]) -> int:
    """Answers (sample 0) that are a worked example's answer where the question's is another."""
    return sum(s.answers[0] in SHOT_ANSWERS and s.answers[0] != s.problem.answer for s in sampled)


# -- sampling ------------------------------------------------------------------------------
@dataclass
class Sampled:
    """One question's answers: `answers[i]` from sample i, `tokens[i]` the tokens it generated
    (`token_ids[i]` the ids themselves, where kept)."""

    problem: Problem
    answers: list[int | None]
    tokens: list[int]
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)


def sample_answers(engine, problems: Sequence[Problem], *, n: int, temperature: float, max_tokens: int,
                   seed: int = 0, parse: Callable[[str], int | None] = first_integer,
                   prompts: Sequence[str | list[int]] | None = None,
                   stop: Sequence[str] = ()) -> list[Sampled]:
    """`n` samples per question from the engine (one request with `n` samples, so they share
    the prompt's KV blocks), each question with its own seed from `question_seeds(seed, ...)`
    (the engine gives each of a request's samples its own stream from that seed). Temperature 0
    gives the greedy answer `n` times over. A sample ends at `max_tokens` or at the first of
    the `stop` strings."""
    from labkit.sampling import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=q, stop=tuple(stop))
              for q in question_seeds(seed, len(problems))]
    outputs = engine.generate(list(prompts) if prompts is not None else [p.prompt for p in problems],
                              params, n=n)
    return [Sampled(p, [parse(s.text) for s in out.samples], [len(s.token_ids) for s in out.samples],
                    [s.text for s in out.samples], [list(s.token_ids) for s in out.samples])
            for p, out in zip(problems, outputs)]


def question_seeds(seed: int, count: int) -> list[int]:
    """`count` seeds, one per question, derived from `seed` by a hash (so two base seeds do not
    hand out overlapping runs of seeds, as `seed + i` would)."""
    return [int.from_bytes(hashlib.blake2b(f"{seed}/question {i}".encode(), digest_size=8).digest(), "little")
            for i in range(count)]


def within_budget(greedy: Sequence[Sampled], budget: int, decode: Callable[[list[int]], str],
                  parse: Callable[[str], int | None]) -> list[Sampled]:
    """What greedy decoding with `max_tokens=budget` answers, read off one longer greedy run:
    greedy picks each token from the tokens before it alone, so a run cut at `budget` tokens
    is the longer run's first `budget` tokens. One run at the largest budget serves them all."""
    rows = []
    for s in greedy:
        if len(s.token_ids) != len(s.answers):
            raise ValueError("within_budget needs the samples' token ids (sample_answers keeps them)")
        ids = [t[:budget] for t in s.token_ids]
        texts = [decode(t) for t in ids]
        rows.append(Sampled(s.problem, [parse(t) for t in texts], [len(t) for t in ids], texts, ids))
    return rows


def force_answers(engine, rows: Sequence[Sampled], prompts: Sequence[str], *,
                  answer_tokens: int = 4) -> list[Sampled]:
    """Budget forcing: each row whose (greedy) answer ran out of budget without "The answer is"
    is continued greedily from its prompt, its text and `FORCE_ANSWER`, for `answer_tokens`
    tokens, and the first number there is its answer. Rows that answered are kept as they are.
    Tokens count what the model generated (its text, then the forced answer's tokens)."""
    todo = [i for i, r in enumerate(rows) if r.answers[0] is None]
    if not todo:
        return list(rows)
    forced = sample_answers(engine, [rows[i].problem for i in todo], n=1, temperature=0.0,
                            max_tokens=answer_tokens, prompts=[prompts[i] + rows[i].texts[0] + FORCE_ANSWER
                                                               for i in todo], stop=[QA_STOP])
    out = list(rows)
    for i, f in zip(todo, forced):
        r = rows[i]
        out[i] = Sampled(r.problem, f.answers, [r.tokens[0] + f.tokens[0]],
                         [r.texts[0] + FORCE_ANSWER + f.texts[0]], [r.token_ids[0] + f.token_ids[0]])
    return out


# The kinds of first sum `first_step` tells apart, in the serial table's column order.
FIRST_STEPS = ("its own digits", "an example's digits", "part an example's", "its whole operands",
               "other digits", "no digit sum")


def serial_row(label: str, written: Sequence[Sampled], with_forcing: Sequence[Sampled], *,
               worked: bool = True) -> dict[str, object]:
    """One row of the serial table: what the answers said on their own (`written`), what they
    got with the answer forced, and (for worked answers only) where each first sum came from;
    an answer given at once has no working, so its first-sum cells are left blank."""
    right = correct_at(with_forcing, 1, "first")
    low, high = wilson_interval(sum(right), len(right))
    steps = Counter(first_step(s.problem, s.texts[0]) for s in written)
    row: dict[str, object] = {
        "arm": label,
        "answered unforced": sum(s.answers[0] is not None for s in written),
        "right unforced": sum(correct_at(written, 1, "first")),
        "right": sum(right),
        "accuracy": f"{sum(right) / len(right):.1%}",
        "95% interval": f"{low:.1%}-{high:.1%}",
        "tokens per question": round(tokens_at(with_forcing, 1), 1),
    }
    for kind in FIRST_STEPS:
        row[f"first sum: {kind}"] = steps[kind] if worked else ""
    return row


def per_sample_accuracy(sampled: Sequence[Sampled]) -> list[float]:
    """Accuracy of sample i alone, for each index i: how much one sample's accuracy varies
    with the draw (each index is a different stream for every question)."""
    count = min(len(s.answers) for s in sampled)
    return [sum(s.answers[i] == s.problem.answer for s in sampled) / len(sampled) for i in range(count)]


def correct_at(sampled: Sequence[Sampled], n: int, rule: str, verifier: Verifier | None = None) -> list[bool]:
    """Per question, whether `rule` over its first `n` samples gives the right answer.
    Rules: "first" (sample 0 alone), "majority", "best_of_n" (needs a verifier)."""
    right = []
    for s in sampled:
        if len(s.answers) < n:
            raise ValueError(f"{n} samples asked, {len(s.answers)} drawn")
        answers = s.answers[:n]
        if rule == "first":
            picked = answers[0]
        elif rule == "majority":
            picked = majority(answers)
        elif rule == "best_of_n":
            if verifier is None:
                raise ValueError("best_of_n needs a verifier")
            picked = best_of_n(s.problem, answers, verifier)
        else:
            raise ValueError(f"unknown rule {rule!r}")
        right.append(picked == s.problem.answer)
    return right


def tokens_at(sampled: Sequence[Sampled], n: int) -> float:
    """Mean output tokens spent per question by its first `n` samples."""
    return sum(sum(s.tokens[:n]) for s in sampled) / len(sampled)


def steps_at(sampled: Sequence[Sampled], n: int) -> float:
    """Mean sequential decode steps per question for its first `n` samples: they run side by
    side, so a question waits for its longest sample, not for their sum."""
    return sum(max(s.tokens[:n]) for s in sampled) / len(sampled)


def samples_read(rule: str, n: int) -> int:
    """How many of the `n` drawn samples a rule looks at: "first" reads one, the others all."""
    return 1 if rule == "first" else n


# -- intervals -----------------------------------------------------------------------------
def wilson_interval(successes: int, total: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion (sound at 0 and at the total, unlike p +- 2 SE)."""
    if total < 1:
        raise ValueError("a proportion of nothing has no interval")
    z = _normal_quantile(1 - (1 - confidence) / 2)
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    # The interval always holds p; the clamps only stop rounding from putting p a hair outside.
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def _normal_quantile(q: float) -> float:
    return float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(q, dtype=torch.float64)))


@dataclass(frozen=True)
class Difference:
    """Accuracy of `b` minus accuracy of `a` on the same questions, with a bootstrap interval."""

    difference: float
    low: float
    high: float
    confidence: float

    @property
    def verdict(self) -> str:
        if self.low > 0:
            return "better"
        if self.high < 0:
            return "worse"
        return "within the noise"


def paired_difference(a: Sequence[bool], b: Sequence[bool], *, confidence: float = 0.95,
                      resamples: int = 4000, seed: int = 0) -> Difference:
    """Paired percentile bootstrap over questions of mean(b) - mean(a)."""
    if len(a) != len(b) or not a:
        raise ValueError("paired_difference needs two equally long, non-empty lists of outcomes")
    diffs = torch.tensor([float(y) - float(x) for x, y in zip(a, b)], dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(diffs), (resamples, len(diffs)), generator=generator)
    means = diffs[picks].mean(dim=1)
    tail = (1 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return Difference(float(diffs.mean()), float(low), float(high), confidence)


def clustered_rate_interval(hits: Sequence[int], totals: Sequence[int], *, confidence: float = 0.95,
                            resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap over questions of a pooled rate sum(hits) / sum(totals), where
    question q contributes `hits[q]` of `totals[q]`: answers to one question are not independent,
    so questions, not answers, are what is resampled."""
    if len(hits) != len(totals) or not hits or sum(totals) < 1:
        raise ValueError("clustered_rate_interval needs equally long lists with something counted")
    h, t = (torch.tensor(list(v), dtype=torch.float64) for v in (hits, totals))
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(h), (resamples, len(h)), generator=generator)
    rates = h[picks].sum(dim=1) / t[picks].sum(dim=1).clamp(min=1)
    tail = (1 - confidence) / 2
    low, high = torch.quantile(rates, torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return float(low), float(high)


def successive_differences(sampled: Sequence[Sampled], ns: Sequence[int], rule: str,
                           verifier: Verifier | None = None) -> list[tuple[int, int, Difference]]:
    """(N, next N, paired difference of accuracy) for each step along `ns`: where a curve
    stops rising is the last step whose rise is beyond the noise."""
    right = {n: correct_at(sampled, n, rule, verifier) for n in ns}
    return [(a, b, paired_difference(right[a], right[b])) for a, b in zip(ns, ns[1:])]


def last_rise(steps: Sequence[tuple[int, int, Difference]]) -> tuple[int, int] | None:
    """The last (N, next N) step that rose beyond the noise; None if none did."""
    risen = [(a, b) for a, b, d in steps if d.verdict == "better"]
    return risen[-1] if risen else None


@dataclass(frozen=True)
class CurvePoint:
    """One method at N samples drawn; the costs count only the samples the method reads."""

    method: str
    samples: int
    tokens_per_question: float
    accuracy: float
    low: float
    high: float
    steps_per_question: float


def accuracy_curve(sampled: Sequence[Sampled], ns: Sequence[int],
                   methods: dict[str, tuple[str, Verifier | None]]) -> list[CurvePoint]:
    """Accuracy with its Wilson interval and the tokens spent, for each method at each N.
    `methods` maps a label to (rule, verifier)."""
    points = []
    for label, (rule, verifier) in methods.items():
        for n in ns:
            right = correct_at(sampled, n, rule, verifier)
            low, high = wilson_interval(sum(right), len(right))
            used = samples_read(rule, n)
            points.append(CurvePoint(label, n, tokens_at(sampled, used), sum(right) / len(right), low, high,
                                     steps_at(sampled, used)))
    return points
