"""Attention, three ways: naive (materialises the score tensor), SDPA (PyTorch's fused
kernel), and a decode-shaped path that reads a KV cache for one new query per sequence.

Shapes follow PyTorch's convention: q [batch, heads, q_len, head_dim], k and v
[batch, kv_heads, kv_len, head_dim]. When kv_heads < heads (grouped-query attention) each
KV head serves `heads // kv_heads` consecutive query heads; no path here copies the KV heads.
Causal masks are aligned to the END of the keys: query i sits at position kv_len - q_len + i,
which is right for a prefill (q_len == kv_len) and for decoding with a cache (q_len == 1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def group_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, KV, G*T, D]: stack the queries that share a KV head (a view-free
    reshape of q only; K and V stay as they are)."""
    batch, heads, steps, dim = q.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    return q.reshape(batch, kv_heads, (heads // kv_heads) * steps, dim)


def ungroup_heads(out: torch.Tensor, heads: int, steps: int) -> torch.Tensor:
    batch, _, _, dim = out.shape
    return out.reshape(batch, heads, steps, dim)


def causal_mask(q_len: int, kv_len: int, group: int = 1, device=None) -> torch.Tensor:
    """Boolean [group*q_len, kv_len] mask, True where a query may attend."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).repeat(group)
    return torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]


def score_tensor_bytes(batch: int, heads: int, q_len: int, kv_len: int,
                       dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one [batch, heads, q_len, kv_len] score tensor: what naive attention
    materialises (and then once more for the softmax output)."""
    return batch * heads * q_len * kv_len * torch.finfo(dtype).bits // 8


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    causal: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, written out: builds the full score tensor."""
    heads, steps = q.shape[1], q.shape[2]
    kv_heads, kv_len = k.shape[1], k.shape[2]
    grouped = group_heads(q, kv_heads)
    scores = grouped @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        mask = causal_mask(steps, kv_len, heads // kv_heads, device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return ungroup_heads(weights @ v, heads, steps)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool = True) -> torch.Tensor:
    """PyTorch's scaled_dot_product_attention (a fused kernel where one applies)."""
    heads, steps, kv_len = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] == heads:
        # Same head count: the fused causal path needs no explicit mask when it is square.
        if not causal or steps == 1:
            return F.scaled_dot_product_attention(q, k, v)
        if steps == kv_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grouped = group_heads(q, k.shape[1])
    mask = None
    if causal and steps > 1:
        mask = causal_mask(steps, kv_len, heads // k.shape[1], device=q.device)
    return ungroup_heads(F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask), heads, steps)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor | list[int] | None = None) -> torch.Tensor:
    """One new query per sequence against its cached keys and values.

    q: [B, H, 1, D]; k_cache, v_cache: [B, KV, max_len, D]; lengths: valid cache length per
    sequence (default: all of max_len). Positions past a sequence's length are masked, so a
    batch of sequences of different lengths shares one padded cache.
    """
    batch, heads, steps, dim = q.shape
    if steps != 1:
        raise ValueError("decode_attention takes exactly one query position per sequence")
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    grouped = group_heads(q, kv_heads)  # [B, KV, G, D]
    scores = grouped @ k_cache.transpose(-1, -2) / math.sqrt(dim)  # [B, KV, G, max_len]
    if lengths is not None:
        lengths = torch.as_tensor(lengths, device=q.device)
        valid = torch.arange(max_len, device=q.device)[None, :] < lengths[:, None]  # [B, L]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(v_cache.dtype)
    return ungroup_heads(weights @ v_cache, heads, 1)


IMPLEMENTATIONS = {"naive": naive_attention, "sdpa": sdpa_attention}
