"""Tests for labkit.sampling.

References are independent of the module: a float64 NumPy re-implementation written from the
definitions, hand-computed small cases, and Hugging Face's own logits warpers when installed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from labkit.sampling import (
    SamplingParams,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    draw_uniform,
    naive_step_generator,
    probabilities,
    process_logits,
    sample,
    sample_batch,
    step_generator,
)

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- reference


def _softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    e = np.zeros_like(x)
    e[finite] = np.exp(x[finite] - x[finite].max())
    return e / e.sum()


def ref_probs(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0, seen=()):
    """Float64 reference written straight from the definitions, one token at a time."""
    x = np.asarray(logits, dtype=np.float64).copy()
    for t in set(seen):
        x[t] = x[t] * penalty if x[t] < 0 else x[t] / penalty
    if temperature == 0:
        onehot = np.zeros_like(x)
        onehot[int(np.argmax(x))] = 1.0  # np.argmax: first maximum
        return onehot
    x = x / temperature
    keep = np.ones(x.shape, dtype=bool)
    if top_k:
        kth = np.sort(x)[::-1][min(top_k, len(x)) - 1]
        keep &= x >= kth
    if top_p < 1.0:
        probs = _softmax(np.where(keep, x, -np.inf))
        mass_above = 0.0
        for i in np.argsort(-probs, kind="stable"):
            if mass_above >= top_p:
                keep[i] = False
            mass_above += probs[i]
    if min_p > 0.0:
        probs = _softmax(np.where(keep, x, -np.inf))
        keep &= probs >= min_p * probs.max()
    return _softmax(np.where(keep, x, -np.inf))


# Small vocab used by the frequency tests; deliberately not sorted so index bugs show.
LOGITS8 = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.0, 1.0, -2.0, -0.5])

SETTINGS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.3, top_k=3),
    "top_p": dict(top_p=0.8),
    "min_p": dict(temperature=1.2, min_p=0.35),
    "all": dict(temperature=0.9, top_k=6, top_p=0.95, min_p=0.05, repetition_penalty=1.5),
}
SEEN8 = [1, 2, 1]  # a positive (1) and a negative (2) logit get penalised


def _ref_for(setting: dict) -> np.ndarray:
    return ref_probs(
        LOGITS8.numpy(),
        temperature=setting.get("temperature", 1.0),
        top_k=setting.get("top_k", 0),
        top_p=setting.get("top_p", 1.0),
        min_p=setting.get("min_p", 0.0),
        penalty=setting.get("repetition_penalty", 1.0),
        seen=SEEN8,
    )


# --------------------------------------------------------------------------- hand-computed


def test_repetition_penalty_hand_example():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 0.0])
    out = apply_repetition_penalty(logits, [0, 1, 1, 4], 2.0)
    # positive seen: /2; negative seen: *2; unseen unchanged; zero stays zero; duplicates penalise once.
    assert torch.equal(out, torch.tensor([1.0, -2.0, 0.5, -3.0, 0.0]))
    # 2-D: one id list per row.
    out2 = apply_repetition_penalty(torch.stack([logits, logits]), [[0], [3]], 2.0)
    assert torch.equal(out2[0], torch.tensor([1.0, -1.0, 0.5, -3.0, 0.0]))
    assert torch.equal(out2[1], torch.tensor([2.0, -1.0, 0.5, -6.0, 0.0]))
    with pytest.raises(ValueError):
        apply_repetition_penalty(logits, [5], 2.0)


def test_temperature_closed_form():
    logits = torch.tensor([1.0, 2.0, -4.0])
    assert torch.allclose(apply_temperature(logits, 2.0), torch.tensor([0.5, 1.0, -2.0]))
    # softmax(l / T) is p^(1/T) renormalised.
    p = torch.softmax(logits.double(), -1)
    for t in (0.5, 1.0, 3.0):
        expected = p ** (1 / t) / (p ** (1 / t)).sum()
        got = probabilities(logits.double(), SamplingParams(temperature=t))
        assert torch.allclose(got, expected, atol=1e-12)
    with pytest.raises(ValueError):
        apply_temperature(logits, 0.0)


def test_top_k_hand_example_and_ties():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert torch.equal(apply_top_k(logits, 2), torch.tensor([NEG_INF, 4.0, 3.0, NEG_INF]))
    assert torch.equal(apply_top_k(logits, 0), logits)
    assert torch.equal(apply_top_k(logits, 10), logits)
    # Values tied with the k-th largest are all kept (HF convention).
    tied = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert torch.equal(apply_top_k(tied, 1), torch.tensor([NEG_INF, 3.0, 3.0, NEG_INF]))


def test_top_p_hand_example():
    # probabilities 0.15, 0.5, 0.05, 0.3 (sorted: 0.5 | 0.3 | 0.15 | 0.05)
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)
    logits = probs.log()
    kept = lambda p: torch.isfinite(apply_top_p(logits, p)).tolist()  # noqa: E731
    assert kept(0.4) == [False, True, False, False]
    assert kept(0.75) == [False, True, False, True]
    assert kept(0.85) == [True, True, False, True]
    assert kept(0.99) == [True, True, True, True]
    assert kept(1.0) == [True, True, True, True]
    # Kept logits keep their values.
    out = apply_top_p(logits, 0.75)
    assert torch.equal(out[[1, 3]], logits[[1, 3]])
    # The top token always survives, even when it alone exceeds top_p.
    assert torch.isfinite(apply_top_p(torch.tensor([10.0, 0.0, 0.0]), 1e-6)).tolist() == [True, False, False]
    # Exact boundary: four tokens of exactly 0.25. The smallest set reaching 0.5 has two tokens,
    # and equal probabilities are ranked by token id.
    flat = torch.zeros(4)
    assert torch.isfinite(apply_top_p(flat, 0.5)).tolist() == [True, True, False, False]
    assert torch.isfinite(apply_top_p(flat, 0.25)).tolist() == [True, False, False, False]
    assert torch.isfinite(apply_top_p(flat, 0.2500001)).tolist() == [True, True, False, False]


def test_min_p_hand_example():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3], dtype=torch.float64)
    logits = probs.log()
    assert torch.isfinite(apply_min_p(logits, 0.2)).tolist() == [False, True, True, True]  # >= 0.1
    assert torch.isfinite(apply_min_p(logits, 0.5)).tolist() == [False, True, False, True]  # >= 0.25
    assert torch.equal(apply_min_p(logits, 0.0), logits)
    # Exactly at the threshold is kept: prob 0.5 * max with min_p = 0.5.
    at_threshold = torch.tensor([0.0, math.log(0.5), math.log(0.4)], dtype=torch.float64)
    assert torch.isfinite(apply_min_p(at_threshold, 0.5)).tolist() == [True, True, False]


def test_processors_against_reference_on_random_logits():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        logits = torch.randn(30, generator=gen, dtype=torch.float64) * 2
        setting = dict(temperature=0.5 + trial % 4 * 0.4, top_k=trial % 7, top_p=[1.0, 0.9, 0.6, 0.3][trial % 4])
        setting["min_p"] = [0.0, 0.05, 0.3][trial % 3]
        params = SamplingParams(**setting)
        expected = ref_probs(logits.numpy(), **setting)
        assert np.allclose(probabilities(logits, params).numpy(), expected, atol=1e-10), setting


def test_top_p_keeps_minimal_nucleus():
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        logits = torch.randn(40, generator=gen, dtype=torch.float64) * 3
        top_p = float(torch.rand((), generator=gen, dtype=torch.float64)) * 0.98 + 0.01
        p = torch.softmax(logits, -1)
        keep = torch.isfinite(apply_top_p(logits, top_p))
        kept = p[keep]
        assert kept.sum() >= top_p - 1e-12  # enough mass
        assert kept.sum() - kept.min() < top_p  # and minimal: dropping the weakest kept falls short
        assert p[~keep].max() <= kept.min() if (~keep).any() else True  # the most probable ones


def test_process_logits_order():
    """Penalty, temperature, top-k, top-p, min-p, in that order; the example is order-sensitive."""
    logits = torch.tensor([3.0, 2.6, 2.2, 1.0, 0.5, -1.0, -2.0], dtype=torch.float64)
    seen = [0, 5]
    params = SamplingParams(temperature=2.5, top_k=6, top_p=0.5, min_p=0.62, repetition_penalty=1.3)
    penalised = apply_repetition_penalty(logits, seen, 1.3)
    composed = apply_min_p(apply_top_p(apply_top_k(apply_temperature(penalised, 2.5), 6), 0.5), 0.62)
    assert torch.equal(process_logits(logits, params, seen), composed)
    assert np.allclose(
        probabilities(logits, params, seen).numpy(),
        ref_probs(logits.numpy(), temperature=2.5, top_k=6, top_p=0.5, min_p=0.62, penalty=1.3, seen=seen),
        atol=1e-12,
    )
    # Sensitivity: top-p before temperature, or min-p before top-p, would keep different sets.
    top_p_first = apply_min_p(apply_temperature(apply_top_p(apply_top_k(penalised, 6), 0.5), 2.5), 0.62)
    min_p_first = apply_top_p(apply_min_p(apply_top_k(apply_temperature(penalised, 2.5), 6), 0.62), 0.5)
    assert torch.isfinite(composed).sum() == 3
    assert torch.isfinite(top_p_first).sum() == 2
    assert torch.isfinite(min_p_first).sum() == 2


def test_greedy_is_argmax_lowest_id_on_ties_and_ignores_seeds():
    logits = torch.tensor([1.0, 5.0, 5.0, 2.0])
    params = SamplingParams(temperature=0)
    assert params.greedy and not SamplingParams().greedy
    for seed in (None, 0, 1, 123):
        for step in (0, 7):
            assert sample(logits, params, seed=seed, step=step) == 1
    assert torch.equal(probabilities(logits, params), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # The repetition penalty still applies under greedy and can move the argmax.
    penalised = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(torch.tensor([3.0, 2.5, 1.0]), penalised, seed=0, step=0, seen_token_ids=[0]) == 1
    assert sample_batch(torch.stack([logits, logits]), [params] * 2, [None, 3], [0, 1]) == [1, 1]


# --------------------------------------------------------------------------- Hugging Face parity

def _hf():
    """HF's logits processors, or skip: only the parity tests need transformers."""
    return pytest.importorskip("transformers.generation.logits_process")


def _no_top_p_boundary(logits: torch.Tensor, top_p: float, margin: float = 1e-6) -> bool:
    p = torch.softmax(logits.double(), -1).sort(-1, descending=True).values
    mass_above = p.cumsum(-1) - p
    return bool(((mass_above - top_p).abs() > margin).all())


def _no_min_p_boundary(logits: torch.Tensor, min_p: float, margin: float = 1e-6) -> bool:
    p = torch.softmax(logits.double(), -1)
    ratio = p / p.amax(-1, keepdim=True)
    return bool(((ratio - min_p).abs() > margin).all())


def test_matches_hf_warpers():
    lp = _hf()
    gen = torch.Generator().manual_seed(2024)
    scores = torch.randn(6, 200, generator=gen) * 2
    ids = torch.randint(0, 200, (6, 1), generator=gen)

    for t in (0.3, 0.7, 1.0, 1.9):
        assert torch.allclose(apply_temperature(scores, t), lp.TemperatureLogitsWarper(t)(ids, scores))
    for k in (1, 5, 50, 199, 200, 500):
        assert torch.equal(apply_top_k(scores, k), lp.TopKLogitsWarper(k)(ids, scores)), k
    for p in (0.05, 0.3, 0.5, 0.9, 0.99):
        assert _no_top_p_boundary(scores, p), "fixture has a boundary tie; pick another seed"
        assert torch.equal(apply_top_p(scores, p), lp.TopPLogitsWarper(p)(ids, scores)), p
    for m in (0.01, 0.1, 0.5, 0.9):
        assert _no_min_p_boundary(scores, m), "fixture has a boundary tie; pick another seed"
        assert torch.equal(apply_min_p(scores, m), lp.MinPLogitsWarper(m)(ids, scores)), m

    input_ids = torch.randint(0, 200, (6, 30), generator=gen)
    for penalty in (0.7, 1.3, 2.0):
        ours = apply_repetition_penalty(scores, input_ids, penalty)
        theirs = lp.RepetitionPenaltyLogitsProcessor(penalty)(input_ids, scores.clone())
        assert torch.equal(ours, theirs), penalty


def test_full_pipeline_matches_hf_processor_list():
    lp = _hf()
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(4, 100, generator=gen) * 2
    input_ids = torch.randint(0, 100, (4, 20), generator=gen)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2)
    pipeline = lp.LogitsProcessorList(
        [
            lp.RepetitionPenaltyLogitsProcessor(1.2),
            lp.TemperatureLogitsWarper(0.8),
            lp.TopKLogitsWarper(40),
            lp.TopPLogitsWarper(0.9),
            lp.MinPLogitsWarper(0.02),
        ]
    )
    theirs = pipeline(input_ids, scores.clone())
    ours = process_logits(scores, params, input_ids)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    assert torch.allclose(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


# --------------------------------------------------------------------------- frequencies


def _draws(params: SamplingParams, n: int, seed: int) -> np.ndarray:
    logits = LOGITS8.expand(n, -1)
    tokens = sample_batch(logits, [params] * n, [seed] * n, range(n), [SEEN8] * n)
    return np.bincount(tokens, minlength=8)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampled_frequencies_match_processed_distribution(name):
    setting = SETTINGS[name]
    params = SamplingParams(**setting)
    expected = _ref_for(setting)
    assert np.allclose(probabilities(LOGITS8, params, SEEN8).numpy(), expected, atol=1e-6)
    counts = _draws(params, 20_000, seed=11)
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a filtered token"
    assert support.sum() >= 2, "setting too strict to test frequencies"
    result = chisquare(counts[support], expected[support] * counts.sum())
    assert result.pvalue > 1e-3, (name, counts, expected)


def test_chisquare_negative_control_rejects_wrong_distribution():
    params = SamplingParams(**SETTINGS["temperature"])
    counts = _draws(params, 20_000, seed=11)
    unprocessed = torch.softmax(LOGITS8.double(), -1).numpy()  # forgets temperature and penalty
    assert chisquare(counts, unprocessed * counts.sum()).pvalue < 1e-6
    # A subtler mistake: penalty applied but temperature 0.8 instead of 0.7.
    near_miss = ref_probs(LOGITS8.numpy(), temperature=0.8, seen=SEEN8)
    assert chisquare(counts, near_miss * counts.sum()).pvalue < 1e-6


def test_sample_is_inverse_cdf_of_one_uniform_per_step():
    params = SamplingParams(temperature=0.9, top_p=0.95)
    expected = _ref_for(dict(temperature=0.9, top_p=0.95))  # SEEN8 unused: penalty 1
    cdf = np.cumsum(expected)
    for step in range(300):
        u = draw_uniform(5, step)
        want = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        assert sample(LOGITS8, params, seed=5, step=step) == want


def test_sample_batch_matches_sample_rowwise():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 50, generator=gen)
    params_list = [SamplingParams(temperature=0.8, top_k=10, repetition_penalty=1.4)] * 6 + [
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.1, temperature=1.5),
        SamplingParams(),
        SamplingParams(temperature=0.5, repetition_penalty=0.8),
        SamplingParams(top_k=1),
    ]
    seeds = list(range(100, 112))
    steps = [s % 5 for s in range(12)]
    seen = [list(range(i, i + 8)) for i in range(12)]
    batched = sample_batch(logits, params_list, seeds, steps, seen)
    single = [
        sample(logits[i], params_list[i], seed=seeds[i], step=steps[i], seen_token_ids=seen[i]) for i in range(12)
    ]
    assert batched == single
    # Uniform params take the vectorised path; it must agree too.
    same = [params_list[0]] * 12
    assert sample_batch(logits, same, seeds, steps, seen) == [
        sample(logits[i], same[i], seed=seeds[i], step=steps[i], seen_token_ids=seen[i]) for i in range(12)
    ]
    with pytest.raises(ValueError):
        sample_batch(logits, params_list[:3], seeds, steps)


# --------------------------------------------------------------------------- random streams


FLAT50 = torch.randn(50, generator=torch.Generator().manual_seed(99)) * 0.3


def _generate(seed: int, scheme: str, steps: int = 32) -> list[int]:
    params = SamplingParams(temperature=1.0)
    return [sample(FLAT50, params, seed=seed, step=k, scheme=scheme) for k in range(steps)]


def test_naive_scheme_makes_shifted_copies():
    a, b = _generate(41, "naive"), _generate(42, "naive")
    assert len(set(a)) > 10  # the outputs are genuinely random, not trivially constant
    assert b[:-1] == a[1:]  # request s+1 is request s shifted by one step
    assert a != b


def test_independent_scheme_breaks_the_shift():
    a, b = _generate(41, "independent"), _generate(42, "independent")
    assert len(set(a)) > 10 and len(set(b)) > 10
    coincide = sum(x == y for x, y in zip(b[:-1], a[1:]))
    assert coincide < 5, coincide  # ~31/50 expected by chance for flat-ish logits


def test_distinct_stream_counts():
    pairs = [(s, k) for s in range(100) for k in range(32)]
    naive = {draw_uniform(s, k, scheme="naive") for s, k in pairs}
    independent = {draw_uniform(s, k) for s, k in pairs}
    assert len(naive) == 131  # s + k takes the values 0..130
    assert len(independent) == 3200


def test_naive_generator_is_manual_seed_of_sum():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(17 + 4)
        expected = torch.rand(3)
    assert torch.equal(torch.rand(3, generator=naive_step_generator(17, 4)), expected)
    assert torch.equal(torch.rand(3, generator=naive_step_generator(20, 1)), expected)


def test_step_generator_neighbours_unrelated_and_reproducible():
    a = torch.rand(1000, generator=step_generator(17, 4))
    assert torch.equal(a, torch.rand(1000, generator=step_generator(17, 4)))
    for other in [(18, 3), (16, 5), (4, 17), (17, 5), (18, 4)]:
        b = torch.rand(1000, generator=step_generator(*other))
        assert not torch.equal(a, b)
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.15  # unrelated, not just different
    with pytest.raises(ValueError):
        step_generator(-1, 0)
    with pytest.raises(ValueError):
        draw_uniform(0, 0, scheme="bogus")


def test_determinism_and_fresh_randomness():
    params = SamplingParams(temperature=1.2, top_k=30)
    tokens = [sample(FLAT50, params, seed=8, step=k) for k in range(40)]
    assert tokens == [sample(FLAT50, params, seed=8, step=k) for k in range(40)]
    assert len(set(tokens)) > 10  # different steps draw different uniforms
    assert sample(FLAT50, params, seed=8, step=3, generator=step_generator(8, 3)) == tokens[3]
    # seed=None: a fresh nondeterministic stream each call.
    unseeded = {sample(FLAT50, params, seed=None, step=0) for _ in range(60)}
    assert len(unseeded) > 5


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=False), "max_tokens"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(seed=True), "seed"),
        (dict(stop="\n\n"), "stop"),
        (dict(stop=("",)), "stop"),
        (dict(stop_token_ids=(1, True)), "stop_token_ids"),
        (dict(stop_token_ids=(-3,)), "stop_token_ids"),
        (dict(ignore_eos=1), "ignore_eos"),
    ],
)
def test_bad_params_raise_value_error_naming_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_good_params_normalised():
    p = SamplingParams(temperature=0, top_p=1, stop=["</s>"], stop_token_ids=[2], seed=np.int64(3))
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.stop == ("</s>",) and p.stop_token_ids == (2,) and p.seed == 3 and type(p.seed) is int
    hash(p)  # frozen and hashable
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # type: ignore[misc]


def test_processor_argument_validation():
    logits = torch.zeros(4)
    for call in (
        lambda: apply_top_p(logits, 0.0),
        lambda: apply_top_k(logits, -2),
        lambda: apply_min_p(logits, 1.0),
        lambda: apply_repetition_penalty(logits, [0], 0.0),
        lambda: apply_temperature(logits, float("nan")),
        lambda: apply_top_k(torch.zeros(2, 2, 2), 1),
        lambda: sample(torch.zeros(2, 4), SamplingParams(), seed=0, step=0),
        lambda: sample(torch.full((4,), NEG_INF), SamplingParams(), seed=0, step=0),
    ):
        with pytest.raises(ValueError):
            call()


# --------------------------------------------------------------------------- no mutation


def test_processors_do_not_mutate_inputs():
    gen = torch.Generator().manual_seed(5)
    for logits in (torch.randn(20, generator=gen), torch.randn(3, 20, generator=gen).half()):
        seen = [1, 2, 3] if logits.dim() == 1 else [[1], [2, 3], []]
        original = logits.clone()
        params = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3)
        calls = [
            lambda: apply_repetition_penalty(logits, seen, 1.3),
            lambda: apply_repetition_penalty(logits, seen, 1.0),
            lambda: apply_temperature(logits, 1.0),
            lambda: apply_top_k(logits, 0),
            lambda: apply_top_k(logits, 5),
            lambda: apply_top_p(logits, 1.0),
            lambda: apply_top_p(logits, 0.5),
            lambda: apply_min_p(logits, 0.0),
            lambda: apply_min_p(logits, 0.2),
            lambda: process_logits(logits, params, seen),
            lambda: probabilities(logits, params, seen),
        ]
        for call in calls:
            out = call()
            assert out.data_ptr() != logits.data_ptr()  # a new tensor, even when nothing is filtered
            out.fill_(123.0)
            assert torch.equal(logits, original)
        if logits.dim() == 1:
            sample(logits, params, seed=0, step=0, seen_token_ids=seen)
        else:
            sample_batch(logits, [params] * 3, [0, 1, 2], [0, 0, 0], seen)
        assert torch.equal(logits, original)
