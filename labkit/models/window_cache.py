"""KV caches for models whose layers attend through a sliding window (Gemma 3's local layers).

A query at position i of a layer with window W sees the keys at positions i - W < j <= i.
Two caches answer the `KVCacheView` contract (`labkit.engine.interfaces`) for such a model:

- `WindowedKVCache`: the contiguous `KVCache`, every position of every layer kept, and each
  layer's window applied as a mask. The reference semantics, and the waste: a local layer
  stores and reads every position, then throws all but the last W away.
- `RollingKVCache`: a local layer keeps only W slots, a ring in which position p lives in
  slot p % W, overwriting the key that fell out of every later query's window; global
  layers (window None) keep every position. Memory stops growing with the sequence for the
  local layers, and a decode step reads W keys there instead of all of them.

One `RollingKVCache.attend` call of T new tokens at positions start .. start+T-1 reads, in
position order, the cached keys the first new query can still see (positions
start - W + 1 .. start - 1, all still in the ring), then the T new keys, and applies the same
mask as the full cache with the positions shifted to that first key. Only then are the new
keys written, so a prompt longer than the window attends over all of its own keys before
the ring keeps its last W. The tests hold the ring to the full cache token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from labkit.models.llama import KVCache, check_positions


class WindowedShape(Protocol):
    """What the caches read from a model's config (`Gemma3Config` has it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]  # per layer: keys a query sees (its own included); None: all

    @property
    def attention_scale(self) -> float: ...


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                       window: int | None, scale: float, sinks: int = 0) -> torch.Tensor:
    """Causal attention in which `group` query heads share each KV head (the layout of
    `llama.grouped_attention`), and a query at position i sees the keys at positions j with
    i - window < j <= i: itself and the window - 1 before it (transformers'
    sliding_window_overlay), or every j <= i when window is None. `sinks`: the first
    positions stay visible to every query whatever the window (chapter 22's attention sinks).

    q: [B, kv_heads, group, T, D] for positions q_start .. q_start+T-1
    k, v: [B, kv_heads, S, D] for positions 0 .. S-1
    """
    batch, kv_heads, group, steps, dim = q.shape
    keys = k.shape[2]
    if q_start + steps != keys:
        raise ValueError(f"queries at {q_start}..{q_start + steps - 1} must end at the last of {keys} keys")
    heads = q.reshape(batch, kv_heads * group, steps, dim)  # head kv * group + g reads KV head kv
    if window is None or keys <= window:  # the window hides nothing: plain causal attention
        if steps == 1 or q_start == 0:  # the kernel skips the masked half of the square
            out = F.scaled_dot_product_attention(heads, k, v, is_causal=steps > 1, scale=scale,
                                                 enable_gqa=True)
            return out.reshape(q.shape)
    positions = torch.arange(keys, device=q.device)
    q_pos, k_pos = positions[q_start:, None], positions[None, :]
    visible = k_pos <= q_pos  # [T, S]
    if window is not None:
        visible &= (k_pos > q_pos - window) | (k_pos < sinks)
    out = F.scaled_dot_product_attention(heads, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.reshape(q.shape)


@dataclass
class WindowedKVCache(KVCache):
    """The contiguous `KVCache`, each layer attending with its own window as a mask and the
    model's scale. Every position stays cached, even those no local layer will read again."""

    # Defaults only because KVCache's `length` has one: build the cache with `empty`.
    layer_windows: tuple[int | None, ...] = ()
    scale: float = 1.0

    @classmethod
    def empty(cls, config: WindowedShape, batch: int, max_len: int,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "WindowedKVCache":
        plain = KVCache.empty(config, batch, max_len, dtype, device)
        return cls(plain.keys, plain.values, layer_windows=config.layer_windows,
                   scale=config.attention_scale)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.store(layer, k, v)
        return windowed_attention(q, keys.to(q.dtype), values.to(q.dtype), self.length,
                                  self.layer_windows[layer], self.scale)


class RollingKVCache:
    """A ring of `window` slots per sliding-window layer, `max_len` slots per global layer."""

    def __init__(self, config: WindowedShape, batch: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.windows, self.scale = config.layer_windows, config.attention_scale
        self.max_len, self.length = max_len, 0
        heads, dim = config.num_kv_heads, config.head_dim
        self.keys, self.values = [], []
        for window in self.windows:
            slots = max_len if window is None else min(window, max_len)
            self.keys.append(torch.zeros(batch, heads, slots, dim, dtype=dtype, device=device))
            self.values.append(torch.zeros(batch, heads, slots, dim, dtype=dtype, device=device))

    def nbytes(self) -> int:
        """Bytes the cache holds, whatever its length: the ring's saving is here."""
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def positions(self, steps: int, limit: int) -> torch.Tensor:
        check_positions(self.length + steps, min(limit, self.max_len))
        return torch.arange(self.length, self.length + steps, device=self.keys[0].device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        window, batch = self.windows[layer], q.shape[0]
        keys, values = self.keys[layer][:batch], self.values[layer][:batch]
        start, steps = self.length, k.shape[2]
        if window is None:  # a global layer: the contiguous cache
            keys[:, :, start:start + steps] = k
            values[:, :, start:start + steps] = v
            return windowed_attention(q, keys[:, :, :start + steps].to(q.dtype),
                                      values[:, :, :start + steps].to(q.dtype), start, None, self.scale)
        first = max(0, start - window + 1)  # the oldest position the first new query sees
        slots = torch.arange(first, start, device=keys.device) % window
        seen_k = torch.cat([keys[:, :, slots].to(q.dtype), k], dim=2)
        seen_v = torch.cat([values[:, :, slots].to(q.dtype), v], dim=2)
        out = windowed_attention(q, seen_k, seen_v, start - first, window, self.scale)
        # Of the new positions only the last `window` stay (and no slot is written twice).
        kept = min(steps, window)
        new_slots = torch.arange(start + steps - kept, start + steps, device=keys.device) % window
        keys[:, :, new_slots] = k[:, :, steps - kept:].to(keys.dtype)
        values[:, :, new_slots] = v[:, :, steps - kept:].to(values.dtype)
        return out

    def advance(self, steps: int) -> None:
        self.length += steps
