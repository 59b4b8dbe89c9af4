"""The serving engine's written contracts.

    LLMEngine --schedule--> StepPlan --ModelRunner.run--> sampled tokens --OutputProcessor--> events
                                          |
                           Backend.batch(pool, tables, ...) -> KVCacheView
                           ServedModel(ids, cache=view, rows=...) -> logits

- `KVCacheView` is what a forward pass asks of a cache, layer by layer. Three caches answer
  it: the contiguous `labkit.models.llama.KVCache` (engine v0), the paged
  `labkit.engine.paged_cache.PagedBatch` (one engine step over the KV pool), and the
  fixed-shape `labkit.experiments.compilation.StaticCache` (a compiled decode step).
- `ServedModel` is all the engine knows of a model: its shape (`ModelShape`), tokenizer,
  dtype, device and context length, and one call.
- `Backend` owns what depends on the hardware: how weights are packed, how the KV pool is
  laid out, and which attention kernel reads it. `labkit.engine.backends` has two, the
  reference path (`F.linear`, gather + SDPA) and the fast path (oneDNN-packed weights and
  labkit's C kernels); the tests hold the second to the first.

The contracts are `typing.Protocol`s: anything with these members fits, whatever its class.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCacheView(Protocol):
    """One forward pass's cache. The pass asks `positions` once, `attend` once per layer,
    then `advance` once."""

    def positions(self, steps: int, limit: int) -> torch.Tensor:
        """Positions of the `steps` new tokens (raise ValueError if any reaches `limit`)."""
        ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store layer `layer`'s new keys and values, then attend: q [B, kv_heads, group, T, D],
        k, v [B, kv_heads, T, D] -> [B, kv_heads, group, T, D]."""
        ...

    def advance(self, steps: int) -> None:
        """The pass is over: `steps` more positions are cached."""
        ...


@runtime_checkable
class ModelShape(Protocol):
    """The sizes the engine lays the KV pool out by."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    group_size: int  # query heads per KV head
    vocab_size: int


@runtime_checkable
class ServedModel(Protocol):
    """The model as the engine serves it."""

    config: ModelShape
    tokenizer: object | None
    dtype: torch.dtype

    @property
    def device(self) -> torch.device: ...

    @property
    def max_positions(self) -> int:
        """The longest sequence (prompt + output) the model can run."""
        ...

    def __call__(self, input_ids: torch.Tensor, cache: KVCacheView | None = None, *,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, len(rows) or seq, vocab] for token ids [batch, seq]; with `rows`,
        only those positions' logits (the engine asks for the tokens it samples)."""
        ...


@runtime_checkable
class KVPoolLike(Protocol):
    """Block storage for every layer's keys and values."""

    num_blocks: int
    block_size: int
    device: torch.device

    @property
    def bytes_per_token(self) -> int: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks, src -> dst (copy on write)."""
        ...


@runtime_checkable
class Backend(Protocol):
    """Weight packing, KV layout and attention kernel: what a model needs to run here."""

    name: str

    def prepare(self, model: ServedModel) -> ServedModel:
        """The model as this backend runs it (e.g. with packed weights); the given model
        is not modified."""
        ...

    def new_pool(self, shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> KVPoolLike: ...

    def batch(self, pool: KVPoolLike, tables: list[list[int]] | list[list[list[int]]], starts: list[int],
              counts: list[int]) -> KVCacheView:
        """One step's cache view: sequence i's `counts[i]` new tokens follow its `starts[i]`
        cached ones, in the blocks `tables[i]` names (one table per layer group of the pool,
        `labkit.engine.kv_groups`; a pool of one group also takes the table alone)."""
        ...
