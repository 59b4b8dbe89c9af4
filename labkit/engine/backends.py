"""The two backends of the serving engine (the `Backend` contract of
`labkit.engine.interfaces`).

- `ReferenceBackend`: the model as loaded (`F.linear` on plain weights) and attention by
  PyTorch over the paged pool (gather the blocks, SDPA). Slow and plain: what the tests
  hold every faster path to.
- `FastBackend`: weights reordered once for oneDNN, with labkit's C matrix-vector kernel for
  a few rows (`labkit.kernels.packed`), and labkit's C paged-attention kernel reading the
  blocks in place (`labkit.kernels.native`). Where oneDNN or a C compiler is missing, or the
  model is not float32 on the CPU, each part falls back to the reference one by itself.
"""

from __future__ import annotations

import torch

from labkit.engine.interfaces import ModelShape, ServedModel
from labkit.engine.paged_cache import KVPool, PagedBatch
from labkit.kernels.packed import pack_model


class ReferenceBackend:
    name = "reference"
    native_attention = False

    def prepare(self, model: ServedModel) -> ServedModel:
        return model

    def new_pool(self, shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> KVPool:
        return KVPool(shape, num_blocks, block_size, dtype, native_attention=self.native_attention, device=device)

    def batch(self, pool: KVPool, tables: list[list[int]], starts: list[int], counts: list[int]) -> PagedBatch:
        return PagedBatch(pool, tables, starts, counts)


class FastBackend(ReferenceBackend):
    name = "fast"
    native_attention = True

    def prepare(self, model: ServedModel) -> ServedModel:
        return pack_model(model)


def backend_for(fast_kernels: bool) -> ReferenceBackend:
    return FastBackend() if fast_kernels else ReferenceBackend()
