"""Exact block-wise attention with an online softmax: the algorithm inside FlashAttention,
written as plain PyTorch loops so that every step can be read.

Naive attention (:func:`labkit.kernels.attention.naive_attention`) builds the whole
``[q_len, kv_len]`` score matrix per head, takes its softmax row by row, and multiplies by
the values. Block-wise attention visits the keys and values ``block_k`` at a time (and the
queries ``block_q`` at a time) and never holds more than one ``block_q x block_k`` tile of
scores. What makes that exact is the *online softmax*: for each query row it keeps

- ``m``, the largest score seen so far (the running max),
- ``l``, the sum of ``exp(score - m)`` over the keys seen so far (the running sum),
- ``O``, the sum of ``exp(score - m) * value`` over the keys seen so far (the running
  output, not yet divided by ``l``),

and, for each new block of scores ``S`` (one row shown; ``V_j`` the block's values)::

    m_new = max(m, max_j S_j)
    alpha = exp(m - m_new)                 # rescales what was summed under the old max
    P_j   = exp(S_j - m_new)
    l     = alpha * l + sum_j P_j
    O     = alpha * O + sum_j P_j V_j
    m     = m_new

After the last block ``O / l`` equals ``softmax(S) V`` over all keys: every term in ``l``
and ``O`` carries the same factor ``exp(-m)``, and ``alpha`` moves the earlier terms to the
current ``m`` whenever the max grows. Subtracting the running max keeps every ``exp`` at
most 1, so nothing overflows. Without ``alpha`` (``rescale=False``, a deliberate bug for
the tests and the chapter) terms summed under different maxima are mixed, and the result
is wrong as soon as a later block raises the max.

Causal attention skips work: a key block that lies entirely after the last query of a
query block (above the diagonal) is never computed; only blocks that cross the diagonal
build a mask. Shapes and conventions follow :mod:`labkit.kernels.attention`: q ``[B, H, T,
D]``, k and v ``[B, KV, S, D]`` with ``H`` a multiple of ``KV`` (grouped-query attention:
the ``H // KV`` query heads of a group are stacked against their one KV head, no KV copy),
causal masks aligned to the end of the keys.

This is a teaching kernel. FlashAttention does all of the above inside one GPU kernel, with
each tile in on-chip memory; a Python loop issues several separate PyTorch operations per
tile, each of which writes its result to memory. On a GPU, where each of them is a kernel
launch, the loop keeps the memory saving and loses the speed; on a CPU it can still beat
naive attention, which computes, allocates and streams whole score tensors. Which share
of a speed-up belongs to the algorithm and which to the fused kernel is a measurement
(chapter 13), not a property of either.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from labkit.kernels.attention import group_heads, ungroup_heads


def _tile_mask(q_start: int, q_stop: int, k_start: int, k_stop: int, group: int,
               offset: int, device) -> torch.Tensor:
    """Boolean ``[group * (q_stop - q_start), k_stop - k_start]`` causal mask of one tile,
    True where allowed. Rows are ordered (group member, query) as :func:`group_heads` stacks
    them; query ``i`` sits at position ``offset + i`` (end-aligned)."""
    q_pos = torch.arange(offset + q_start, offset + q_stop, device=device).repeat(group)
    k_pos = torch.arange(k_start, k_stop, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        *, block_q: int = 128, block_k: int = 128, rescale: bool = True,
                        stats: dict | None = None) -> torch.Tensor:
    """Exact attention, ``softmax(q k^T / sqrt(d) + mask) v``, computed tile by tile with an
    online softmax (see the module docstring for the recurrences).

    q ``[B, H, T, D]``; k, v ``[B, KV, S, D]`` (``S >= T`` when causal: the mask is
    end-aligned, query ``i`` at position ``S - T + i``). For each block of ``block_q``
    queries (all ``H // KV`` heads of a group at once) it loops over blocks of ``block_k``
    keys, keeping the running max ``m``, sum ``l`` and output ``O`` of every query row; when
    ``causal``, key blocks wholly after the block's last query are skipped, and only tiles
    that cross the diagonal are masked. The largest score tile is
    ``[B, KV, (H // KV) * block_q, block_k]``. ``rescale=False`` omits the correction
    ``alpha = exp(m_old - m_new)`` (a deliberate bug). ``stats``, if given, is filled with
    ``tiles`` (computed), ``skipped`` (above the diagonal), ``masked`` (tiles that crossed
    the diagonal) and ``tile_bytes`` (one score tile). The output is in ``q.dtype``; the
    running statistics are kept in float32 (float64 for float64 inputs).
    """
    batch, heads, steps, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    if causal and kv_len < steps:
        raise ValueError(f"causal attention needs kv_len >= q_len, got {kv_len} < {steps}")
    if block_q < 1 or block_k < 1:
        raise ValueError("block sizes must be positive")
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(dim)
    offset = kv_len - steps
    out = torch.empty_like(q)
    tiles = skipped = masked = 0
    for q0 in range(0, steps, block_q):
        q1 = min(q0 + block_q, steps)
        qb = group_heads(q[:, :, q0:q1], kv_heads).to(acc_dtype)  # [B, KV, G*Br, D]
        rows = qb.shape[2]
        m = torch.full((batch, kv_heads, rows, 1), float("-inf"), dtype=acc_dtype, device=q.device)
        l = torch.zeros((batch, kv_heads, rows, 1), dtype=acc_dtype, device=q.device)
        acc = torch.zeros((batch, kv_heads, rows, dim), dtype=acc_dtype, device=q.device)
        # Causal: the last query of this block sits at offset + q1 - 1, so no key at or
        # beyond offset + q1 is ever visible to it: those blocks are skipped.
        k_stop = offset + q1 if causal else kv_len
        for k0 in range(0, kv_len, block_k):
            if k0 >= k_stop:
                skipped += 1
                continue
            k1 = min(k0 + block_k, kv_len)
            kb = k[:, :, k0:k1].to(acc_dtype)
            vb = v[:, :, k0:k1].to(acc_dtype)
            s = (qb @ kb.transpose(-1, -2)) * scale  # [B, KV, G*Br, Bc]: one tile of scores
            if causal and k1 - 1 > offset + q0:  # the tile crosses the diagonal
                s.masked_fill_(~_tile_mask(q0, q1, k0, k1, group, offset, q.device),
                               float("-inf"))
                masked += 1
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s - m_new)
            if rescale:
                alpha = torch.exp(m - m_new)  # exp(-inf) = 0 on the first block
                l = alpha * l + p.sum(dim=-1, keepdim=True)
                acc = alpha * acc + p @ vb
            else:  # the bug: earlier terms keep their old max
                l = l + p.sum(dim=-1, keepdim=True)
                acc = acc + p @ vb
            m = m_new
            tiles += 1
        out[:, :, q0:q1] = ungroup_heads((acc / l).to(q.dtype), heads, q1 - q0)
    if stats is not None:
        stats.update(tiles=tiles, skipped=skipped, masked=masked,
                     tile_bytes=batch * kv_heads * group * min(block_q, steps)
                     * min(block_k, kv_len) * torch.finfo(acc_dtype).bits // 8)
    return out


def blockwise_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               lengths: torch.Tensor | list[int] | None = None, *,
                               block_k: int = 256, rescale: bool = True) -> torch.Tensor:
    """One new query per sequence against a long cache, visiting the cache ``block_k``
    positions at a time with the online softmax (same recurrences as
    :func:`blockwise_attention`; the decode counterpart of
    :func:`labkit.kernels.attention.decode_attention`).

    q ``[B, H, 1, D]``; k_cache, v_cache ``[B, KV, max_len, D]``; ``lengths``: valid cache
    length per sequence (default all of ``max_len``; each must be >= 1). Blocks past the
    longest length are skipped; positions past a sequence's own length are masked. The score
    tile is ``[B, KV, H // KV, block_k]``: the memory saving is small here (decode scores are
    one row per head), the point is that the same loop serves both shapes, and that its
    partial results per block could be computed in parallel and merged the same way
    (split-KV, "flash decoding")."""
    batch, heads, steps, dim = q.shape
    if steps != 1:
        raise ValueError("blockwise_decode_attention takes exactly one query per sequence")
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qb = group_heads(q, kv_heads).to(acc_dtype)  # [B, KV, G, D]
    rows = qb.shape[2]
    if lengths is None:
        limit, valid_len = max_len, None
    else:
        valid_len = torch.as_tensor(lengths, device=q.device)
        if int(valid_len.min()) < 1:
            raise ValueError("every sequence needs at least one cached position")
        limit = int(valid_len.max())
    m = torch.full((batch, kv_heads, rows, 1), float("-inf"), dtype=acc_dtype, device=q.device)
    l = torch.zeros((batch, kv_heads, rows, 1), dtype=acc_dtype, device=q.device)
    acc = torch.zeros((batch, kv_heads, rows, dim), dtype=acc_dtype, device=q.device)
    for k0 in range(0, limit, block_k):
        k1 = min(k0 + block_k, limit)
        s = (qb @ k_cache[:, :, k0:k1].to(acc_dtype).transpose(-1, -2)) / math.sqrt(dim)
        if valid_len is not None:
            pos = torch.arange(k0, k1, device=q.device)
            s.masked_fill_(~(pos[None, :] < valid_len[:, None])[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new) if rescale else torch.ones_like(m)
        l = alpha * l + p.sum(dim=-1, keepdim=True)
        acc = alpha * acc + p @ v_cache[:, :, k0:k1].to(acc_dtype)
        m = m_new
    return ungroup_heads((acc / l).to(q.dtype), heads, 1)


def working_set_bytes(batch: int, heads: int, kv_heads: int, q_len: int, head_dim: int,
                      block_q: int, block_k: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Closed-form bytes :func:`blockwise_attention` holds beyond its inputs, for float32
    statistics (the default for float32/16-bit inputs):

    - ``tile``: one score tile ``[B, KV, G*Br, Bc]`` (the exponentials ``P`` are a second);
    - ``stats``: running max and sum, ``2 x [B, KV, G*Br, 1]``;
    - ``running_output``: ``O``, ``[B, KV, G*Br, D]``;
    - ``working``: 2 tiles + stats + 2 running outputs (old and new ``O`` alive together) +
      the query block: what a step holds at its peak;
    - ``output``: the ``[B, H, T, D]`` result in ``dtype``, which every implementation
      returns and is not "extra".

    Br and Bc are capped at the lengths. None of it depends on the sequence length except
    the output."""
    acc = 4
    rows = heads * min(block_q, q_len)  # G*Br per KV head, times KV heads
    tile = batch * rows * block_k * acc
    stats = 2 * batch * rows * acc
    running = batch * rows * head_dim * acc
    return {"tile": tile, "stats": stats, "running_output": running,
            "working": 2 * tile + stats + 3 * running,
            "output": batch * heads * q_len * head_dim * torch.finfo(dtype).bits // 8}


def sdpa_backend(backend: str) -> Callable[..., torch.Tensor]:
    """An attention function that calls ``F.scaled_dot_product_attention`` (causal, square,
    ``enable_gqa`` when KV heads are fewer) restricted to one of PyTorch's SDPA backends:
    ``"flash"`` (FlashAttention-2, CUDA only), ``"efficient"`` (memory-efficient, CUDA),
    ``"math"`` (the unfused reference) or ``"any"`` (PyTorch chooses)."""
    import torch.nn.functional as F

    def call(q, k, v, causal: bool = True):
        kwargs = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        causal_square = causal and q.shape[2] == k.shape[2]
        if causal and not causal_square and q.shape[2] > 1:
            raise ValueError("sdpa_backend calls handle square causal or unmasked problems only")
        if backend == "any":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal_square, **kwargs)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH,
                  "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal_square, **kwargs)

    call.__name__ = f"sdpa_{backend}"
    return call


__all__ = ["blockwise_attention", "blockwise_decode_attention", "working_set_bytes", "sdpa_backend"]
