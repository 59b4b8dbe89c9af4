"""A service's engine fits its context to the KV pool (`EngineConfig.fit_context_to_pool`):
an unset max_model_len is capped to the longest sequence the pool holds, and said; a set one
that does not fit is refused at construction, before any request can meet it."""

from __future__ import annotations

import pytest

from conftest import make_tiny_gemma3, make_tiny_llama
from labkit.engine.limits import EngineLimits
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.scheduler import SchedulerConfig


@pytest.mark.parametrize("windows, step", [((None,), None), ((None,), 8), ((8, None), None), ((8, 8), 4)])
@pytest.mark.parametrize("num_blocks", [1, 5, 16])
def test_the_longest_sequence_is_the_last_length_whose_blocks_fit(windows, step, num_blocks):
    limits = EngineLimits(max_model_len=100, block_size=4, num_blocks=num_blocks, vocab_size=10,
                          windows=windows, step_tokens=step)
    # a linear scan of the same block count, from the other end
    scanned = max([t for t in range(0, 101) if limits.blocks_for(t) <= num_blocks], default=0)
    assert limits.longest_sequence() == scanned
    if windows == (None,):
        assert scanned == min(100, 4 * num_blocks)  # every token holds its slot: the pool's size
    longest = limits.longest_sequence()
    assert limits.refusal(longest - 1, 1) is None
    if longest < 100:
        assert limits.refusal(longest, 1).code == "kv_budget_exceeded"


def test_an_unset_context_is_capped_to_the_pool_and_said():
    model = make_tiny_llama()
    engine = LLMEngine(model, EngineConfig(block_size=4, kv_cache_tokens=64, fit_context_to_pool=True))
    assert model.max_positions > 64
    assert engine.max_model_len == engine.limits.max_model_len == 64
    assert "capped to 64 tokens" in engine.context_note and str(model.max_positions) in engine.context_note
    # a request for "the rest of the context" now fits the pool
    assert engine.limits.refusal(10, engine.max_model_len - 10) is None
    plain = LLMEngine(model, EngineConfig(block_size=4, kv_cache_tokens=64))
    assert plain.context_note is None and plain.max_model_len == model.max_positions
    assert plain.limits.refusal(10, plain.max_model_len - 10).code == "kv_budget_exceeded"


def test_a_pool_that_holds_the_whole_context_changes_nothing():
    model = make_tiny_llama()
    engine = LLMEngine(model, EngineConfig(block_size=4, kv_cache_tokens=4 * model.max_positions,
                                           fit_context_to_pool=True))
    assert engine.context_note is None and engine.max_model_len == model.max_positions


def test_a_set_context_that_the_pool_cannot_hold_is_refused():
    model = make_tiny_llama()
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        LLMEngine(model, EngineConfig(block_size=4, kv_cache_tokens=64, max_model_len=100,
                                      fit_context_to_pool=True))
    LLMEngine(model, EngineConfig(block_size=4, kv_cache_tokens=64, max_model_len=64, fit_context_to_pool=True))


def test_windowed_layers_hold_only_their_window_so_the_pool_reaches_further():
    model = make_tiny_gemma3(max_len=128)  # four layers with a window of 8, two global
    engine = LLMEngine(model, EngineConfig(block_size=4, kv_cache_tokens=32, fit_context_to_pool=True,
                                           scheduler=SchedulerConfig(max_batched_tokens=8)))
    limits = engine.limits
    assert engine.max_model_len == limits.longest_sequence()
    assert limits.blocks_for(engine.max_model_len) <= limits.num_blocks
    assert engine.max_model_len == 128 or limits.blocks_for(engine.max_model_len + 1) > limits.num_blocks
