"""What SDPA's CPU kernel skips under the causal flag, block by block (chapter 4).

PyTorch's CPU flash-attention kernel (`aten/src/ATen/native/cpu/FlashAttentionKernel.cpp`)
walks the score matrix in blocks: query blocks of 256 rows for 768 queries or more, 64 from
192, 32 below, and key blocks of 512 columns. With the causal flag each query block stops at
the key block that holds its last query's own position (`num_keys = min(m + qBlockSize,
kvSize)`), and every key block it visits is multiplied at full width and masked afterwards.
So the flag skips only whole 512-key blocks above the diagonal: a prompt of at most 512
tokens is scored over the whole square, and the triangle's saving appears only beyond it.

- :func:`kernel_scored_pairs`: the (query, key) scores that schedule computes, against the
  square and the causal triangle.
- :func:`time_causal_flag`: one attention call per prompt length with the causal flag, with
  no mask at all (the whole square, a different result), and with an explicit boolean
  [T, T] mask (what a kernel given a mask computes: every block), interleaved in rounds.
  The timing is the check on the schedule: a PyTorch version with other block sizes shows
  up as a ratio the schedule does not predict.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from labkit.util.timing import measure_interleaved

KV_BLOCK = 512  # keys per block, every query length
Q_BLOCKS = ((768, 256), (192, 64), (0, 32))  # (from this many queries, rows per block)
VARIANTS = ("causal flag", "explicit mask", "no mask")


def query_block(q_len: int) -> int:
    """Rows per query block the CPU kernel uses for `q_len` queries."""
    return next(rows for start, rows in Q_BLOCKS if q_len >= start)


def kernel_scored_pairs(q_len: int, kv_len: int | None = None, *, causal: bool = True) -> int:
    """(query, key) scores the CPU flash kernel computes per head for `q_len` queries over
    `kv_len` keys (default `q_len`: a prompt attending to itself). Without `causal` that is
    the whole rectangle; with it, each query block computes every 512-key block up to the
    one holding its last query's position, at full width."""
    kv_len = q_len if kv_len is None else kv_len
    if q_len < 1 or kv_len < 1:
        raise ValueError(f"lengths must be positive, got {q_len} queries and {kv_len} keys")
    if not causal:
        return q_len * kv_len
    rows_per_block, scored = query_block(q_len), 0
    for m in range(0, q_len, rows_per_block):
        rows = min(rows_per_block, q_len - m)
        num_keys = min(m + rows, kv_len)
        scored += rows * sum(min(KV_BLOCK, kv_len - n) for n in range(0, num_keys, KV_BLOCK))
    return scored


def square_share(length: int) -> float:
    """The share of the whole [length, length] score square the causal kernel computes."""
    return kernel_scored_pairs(length) / length**2


def time_causal_flag(lengths: Sequence[int], *, heads: int, kv_heads: int, head_dim: int,
                     rounds: int = 5, threads: int | None = None,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Time one grouped attention call (`enable_gqa`, float32) over a prompt of each
    length, in the three :data:`VARIANTS`, all interleaved for `rounds` rounds. Before
    timing, checks that the causal flag and the explicit mask give the same output (within
    float32 rounding), so the two timed variants compute one function. One record per
    (length, variant): samples_s, median_s, scored (the schedule's scores per head: the
    square for the mask and for no mask)."""
    if rounds < 3:
        raise ValueError("rounds must be at least 3 (compare needs three samples a side)")
    generator = torch.Generator().manual_seed(seed)
    runners, scored = {}, {}
    for length in lengths:
        q = torch.randn(1, heads, length, head_dim, generator=generator)
        k, v = (torch.randn(1, kv_heads, length, head_dim, generator=generator) for _ in "kv")
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        if not torch.allclose(causal, masked, atol=1e-5, rtol=1e-4):
            raise AssertionError(f"causal flag and explicit mask disagree at {length} tokens")
        runners[(length, "causal flag")] = (
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=True))
        runners[(length, "explicit mask")] = (
            lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True))
        runners[(length, "no mask")] = (
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        scored[(length, "causal flag")] = kernel_scored_pairs(length)
        scored[(length, "explicit mask")] = scored[(length, "no mask")] = length * length
    timings = measure_interleaved(runners, rounds=rounds, warmup=1, threads=threads)
    return [{"length": length, "variant": variant, "samples_s": list(t.samples),
             "median_s": statistics.median(t.samples), "scored": scored[(length, variant)]}
            for (length, variant), t in timings.items()]


__all__ = ["KV_BLOCK", "Q_BLOCKS", "VARIANTS", "kernel_scored_pairs", "query_block",
           "square_share", "time_causal_flag"]
