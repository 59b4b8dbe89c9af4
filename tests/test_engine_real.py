"""The serving engine on SmolLM2-135M: a batch with chunked prefill, preemption and a
prefix-cache hit gives every request exactly the tokens `transformers` generate gives it
alone; stop strings, text and seeded sampling behave as in the single-request loop."""

import pytest

from conftest import PROMPTS, hf_greedy
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
    params = SamplingParams(temperature=0.0, max_tokens=STEPS)
    outs = engine.generate(prompts + [prompts[0] + [28, 1485]], params)  # the last one hits the cache
    expected = [hf_greedy(reference, ids, STEPS) for ids in prompts + [prompts[0] + [28, 1485]]]
    assert [o.token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.blocks_used == 0
    engine.check_invariants()


def test_engine_text_and_stops_match_the_single_request_loop(model):
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=2048))
    cases = [SamplingParams(temperature=0.0, max_tokens=40, stop=("\n",)),
             SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30, seed=11),
             SamplingParams(temperature=0.0, max_tokens=30)]
    prompt = "The three most important ideas in computer science are"
    outs = engine.generate([prompt] * len(cases), cases)
    for out, params in zip(outs, cases):
        alone = generate(model, prompt, params)
        assert out.token_ids == alone.token_ids and out.text == alone.text
        assert out.samples[0].finish_reason == alone.finish_reason
