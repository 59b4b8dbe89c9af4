"""Block-wise attention with an online softmax equals ordinary attention, skips the tiles
above the diagonal, and fails when its rescale is removed."""

import pytest
import torch

from conftest import random_qkv as qkv
from labkit.experiments.attention_cost import reference_attention
from labkit.kernels.attention import decode_attention, naive_attention
from labkit.experiments.blockwise_attention import allocation_peak, compare_methods
from labkit.kernels.blockwise import blockwise_attention, blockwise_decode_attention, sdpa_backend, working_set_bytes


@pytest.fixture(autouse=True)
def one_thread():
    """Many tiny tensor operations: one thread avoids waiting for a second on a busy machine."""
    from labkit.util.timing import num_threads

    with num_threads(1):
        yield


SHAPES = [  # batch, heads, kv_heads, q_len, kv_len
    (2, 4, 4, 37, 37),   # MHA prefill, length not a multiple of the blocks
    (1, 9, 3, 50, 50),   # GQA prefill (SmolLM2's 9/3 heads)
    (1, 6, 2, 13, 40),   # a chunk of new queries after a cached prefix (end-aligned mask)
    (2, 9, 3, 1, 33),    # one query
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("blocks", [(8, 8), (16, 5), (64, 64)])
def test_blockwise_matches_reference(shape, causal, blocks):
    q, k, v = qkv(*shape)
    out = blockwise_attention(q, k, v, causal=causal, block_q=blocks[0], block_k=blocks[1])
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.allclose(out.double(), reference_attention(q, k, v, causal), atol=2e-6)
    assert torch.allclose(out, naive_attention(q, k, v, causal=causal), atol=2e-6)


def test_float64_is_exact_to_float64_rounding():
    q, k, v = qkv(1, 9, 3, 40, 40, dtype=torch.float64)
    out = blockwise_attention(q, k, v, block_q=8, block_k=8)
    assert (out - reference_attention(q, k, v)).abs().max().item() < 1e-12


def test_bfloat16_inputs_keep_float32_statistics():
    q, k, v = qkv(1, 9, 3, 32, 32, dim=64, dtype=torch.bfloat16)
    out = blockwise_attention(q, k, v, block_q=8, block_k=8)
    assert out.dtype == torch.bfloat16
    assert (out.double() - reference_attention(q, k, v)).abs().max().item() < 2e-2


def test_broken_rescale_fails_once_the_max_grows():
    q, k, v = qkv(1, 9, 3, 64, 64)
    ref = reference_attention(q, k, v)
    broken = blockwise_attention(q, k, v, block_q=16, block_k=16, rescale=False)
    assert (broken.double() - ref).abs().max().item() > 1e-2
    # With a single key block there is nothing to rescale: the bug is invisible.
    single = blockwise_attention(q, k, v, block_q=64, block_k=64, rescale=False)
    assert (single.double() - ref).abs().max().item() < 2e-6


def test_causal_tiles_above_the_diagonal_are_skipped():
    q, k, v = qkv(1, 2, 1, 64, 64)
    stats = {}
    blockwise_attention(q, k, v, block_q=16, block_k=16, stats=stats)
    # 4 query blocks x 4 key blocks: 10 on or below the diagonal, 6 above, 4 masked.
    assert stats["tiles"] == 10 and stats["skipped"] == 6 and stats["masked"] == 4
    assert stats["tile_bytes"] == 2 * 16 * 16 * 4
    blockwise_attention(q, k, v, causal=False, block_q=16, block_k=16, stats=stats)
    assert stats["tiles"] == 16 and stats["skipped"] == 0 and stats["masked"] == 0


def test_causal_needs_enough_keys():
    q, k, v = qkv(1, 2, 2, 8, 4)
    with pytest.raises(ValueError, match="kv_len"):
        blockwise_attention(q, k, v)


@pytest.mark.parametrize("lengths", [None, [33, 10, 1]])
@pytest.mark.parametrize("block_k", [4, 7, 256])
def test_decode_variant_matches_decode_attention(lengths, block_k):
    q, k, v = qkv(3, 9, 3, 1, 33)
    out = blockwise_decode_attention(q, k, v, lengths, block_k=block_k)
    assert torch.allclose(out, decode_attention(q, k, v, lengths), atol=2e-6)


def test_decode_variant_broken_rescale_and_bad_input():
    q, k, v = qkv(1, 9, 3, 1, 64)
    good = decode_attention(q, k, v)
    broken = blockwise_decode_attention(q, k, v, block_k=8, rescale=False)
    assert (broken - good).abs().max().item() > 1e-2
    with pytest.raises(ValueError):
        blockwise_decode_attention(*qkv(1, 9, 3, 2, 8))
    with pytest.raises(ValueError):
        blockwise_decode_attention(q, k, v, [0])


def test_working_set_formula():
    sizes = working_set_bytes(1, 9, 3, 8192, 64, 128, 128)
    assert sizes["tile"] == 9 * 128 * 128 * 4
    assert sizes["stats"] == 2 * 9 * 128 * 4
    assert sizes["running_output"] == 9 * 128 * 64 * 4
    assert sizes["output"] == 9 * 8192 * 64 * 4
    assert sizes["working"] == 2 * sizes["tile"] + sizes["stats"] + 3 * sizes["running_output"]


def test_allocation_peak_counts_a_temporary_exactly():
    x = torch.ones(256, 256)

    def fn():
        tmp = x * 2  # 256 KiB, freed before the result (another 256 KiB) is made
        return tmp + 1

    peak = allocation_peak(fn)
    assert peak.result_bytes == 256 * 256 * 4
    assert peak.peak_bytes >= 2 * 256 * 256 * 4
    assert peak.allocated_bytes >= 2 * 256 * 256 * 4 and peak.allocations >= 2
    assert peak.extra_bytes == peak.peak_bytes - peak.result_bytes


def test_blockwise_peak_is_far_below_naive():
    q, k, v = qkv(1, 9, 3, 512, 512, dim=64)
    naive = allocation_peak(lambda: naive_attention(q, k, v))
    block = allocation_peak(lambda: blockwise_attention(q, k, v, block_q=64, block_k=64))
    sizes = working_set_bytes(1, 9, 3, 512, 64, 64, 64)
    assert naive.peak_bytes >= 2 * 9 * 512 * 512 * 4
    assert block.extra_bytes < 3 * sizes["working"]
    assert block.peak_bytes * 5 < naive.peak_bytes


def test_sdpa_backend_any_and_math_agree():
    q, k, v = qkv(1, 9, 3, 24, 24)
    ref = reference_attention(q, k, v)
    for backend in ("any", "math"):
        assert torch.allclose(sdpa_backend(backend)(q, k, v).double(), ref, atol=2e-6)


def test_compare_methods_records():
    methods = {"naive": naive_attention, "blockwise": blockwise_attention}
    rows = compare_methods(methods, [64], heads=4, kv_heads=2, head_dim=16, repeats=1,
                           warmup=1, threads=1)
    assert [r["method"] for r in rows] == ["naive", "blockwise"]
    for r in rows:
        assert r["median_s"] > 0 and r["repeats"] == 1 and r["skipped"] is None
        assert r["result_bytes"] == 4 * 64 * 16 * 4
        assert r["score_bytes"] == 4 * 64 * 64 * 4
    skipped = compare_methods({"naive": naive_attention}, [64], heads=4, kv_heads=2, head_dim=16,
                              repeats=1, memory_fraction=0.0)
    assert skipped[0]["skipped"] and skipped[0]["median_s"] is None


def test_frames_ratios_and_plots():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.experiments.blockwise_attention import plot_peaks, plot_ratios, plot_times, records_frame, time_ratios

    rows = [{"method": m, "length": n, "median_s": t * n, "peak_bytes": 2**20 * n,
             "result_bytes": 2**20, "extra_bytes": 2**20 * (n - 1), "score_bytes": 2**20 * n * n}
            for m, t in (("naive", 2.0), ("blockwise", 1.0)) for n in (2, 4)]
    df = records_frame(rows)
    assert df["peak_mib"].tolist() == [2.0, 4.0, 2.0, 4.0]
    ratios = time_ratios(df, [("naive", "blockwise"), ("naive", "missing")])
    assert ratios["ratio"].tolist() == [2.0, 2.0] and set(ratios["pair"]) == {"naive / blockwise"}
    fig, (a, b, c) = plt.subplots(1, 3)
    plot_peaks(a, df, {"formula": ([2, 4], [1.0, 2.0])})
    plot_times(b, df)
    plot_ratios(c, ratios)
    assert len(a.lines) == 3 and len(b.lines) == 2
    plt.close(fig)
    from labkit.experiments.blockwise_attention import plot_block_sizes

    df["block"] = [32, 64, 32, 64]
    fig, (a, b) = plt.subplots(1, 2)
    plot_block_sizes(a, b, df[df["method"] == "naive"])
    assert [t.get_text() for t in a.get_xticklabels()] == ["32", "64"]
    plt.close(fig)


def test_compare_at_uses_every_timed_call():
    import pandas as pd

    from labkit.experiments.blockwise_attention import compare_at

    rows = compare_methods({"naive": naive_attention, "blockwise": blockwise_attention}, [64],
                           heads=4, kv_heads=2, head_dim=16, repeats=3, warmup=1, threads=1)
    assert all(len(r["samples_s"]) == 3 for r in rows)
    df = pd.DataFrame([{"method": "a", "length": 8, "samples_s": [1.0, 1.1, 1.2]},
                       {"method": "b", "length": 8, "samples_s": [3.0, 3.1, 3.2]}])
    c = compare_at(df, "a", "b", 8)
    assert c.verdict == "faster" and 2.5 < c.ratio < 3.0


def test_speed_owner_reads_both_steps():
    """The credit for the fused kernel's speed comes from both comparisons: the loop against
    naive attention (the algorithm) and the fused kernel against the loop (the kernel).
    Judging from the second alone, as the chapter once did, would give the kernel the
    speed in the first case below, where the algorithm made most of it."""
    from labkit.experiments.blockwise_attention import speed_owner
    from labkit.util.compare import Comparison

    def c(ratio, low, high):
        return Comparison("a", "b", ratio, low, high, 0.95, 3, 3)

    # both faster, the algorithm's interval above the kernel's (the CPU run of the chapter)
    text = speed_owner(c(6.89, 6.75, 7.60), c(1.68, 1.61, 1.77))
    assert "6.89 times as fast as naive attention" in text and "1.68 times" in text
    assert "came with the algorithm than with the kernel" in text
    assert "belongs to the kernel" not in text
    # both faster, the kernel's share clearly larger; then overlapping intervals
    assert "came with the kernel than with the algorithm" in speed_owner(
        c(1.3, 1.2, 1.4), c(5.0, 4.0, 6.0))
    assert "neither share is clearly the larger" in speed_owner(
        c(2.0, 1.5, 3.0), c(2.5, 2.0, 3.5))
    # the loop slower than naive attention (the source's GPU): the kernel owns the speed
    text = speed_owner(c(0.06, 0.05, 0.07), c(100.0, 90.0, 110.0))
    assert "the speed belongs to the kernel" in text
    assert "slower than naive attention (0.06 times its speed)" in text
    # the loop within the noise of naive attention, the kernel faster
    text = speed_owner(c(1.02, 0.9, 1.2), c(3.0, 2.8, 3.2))
    assert "the speed belongs to the kernel" in text
    assert "not faster than naive attention beyond the noise (ratio 1.02)" in text
    # the loop faster, the kernel no faster than the loop: the algorithm owns the speed
    text = speed_owner(c(4.0, 3.5, 4.5), c(0.98, 0.9, 1.1))
    assert "so does the speed" in text and "belongs to the kernel" not in text
    assert "not faster than the loop beyond the noise (ratio 0.98)" in text
    # neither step faster
    text = speed_owner(c(1.0, 0.9, 1.1), c(0.8, 0.7, 0.9))
    assert "neither owns a speed-up" in text and "slower than the loop" in text
    assert text.endswith(".")
    # measured against another baseline, the sentence names it
    text = speed_owner(c(2.1, 2.0, 2.2), c(1.5, 1.4, 1.6), baseline="unfused SDPA")
    assert "2.10 times as fast as unfused SDPA" in text and "naive" not in text
