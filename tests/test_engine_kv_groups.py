"""Layer groups (`labkit.engine.kv_groups`): a windowed layer group's blocks are given back as
its window passes them, prefix hits take only what the window still reads, and the paged
engine on a model with windows gives the tokens and log-probabilities of the cache that keeps
every position and applies the windows as masks (`WindowedKVCache`)."""

import pytest
from conftest import TINY_GEMMA_LOGIT_ERROR, assert_greedy_near, chosen_scores, masked_greedy_scores

from labkit.engine.block_manager import BlockManager
from labkit.engine.kv_groups import NO_BLOCK, first_block, layer_groups, peak_blocks
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.scheduler import SchedulerConfig
from labkit.engine.sequence import Sequence
from labkit.sampling import SamplingParams

GEMMA_WINDOWS = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))  # Gemma 3 270M's layers


def test_gemma_splits_into_six_groups_of_three_one_global():
    groups = layer_groups(18, GEMMA_WINDOWS)
    assert groups.num_groups == 6 and groups.layers_per_group == 3
    assert groups.windows == (None, 512, 512, 512, 512, 512) and groups.layers[0] == (5, 11, 17)
    assert sorted(layer for members in groups.layers for layer in members) == list(range(18))
    for layer, window in enumerate(GEMMA_WINDOWS):
        group, slot = groups.locate(layer)
        assert groups.windows[group] == window and groups.layers[group][slot] == layer


def test_a_model_without_windows_is_one_group_of_every_layer():
    groups = layer_groups(30)
    assert groups.windows == (None,) and groups.layers == (tuple(range(30)),)
    mixed = layer_groups(6, (8, 8, None, 8, 8, None))  # 4 local, 2 global: groups of 2
    assert mixed.windows == (None, 8, 8) and mixed.layers == ((2, 5), (0, 1), (3, 4))
    with pytest.raises(ValueError):
        layer_groups(5, (8, None))


def seq(tokens, seq_id=0):
    return Sequence(seq_id, str(seq_id), list(tokens), SamplingParams(temperature=0.0))


def run(bm, s, step):
    """Compute `step` more tokens of `s` the way the engine does: slots, then the step, then
    register the full blocks and give back what the window has passed."""
    bm.grow(s, s.num_computed_tokens + step)
    s.num_computed_tokens += step
    bm.computed(s)


@pytest.mark.parametrize("step", [1, 6])
def test_a_windowed_group_holds_its_window_however_long_the_sequence(step):
    """Window 8 over blocks of 4: after every step the windowed table holds exactly the blocks
    from the first one the next position reads, and the most blocks ever held at once is
    what `peak_blocks` says (the admission check's count)."""
    windows, bs = (None, 8), 4
    bm = BlockManager(64, bs, windows=windows)
    s = seq(range(61))
    bm.allocate_prompt(s)
    peak = 0
    while s.num_computed_tokens < s.num_tokens:
        n = min(step, s.num_tokens - s.num_computed_tokens)
        bm.grow(s, s.num_computed_tokens + n)
        peak = max(peak, bm.num_used)
        s.num_computed_tokens += n
        bm.computed(s)
        full, windowed = s.block_tables
        first = first_block(8, s.num_computed_tokens, bs)
        assert NO_BLOCK not in full and len(full) == -(-s.num_computed_tokens // bs)
        assert windowed[:first] == [NO_BLOCK] * first and NO_BLOCK not in windowed[first:]
        bm.check([s])
    assert peak == peak_blocks(windows, 61, step, bs) if step == 1 else peak <= peak_blocks(windows, 61, step, bs)
    assert s.blocks_held[1] == 3  # blocks 13-15: what position 61 sees
    bm.free(s)
    assert bm.num_free == 64
    bm.check([])


def test_a_prefix_hit_takes_only_the_blocks_the_window_still_reads():
    """A 30-token prompt computed and finished, then the same prompt with 5 more tokens: the
    hit is 7 blocks; the windowed group takes only blocks 5 and 6 (what position 28 sees
    through a window of 8). Once the window's blocks are evicted the hit must shrink to
    where every group has what it reads: here to nothing."""
    for unrelated_tokens, hit in ((12, 28), (16, 0)):
        bm = BlockManager(16, 4, windows=(None, 8))
        a = seq(range(30), 0)
        bm.allocate_prompt(a)
        run(bm, a, 30)
        bm.free(a)
        x = seq(range(100, 100 + unrelated_tokens), 1)  # takes free blocks, then the oldest cached
        bm.allocate_prompt(x)
        bm.grow(x, x.num_tokens)
        b = seq(list(range(30)) + [7] * 5, 2)
        assert bm.allocate_prompt(b) == hit
        if hit:
            assert b.block_tables[1][:5] == [NO_BLOCK] * 5 and NO_BLOCK not in b.block_tables[1][5:]
            assert len(b.block_tables[0]) == 7 and NO_BLOCK not in b.block_tables[0]
        bm.check([x, b])


# -- the engine on a tiny Gemma 3 with random weights (tests/conftest.py) --------------------
PROMPTS = [list(range(1, 4)), [5, 9, 2, 7] * 5, [(7 * i) % 61 + 1 for i in range(41)]]


@pytest.mark.parametrize("kv_cache_tokens, chunk", [(512, 7), (512, 64), (48, 8)])
def test_the_engine_on_windowed_layers_gives_the_masked_caches_tokens(tiny_gemma3, kv_cache_tokens, chunk):
    """Three prompts (3, 20 and 41 tokens; windows of 8 over blocks of 4), the 41-token one
    twice (a prefix hit) and once with n = 2, prefilled in chunks of 7 or 64 tokens, or on a
    pool so small that sequences are preempted and recomputed: every sample's 24 greedy tokens
    and log-probabilities are the masked full cache's, no step leaves a block unaccounted for,
    no windowed table holds more than its window and a step, and all blocks come back."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    config = EngineConfig(block_size=4, kv_cache_tokens=kv_cache_tokens, fast_kernels=False,
                          scheduler=SchedulerConfig(max_batched_tokens=chunk, max_num_seqs=8))
    engine = LLMEngine(tiny_gemma3, config)
    assert engine.groups.windows == (None, 8, 8) and engine.blocks.num_blocks == 3 * kv_cache_tokens // 4
    ids = [engine.add_request(p, params) for p in PROMPTS] + [engine.add_request(PROMPTS[2], params, n=2)]
    most_windowed = 0
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
        for s in engine.scheduler.running:
            most_windowed = max(most_windowed, *s.blocks_held[1:])
    assert most_windowed <= -(-(8 + chunk - 1) // 4) + 1
    for request_id, prompt in zip(ids, PROMPTS + [PROMPTS[2]]):
        want_tokens, want_scores = masked_greedy_scores(tiny_gemma3, prompt, 24)
        samples = engine.release(request_id).samples
        assert_greedy_near([want_tokens] * len(samples), [s.token_ids for s in samples], [want_scores] * len(samples),
                           TINY_GEMMA_LOGIT_ERROR, [chosen_scores(s.token_ids, s.logprobs) for s in samples],
                           what="the paged engine on windowed layers against the masked full cache")
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.prefix_hits > 0
    if kv_cache_tokens == 48:
        assert stats.preemptions > 0


def test_aborts_on_windowed_layers_give_every_block_back(tiny_gemma3):
    """Requests aborted while waiting, halfway through a chunked prefill past the window, and
    while decoding with n = 2: every step's accounting holds, the request left alone still
    gives the masked cache's tokens, and the pool ends empty."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
    config = EngineConfig(block_size=4, kv_cache_tokens=512, fast_kernels=False,
                          scheduler=SchedulerConfig(max_batched_tokens=8, max_num_seqs=3))
    engine = LLMEngine(tiny_gemma3, config)
    long_prompt = [(3 * i) % 60 + 2 for i in range(40)]
    kept = engine.add_request(PROMPTS[1], params)
    decoding = engine.add_request(PROMPTS[0], params, n=2)
    prefilling = engine.add_request(long_prompt, params)
    waiting = engine.add_request(long_prompt[:12], params)  # a fourth sequence past max_num_seqs
    aborted = set()
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
        prefill_seq = engine.requests[prefilling].seqs[0]
        if prefilling not in aborted and prefill_seq.num_computed_tokens >= 24:  # past the window of 8
            assert prefill_seq.num_computed_tokens < len(long_prompt)
            assert prefill_seq.block_tables[1][0] == NO_BLOCK  # a passed block was given back
            for request_id in (prefilling, waiting):
                assert engine.abort(request_id)
                aborted.add(request_id)
        if decoding not in aborted and len(engine.requests[decoding].seqs) == 2 and \
                len(engine.requests[decoding].seqs[1].output_token_ids) >= 12:
            assert engine.abort(decoding)
            aborted.add(decoding)
        engine.check_invariants()
    assert aborted == {prefilling, waiting, decoding}
    assert engine.requests[waiting].seqs[0].num_computed_tokens == 0  # aborted before it ran
    want_tokens, want_scores = masked_greedy_scores(tiny_gemma3, PROMPTS[1], 30)
    kept_sample = engine.release(kept).samples[0]
    assert_greedy_near([want_tokens], [kept_sample.token_ids], [want_scores], TINY_GEMMA_LOGIT_ERROR,
                       [chosen_scores(kept_sample.token_ids, kept_sample.logprobs)],
                       what="the request left alone against the masked full cache")
    assert engine.stats().blocks_used == 0
