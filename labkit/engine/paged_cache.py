"""Paged KV storage and attention over it.

`KVPool` is the memory: for every layer, `num_blocks` blocks of `block_size` token slots.
Position p of a sequence lives in block `block_table[p // block_size]`, slot
`p % block_size`. Inside a block, each KV head's values are stored slot by slot
([block_size, head_dim]) and its keys transposed ([head_dim, block_size]), so a block of
one head is two contiguous runs of memory, and an attention kernel can score a query
against all the block's keys with plain vector arithmetic (one multiply-add per key
dimension covers every slot at once) instead of one dot product per slot.

A model whose layers attend through windows (Gemma 3) has its layers split into groups
(`labkit.engine.kv_groups`): a block then holds one group's layers, the pool is
[layers per group, blocks, ...], and each sequence has one block table per group. A windowed
group's table reads only the blocks its window still covers: the blocks before them were
given back to the pool (a ring made of blocks), and attention gathers what is left.

`PagedBatch` is one engine step's view of that memory. The step packs the new tokens of
every scheduled sequence into one row ([1, total_tokens]), so the matrix products run
once for all of them; `Llama.forward` then asks the batch, layer by layer, to `attend`:
the batch writes the new keys and values into their slots and computes each sequence's
attention over the blocks its table names. Where labkit's C kernel builds, one call per
layer does that for every packed row at once (decode tokens and prompt chunks alike),
reading the blocks in place (`labkit.kernels.native.paged_attention`). The reference
path, which the tests hold the kernel to, uses PyTorch: decode tokens gather their blocks
for one padded SDPA call, a whole prompt uses SDPA's causal kernel on its own keys and
values, and a chunk after a cached prefix gathers its blocks and attends alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from labkit.engine.interfaces import ModelShape
from labkit.engine.kv_groups import layer_groups
from labkit.kernels import native
from labkit.models.llama import check_positions, grouped_attention
from labkit.models.window_cache import windowed_attention


class KVPool:
    def __init__(self, config: ModelShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, native_attention: bool = True,
                 device: torch.device | str = "cpu"):
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        self.device = torch.device(device)
        # A model with sliding-window layers (Gemma 3) names each layer's window; a block
        # holds the layers of one group (all layers where no layer has a window).
        self.windows = getattr(config, "layer_windows", None)
        self.groups = layer_groups(config.num_layers, self.windows)
        self.layer_slots = [self.groups.locate(layer) for layer in range(config.num_layers)]
        layers, heads, dim = self.groups.layers_per_group, config.num_kv_heads, config.head_dim
        self.keys = torch.zeros(layers, num_blocks, heads, dim, block_size, dtype=dtype, device=self.device)
        self.values = torch.zeros(layers, num_blocks, heads, block_size, dim, dtype=dtype, device=self.device)
        # The C kernel has no window: a windowed model attends by gather + SDPA.
        windowed = self.windows is not None and any(w is not None for w in self.windows)
        # Attention by labkit's C kernel where it builds (float32 or bfloat16 entries on the
        # CPU), else gather + SDPA.
        self.native = (native_attention and dtype in (torch.float32, torch.bfloat16) and not windowed
                       and self.device.type == "cpu" and native.load() is not None)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of every layer takes (in every group's block)."""
        return 2 * self.keys[:, 0, :, :, 0].nbytes * self.groups.num_groups

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (copy on write): every layer, keys and values."""
        for src, dst in copies:
            self.keys[:, dst] = self.keys[:, src]
            self.values[:, dst] = self.values[:, src]

    def write(self, layer: int, blocks: torch.Tensor, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer `layer`'s new keys and values k, v [N, kv_heads, D] at (blocks[i],
        slots[i]) of its group's blocks, rounded to the pool's dtype."""
        slot = self.layer_slots[layer][1]
        self.keys[slot][blocks, :, :, slots] = k.to(self.keys.dtype)
        self.values[slot][blocks, :, slots, :] = v.to(self.values.dtype)

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values in these blocks of its group, in order: each
        [..., kv_heads, len * block_size, D]."""
        slot = self.layer_slots[layer][1]
        k = self.keys[slot][blocks]  # [..., n, heads, D, bs]
        v = self.values[slot][blocks]  # [..., n, heads, bs, D]
        k = k.transpose(-1, -2).transpose(-3, -4).flatten(-3, -2)
        v = v.transpose(-3, -4).flatten(-3, -2)
        return k, v


@dataclass
class Segment:
    """One sequence's share of a packed step."""
    rows: slice           # its new tokens' rows in the packed batch
    start: int            # position of its first new token (= tokens already cached)
    blocks: torch.Tensor  # the blocks holding positions 0 .. start + new tokens - 1 (first group)
    length: int           # start + new tokens: the context it attends over
    # per layer group: (first block read, the blocks from it on); a windowed group's first
    # block is the first one its window covers
    groups: list[tuple[int, torch.Tensor]]


def _per_group(table: list[int] | list[list[int]], groups: int) -> list[list[int]]:
    """A sequence's tables as one list per group (a pool of one group takes a plain table)."""
    per_group = table if table and isinstance(table[0], list) else [table]
    if len(per_group) != groups:
        raise ValueError(f"{len(per_group)} block tables for a pool of {groups} layer groups")
    return per_group


class PagedBatch:
    """What `Llama.forward` needs from a cache (a `KVCacheView`), for a packed batch of
    sequences. Its index tensors live on the pool's device."""

    def __init__(self, pool: KVPool, tables: list[list[int]] | list[list[list[int]]], starts: list[int],
                 counts: list[int]):
        """tables[i]: sequence i's block table, or one table per layer group where the pool
        has several."""
        self.pool = pool
        bs, device, groups = pool.block_size, pool.device, pool.groups
        positions, new_slots, segments = [], [], []
        new_blocks: list[list[torch.Tensor]] = [[] for _ in range(groups.num_groups)]
        row, self.end = 0, 0
        for table, start, count in zip(tables, starts, counts):
            length = start + count
            self.end = max(self.end, length)
            new = torch.arange(start, length, device=device)
            live = []
            for group, group_table in enumerate(_per_group(table, groups.num_groups)):
                first = groups.first_block(group, start, bs)
                ids = group_table[first:-(-length // bs)]
                if min(ids, default=0) < 0:
                    raise ValueError(f"a block table of layer group {group} lacks a block its window reads")
                blocks = torch.tensor(ids, dtype=torch.long, device=device)
                new_blocks[group].append(blocks[new // bs - first])  # (block, slot) of each new token
                live.append((first, blocks))
            positions.append(new)
            new_slots.append(new % bs)
            segments.append(Segment(slice(row, row + count), start, live[0][1], length, live))
            row += count
        self._positions = torch.cat(positions)
        self.group_new_blocks = [torch.cat(blocks) for blocks in new_blocks]
        self.new_blocks, self.new_slots = self.group_new_blocks[0], torch.cat(new_slots)
        self.num_tokens = row
        self.native = pool.native
        self.segments = segments
        if self.native:
            # One kernel call per layer attends every packed row over its own sequence's
            # blocks, read in place; the tables and tiles are checked once here for all layers.
            tiles = native.tiles_for([(i, s.rows.start, s.rows.stop - s.rows.start, s.start)
                                      for i, s in enumerate(segments)])
            self.tables, self.tiles = native.check_tiles(_padded_tables(segments), tiles, row, pool.num_blocks,
                                                         bs, pool.config.group_size, pool.config.head_dim)
            return
        self.prefill = [s for s in segments if s.rows.stop - s.rows.start > 1]
        decode = [s for s in segments if s.rows.stop - s.rows.start == 1]
        self.decode_rows = torch.tensor([s.rows.start for s in decode], dtype=torch.long, device=device)
        self.decode_only = not self.prefill  # then decode row i is packed row i
        if decode:
            # Tables padded with block 0 to the longest; lengths say what is context, and
            # one padding mask serves every layer.
            self.decode_blocks = _padded_tables(decode)
            self.decode_len = max(s.length for s in decode)
            self.decode_lengths = torch.tensor([s.length for s in decode], device=device)
            mask = torch.arange(self.decode_len, device=device)[None, :] < self.decode_lengths[:, None]
            self.decode_mask = mask[:, None, None, :]

    def positions(self, steps: int, limit: int) -> torch.Tensor:
        if steps != self.num_tokens:
            raise ValueError(f"the batch packs {self.num_tokens} tokens, the model got {steps}")
        check_positions(self.end, limit)
        return self._positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, kv_heads, group, N, D]; k, v: [1, kv_heads, N, D] for the N packed tokens
        group = self.pool.layer_slots[layer][0]
        self.pool.write(layer, self.group_new_blocks[group], self.new_slots, k[0].transpose(0, 1),
                        v[0].transpose(0, 1))
        if self.pool.windows is not None:
            return self._windowed(layer, q)
        if self.native:  # the kernel takes float32 queries whatever the model's dtype
            out = native.paged_attention(self.pool.keys[layer], self.pool.values[layer], self.tables,
                                         self.tiles, q[0].permute(2, 0, 1, 3).float(), checked=True)
            return out.permute(1, 2, 0, 3).unsqueeze(0).to(q.dtype)
        if self.decode_only:
            return self._decode(layer, q[0].permute(2, 0, 1, 3)).permute(1, 2, 0, 3).unsqueeze(0)
        out = torch.empty_like(q)
        for s in self.prefill:
            if s.start == 0:  # a whole prompt: plain causal attention over its own k, v, as stored
                kk, vv = (self._as_stored(t[:, :, s.rows]) for t in (k, v))
                out[:, :, :, s.rows] = grouped_attention(q[:, :, :, s.rows], kk, vv, 0)
                continue
            kk, vv = self._gather(layer, s.blocks, q.dtype)  # [kv_heads, S', D]
            kk, vv = kk[None, :, :s.length], vv[None, :, :s.length]
            out[:, :, :, s.rows] = grouped_attention(q[:, :, :, s.rows], kk, vv, s.start)
        if len(self.decode_rows):
            o = self._decode(layer, q[0, :, :, self.decode_rows].permute(2, 0, 1, 3))
            out[0, :, :, self.decode_rows] = o.permute(1, 2, 0, 3)
        return out

    def _windowed(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """A model whose layers have windows and their own scale (Gemma 3): each sequence's
        queries over the blocks its layer group still holds, from the first one the window
        covers (positions counted from that block's first), the window applied as a mask
        within them."""
        out = torch.empty_like(q)
        window, scale = self.pool.windows[layer], self.pool.config.attention_scale
        group = self.pool.layer_slots[layer][0]
        for s in self.segments:
            first, blocks = s.groups[group]
            offset = first * self.pool.block_size
            kk, vv = self._gather(layer, blocks, q.dtype)  # [kv_heads, S', D]
            out[:, :, :, s.rows] = windowed_attention(q[:, :, :, s.rows], kk[None, :, :s.length - offset],
                                                      vv[None, :, :s.length - offset], s.start - offset,
                                                      window, scale)
        return out

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [B, kv_heads, group, D]: each decode row's one query over its whole context."""
        kk, vv = self._gather(layer, self.decode_blocks, q.dtype)  # [B, kv_heads, S', D]
        kk, vv = kk[:, :, :self.decode_len], vv[:, :, :self.decode_len]
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=self.decode_mask)

    def _as_stored(self, t: torch.Tensor) -> torch.Tensor:
        """t as the pool holds it (rounded to its dtype), in t's dtype."""
        return t.to(self.pool.dtype).to(t.dtype)

    def _gather(self, layer: int, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        kk, vv = self.pool.gather(layer, blocks)
        return kk.to(dtype), vv.to(dtype)

    def native_pool(self) -> native.PagedLayer:
        """Every layer of the pool with this step's slots, tables and tiles, for a kernel that
        runs all the layers of a step (`native.decoder_layers_blocks`). Only where `native`."""
        if not self.native:
            raise ValueError("the pool is not on labkit's C kernels")
        return native.PagedLayer(self.pool.keys, self.pool.values, self.new_blocks, self.new_slots, self.tables,
                                 self.tiles)

    def native_layer(self, layer: int) -> native.PagedLayer:
        """`native_pool` narrowed to layer `layer`, for a kernel that runs one layer
        (`native.decoder_layer_blocks`)."""
        pool = self.native_pool()
        return replace(pool, keys=pool.keys[layer], values=pool.values[layer])

    def advance(self, steps: int) -> None:
        """Nothing to do: the engine advances each sequence's `num_computed_tokens`."""


def _padded_tables(segments: list[Segment]) -> torch.Tensor:
    """The segments' block lists as one int64 table [len, longest], padded with block 0."""
    device = segments[0].blocks.device if segments else None
    tables = torch.zeros(len(segments), max((len(s.blocks) for s in segments), default=1), dtype=torch.long,
                         device=device)
    for i, s in enumerate(segments):
        tables[i, :len(s.blocks)] = s.blocks
    return tables
