"""labkit.experiments.blockwise_attention: what naive attention's time includes besides
arithmetic (fresh pages on every call) and intervals named for what few calls give."""

import resource
from functools import partial

import pytest
import torch

from labkit.experiments.blockwise_attention import (MMAP_THRESHOLD_MAX, allocation_peak,
                                                    compare_methods, first_touch,
                                                    compare_less_touch, interval_words)
from labkit.kernels.attention import naive_attention
from labkit.kernels.blockwise import blockwise_attention
from labkit.util.compare import compare

MiB = 2**20


def test_fresh_sizes_are_the_allocations_glibc_maps_on_every_call():
    def call():
        big, small = torch.empty(40 * MiB, dtype=torch.uint8), torch.empty(MiB, dtype=torch.uint8)
        return big[:1] + small[:1]

    alloc = allocation_peak(call)
    assert alloc.fresh_sizes == (40 * MiB,) and alloc.fresh_bytes == 40 * MiB
    assert MMAP_THRESHOLD_MAX == 32 * MiB


def test_naive_takes_four_score_tensors_of_fresh_pages_per_call_and_the_loop_none():
    """Read off naive_attention's code: the product, its scaled copy, the masked copy and
    the softmax each allocate one [1, 9, 2048, 2048] float32 tensor (144 MiB); the two
    boolean masks (12 MiB) and the output stay below glibc's mapping limit."""
    methods = {"naive": naive_attention,
               "blockwise": partial(blockwise_attention, block_q=128, block_k=128)}
    naive, loop = compare_methods(methods, [2048], repeats=3, threads=1)
    assert naive["score_bytes"] == 144 * MiB
    assert naive["fresh_sizes"] == [144 * MiB] * 4
    assert naive["fresh_bytes"] == 4 * naive["score_bytes"]
    assert loop["fresh_bytes"] == 0 and loop["fresh_sizes"] == []


def test_first_touch_faults_in_every_page_each_call():
    size = 64 * MiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    timing = first_touch([size, size], repeats=2, warmup=1, threads=1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert len(timing.samples) == 2 and timing.median > 0
    # three calls of two fresh blocks; at most one fault per 2 MiB page (transparent huge
    # pages), one per 4 KiB page without them
    assert faults >= 3 * 2 * size // (2 * MiB)


def test_compare_less_touch_takes_the_cost_out_and_keeps_its_noise():
    loop, naive = [1.0, 1.02, 0.98, 1.01, 0.99], [6.0, 6.2, 6.1, 6.05, 6.15]
    exact = compare_less_touch(loop, naive, [4.0] * 5)
    assert exact.ratio == pytest.approx((6.1 - 4.0) / 1.0)  # medians: 6.1 - 4.0 over 1.0
    assert exact.low > 1 and exact.verdict == "faster"
    # the same medians with a noisy cost: the interval widens by what the cost's calls vary
    noisy = compare_less_touch(loop, naive, [3.4, 4.0, 4.6, 3.7, 4.3])
    assert noisy.ratio == pytest.approx(exact.ratio)
    assert noisy.high - noisy.low > 2 * (exact.high - exact.low)
    # against the plain compare of naive less a fixed median: never narrower
    fixed = compare(loop, [s - 4.0 for s in naive])
    assert noisy.low <= fixed.low and noisy.high >= fixed.high
    with pytest.raises(ValueError):
        compare_less_touch(loop, naive, [6.5, 6.6, 6.7])  # the cost is not less than b
    with pytest.raises(ValueError):
        compare_less_touch(loop, naive, [1.0, 1.0])


def test_interval_words_keep_the_verdict_and_name_the_range_for_what_it_is():
    faster = compare([1.0, 1.1, 0.9], [2.0, 2.1, 1.9])
    words = interval_words(faster)
    assert words.startswith(faster.phrase().split(" (")[0])  # "2.00 times faster"
    assert "95%" not in words and "bootstrap range" in words and "over 3 calls each)" in words
    tie = interval_words(compare([1.0, 1.1, 0.9], [1.0, 1.1, 0.9, 1.05]))
    assert tie.startswith("no faster beyond the noise") and "over 3 and 4 calls)" in tie
    slower = interval_words(compare([2.0, 2.1, 1.9], [1.0, 1.1, 0.9]))
    assert slower.startswith("slower") and "bootstrap range" in slower
