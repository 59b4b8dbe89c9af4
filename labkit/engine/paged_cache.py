"""Paged KV storage and attention over it.

`KVPool` is the memory: for every layer, one tensor of `num_blocks * block_size` token
slots. Slot `b * block_size + i` is position i of block b; a sequence's position p lives
in slot `block_table[p // block_size] * block_size + p % block_size`.

`PagedBatch` is one engine step's view of that memory. The step packs the new tokens of
every scheduled sequence into one row ([1, total_tokens]), so the matrix products run
once for all of them; `Llama.forward` then asks the batch, layer by layer, to `attend`:
the batch writes the new keys and values into their slots and computes each sequence's
attention over the slots its block table names (gathered, since on a CPU a gather and
one attention call is the simplest correct kernel). Decode tokens (one per sequence) are
attended together in one padded call; prefill chunks one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.models.gguf_file import LlamaConfig
from labkit.models.llama import check_positions, grouped_attention


class KVPool:
    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32):
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        shape = (config.num_layers, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.keys[:, 0].nbytes

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (copy on write): every layer, keys and values."""
        bs = self.block_size
        for src, dst in copies:
            self.keys[:, dst * bs:(dst + 1) * bs] = self.keys[:, src * bs:(src + 1) * bs]
            self.values[:, dst * bs:(dst + 1) * bs] = self.values[:, src * bs:(src + 1) * bs]

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot of every position in [start, end) of a sequence with this block table."""
        positions = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size


@dataclass
class Segment:
    """One sequence's share of a packed step."""
    rows: slice              # its new tokens' rows in the packed batch
    start: int               # position of its first new token (= tokens already cached)
    context_slots: torch.Tensor  # slots of positions 0 .. start + new tokens - 1


class PagedBatch:
    """What `Llama.forward` needs from a cache, for a packed batch of sequences."""

    def __init__(self, pool: KVPool, tables: list[list[int]], starts: list[int], counts: list[int]):
        self.pool = pool
        positions, new_slots, self.prefill, decode = [], [], [], []
        row, self.end = 0, 0
        for table, start, count in zip(tables, starts, counts):
            self.end = max(self.end, start + count)
            slots = pool.slots(table, 0, start + count)
            positions.append(torch.arange(start, start + count))
            new_slots.append(slots[start:])
            segment = Segment(slice(row, row + count), start, slots)
            (decode if count == 1 else self.prefill).append(segment)
            row += count
        self._positions = torch.cat(positions)
        self.new_slots = torch.cat(new_slots)
        self.num_tokens = row
        self.decode_rows = torch.tensor([s.rows.start for s in decode], dtype=torch.long)
        if decode:
            longest = max(len(s.context_slots) for s in decode)
            self.decode_slots = torch.zeros(len(decode), longest, dtype=torch.long)
            self.decode_mask = torch.zeros(len(decode), longest, dtype=torch.bool)
            for i, s in enumerate(decode):
                self.decode_slots[i, :len(s.context_slots)] = s.context_slots
                self.decode_mask[i, :len(s.context_slots)] = True

    def positions(self, steps: int, limit: int) -> torch.Tensor:
        if steps != self.num_tokens:
            raise ValueError(f"the batch packs {self.num_tokens} tokens, the model got {steps}")
        check_positions(self.end, limit)
        return self._positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, kv_heads, group, N, D]; k, v: [1, kv_heads, N, D] for the N packed tokens
        keys, values = self.pool.keys[layer], self.pool.values[layer]  # [slots, kv_heads, D]
        keys.index_copy_(0, self.new_slots, k[0].transpose(0, 1))
        values.index_copy_(0, self.new_slots, v[0].transpose(0, 1))
        out = torch.empty_like(q)
        for s in self.prefill:
            kk = keys[s.context_slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, S, D]
            vv = values[s.context_slots].transpose(0, 1).unsqueeze(0)
            out[:, :, :, s.rows] = grouped_attention(q[:, :, :, s.rows], kk, vv, s.start)
        if len(self.decode_rows):
            # [B, kv_heads, group, D] queries over [B, kv_heads, S, D] padded contexts
            qq = q[0, :, :, self.decode_rows].permute(2, 0, 1, 3)
            kk = keys[self.decode_slots].permute(0, 2, 1, 3)
            vv = values[self.decode_slots].permute(0, 2, 1, 3)
            mask = self.decode_mask[:, None, None, :]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)
            out[0, :, :, self.decode_rows] = o.permute(1, 2, 0, 3)
        return out

    def advance(self, steps: int) -> None:
        """Nothing to do: the engine advances each sequence's `num_computed_tokens`."""
