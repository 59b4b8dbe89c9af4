"""The sliding-window experiments of chapter 22: sinks, second-half losses, reach, costs."""

import math

import pytest
import torch

from labkit.eval import eval_text
from labkit.experiments.sliding_window import (
    SinkWindowCache,
    decode_step_costs,
    every_layer_windowed,
    influence_by_distance,
    local_layers_windowed,
    second_half_loss,
    sink_window_attention,
)
from labkit.models.window_cache import WindowedKVCache, windowed_attention


def grouped_qkv(steps=12, keys=20, seed=0, dtype=torch.float32):
    """q [1, 2 kv heads, group 3, steps, 8] for the last `steps` of `keys` positions."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 3, steps, 8, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(1, 2, keys, 8, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(1, 2, keys, 8, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


# -- the mask -----------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 1, 3, 7, 50])
def test_no_sinks_is_windowed_attention(window):
    q, k, v = grouped_qkv()
    ours = sink_window_attention(q, k, v, 8, window, 0, 0.3)
    torch.testing.assert_close(ours, windowed_attention(q, k, v, 8, window, 0.3), rtol=0, atol=0)


@pytest.mark.parametrize("window,sinks", [(3, 1), (4, 4), (2, 6), (5, 30)])
def test_sinks_match_a_float64_loop(window, sinks):
    q, k, v = grouped_qkv()
    start, scale = 8, 0.3
    ours = sink_window_attention(q, k, v, start, window, sinks, scale)
    q64, k64, v64 = q.double(), k.double(), v.double()
    expected = torch.empty_like(q64)
    for t in range(q.shape[3]):  # position by position, the rule written as a list of keys
        i = start + t
        seen = [j for j in range(i + 1) if j > i - window or j < sinks]
        scores = torch.einsum("bhgd,bhsd->bhgs", q64[:, :, :, t], k64[:, :, seen]) * scale
        expected[:, :, :, t] = torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), v64[:, :, seen])
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5)


def test_cache_rejects_impossible_settings(tiny_llama):
    with pytest.raises(ValueError):
        SinkWindowCache.empty(tiny_llama.config, 1, 8, window=0)
    with pytest.raises(ValueError):
        SinkWindowCache.empty(tiny_llama.config, 1, 8, window=4, sinks=-1)


# -- SmolLM2 through the cache --------------------------------------------------------------

@pytest.fixture(scope="module")
def passage(model):
    return model.tokenizer.encode(eval_text())[:160]


@pytest.mark.slow
def test_wide_window_is_the_model_itself(model, passage):
    ids = torch.tensor([passage[:64]])
    plain = model(ids, cache=model.new_cache(1, 64))
    wide = model(ids, cache=SinkWindowCache.empty(model.config, 1, 64, window=64, sinks=4))
    torch.testing.assert_close(wide, plain, rtol=0, atol=1e-5)
    narrow = model(ids, cache=SinkWindowCache.empty(model.config, 1, 64, window=16))
    torch.testing.assert_close(narrow[0, :16], plain[0, :16], rtol=0, atol=1e-5)  # window not yet full
    assert (narrow[0, 16:] - plain[0, 16:]).abs().amax() > 1.0


@pytest.mark.slow
def test_second_half_loss(model, passage):
    full = second_half_loss(model, passage, window=None, chunk=64)
    # independent: one forward pass, no cache, the second half scored by hand
    logp = torch.log_softmax(model(torch.tensor([passage]))[0].double(), dim=-1)
    targets = torch.tensor(passage[80:])
    direct = -logp[torch.arange(79, 159), targets].mean().item()
    assert full.tokens_scored == 80
    assert full.nats_per_token == pytest.approx(direct, rel=1e-5)

    plain = second_half_loss(model, passage, window=32, chunk=64)
    sinks = second_half_loss(model, passage, window=32, sinks=4, chunk=64)
    for record in (full, plain, sinks):
        assert record.tokens_scored == 80 and math.isfinite(record.nats_per_token)
    assert plain.label == "window 32" and sinks.label == "window 32 + 4 sinks"
    # Sinks should not make things worse beyond noise (on this passage they help a lot:
    # about 3.33 nats vs 5.85 for the plain window, 2.97 for full attention).
    assert sinks.nats_per_token < plain.nats_per_token + 0.1


# -- Gemma 3: reach through stacked windows -------------------------------------------------

@pytest.fixture(scope="module")
def gemma():
    from labkit.models import load_model

    return load_model("gemma3-270m", with_tokenizer=False)


@pytest.fixture(scope="module")
def gemma_ids():
    from labkit.models.loader import load_tokenizer

    ids = load_tokenizer("gemma3-270m").encode(eval_text()[:2000], add_special_tokens=True)
    assert ids[0] == 2  # BOS
    return ids[:100]


WINDOW, PERTURBED = 4, 16  # 18 layers x (4 - 1) = 54 positions of reach: ends at 70 < 100


@pytest.mark.slow
def test_every_layer_windowed_reach_stops_at_the_bound(gemma, gemma_ids):
    before = gemma.config.layer_windows
    result = influence_by_distance(gemma, gemma_ids, PERTURBED,
                                   layer_windows=every_layer_windowed(gemma.config, WINDOW))
    assert gemma.config.layer_windows == before  # the model is left as it was
    bound = result.reach_bound
    assert bound == 18 * (WINDOW - 1) == 54
    change = result.max_abs_logit_change
    assert all(c == 0.0 for c in change[:PERTURBED])
    assert all(c == 0.0 for c in change[PERTURBED + bound + 1:])
    assert max(change[PERTURBED + bound - WINDOW:PERTURBED + bound + 1]) > 0  # it does get there
    assert result.farthest_reach <= bound


@pytest.mark.slow
def test_global_layers_carry_influence_everywhere(gemma, gemma_ids):
    result = influence_by_distance(gemma, gemma_ids, PERTURBED,
                                   layer_windows=local_layers_windowed(gemma.config, WINDOW))
    assert result.reach_bound is None
    change = result.max_abs_logit_change
    assert all(c == 0.0 for c in change[:PERTURBED])
    beyond = change[PERTURBED + 18 * (WINDOW - 1) + 1:]
    assert len(beyond) > 20 and min(beyond) > 1e-3  # every later position moves
    assert result.farthest_reach == len(gemma_ids) - 1 - PERTURBED


# -- the arithmetic -------------------------------------------------------------------------

def test_decode_step_costs():
    from types import SimpleNamespace

    # Gemma 3 270M's shape (no need to load it): 18 layers, 1 KV head of 256, every 6th global
    config = SimpleNamespace(num_layers=18, num_kv_heads=1, head_dim=256,
                             layer_windows=tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18)))
    per_position = 2 * 256 * 4
    full, masked, rolling = decode_step_costs(config, 4096)
    assert full.kv_bytes_held == masked.kv_bytes_held == 18 * 4096 * per_position
    assert full.keys_read == masked.keys_read == 18 * 4096
    assert masked.keys_attended == rolling.keys_read == rolling.keys_attended == 15 * 512 + 3 * 4096
    assert rolling.kv_bytes_held == rolling.kv_bytes_read == (15 * 512 + 3 * 4096) * per_position
    # inside the window the three are the same
    assert len({(c.kv_bytes_held, c.keys_read) for c in decode_step_costs(config, 300)}) == 1


# -- per-passage sweep and the share recovered -----------------------------------------------

def test_passage_sweep_keeps_passages_apart(tiny_llama):
    from labkit.experiments.sliding_window import passage_sweep, window_loss_sweep

    gen = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, 97, (40,), generator=gen).tolist() for _ in range(2)]
    rows = passage_sweep(tiny_llama, texts, [8], sinks=(1, 4))
    assert [(r["passage"], r["window"], r["sinks"]) for r in rows] == [
        (p, w, s) for p in (0, 1) for w, s in ((None, 0), (8, 0), (8, 1), (8, 4))]
    full = second_half_loss(tiny_llama, texts[1], None)
    assert rows[4]["nats_per_token"] == pytest.approx(full.nats_per_token, rel=1e-12)
    assert rows[4]["bits_per_token"] == pytest.approx(full.nats_per_token / math.log(2))
    assert rows[6]["setting"] == "window 8 + 1 sink" and rows[4]["tokens"] == 20
    # summed over passages, the rows are window_loss_sweep's records
    summed = window_loss_sweep(tiny_llama, texts, [8], sinks=4)
    for record in summed:
        mine = [r for r in rows if (r["window"], r["sinks"]) == (record.window, record.sinks)]
        total = sum(r["nats_per_token"] * r["tokens"] for r in mine)
        assert total == pytest.approx(record.nll_nats, rel=1e-9)


def test_damage_recovered():
    from labkit.experiments.sliding_window import damage_recovered

    assert damage_recovered(3.00, 7.07, 3.35) == pytest.approx(0.914, abs=1e-3)  # the source's
    assert damage_recovered(3.0, 5.0, 3.0) == 1.0 and damage_recovered(3.0, 5.0, 5.0) == 0.0
    assert damage_recovered(3.0, 5.0, 6.0) < 0
    with pytest.raises(ValueError):
        damage_recovered(3.0, 3.0, 3.0)


# -- Gemma 3: what the timed steps run ---------------------------------------------------------

@pytest.mark.slow
def test_primed_caches_and_runners(gemma):
    from labkit.experiments.sliding_window import (SCHEMES, attention_runner,
                                                   decode_step_runner, primed_cache)

    caches = {scheme: primed_cache(gemma, scheme, 600) for scheme in SCHEMES}
    assert all(cache.length == 600 for cache in caches.values())
    assert caches["rolling cache"].nbytes() == sum(
        c.kv_bytes_held for c in decode_step_costs(gemma.config, 601)  # room for the step
        if c.scheme == "rolling cache")
    assert caches["full cache"].layer_windows == (None,) * 18
    assert caches["mask over full cache"].layer_windows == gemma.config.layer_windows
    for cache in caches.values():
        step = decode_step_runner(gemma, cache)
        first, second = step(), step()
        assert first.shape == (1, 1, 262_144) and cache.length == 600
        torch.testing.assert_close(first, second, rtol=0, atol=0)  # the same step each call
        outs = attention_runner(gemma, cache)()
        assert len(outs) == 18 and outs[0].shape == (1, 1, 4, 1, 256)
    with pytest.raises(ValueError):
        primed_cache(gemma, "paged", 10)


@pytest.mark.slow
def test_rolling_and_masked_caches_give_the_same_greedy_tokens(gemma, gemma_ids):
    from dataclasses import replace

    from labkit.experiments.sliding_window import greedy_with_cache
    from labkit.models.window_cache import RollingKVCache

    config = replace(gemma.config, layer_windows=local_layers_windowed(gemma.config, 8))
    rolling = greedy_with_cache(gemma, RollingKVCache(config, 1, 60), gemma_ids[:40], 12)
    masked = greedy_with_cache(gemma, WindowedKVCache.empty(config, 1, 60), gemma_ids[:40], 12)
    assert len(rolling.token_ids) == 12
    # two caches, two numerical paths: the logits within 1e-3 on the steps both share, the
    # tokens equal up to the near-tie rule
    from conftest import assert_greedy_near

    assert_greedy_near([masked.token_ids], [rolling.token_ids], [torch.stack(masked.logits)], 1e-3,
                       [torch.stack(rolling.logits)], what="the rolling cache against the masked one")


def test_cache_nbytes_is_the_closed_form():
    from types import SimpleNamespace

    from labkit.experiments.sliding_window import cache_nbytes
    from labkit.models.window_cache import RollingKVCache

    config = SimpleNamespace(num_layers=6, num_kv_heads=2, head_dim=8, attention_scale=0.3,
                             layer_windows=(16, 16, None, 16, 16, None))
    for context in (10, 16, 100):
        costs = {c.scheme: c.kv_bytes_held for c in decode_step_costs(config, context)}
        assert cache_nbytes(RollingKVCache(config, 1, context)) == costs["rolling cache"]
        masked = WindowedKVCache.empty(config, 1, context)
        assert cache_nbytes(masked) == costs["mask over full cache"] == costs["full cache"]


# -- two caches' greedy tokens under the near-tie rule --------------------------------------

def _rows(*tops):
    """[vocab 6] logit rows whose top token and runner-up are given with their gap."""
    rows = []
    for token, runner_up, gap in tops:
        row = torch.full((6,), -5.0)
        row[token], row[runner_up] = 1.0, 1.0 - gap
        rows.append(row)
    return rows


def test_compare_paths_excuses_a_near_tie_and_measures_only_the_shared_steps():
    from labkit.experiments.sliding_window import compare_paths, shared_score_error

    ref = _rows((1, 2, 1.0), (3, 4, 5e-4), (0, 5, 1.0))
    cand = [r.clone() for r in ref]
    cand[0][1] += 2e-4                 # a rounding difference on a shared step: counted
    cand[1][3], cand[1][4] = 0.9995, 1.0  # the flip, at a gap of 5e-4
    cand[2] += 50.0                   # after the divergence: another context, never read
    same = compare_paths([1, 3, 0], ref, [1, 3, 0], ref)
    assert same.ok and same.agreement.exact and same.score_error == 0.0
    flip = compare_paths([1, 3, 0], ref, [1, 4, 5], cand, bound=1e-3)
    assert flip.ok and flip.agreement.excused and flip.agreement.diverged_at == 1
    assert flip.score_error == pytest.approx(5e-4, rel=1e-3)  # the flip step itself
    # a divergence at a wide gap fails, and so does an error beyond the bound
    assert not compare_paths([1, 3, 0], ref, [2, 3, 0], ref).ok
    noisy = [r + torch.arange(6) * 1e-2 for r in ref]
    assert not compare_paths([1, 3, 0], ref, [1, 3, 0], noisy).within_bound
    # top-k pairs (the engine's top_logprobs) against full rows
    pairs = [[(1, 1.0), (2, 0.0)]]
    assert shared_score_error(ref[:1], pairs, 1) == pytest.approx(0.0)
    assert shared_score_error(ref[:1], [[(1, 1.25)]], 1) == pytest.approx(0.25)


# -- readings that claim no more than the data ----------------------------------------------

def test_paired_interval_uses_t_for_n_minus_one_degrees_of_freedom():
    from labkit.experiments.sliding_window import T_975, paired_interval

    # chapter 22's five passages: a mean 2.17 standard errors below 0 is within the noise
    # with 4 degrees of freedom (cutoff 2.776), though it would pass a cutoff of 2
    d = [-0.0822, -0.0050, -0.1151, 0.0064, -0.0528]
    got = paired_interval(d)
    mean = sum(d) / 5
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / 4) / math.sqrt(5)
    assert got.n == 5 and got.mean == pytest.approx(mean)
    assert got.half_width == pytest.approx(2.776 * se)
    assert abs(mean) > 2 * se and got.verdict == "within the noise"
    assert got.low < 0 < got.high
    # every difference of one sign and tight: a direction
    assert paired_interval([0.10, 0.11, 0.09, 0.10, 0.12]).verdict == "higher"
    assert paired_interval([-0.10, -0.11, -0.09]).verdict == "lower"
    # two pairs: one degree of freedom, cutoff 12.706
    assert paired_interval([1.0, 3.0]).half_width == pytest.approx(12.706 * 1.0)
    # more than 30 pairs: the 30-degree value, slightly wide
    many = paired_interval([0.0, 1.0] * 20)
    assert many.half_width == pytest.approx(T_975[-1] * math.sqrt(40 / 39 * 0.25) / math.sqrt(40))
    assert T_975[3] == 2.776 and T_975[0] == 12.706
    with pytest.raises(ValueError):
        paired_interval([0.1])


def test_cache_fit_sentence_reads_each_outcome():
    from labkit.experiments.sliding_window import cache_fit_sentence

    mib = 2**20
    # chapter 22 on a 300 MiB cache: the ring's 116 MB fits, the mask's 604 MB does not
    one = cache_fit_sentence(16384, 116e6, 604e6, 300 * mib)
    assert "the rolling cache's 116 MB is smaller than" in one
    assert "the mask's 604 MB is not" in one and "(300 MiB)" in one
    # a 16 MiB laptop cache: neither
    assert "neither the rolling cache's 116 MB nor the mask's 604 MB" in cache_fit_sentence(
        16384, 116e6, 604e6, 16 * mib)
    # a cache that holds both
    assert " both " in cache_fit_sentence(256, 9e6, 9e6, 300 * mib)
    # unknown size: no claim either way
    unknown = cache_fit_sentence(16384, 116e6, 604e6, None)
    assert "could not be read" in unknown and "smaller" not in unknown
