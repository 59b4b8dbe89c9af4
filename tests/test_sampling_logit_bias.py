"""OpenAI's logit_bias in labkit.sampling and the engine.

References: the closed form (the bias is added to the raw logits, so every token's odds
against the others are multiplied by exp(bias)), a NumPy softmax written from that
definition, a chi-square test of the sampler's draws against it, and full forward passes
of a tiny model with the bias added by hand for the engine's greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import TINY_LOGIT_ERROR, assert_greedy_near, make_tiny_llama
from labkit.engine.limits import Refused
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.runner import ModelRunner
from labkit.sampling import (SamplingParams, apply_logit_bias, probabilities, process_logits, sample,
                             sample_batch)

LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.4, 1.0, -1.2, 0.0, 0.7])


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_bias_is_added_to_the_named_logits_only():
    out = apply_logit_bias(LOGITS, {3: 2.5, 0: -1.0})
    want = LOGITS.clone()
    want[3] += 2.5
    want[0] -= 1.0
    assert torch.equal(out, want)
    rows = apply_logit_bias(LOGITS.expand(3, -1), ((3, 2.5), (0, -1.0)))  # every row the same
    assert torch.equal(rows, want.expand(3, -1))
    assert torch.equal(apply_logit_bias(LOGITS, ()), LOGITS)


def test_plus_100_forces_and_minus_100_bans_a_token_under_greedy():
    greedy = SamplingParams(temperature=0.0)
    assert sample(LOGITS, greedy, seed=None, step=0) == 0
    for token in range(len(LOGITS)):
        forced = SamplingParams(temperature=0.0, logit_bias={token: 100})
        assert sample(LOGITS, forced, seed=None, step=0) == token
    banned = SamplingParams(temperature=0.0, logit_bias={0: -100})
    assert sample(LOGITS, banned, seed=None, step=0) == 1  # the next best
    # sampled at temperature 1: a -100 bias leaves the token a probability of e^-100 relative
    banned_t1 = SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100})
    p = probabilities(LOGITS, banned_t1)
    assert float(p[0]) < 1e-40 and float(p[1]) < 1e-40
    draws = sample_batch(LOGITS.expand(2000, -1), [banned_t1] * 2000, [7] * 2000, range(2000))
    assert 0 not in draws and 1 not in draws


def test_the_distribution_shifts_by_exp_bias_in_closed_form():
    bias = {2: 1.3, 5: -0.7, 6: 2.0}
    params = SamplingParams(temperature=1.0, logit_bias=bias)
    ours = probabilities(LOGITS, params).double().numpy()
    raw = softmax(LOGITS.double().numpy())
    # p'(j) is proportional to p(j) * exp(bias_j)
    shifted = raw * np.exp([bias.get(j, 0.0) for j in range(len(raw))])
    assert np.allclose(ours, shifted / shifted.sum(), atol=1e-7)
    # odds between two biased tokens change by exp(difference of their biases)
    assert ours[6] / ours[2] == pytest.approx(raw[6] / raw[2] * np.exp(2.0 - 1.3), rel=1e-5)


def test_sampled_frequencies_follow_the_biased_distribution():
    bias = {2: 1.3, 5: -0.7, 6: 2.0}
    params = SamplingParams(temperature=1.0, logit_bias=bias)
    n = 20_000
    counts = np.bincount(sample_batch(LOGITS.expand(n, -1), [params] * n, [11] * n, range(n)), minlength=8)
    raw = softmax(LOGITS.double().numpy())
    shifted = raw * np.exp([bias.get(j, 0.0) for j in range(8)])
    expected = shifted / shifted.sum()
    assert chisquare(counts, expected * n).pvalue > 1e-3, (counts, expected)
    # negative control: the same draws are far from the unbiased distribution
    assert chisquare(counts, raw * n).pvalue < 1e-6


def test_bias_comes_before_the_penalties_and_temperature():
    # repetition penalty 2 on token 1, a bias of -3 on it: vLLM's order biases first, so the
    # penalty sees the negative logit 1.5 - 3 and multiplies it (it would divide 1.5 otherwise)
    params = SamplingParams(temperature=0.5, repetition_penalty=2.0, logit_bias={1: -3.0})
    out = process_logits(LOGITS, params, seen_token_ids=[1])
    assert float(out[1]) == pytest.approx((1.5 - 3.0) * 2.0 / 0.5)
    assert float(out[0]) == pytest.approx(2.0 / 0.5)
    freq = SamplingParams(temperature=1.0, frequency_penalty=1.0, logit_bias={4: 0.5})
    out = process_logits(LOGITS, freq, output_token_ids=[4, 4])
    assert float(out[4]) == pytest.approx(1.0 + 0.5 - 2 * 1.0)


@pytest.mark.parametrize("bad, match", [
    ({-1: 1.0}, "logit_bias token id"),
    ({"3": 1.0}, "logit_bias token id"),
    ({True: 1.0}, "logit_bias token id"),
    ({3: float("nan")}, r"logit_bias\[3\]"),
    ({3: float("inf")}, r"logit_bias\[3\]"),
    ({3: "1"}, r"logit_bias\[3\]"),
    (((3, 1.0), (3, 2.0)), "twice"),
    (((3, 1.0, 2),), "pairs"),
    ("3", "pairs"),
    (5, "pairs"),
])
def test_bad_bias_raises_value_error_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bad)


def test_bias_is_stored_sorted_and_hashable():
    a = SamplingParams(logit_bias={9: 1, 2: -0.5})
    b = SamplingParams(logit_bias=[(2, -0.5), (9, 1.0)])
    assert a.logit_bias == ((2, -0.5), (9, 1.0)) and a == b and hash(a) == hash(b)
    assert type(a.logit_bias[1][1]) is float
    assert SamplingParams().logit_bias == ()


def test_an_id_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"in \[0, 8\)"):
        apply_logit_bias(LOGITS, {8: 1.0})
    with pytest.raises(ValueError, match="in \\[0, 8\\)"):
        probabilities(LOGITS, SamplingParams(logit_bias={8: 1.0}))


def test_the_runner_keeps_its_greedy_fast_path_only_without_a_bias():
    class Seq:
        def __init__(self, params):
            self.params, self.token_ids, self.output_token_ids, self.sampling_seed = params, [0], [], None
            self.matcher = None  # no response format

    rows = LOGITS.expand(2, -1).clone()
    plain, biased = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias={5: 10.0})
    got = [t.token_id for t in ModelRunner.sample([Seq(plain), Seq(biased)], rows)]
    assert got == [0, 5]
    assert [t.token_id for t in ModelRunner.sample([Seq(biased)], rows[:1])] == [5]


def biased_greedy(model, prompt, steps, bias):
    """Full forward passes, the bias added by hand, argmax; and the biased logits of each step."""
    out, rows = [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + out]))[0, -1].float().clone()
            for token, value in bias.items():
                logits[token] += value
            rows.append(logits)
            out.append(int(torch.argmax(logits)))
    return out, torch.stack(rows)


def test_the_engine_applies_the_bias_to_every_step():
    model = make_tiny_llama(vocab=61)
    prompt = list(range(12))
    engine = LLMEngine(model, EngineConfig(block_size=4, kv_cache_tokens=256))
    plain = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids
    bias = {plain[0]: -100.0, 7: 3.0}  # ban the unbiased first token, favour another one
    expected, scores = biased_greedy(model, prompt, 8, bias)
    assert expected[0] != plain[0] and expected != plain
    biased = SamplingParams(temperature=0.0, max_tokens=8, logit_bias=bias)
    got = engine.generate([prompt], biased)[0].token_ids
    assert plain[0] not in got
    assert_greedy_near([expected], [got], [scores], TINY_LOGIT_ERROR,
                       what="the engine's biased greedy tokens against full passes")
    assert engine.stats().blocks_used == 0


def test_the_engine_refuses_a_bias_token_outside_the_vocabulary():
    engine = LLMEngine(make_tiny_llama(vocab=61), EngineConfig(block_size=4, kv_cache_tokens=128))
    with pytest.raises(Refused, match="logit_bias") as refused:
        engine.check_request([1, 2], SamplingParams(logit_bias={61: 1.0}))
    assert refused.value.code == "unknown_token" and refused.value.param == "logit_bias"
    assert engine.limits.refusal(2, 4, logit_bias_ids=(60,)) is None
