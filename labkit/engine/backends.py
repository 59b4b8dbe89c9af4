"""The two backends of the serving engine (the `Backend` contract of
`labkit.engine.interfaces`).

- `ReferenceBackend`: the model as loaded (`F.linear` on plain weights) and attention by
  PyTorch over the paged pool (gather the blocks, SDPA). Slow and plain: what the tests
  hold every faster path to.
- `FastBackend`: weights reordered once for oneDNN, with labkit's C matrix-vector kernel for
  a few rows (`labkit.kernels.packed`), and labkit's C paged-attention kernel reading the
  blocks in place (`labkit.kernels.native`). Where oneDNN or a C compiler is missing, or the
  model is not float32 on the CPU, each part falls back to the reference one by itself.
- `GGUFBackend`: the fast backend, but a step of a few rows multiplies by the model file's
  own quantized blocks, read in place (`labkit.kernels.gguf_blocks`): the same weights at
  under a fifth of the bytes a decode step reads. Steps of many rows (prefill) use the
  packed float32 weights, which are those blocks' values. `quantize_x=True` (weights
  "gguf-int8") also rounds the activations to 8 bits a block and multiplies bytes by bytes,
  llama.cpp's scheme: faster, no longer the float32 model's numbers.
- `BF16Backend`: the fast backend on bfloat16 weights and activations with float32 sums
  (`labkit.kernels.bf16_weights`): a step of a few rows reads the bfloat16 rows in place.

Every backend's pool holds float32 or bfloat16 keys and values (`EngineConfig.kv_dtype`);
labkit's C attention reads either.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def batch(self, pool: KVPool, tables: list[list[int]] | list[list[list[int]]], starts: list[int],
              counts: list[int]) -> PagedBatch:
        return PagedBatch(pool, tables, starts, counts)


class FastBackend(ReferenceBackend):
    name = "fast"
    native_attention = True

    def prepare(self, model: ServedModel) -> ServedModel:
        return pack_model(model)


class GGUFBackend(FastBackend):
    def __init__(self, quantize_x: bool = False):
        self.quantize_x = quantize_x
        self.name = "gguf-int8" if quantize_x else "gguf"

    def prepare(self, model: ServedModel) -> ServedModel:
        """The model with its matrices on the file's blocks. ValueError where that cannot be
        done: the C kernels do not build here, the model is not float32 on the CPU, or it was
        not loaded from a GGUF of the registry (it has no `name`)."""
        from labkit.kernels.gguf_blocks import block_model
        from labkit.models import registry
        from labkit.models.gguf_file import open_reader, raw_blocks

        _check_kernels_and_model("gguf", model)
        from labkit.models.llama import Llama

        name = getattr(model, "name", None)
        if name is None:
            raise ValueError("weights='gguf' needs a model loaded by name from the registry")
        if not isinstance(model, Llama):
            raise ValueError(f"weights='gguf' runs the Llama forward pass on Q4_1/Q8_0 blocks; "
                             f"{name} is a {type(model).__name__}")
        return block_model(model, raw_blocks(open_reader(registry.fetch(name)), model.config),
                           quantize_x=self.quantize_x)


class BF16Backend(FastBackend):
    name = "bf16"

    def prepare(self, model: ServedModel) -> ServedModel:
        """The model on bfloat16 weights. ValueError where the C kernels do not build here or
        the model is not float32 on the CPU."""
        from labkit.kernels.bf16_weights import bf16_model

        _check_kernels_and_model("bf16", model)
        return bf16_model(model)


def _check_kernels_and_model(weights: str, model: ServedModel) -> None:
    """ValueError unless labkit's C kernels build here and `model` is float32 on the CPU:
    what every mode that reads weights in its own format needs."""
    from labkit.kernels import native

    if native.load() is None:
        raise ValueError(f"weights={weights!r} needs labkit's C kernels: {native.why_unavailable()}")
    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise ValueError(f"weights={weights!r} serves a float32 model on the CPU")


# What EngineConfig.weights may say: float32 weights, bfloat16 weights and activations, or
# the model file's blocks with the activations in float32 or rounded to 8 bits.
WEIGHTS = ("f32", "bf16", "gguf", "gguf-int8")
# What EngineConfig.kv_dtype may say, and the pool's dtype for each.
KV_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def kv_dtype_for(kv_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype: `kv_dtype` ("f32", "bf16"), or the model's own when None."""
    if kv_dtype is None:
        return model_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {tuple(KV_DTYPES)} or None, got {kv_dtype!r}")
    return KV_DTYPES[kv_dtype]


# What runs when no mode is named (EngineConfig(weights=None), `labkit generate` and `labkit
# serve` without --weights): the fastest mode whose greedy tokens equal float32's on the test
# prompts and whose logits stay within 1e-3 of them (`labkit bench lowbit`, chapter 12).
PREFERRED_WEIGHTS = "gguf"


@dataclass(frozen=True)
class PreparedWeights:
    weights: str               # the mode that runs (one of WEIGHTS)
    backend: "ReferenceBackend"
    model: ServedModel         # the model as that backend runs it
    fallback: str | None       # why PREFERRED_WEIGHTS could not run here (None: it runs, or a
                               # mode was named)


def prepare_weights(model: ServedModel, weights: str | None, fast_kernels: bool = True) -> PreparedWeights:
    """`model` ready to run in mode `weights`; None: PREFERRED_WEIGHTS, or float32 where that
    cannot run (no C compiler, a model other than the Llama, ...), saying why. A mode named
    explicitly that cannot run is a ValueError, never a quiet substitute."""
    if weights is not None or not fast_kernels:
        weights = weights or "f32"
        backend = backend_for(fast_kernels, weights)
        return PreparedWeights(weights, backend, backend.prepare(model), None)
    try:
        backend = backend_for(True, PREFERRED_WEIGHTS)
        return PreparedWeights(PREFERRED_WEIGHTS, backend, backend.prepare(model), None)
    except ValueError as exc:
        backend = backend_for(True, "f32")
        return PreparedWeights("f32", backend, backend.prepare(model), str(exc))


def backend_for(fast_kernels: bool, weights: str = "f32") -> ReferenceBackend:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights != "f32" and not fast_kernels:
        raise ValueError(f"weights={weights!r} runs on the fast kernels; fast_kernels=False is float32 only")
    if weights == "bf16":
        return BF16Backend()
    if weights.startswith("gguf"):
        return GGUFBackend(quantize_x=weights == "gguf-int8")
    return FastBackend() if fast_kernels else ReferenceBackend()
