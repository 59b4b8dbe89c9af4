"""Speculative decoding: greedy output equals plain greedy decoding for both drafters and
every lookahead (up to the near-tie rule: a verification reads k + 1 rows at once, plain
decoding one, another order of the float32 sums); with sampling, the rejection rule keeps the target's distribution
(chi-square against the exact distribution, with a negative control that must fail)."""

import pytest
import torch
from scipy.stats import chisquare

from conftest import TINY_LOGIT_ERROR, assert_greedy_near, greedy_reference_scores, make_tiny_llama
from labkit.engine.speculative import (LayerSkipDrafter, NgramDrafter, accept,
                                       expected_tokens_per_verification, speculative_generate)
from labkit.sampling import SamplingParams, probabilities, step_generator
from labkit.util.near_tie import flip_tolerance, top_two_margins


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(vocab=97, layers=3)


def test_ngram_drafter_continues_the_latest_match():
    d = NgramDrafter(max_n=2)
    params = SamplingParams(temperature=0.0)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 4, 1, 2], 3, params, 0)[0] == [3, 4, 1]
    assert d.propose([5, 6, 7], 2, params, 0)[0] == []  # nothing repeats
    assert d.propose([7, 7], 3, params, 0)[0] == [7]    # the 1-gram fallback


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("drafter", ["ngram", "layerskip1", "layerskip2"])
def test_greedy_speculation_equals_plain_greedy(tiny, drafter, k):
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 40, 41, 5, 6]
    d = NgramDrafter() if drafter == "ngram" else LayerSkipDrafter(tiny, int(drafter[-1]))
    out, stats = speculative_generate(tiny, prompt, SamplingParams(temperature=0.0, max_tokens=30), d, k=k)
    want, scores = greedy_reference_scores(tiny, prompt, 30)
    assert_greedy_near([want], [out], [scores], TINY_LOGIT_ERROR, what=f"{drafter}, k={k}, against plain greedy")
    assert stats.verifications <= 30 and stats.accepted + stats.verifications >= 30


def test_full_depth_draft_is_always_accepted(tiny):
    d = LayerSkipDrafter(tiny, len(tiny.layers))  # the draft is the target itself
    out, stats = speculative_generate(tiny, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=21), d, k=4)
    want, scores = greedy_reference_scores(tiny, [1, 2, 3], 21)
    assert_greedy_near([want], [out], [scores], TINY_LOGIT_ERROR, what="a full-depth draft against plain greedy")
    # The draft steps one row at a time, the verification reads five: two paths, which may
    # part only at a near-tie. Where the plain run has none, every guess is the verifier's.
    if min(top_two_margins(scores)) > flip_tolerance(TINY_LOGIT_ERROR):
        assert stats.acceptance_rate == 1.0 and stats.verifications == 5  # 4 guesses + 1 bonus each


def test_layer_skip_draft_of_a_packed_model_equals_the_plain_draft(tiny):
    from labkit.kernels.packed import is_packed, pack_model
    packed = pack_model(tiny)
    plain_draft, packed_draft = LayerSkipDrafter(tiny, 2), LayerSkipDrafter(packed, 2)
    assert len(packed_draft.model.layers) == 2 and packed_draft.model.lm_head is packed.lm_head
    assert is_packed(packed_draft.model) == is_packed(packed) and len(tiny.layers) == 3
    params, context = SamplingParams(temperature=0.0), [5, 6, 7, 8, 5, 6]
    for d in (plain_draft, packed_draft):
        d.reset(context)
    # the draft's greedy guesses on packed and plain weights: two paths, up to the near-tie rule
    guesses, guess_scores = greedy_reference_scores(plain_draft.model, context, 4)
    proposals = [d.propose(context, 4, params, 0)[0] for d in (plain_draft, packed_draft)]
    assert_greedy_near([guesses] * 2, proposals, [guess_scores] * 2, TINY_LOGIT_ERROR, what="the drafts' guesses")
    out, _ = speculative_generate(packed, context, SamplingParams(temperature=0.0, max_tokens=12), packed_draft, k=3)
    want, scores = greedy_reference_scores(tiny, context, 12)
    assert_greedy_near([want], [out], [scores], TINY_LOGIT_ERROR,
                       what="speculative on packed weights against plain greedy")


def test_accept_rule_counts():
    gen = step_generator(0, 0)
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert accept(p, [1, 0], None, gen) == (2, 2)  # both guesses are the argmax: bonus token 2
    assert accept(p, [2, 0], None, gen) == (0, 1)  # first guess impossible: the target's token


def joint_two_tokens(model, prompt, params):
    """Exact P(x1, x2) of the first two sampled tokens, from the target alone."""
    p1 = probabilities(model(torch.tensor([prompt]))[0, -1], params)
    rows = torch.tensor([prompt + [x] for x in range(p1.numel())])
    p2 = probabilities(model(rows)[:, -1], params)
    return (p1[:, None] * p2).flatten().double()


@pytest.mark.slow
@pytest.mark.parametrize("sampled_draft", [False, True])
def test_sampling_keeps_the_target_distribution(sampled_draft):
    model = make_tiny_llama(seed=3, vocab=6, hidden=16, layers=2, heads=2, kv_heads=1)
    prompt = [1, 2, 3, 1, 2]
    draws = 6000
    counts = torch.zeros(36, dtype=torch.float64)
    rejections = 0
    for seed in range(draws):
        params = SamplingParams(temperature=1.0, max_tokens=2, seed=seed)
        d = LayerSkipDrafter(model, 1, sample=sampled_draft)
        out, stats = speculative_generate(model, prompt, params, d, k=2, stop_at_eos=False)
        counts[out[0] * 6 + out[1]] += 1
        rejections += stats.proposed - stats.accepted
    expected = joint_two_tokens(model, prompt, SamplingParams(temperature=1.0))
    keep = expected * draws >= 5
    assert rejections > draws / 20  # the draft is wrong often enough to test the residual
    observed = counts[keep]
    assert chisquare(observed, expected[keep] / expected[keep].sum() * observed.sum()).pvalue > 1e-3
    # negative control: the draft's own distribution is measurably different
    draft_only = joint_two_tokens(d.model, prompt, SamplingParams(temperature=1.0))
    assert chisquare(observed, draft_only[keep] / draft_only[keep].sum() * observed.sum()).pvalue < 1e-6


def test_expected_tokens_per_verification():
    assert expected_tokens_per_verification(0.0, 4) == 1.0
    assert expected_tokens_per_verification(1.0, 4) == 5.0
    assert expected_tokens_per_verification(0.5, 2) == pytest.approx(1.75)
