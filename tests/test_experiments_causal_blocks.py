"""The CPU flash kernel's block schedule under the causal flag, and the timing of the flag
against a mask and against no mask (chapter 4)."""

import pytest

from labkit.experiments import causal_blocks as cb


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
