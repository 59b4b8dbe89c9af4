"""Perplexity: closed forms on synthetic models, and agreement with transformers' loss."""

import math

import pytest
import torch

from labkit.eval import EVAL_TEXT, eval_text, score_tokens


def uniform(vocab):
    return lambda ids: torch.zeros(1, ids.shape[1], vocab)


def test_uniform_model_has_perplexity_equal_to_vocab():
    score = score_tokens(uniform(50), list(range(40)), window=8, stride=5)
    assert score.tokens_scored == 39
    assert score.perplexity == pytest.approx(50)
    assert score.bits_per_token == pytest.approx(math.log2(50))


def test_every_token_scored_once_whatever_the_window():
    ids = list(range(100))
    for window, stride in [(10, 10), (10, 3), (7, 1), (200, 50)]:
        assert score_tokens(uniform(128), ids, window, stride).tokens_scored == 99


def test_oracle_model_has_perplexity_one():
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]

    def oracle(chunk):  # knows the next id is the current id + 1
        logits = torch.full((1, chunk.shape[1], 16), -1e9)
        logits[0, torch.arange(chunk.shape[1]), chunk[0] + 1] = 0.0
        return logits
    assert score_tokens(oracle, ids, window=4, stride=2).perplexity == pytest.approx(1.0)


def test_bad_windows_are_refused():
    with pytest.raises(ValueError):
        score_tokens(uniform(4), [1, 2, 3], window=4, stride=5)


def test_eval_text_is_large_enough(model):
    assert EVAL_TEXT.exists()
    assert len(model.tokenizer.encode(eval_text())) >= 20_000


def test_matches_transformers_loss(model, reference):
    ids = model.tokenizer.encode(eval_text())[:300]
    ours = score_tokens(model, ids, window=300)
    with torch.no_grad():
        loss = reference(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert ours.nats_per_token == pytest.approx(loss, rel=1e-4)
