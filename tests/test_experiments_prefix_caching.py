"""The prefix-caching experiments of chapter 16 (hit-rate simulation, probe statistics)."""

import random

import pytest

from conftest import make_tiny_llama
from labkit.experiments.prefix_caching import (
                                               block_hashes,
                                               cached_after_shared_prefix,
                                               hit_rate_sweep,
                                               ideal_hit_rate,
                                               pairwise_wins,
                                               prefix_ttft,
                                               prob_slower,
                                               probe_trials,
                                               shared_prefix_workload,
                                               simulate_hit_rate,
                                               threshold_accuracy,
                                               zipf_weights,
                                               )


def test_block_hashes_agree_up_to_the_first_differing_block():
    a = list(range(64))
    b = a[:40] + [999] * 24
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == len(hb) == 4
    assert ha[:2] == hb[:2] and ha[2] != hb[2] and ha[3] != hb[3]
    assert len(block_hashes(a[:47])) == 2                      # partial block: no hash
    assert block_hashes(a, salt="x")[0] != ha[0]               # a salt changes every hash
    assert block_hashes(a, salt="x") == block_hashes(a, salt="x")


def test_identical_prefixes_hit_n_minus_1_over_n_of_full_blocks():
    n, prefix = 20, [7] * 100                                  # 6 full blocks of 16 + 4 tokens
    rng = random.Random(0)
    prompts = [prefix + [1000 + rng.randrange(10_000) for _ in range(12)] for _ in range(n)]
    r = simulate_hit_rate(prompts, num_blocks=64)
    assert r.per_request == [0] + [96] * (n - 1)
    assert r.hit_rate == pytest.approx((n - 1) / n * 96 / 112)


def test_no_cache_means_no_hits_and_tiny_pools_evict():
    work = shared_prefix_workload(50, [64, 48], (4, 20), seed=1)
    assert simulate_hit_rate(work.prompts, 0).hit_rate == 0.0
    rates = [r.hit_rate for r in hit_rate_sweep(work, [0, 6, 12, 64])]
    assert rates[0] == 0.0 and rates == sorted(rates)
    assert rates[-1] == pytest.approx(ideal_hit_rate(work))
    small = simulate_hit_rate(work.prompts, 6)
    assert small.evictions > 0


def test_prompts_larger_than_the_pool_do_not_fit():
    r = simulate_hit_rate([[1] * 100, [1] * 100], num_blocks=4)
    assert r.did_not_fit == 2 and r.cached_tokens == 0


def test_scopes_split_the_cache():
    work = shared_prefix_workload(200, [64], (4, 20), tenants=4, seed=2)
    shared, scoped = (hit_rate_sweep(work, [256], scoped=s)[0].hit_rate for s in (False, True))
    assert scoped < shared
    assert scoped == pytest.approx(ideal_hit_rate(work, scoped=True))
    assert shared == pytest.approx(ideal_hit_rate(work))


def test_output_tokens_and_in_flight_requests_keep_the_books_straight():
    work = shared_prefix_workload(80, [96, 64, 32], (8, 40), alpha=1.2, seed=3)
    for n in (8, 20, 100):
        r = simulate_hit_rate(work.prompts, n, output_tokens=24, in_flight=3)
        assert 0.0 <= r.hit_rate <= ideal_hit_rate(work) + 1e-12


def test_only_full_blocks_are_shared():
    assert cached_after_shared_prefix(15, 64) == 0
    assert cached_after_shared_prefix(16, 64) == 16
    assert cached_after_shared_prefix(31, 64) == 16
    assert cached_after_shared_prefix(64, 64) == 48           # the last token is always computed


def test_zipf_weights():
    w = zipf_weights(4, 1.0)
    assert sum(w) == pytest.approx(1.0) and w[0] == pytest.approx(2 * w[1])
    assert zipf_weights(3, 0.0) == pytest.approx([1 / 3] * 3)


def test_probe_statistics_on_synthetic_timings():
    slow, fast = [0.30, 0.31, 0.29, 0.33], [0.10, 0.12, 0.11, 0.09]
    assert prob_slower(slow, fast) == 1.0 and prob_slower(fast, slow) == 0.0
    assert pairwise_wins(slow, fast) == 4
    assert prob_slower([1.0, 2.0], [1.0, 2.0]) == 0.5
    rng = random.Random(0)
    a = [rng.gauss(1, 0.1) for _ in range(400)]
    b = [rng.gauss(1, 0.1) for _ in range(400)]
    assert abs(prob_slower(a, b) - 0.5) < 0.06
    t, acc = threshold_accuracy(slow, fast)
    assert acc == 1.0 and 0.12 <= t <= 0.29
    with pytest.raises(ValueError):
        pairwise_wins([1.0], [1.0, 2.0])


def test_engine_experiments_on_a_tiny_model():
    model = make_tiny_llama(seed=0, max_len=256)
    rng = random.Random(5)
    ids = [rng.randrange(97) for _ in range(2000)]
    t = prefix_ttft(model, ids, prefix_tokens=48, follow_tokens=8, trials=3, warmup=1, kv_cache_tokens=512)
    assert t.cached_tokens == [48, 48, 48] and len(t.warm.samples) == len(t.cold.samples) == 3
    p = probe_trials(model, ids, trials=3, warmup=1, secret_tokens=32, question_tokens=8, kv_cache_tokens=512)
    assert p.right_cached == [32] * 3 and p.wrong_cached == [0] * 3
    s = probe_trials(model, ids, trials=3, warmup=1, secret_tokens=32, question_tokens=8, kv_cache_tokens=512,
                     scoped=True)
    assert s.right_cached == [0] * 3
    assert set(s.to_dict()) >= {"pairwise_wins", "prob_wrong_slower"}


def test_prob_slower_interval_and_reading():
    from labkit.experiments.prefix_caching import coin_toss_reading, prob_slower_interval

    rng = random.Random(1)
    same = [rng.gauss(1.0, 0.1) for _ in range(40)], [rng.gauss(1.0, 0.1) for _ in range(40)]
    low, high = prob_slower_interval(*same)
    assert low < 0.5 < high and coin_toss_reading(low, high) == "consistent with a coin toss"
    apart = [2.0 + 0.01 * i for i in range(10)], [1.0 + 0.01 * i for i in range(10)]
    assert prob_slower_interval(*apart) == (1.0, 1.0)
    assert coin_toss_reading(1.0, 1.0).startswith("above a coin toss")
    assert coin_toss_reading(0.1, 0.4).startswith("below a coin toss")
    assert prob_slower_interval(*same) == (low, high)  # seeded


def test_sign_test_of_paired_probes():
    from labkit.experiments.prefix_caching import paired_reading, sign_test_p

    # 27 of 40 one way: sum_{i>=27} C(40, i) / 2^40, doubled (chapter 16's scoped count)
    a, b = [2.0] * 27 + [0.5] * 13, [1.0] * 40
    assert sign_test_p(a, b) == pytest.approx(0.038477, abs=1e-6)
    assert sign_test_p(b, a) == sign_test_p(a, b)                 # two-sided: symmetric
    assert sign_test_p([2.0] * 40, [1.0] * 40) == pytest.approx(2 / 2 ** 40)
    assert sign_test_p([2.0, 1.0] * 10, [1.0, 2.0] * 10) == 1.0   # 10 of 20: capped at 1
    assert sign_test_p([1.0] * 5, [1.0] * 5) == 1.0               # all ties: no evidence
    # ties are dropped, not counted for either side: 3 of 3 untied pairs
    assert sign_test_p([2.0] * 3 + [1.0] * 9, [1.0] * 12) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        sign_test_p([1.0], [1.0, 2.0])
    assert "consistent with a coin toss" in paired_reading([2.0, 1.0] * 10, [1.0, 2.0] * 10)
    assert "see the wrong guess slower" in paired_reading(a, b)
    assert "see the right guess slower" in paired_reading(b, a)
    assert "p = 0.038" in paired_reading(a, b)
