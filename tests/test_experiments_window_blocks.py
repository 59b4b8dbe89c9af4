"""Chapter 22's engine measurements (`labkit.experiments.window_blocks`): the block counts
follow from the windows by hand, and a real engine's trace on a windowed model holds its
window while giving the masked cache's tokens."""

from conftest import TINY_GEMMA_LOGIT_ERROR, assert_greedy_near, masked_greedy_scores

from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.scheduler import SchedulerConfig
from labkit.experiments.window_blocks import blocks_held, engine_block_trace


def test_blocks_held_counts_the_window_not_the_sequence():
    # Window 8 over blocks of 4, 61 positions one at a time: the full group holds 16 blocks,
    # the windowed one blocks 13-15 (what position 61 sees); at most 3 at once.
    counted = blocks_held((None, 8), 61, 1, 4)
    assert (counted.held, counted.peak, counted.every_position) == (19, 19, 32)
    # Chunks of 16: during a step the window behind it and its 16 new positions are held.
    chunked = blocks_held((None, 8), 61, 16, 4)
    assert chunked.held == 19 and chunked.peak == 16 + 6  # the step 48..60: blocks 0-15 and 10-15
    plain = blocks_held((None,), 61, 16, 4)  # no window: every position
    assert plain.held == plain.peak == plain.every_position == 16


def test_the_engine_trace_holds_the_window_and_gives_the_masked_tokens(tiny_gemma3):
    config = EngineConfig(block_size=4, kv_cache_tokens=256, fast_kernels=False,
                          scheduler=SchedulerConfig(max_batched_tokens=16))
    engine = LLMEngine(tiny_gemma3, config)
    prompt = [(5 * i) % 63 + 1 for i in range(40)]
    out, rows = engine_block_trace(engine, prompt, 12)
    # the paged engine and the masked full cache: two paths, equal up to the near-tie rule
    want, scores = masked_greedy_scores(tiny_gemma3, prompt, 12)
    assert_greedy_near([want], [out.samples[0].token_ids], [scores], TINY_GEMMA_LOGIT_ERROR,
                       what="the engine's trace against the masked full cache")
    assert [r["positions"] for r in rows] == [16, 32, 40] + list(range(41, 51))
    for row in rows:
        full, *windowed = row["held"]
        assert full == -(-row["positions"] // 4)
        assert all(w == full - max(0, row["positions"] - 7) // 4 for w in windowed)
    assert engine.stats().blocks_used == 0
