"""The CPU flash kernel's block schedule under the causal flag, and the timing of the flag
against a mask and against no mask (chapter 4)."""

import pytest
import torch
import torch.nn.functional as F

from labkit.experiments import causal_blocks as cb
from labkit.util.compare import Comparison


def brute_force_scores(q_len: int, q_rows: int, kv_block: int = 512) -> int:
    """The schedule written out cell by cell: query i belongs to block i // q_rows, whose last
    query is min(block end, q_len) - 1; that block computes every key in every 512-key block
    that starts at or before that last query."""
    total = 0
    for i in range(q_len):
        last = min((i // q_rows + 1) * q_rows, q_len) - 1
        total += sum(1 for j in range(q_len) if (j // kv_block) * kv_block <= last)
    return total


@pytest.mark.parametrize("length, rows", [(100, 32), (128, 32), (300, 64), (512, 64),
                                          (700, 64), (1024, 256), (2048, 256)])
def test_scored_pairs_match_the_schedule_cell_by_cell(length, rows):
    assert cb.query_block(length) == rows
    assert cb.kernel_scored_pairs(length) == brute_force_scores(length, rows)


def test_up_to_one_key_block_the_causal_flag_skips_nothing():
    for length in (1, 64, 128, 512):
        assert cb.square_share(length) == 1.0
    # beyond it whole blocks are skipped: 2,048 tokens score 20 of 32 block pairs' area
    assert cb.square_share(2048) == pytest.approx(0.625)
    assert cb.square_share(1024) == pytest.approx(0.75)
    for length in (600, 2048, 8192):  # never below the triangle, never above the square
        assert length * (length + 1) // 2 <= cb.kernel_scored_pairs(length) < length**2
    assert cb.kernel_scored_pairs(7, 9, causal=False) == 63
    with pytest.raises(ValueError):
        cb.kernel_scored_pairs(0)


def test_time_causal_flag_times_every_variant_and_checks_they_agree():
    records = cb.time_causal_flag([64, 96], heads=4, kv_heads=2, head_dim=8, rounds=3,
                                  threads=1)
    assert sorted((r["length"], r["variant"]) for r in records) == sorted(
        (n, v) for n in (64, 96) for v in cb.VARIANTS)
    for r in records:
        assert len(r["samples_s"]) == 3 and r["median_s"] > 0
        assert r["scored"] == r["length"] ** 2  # under 512 keys every variant scores it all
    with pytest.raises(ValueError):
        cb.time_causal_flag([64], heads=4, kv_heads=2, head_dim=8, rounds=2)


def naive_causal_grouped(q, k, v):
    """Reference: each KV head copied to its query heads, the full score square, the future
    set to -inf, a softmax and a weighted sum."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def grouped_inputs(heads=6, kv_heads=2, length=40, dim=8):
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, heads, length, dim, generator=generator)
    k, v = (torch.randn(1, kv_heads, length, dim, generator=generator) for _ in "kv")
    return q, k, v


def test_old_stacked_path_computes_what_the_causal_flag_computes():
    q, k, v = grouped_inputs()
    old = cb.stacked_mask_attention(q, k, v)
    flag = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(old, naive_causal_grouped(q, k, v), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(old, flag, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError):  # 5 query heads do not split over 2 KV heads
        cb.stacked_mask_attention(q[:, :5], k, v)


def test_old_stacked_path_hands_sdpa_the_old_layout(monkeypatch):
    """What made it the old path: kv_heads heads of group * T stacked queries, a
    [group * T, T] mask, no enable_gqa (2929be7's parent)."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((tuple(q.shape), tuple(kwargs["attn_mask"].shape), kwargs))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(cb.F, "scaled_dot_product_attention", spy)
    q, k, v = grouped_inputs(heads=6, kv_heads=2, length=40, dim=8)
    cb.stacked_mask_attention(q, k, v)
    (q_shape, mask_shape, kwargs), = seen
    assert q_shape == (1, 2, 3 * 40, 8) and mask_shape == (3 * 40, 40)
    assert not kwargs.get("enable_gqa") and not kwargs.get("is_causal")


def test_timing_refuses_an_old_path_that_disagrees(monkeypatch):
    monkeypatch.setattr(cb, "stacked_mask_attention", lambda q, k, v: torch.zeros_like(q))
    with pytest.raises(AssertionError, match="old stacked path"):
        cb.time_causal_flag([64], heads=4, kv_heads=2, head_dim=8, rounds=3, threads=1)


def test_prediction_lies_inside_above_or_below_the_measured_interval():
    measured = Comparison("flag", "no mask", ratio=1.5, low=1.4, high=1.8, confidence=0.95,
                          samples_a=7, samples_b=7)
    assert cb.predicted_flag_speedup(2048) == pytest.approx(1.6)  # 1 / 62.5%
    assert cb.predicted_flag_speedup(512) == 1.0
    assert cb.prediction_against(1.6, measured) == "inside"
    assert cb.prediction_against(1.9, measured) == "above"  # the flag saved less than predicted
    assert cb.prediction_against(1.3, measured) == "below"
