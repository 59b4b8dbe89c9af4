"""The serving engine on SmolLM2-135M: a batch with chunked prefill, preemption and a
prefix-cache hit gives every request the tokens `transformers` generate gives it alone; stop
strings, text and seeded sampling behave as in the single-request loop. Greedy tokens of two
numerical paths are compared under the near-tie rule (`conftest.assert_greedy_near`)."""

import pytest

from conftest import (PROMPTS, SMOL_LOGIT_ERROR, assert_greedy_near, chosen_scores, greedy_reference_scores,
                      hf_greedy_scores)
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.loop import generate
from labkit.engine.scheduler import SchedulerConfig
from labkit.sampling import SamplingParams

pytestmark = pytest.mark.slow
STEPS = 24


def test_batched_engine_equals_transformers_alone(model, reference):
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    # A pool of 12 blocks of 16 cannot hold six sequences of up to ~60 tokens: preemption.
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=12 * 16, scheduler=SchedulerConfig(
        max_batched_tokens=24, max_num_seqs=6)))
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, logprobs=0)
    outs = engine.generate(prompts + [prompts[0] + [28, 1485]], params)  # the last one hits the cache
    expected = [hf_greedy_scores(reference, ids, STEPS) for ids in prompts + [prompts[0] + [28, 1485]]]
    assert_greedy_near([t for t, _ in expected], [o.token_ids for o in outs], [s for _, s in expected],
                       SMOL_LOGIT_ERROR, [chosen_scores(o.token_ids, o.samples[0].logprobs) for o in outs],
                       what="the batched engine against transformers alone")
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.blocks_used == 0
    engine.check_invariants()


def test_engine_text_and_stops_match_the_single_request_loop(model):
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=2048))
    cases = [SamplingParams(temperature=0.0, max_tokens=40, stop=("\n",), logprobs=0),
             SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30, seed=11),
             SamplingParams(temperature=0.0, max_tokens=30, logprobs=0)]
    prompt = "The three most important ideas in computer science are"
    outs = engine.generate([prompt] * len(cases), cases)
    for out, params in zip(outs, cases):
        alone = generate(model, prompt, params)
        if params.greedy:
            # the loop is `greedy_reference`'s path (the plain model, one contiguous cache):
            # its scores; the batched engine on the fast kernels is another path
            want, scores = greedy_reference_scores(model, alone.prompt_token_ids, len(alone.token_ids))
            assert want == alone.token_ids
            agreement = assert_greedy_near([want], [out.token_ids], [scores], SMOL_LOGIT_ERROR,
                                           [chosen_scores(out.token_ids, out.samples[0].logprobs)],
                                           what="the batched engine against the single-request loop")
            if agreement.excused:
                continue  # parted at a near-tie: the texts that follow are not the same input
        assert out.token_ids == alone.token_ids and out.text == alone.text
        assert out.samples[0].finish_reason == alone.finish_reason
