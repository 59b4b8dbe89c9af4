"""OpenAI presence and frequency penalties: the documented formula, counted over the output
only, applied before temperature, under greedy too; and the engine feeds them a sample's
output tokens, not its prompt."""

import math

import pytest
import torch

from conftest import TINY_LOGIT_ERROR, assert_greedy_near, make_tiny_llama
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.sampling import (
    SamplingParams,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    apply_temperature,
    probabilities,
    process_logits,
    sample,
    sample_batch,
)

LOGITS = torch.tensor([1.0, 2.0, -0.5, 0.25, 3.0], dtype=torch.float64)
OUTPUT = [1, 3, 3, 3]  # counts: token 0 -> 0, token 1 -> 1, token 3 -> 3, others 0


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.25), (-0.75, 1.5), (2.0, -2.0), (0.0, 0.3), (1.1, 0.0)])
def test_formula_against_a_hand_computation(presence, frequency):
    expected = LOGITS.tolist()
    expected[1] -= 1 * frequency + presence
    expected[3] -= 3 * frequency + presence
    got = apply_presence_frequency_penalties(LOGITS, OUTPUT, presence, frequency)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    assert got.data_ptr() != LOGITS.data_ptr()


def test_hand_numbers():
    # One case spelled out: presence 0.5, frequency 0.25.
    got = apply_presence_frequency_penalties(LOGITS, OUTPUT, 0.5, 0.25)
    assert got.tolist() == pytest.approx([1.0, 2.0 - 0.75, -0.5, 0.25 - 1.25, 3.0], abs=1e-12)


def test_batch_rows_equal_single_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=gen)
    outputs = [[], [0, 0, 29], torch.tensor([5, 6, 5, 5]), [7]]
    batched = apply_presence_frequency_penalties(logits, outputs, 0.6, -0.4)
    for row, ids in enumerate(outputs):
        assert torch.equal(batched[row], apply_presence_frequency_penalties(logits[row], ids, 0.6, -0.4))
    with pytest.raises(ValueError, match="rows"):
        apply_presence_frequency_penalties(logits, outputs[:3], 0.6, -0.4)
    with pytest.raises(ValueError, match=r"\[0, 30\)"):
        apply_presence_frequency_penalties(logits[0], [30], 0.6, -0.4)


def test_sample_batch_rows_equal_sample():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 25, generator=gen)
    outputs = [list(range(i, i + 4)) * (i % 3) for i in range(6)]
    mixed = [SamplingParams(temperature=0.9, presence_penalty=0.5 * (i % 2), frequency_penalty=0.4, seed=i)
             for i in range(6)]
    same = [SamplingParams(temperature=0.9, presence_penalty=1.0, frequency_penalty=0.7)] * 6
    for params_list in (mixed, same):
        seeds, steps = list(range(6)), [3] * 6
        batched = sample_batch(logits, params_list, seeds, steps, output_token_ids=outputs)
        assert batched == [sample(logits[i], params_list[i], seed=i, step=3, output_token_ids=outputs[i])
                           for i in range(6)]


def test_applied_after_the_repetition_penalty_and_before_temperature():
    seen = [0, 2, 1, 3, 3, 3]
    params = SamplingParams(temperature=0.5, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    composed = apply_temperature(
        apply_presence_frequency_penalties(apply_repetition_penalty(LOGITS, seen, 1.3), OUTPUT, 0.5, 0.25), 0.5)
    assert torch.equal(process_logits(LOGITS, params, seen, output_token_ids=OUTPUT), composed)
    # Before the penalties the temperature would halve the penalty's effect: not the same.
    other = apply_presence_frequency_penalties(
        apply_temperature(apply_repetition_penalty(LOGITS, seen, 1.3), 0.5), OUTPUT, 0.5, 0.25)
    assert not torch.allclose(composed, other)


def test_greedy_argmax_moves_when_the_penalty_is_large():
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0])
    plain = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert sample(logits, plain, seed=0, step=0, output_token_ids=[1]) == 1
    assert sample(logits, penalised, seed=0, step=0, output_token_ids=[1]) == 2
    assert sample(logits, SamplingParams(temperature=0.0, frequency_penalty=0.6), seed=0, step=0,
                  output_token_ids=[1, 1]) == 2  # 3 - 2 * 0.6 = 1.8 < 2
    # A negative penalty pulls a repeated token up past the argmax.
    assert sample(logits, SamplingParams(temperature=0.0, frequency_penalty=-1.0), seed=0, step=0,
                  output_token_ids=[3, 3, 3]) == 3
    both = torch.stack([logits, logits])
    assert sample_batch(both, [penalised, plain], [None, None], [0, 0], output_token_ids=[[1], [1]]) == [2, 1]
    assert torch.equal(probabilities(logits, penalised, output_token_ids=[1]), torch.tensor([0.0, 0.0, 1.0, 0.0]))


def test_zero_penalties_change_nothing():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 40, generator=gen)
    outputs = [[1, 1, 2], [3], []]
    assert torch.equal(apply_presence_frequency_penalties(logits, outputs, 0.0, 0.0), logits)
    assert torch.equal(apply_presence_frequency_penalties(logits, None, 1.0, 1.0), logits)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=4)
    assert torch.equal(probabilities(logits, params, output_token_ids=outputs), probabilities(logits, params))
    assert (sample_batch(logits, [params] * 3, [1, 2, 3], [0, 0, 0], output_token_ids=outputs)
            == sample_batch(logits, [params] * 3, [1, 2, 3], [0, 0, 0]))


def test_positional_construction_still_works_and_defaults_are_off():
    params = SamplingParams(0.7, 5, 0.9, 0.05, 1.1, 32, 3)
    assert (params.temperature, params.top_k, params.max_tokens, params.seed) == (0.7, 5, 32, 3)
    assert params.presence_penalty == params.frequency_penalty == 0.0 and params.logprobs is None
    given = SamplingParams(presence_penalty=1, frequency_penalty=-2, logprobs=20)
    assert given.presence_penalty == 1.0 and isinstance(given.presence_penalty, float)
    assert given.frequency_penalty == -2.0 and given.logprobs == 20


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("bad", [math.nan, 2.5, -2.01, "1", True, None, math.inf])
def test_penalty_validation(field, bad):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: bad})
    with pytest.raises(ValueError, match=field):
        apply_presence_frequency_penalties(LOGITS, OUTPUT, **{"presence_penalty": 0.0, "frequency_penalty": 0.0,
                                                              field: bad})


@pytest.mark.parametrize("bad", [-1, 21, 1.0, "5", True])
def test_logprobs_validation(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


def penalised_greedy(model, prompt, steps, presence, frequency, count_prompt=False, scores=False):
    """Full forward pass, penalty over the output so far (or prompt + output), argmax; with
    `scores`, also the penalised logits [steps, vocab] each token was chosen from."""
    out, rows = [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + out]))[0, -1].float()
            counted = prompt + out if count_prompt else out
            rows.append(apply_presence_frequency_penalties(logits, counted, presence, frequency))
            out.append(int(torch.argmax(rows[-1])))
    return (out, torch.stack(rows)) if scores else out


def test_engine_penalises_output_tokens_not_the_prompt():
    model = make_tiny_llama(vocab=61)
    prompt = list(range(20))  # holds tokens this model picks next, so counting it would matter
    expected, scores = penalised_greedy(model, prompt, 10, 0.5, 1.5, scores=True)
    assert expected != penalised_greedy(model, prompt, 10, 0.5, 1.5, count_prompt=True)
    assert expected != penalised_greedy(model, prompt, 10, 0.0, 0.0)
    params = SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=1.5, presence_penalty=0.5)
    engine = LLMEngine(model, EngineConfig(block_size=4, kv_cache_tokens=128))
    # the engine (cached, paged, fast kernels) against full passes: up to the near-tie rule on
    # the penalised logits (a penalty moves logits by exact amounts, the same in both paths)
    assert_greedy_near([expected], [engine.generate([prompt], params)[0].token_ids], [scores], TINY_LOGIT_ERROR,
                       what="the engine's penalised greedy tokens against full passes")
