import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_LOGIT_ERROR, assert_greedy_near, greedy_reference, make_tiny_llama
from labkit.experiments import long_context as lc
from labkit.models.window_cache import RollingKVCache


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(seed=3, max_len=256)


def ids_of(n, vocab=97, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_token_losses_equal_one_pass_cross_entropy(tiny):
    ids = ids_of(200)
    one_pass = F.cross_entropy(tiny(torch.tensor([ids]))[0, :-1], torch.tensor(ids[1:]),
                               reduction="none")
    for chunk in (7, 64, 199, 200, 512):
        got = lc.token_losses(tiny, ids, chunk=chunk)
        assert got.shape == one_pass.shape
        torch.testing.assert_close(got, one_pass, atol=1e-5, rtol=1e-5)


def test_loss_by_position_buckets():
    losses = torch.tensor([1.0, 1.0, 3.0, 3.0, 5.0]) * math.log(2)  # positions 1..5, bits 1,1,3,3,5
    rows = lc.loss_by_position(losses, [0, 2, 4, 6])
    assert [(r["start"], r["end"], r["tokens"]) for r in rows] == [(0, 2, 1), (2, 4, 2), (4, 6, 2)]
    assert [r["bits_per_token"] for r in rows] == pytest.approx([1.0, 2.0, 4.0])
    assert lc.doubling_edges(256, 8192) == [0, 256, 512, 1024, 2048, 4096, 8192]
    assert lc.doubling_edges(256, 1000) == [0, 256, 512, 1000]


def test_chunked_prefill_equals_whole(tiny):
    ids = ids_of(150, seed=1)
    whole = lc.prefill(tiny, ids)
    reference = tiny(torch.tensor([ids]))[0, -1]
    torch.testing.assert_close(whole, reference, atol=1e-5, rtol=1e-5)
    for chunk in (16, 100, 150):
        torch.testing.assert_close(lc.prefill(tiny, ids, chunk), whole, atol=1e-5, rtol=1e-5)


def test_measure_prefill_reports_memory_and_times(tiny):
    out = lc.measure_prefill(tiny, ids_of(100), chunk=32, repeats=3)
    assert out["tokens"] == 100 and out["chunk"] == 32 and len(out["seconds"]) == 3
    assert out["peak_bytes"] >= 0 and min(out["seconds"]) > 0


def test_kv_cache_bytes_match_the_caches(tiny):
    assert lc.kv_cache_bytes(tiny.config, 100) == tiny.new_cache(1, 100).keys.nbytes * 2
    gemma_like = SimpleNamespace(layer_windows=(8, None, 8), num_layers=3, num_kv_heads=1,
                                 head_dim=4, attention_scale=0.5)
    for n in (5, 8, 30):
        assert lc.kv_cache_bytes(gemma_like, n) == RollingKVCache(gemma_like, 1, n).nbytes()
    assert lc.score_matrix_bytes(tiny.config, 10) == tiny.config.num_heads * 100 * 4



def test_attention_scores_by_hand():
    full = SimpleNamespace(num_layers=2, num_heads=3)
    # a whole prompt takes the causal kernel: the visible triangle, 10 x 11 / 2 = 55
    assert lc.attention_scores(full, 10) == 2 * 3 * 55
    # chunks of 4: the first is causal (4 x 5 / 2), then masked rectangles 4 x 8 and 2 x 10
    assert lc.attention_scores(full, 10, 4) == 2 * 3 * (10 + 32 + 20)
    windowed = SimpleNamespace(num_layers=2, num_heads=1, layer_windows=(4, None))
    # whole: the window hides keys, so the windowed layer scores the square 10 x 10 under a
    # mask; the full layer its triangle
    assert lc.attention_scores(windowed, 10) == 100 + 55
    # chunks of 4: the windowed layer sees at most 3 positions before a chunk:
    # 4 x 5 / 2 (causal), 4 x (3+4), 2 x (3+2); the full layer as above
    assert lc.attention_scores(windowed, 10, 4) == (10 + 28 + 10) + (10 + 32 + 20)
    assert lc.attention_scores(full, 10, 10) == lc.attention_scores(full, 10, 64)
    # a window as wide as the prompt hides nothing: causal there too
    assert lc.attention_scores(SimpleNamespace(num_layers=1, num_heads=1, layer_windows=(10,)),
                               10) == 55


def _counting_sdpa(monkeypatch):
    """Count the query-key scores SDPA is asked for: batch x heads x (the triangle
    T (T + 1) / 2 when called with is_causal, else query rows x keys)."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def counted(q, k, v, *args, **kwargs):
        rows, keys = q.shape[2], k.shape[2]
        per_head = rows * (rows + 1) // 2 if kwargs.get("is_causal") else rows * keys
        assert not kwargs.get("is_causal") or rows == keys  # the triangle needs a square
        seen.append(q.shape[0] * q.shape[1] * per_head)
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return seen


@pytest.mark.parametrize("chunk", [None, 16, 40])
def test_attention_scores_count_what_the_llama_computes(tiny, monkeypatch, chunk):
    seen = _counting_sdpa(monkeypatch)
    lc.prefill(tiny, ids_of(100, seed=4), chunk)
    assert sum(seen) == lc.attention_scores(tiny.config, 100, chunk)


@pytest.mark.parametrize("chunk", [None, 8, 12])
def test_attention_scores_count_what_the_rolling_cache_computes(monkeypatch, chunk):
    config = SimpleNamespace(layer_windows=(8, None, 8), num_layers=3, num_kv_heads=1,
                             num_heads=2, head_dim=4, attention_scale=0.5)
    seen = _counting_sdpa(monkeypatch)
    cache, length = RollingKVCache(config, 1, 30), 30
    step = chunk or length
    for start in range(0, length, step):
        steps = min(step, length - start)
        q = torch.randn(1, 1, 2, steps, 4)  # [B, kv_heads, group, T, D]
        k, v = torch.randn(1, 1, steps, 4), torch.randn(1, 1, steps, 4)
        for layer in range(3):
            cache.attend(layer, q, k, v)
        cache.advance(steps)
    assert sum(seen) == lc.attention_scores(config, length, chunk)


def _bucket(start, bits, se):
    return {"start": start, "end": 2 * start or 64, "bits_per_token": bits, "stderr": se}


def test_two_se_change_reads_the_direction_and_the_noise():
    ref = _bucket(512, 4.0, 0.1)
    assert lc.two_se_change(ref, _bucket(1024, 4.5, 0.1)) == "rises"  # 0.5 > 2 x 0.141
    assert lc.two_se_change(ref, _bucket(1024, 3.5, 0.1)) == "falls"
    assert lc.two_se_change(ref, _bucket(1024, 4.25, 0.1)) == "level"  # 0.25 < 0.283
    assert lc.two_se_change(ref, _bucket(1024, 3.75, 0.1)) == "level"


def test_loss_trend_rises_when_the_last_bucket_rises_against_either():
    # chapter 23's recorded Gemma curve: level against 512-1,024, risen against 8,192-16,384
    rows = [_bucket(0, 4.37, 0.52), _bucket(512, 4.3155, 0.1879), _bucket(8192, 4.1363, 0.0433),
            _bucket(16384, 4.2739, 0.0322)]
    trend = lc.loss_trend(rows)
    assert trend["reference"]["start"] == 512 and trend["previous"]["start"] == 8192
    assert (trend["vs_reference"], trend["vs_previous"], trend["word"]) == ("level", "rises", "rises")
    level = rows[:3] + [_bucket(16384, 4.15, 0.0322)]
    assert lc.loss_trend(level)["word"] == "level"
    falls = [_bucket(0, 5.0, 0.5), _bucket(512, 4.5, 0.05), _bucket(1024, 4.1, 0.05),
             _bucket(2048, 4.05, 0.05)]
    assert lc.loss_trend(falls)["word"] == "falls"  # below the reference, level to the last
    short = [_bucket(0, 5.0, 0.5), _bucket(64, 4.0, 0.1), _bucket(128, 4.8, 0.1)]
    assert lc.loss_trend(short)["reference"]["start"] == 64  # nothing from 512: the second
    with pytest.raises(ValueError):
        lc.loss_trend(short[:2])


def test_slope_bounds_span_what_the_repeats_allow():
    # times 1-2 s at 1,000 and 4-8 s at 2,000: the slope lies between log2(4/2) and log2(8/1)
    (one,) = lc.slope_bounds([1000, 2000], [1.0, 4.0], [2.0, 8.0])
    assert (one["from"], one["to"]) == (1000, 2000)
    assert one["low"] == pytest.approx(1.0) and one["high"] == pytest.approx(3.0)
    (single,) = lc.slope_bounds([1000, 4000], [1.0, 16.0], [1.0, 16.0])
    assert single["low"] == single["high"] == pytest.approx(2.0)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_prompt_places_needle_and_keeps_length(depth):
    prefix, needle, suffix = [-1, -2], [-7, -8, -9], [-3]
    hay = list(range(100))
    ids, at = lc.needle_prompt(prefix, hay, needle, suffix, 50, depth)
    room = 50 - 2 - 3 - 1
    assert len(ids) == 50
    assert ids[at:at + 3] == needle and at == 2 + round(depth * room)
    assert ids[:2] == prefix and ids[-1:] == suffix
    assert [t for t in ids if t >= 0] == hay[:room]  # the haystack, in order, unbroken
    with pytest.raises(ValueError):
        lc.needle_prompt(prefix, hay[:10], needle, suffix, 50, depth)


def test_greedy_answer_equals_uncached_greedy(tiny):
    ids = ids_of(40, seed=2)
    seq, rows = list(ids), []
    for _ in range(6):  # no cache: the whole sequence again for every token
        rows.append(tiny(torch.tensor([seq]))[0, -1])
        seq.append(int(rows[-1].argmax()))
    # chunks of 16 through a cache against whole passes: two paths, up to the near-tie rule
    assert_greedy_near([seq[40:]], [lc.greedy_answer(tiny, ids, 6, chunk=16)], [torch.stack(rows)], TINY_LOGIT_ERROR,
                       what="a chunked prefill against uncached passes")
    # one prefill and the same decode steps as greedy_reference: the same path, exact
    assert lc.greedy_answer(tiny, ids, 6, chunk=None) == greedy_reference(tiny, ids, 6)


def test_found_needs_the_whole_number():
    assert lc.found("4826", "The secret code is 4826.")
    assert not lc.found("4826", "48265") and not lc.found("4826", "4 8 2 6")


def test_admission_admits_the_context_and_refuses_one_more(tiny):
    from labkit.engine.llm_engine import EngineConfig, LLMEngine
    from labkit.sampling import SamplingParams

    n = tiny.max_positions
    engine = LLMEngine(tiny, EngineConfig(kv_cache_tokens=n, block_size=16, fast_kernels=False))
    one = SamplingParams(temperature=0.0, max_tokens=1)
    row = lc.admission(engine, ids_of(n - 1), ids_of(n), one)
    assert row == {"fits": n - 1, "admitted": True, "over": n,
                   "code": "context_length_exceeded", "param": "prompt"}
    assert lc.forward_refusal(tiny, n) is None
    assert str(n + 1) in lc.forward_refusal(tiny, n + 1)
