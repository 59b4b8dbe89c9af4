"""The KV-cache experiments of chapter 10."""

import pytest
import torch

from conftest import PROMPTS
from labkit.experiments.kv_caching import (
                                           cache_equivalence,
                                           eval_prompts,
                                           fill_cache,
                                           generate_uncached,
                                           kv_bytes_per_token,
                                           loop_work,
                                           perturbed_cache_trials,
                                           rate_interval,
                                           speedup_curve,
                                           spot_check_reading,
                                           speedup_trend,
                                           stale_cache_trials,
                                           summarize_trials,
                                           )
from labkit.experiments.naive_generation import generate_naive
from labkit.eval import eval_text
from labkit.models.llama import KVCache


def test_bytes_per_token_closed_form(model):
    c = model.config
    assert kv_bytes_per_token(c) == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(c, torch.float16) == 23_040
    assert kv_bytes_per_token(c, kv_heads=c.num_heads) == 3 * 46_080
    assert KVCache.empty(c, 1, 8).nbytes(1) == kv_bytes_per_token(c)


def test_equivalence_on_a_short_prompt(model):
    ids = model.tokenizer.encode(PROMPTS[1])
    out = cache_equivalence(model, ids, 6)
    # two numerical paths: the same tokens up to a near-tie (labkit.util.near_tie)
    assert out["agreement"].ok, out["agreement"].describe()
    assert len(out["cached"]) == 6 and out["identical"] == out["agreement"].exact
    assert len(out["step_max_abs_diff"]) == out["agreement"].compared and out["max_abs_diff"] < 1e-3
    assert generate_uncached(model, ids, 6)[0] == generate_naive(model, ids, 6)[0]


def test_speedup_curve_records(model):
    ids = model.tokenizer.encode(PROMPTS[0])
    (rec,) = speedup_curve(model, ids, [(4, 3)], repeats=1, warmup=0)
    assert rec["prompt_tokens"] == 4 and rec["new_tokens"] == 3
    assert rec["speedup"] == pytest.approx(rec["uncached_s"] / rec["cached_s"])
    assert rec["verdict"] == "too few runs"
    (rec,) = speedup_curve(model, ids, [(4, 3)], repeats=3, warmup=0)
    assert rec["speedup_low"] <= rec["speedup"] <= rec["speedup_high"]
    assert rec["verdict"] in ("faster", "slower", "within the noise")


def test_speedup_trend_says_only_what_the_intervals_show():
    def case(n, speedup, low, high):
        return {"new_tokens": n, "speedup": speedup, "speedup_low": low, "speedup_high": high}

    apart = [case(16, 1.5, 1.4, 1.6), case(32, 2.2, 2.1, 2.3), case(64, 2.8, 2.7, 2.9)]
    assert speedup_trend(apart, "new_tokens") == "rises at every step, each interval above the last"
    close = [case(16, 1.5, 1.4, 1.6), case(32, 1.55, 1.45, 1.65)]
    assert speedup_trend(close, "new_tokens") == "rises at every step, but neighbouring intervals overlap"
    broken = apart + [case(128, 0.7, 0.6, 0.8)]  # the corrupt record's shape: a drop at the end
    assert speedup_trend(broken, "new_tokens") == "does not rise at every step"


def test_fill_cache_fills_every_position(model):
    ids = model.tokenizer.encode(PROMPTS[0])[:10]
    cache = fill_cache(model, ids, chunk=4)
    assert cache.length == cache.max_len == 10
    assert cache.nbytes() == 10 * kv_bytes_per_token(model.config)


@pytest.fixture(scope="module")
def prompts(model):
    return eval_prompts(model.tokenizer, eval_text(), count=3, length=12)


def test_eval_prompts_deterministic(model, prompts):
    assert len(prompts) == 3 and all(len(p) == 12 for p in prompts)
    assert eval_prompts(model.tokenizer, eval_text(), count=3, length=12) == prompts


def test_stale_cache_differs_and_control_is_exact(model, prompts):
    stale = stale_cache_trials(model, prompts)
    control = stale_cache_trials(model, prompts, shift=0)
    assert all(t["max_abs_err"] > 1e-2 for t in stale)
    assert all(t["max_abs_err"] < 1e-3 and t["right"] for t in control)
    s = summarize_trials(stale)
    assert s["trials"] == 3 and s["worst_err"] >= s["median_err"] > 0


def test_perturbed_trial_restores_weights(model, prompts):
    layer = model.layers[5]
    before, saved = layer.qkv, layer.qkv.clone()
    trials = perturbed_cache_trials(model, prompts[:2], layer=5, scale=0.02, seed=0)
    assert layer.qkv is before and torch.equal(layer.qkv, saved)
    assert all(t["max_abs_err"] > 0 for t in trials)


def test_perturbed_trial_restores_weights_on_error(model):
    layer = model.layers[0]
    before = layer.qkv
    with pytest.raises(Exception):
        perturbed_cache_trials(model, [[1, 2, 10**9]], layer=0)  # an id outside the vocab
    assert layer.qkv is before


def test_equivalence_excuses_a_near_tie_and_fails_a_wide_gap(monkeypatch):
    """Synthetic paths: the uncached reference's top two at step 1 differ by 1e-4 and the
    cached path, 1e-4 off, takes the runner-up: excused (tolerance 2e-4). The same flip at a
    gap of 1.0 fails."""
    from labkit.experiments import kv_caching

    def paths(gap):
        ref = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 1.0 + gap, 1.0])]
        cand = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 1.0 + gap - 1e-4, 1.0 + 1e-4])]
        monkeypatch.setattr(kv_caching, "generate_uncached", lambda m, p, s: ([0, 1], ref))
        monkeypatch.setattr(kv_caching, "generate_cached",
                            lambda m, p, s, keep_logits=False: ([0, 2], cand))
        return kv_caching.cache_equivalence(None, [5], 2)

    near = paths(1e-4)
    assert not near["identical"] and near["agreement"].excused and near["agreement"].ok
    wide = paths(1.0)
    assert not wide["agreement"].ok and not wide["agreement"].excused


def test_equivalence_tolerance_is_the_stated_bound_not_the_runs_difference(monkeypatch):
    """A cached path 0.01 off every logit flips a gap of 0.015: twice this run's own
    difference (0.02) would excuse it, twice the stated float32 error (2e-3) does not."""
    from labkit.experiments import kv_caching
    from labkit.experiments.path_agreement import LOGIT_ERROR

    ref = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 1.015, 1.0])]
    cand = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 1.005, 1.01])]
    monkeypatch.setattr(kv_caching, "generate_uncached", lambda m, p, s: ([0, 1], ref))
    monkeypatch.setattr(kv_caching, "generate_cached",
                        lambda m, p, s, keep_logits=False: ([0, 2], cand))
    out = kv_caching.cache_equivalence(None, [5], 2)
    assert out["logit_error"] == LOGIT_ERROR and out["agreement"].tolerance == 2 * LOGIT_ERROR
    assert out["max_abs_diff"] == pytest.approx(0.01) and not out["agreement"].ok
    assert kv_caching.cache_equivalence(None, [5], 2, logit_error=0.01)["agreement"].excused


def test_loop_work_counts_passes_and_positions():
    assert loop_work(16, 16) == {"passes": 16, "cached_positions": 31, "uncached_positions": 376}
    assert loop_work(4, 1) == {"passes": 1, "cached_positions": 4, "uncached_positions": 4}
    with pytest.raises(ValueError):
        loop_work(0, 4)


def test_rate_interval_is_wilsons():
    low, high = rate_interval(1, 20)
    assert low == pytest.approx(0.00888, abs=1e-4) and high == pytest.approx(0.2361, abs=1e-4)
    assert rate_interval(0, 20)[0] == 0.0 and rate_interval(20, 20)[1] == 1.0
    low, high = rate_interval(8, 20)
    assert low < 0.4 < high
    with pytest.raises(ValueError):
        rate_interval(3, 2)


def test_spot_check_reading_follows_the_count():
    # 1 of 20 passed: the check usually catches a stale cache (the issue-33 contradiction)
    rare = spot_check_reading(1, 20)
    assert "caught the wrong cache in 19 of 20" in rare and "usually catch" in rare
    assert "miss this bug more often" not in rare
    # 16 of 20 passed: the interval lies above one half, so the check usually misses it
    often = spot_check_reading(16, 20)
    assert "miss this bug more often than it caught it" in often
    # 8 of 20 (the source's): the interval holds one half, so no direction is claimed
    assert "cannot tell" in spot_check_reading(8, 20)
    assert "caught every one" in spot_check_reading(0, 20)
    with pytest.raises(ValueError):
        spot_check_reading(21, 20)
