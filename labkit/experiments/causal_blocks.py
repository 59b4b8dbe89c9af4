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
- :func:`stacked_mask_attention`: the path labkit's model took before the causal flag
  (commit 2929be7 replaced it): the query heads that share a KV head stacked along the
  sequence axis, `[B, kv_heads, group * T, D]`, with a `[group * T, T]` boolean mask built
  on every call and no `enable_gqa`.
- :func:`time_causal_flag`: one attention call per prompt length with the causal flag, with
  an explicit boolean [T, T] mask (what a kernel given a mask computes: every block), with
  the old stacked path, and with no mask at all (the whole square, a different result),
  interleaved in rounds. The timing is the check on the schedule: a PyTorch version with
  other block sizes shows up as a ratio the schedule does not predict
  (:func:`predicted_flag_speedup`, :func:`prediction_against`).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from labkit.util.compare import Comparison
from labkit.util.timing import measure_interleaved

KV_BLOCK = 512  # keys per block, every query length
Q_BLOCKS = ((768, 256), (192, 64), (0, 32))  # (from this many queries, rows per block)
OLD_PATH = "old stacked path"  # the model's prefill attention before the causal flag
VARIANTS = ("causal flag", "explicit mask", OLD_PATH, "no mask")


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


def predicted_flag_speedup(length: int) -> float:
    """How many times faster than no mask the causal flag should be over a prompt of
    `length` tokens if the time follows the scores computed: the square over the schedule's
    scores (1.0 up to one key block)."""
    return 1.0 / square_share(length)


def prediction_against(predicted: float, measured: Comparison) -> str:
    """Where a predicted ratio lies against a measured one's interval: "inside" it,
    "above" it (the measurement fell short of the prediction) or "below" it."""
    if predicted > measured.high:
        return "above"
    if predicted < measured.low:
        return "below"
    return "inside"


def stacked_mask_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped attention of a prompt over itself the way labkit's model computed it
    before the causal flag (2929be7's parent): q [B, heads, T, D], where query head
    `kv * group + g` reads KV head `kv`, and k, v [B, kv_heads, T, D]. The `group` query heads
    of a KV head are stacked along the sequence axis, so SDPA sees `kv_heads` heads of
    `group * T` queries, with a `[group * T, T]` mask (row r is position r % T) built on
    every call, as the old path did. Returns [B, heads, T, D], the causal result."""
    batch, heads, steps, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    if heads % kv_heads or keys != steps:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads of {keys} keys: need "
                         f"whole groups and a prompt attending to its own {steps} positions")
    group = heads // kv_heads
    stacked = q.reshape(batch, kv_heads, group * steps, dim)
    q_pos = torch.arange(steps, device=q.device).repeat(group)  # row r: position r % T
    mask = torch.arange(keys, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(stacked, k, v, attn_mask=mask)
    return out.reshape(batch, heads, steps, dim)


def time_causal_flag(lengths: Sequence[int], *, heads: int, kv_heads: int, head_dim: int,
                     rounds: int = 5, threads: int | None = None,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Time one grouped attention call (float32) over a prompt of each length, in the four
    :data:`VARIANTS`, all interleaved for `rounds` rounds: the causal flag, an explicit
    [T, T] mask (both with `enable_gqa`), the old stacked path
    (:func:`stacked_mask_attention`) and no mask. Before timing, checks that the three
    causal variants give the same output (within float32 rounding), so they compute one
    function. One record per (length, variant): samples_s, median_s, scored (the schedule's
    scores per query head: the square for the masks and for no mask)."""
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
        for name, out in (("explicit mask", masked), (OLD_PATH, stacked_mask_attention(q, k, v))):
            if not torch.allclose(causal, out, atol=1e-5, rtol=1e-4):
                raise AssertionError(f"causal flag and {name} disagree at {length} tokens")
        runners[(length, "causal flag")] = (
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=True))
        runners[(length, "explicit mask")] = (
            lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True))
        runners[(length, OLD_PATH)] = lambda q=q, k=k, v=v: stacked_mask_attention(q, k, v)
        runners[(length, "no mask")] = (
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        scored[(length, "causal flag")] = kernel_scored_pairs(length)
        for variant in ("explicit mask", OLD_PATH, "no mask"):
            scored[(length, variant)] = length * length
    timings = measure_interleaved(runners, rounds=rounds, warmup=1, threads=threads)
    return [{"length": length, "variant": variant, "samples_s": list(t.samples),
             "median_s": statistics.median(t.samples), "scored": scored[(length, variant)]}
            for (length, variant), t in timings.items()]


__all__ = ["KV_BLOCK", "OLD_PATH", "Q_BLOCKS", "VARIANTS", "kernel_scored_pairs",
           "predicted_flag_speedup", "prediction_against", "query_block", "square_share",
           "stacked_mask_attention", "time_causal_flag"]
