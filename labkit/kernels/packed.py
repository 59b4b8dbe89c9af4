"""Pre-packed weights: the same matrix products through oneDNN, with each weight reordered
once into the blocked layout its kernels read fastest.

`F.linear` on a float32 CPU tensor calls the BLAS PyTorch was built with (MKL in the
PyPI wheels). A decode step multiplies one row by every weight matrix, so it is bound by
how fast the kernel streams weights from memory; on the AMD machines this book is built
on, MKL's single-row path streams about 12 GB/s and oneDNN's reordered-weight kernel about
20 GB/s, and for many rows (prefill) oneDNN runs ~1.4x the GFLOP/s (chapter 18 times a
decode step with each). The reordering happens once per weight, at load; the numbers are the same products
summed in a different order (differences at float32 rounding, ~1e-6 relative).

`pack_model(model)` returns a shallow copy of a `Llama` whose matrices are `PackedLinear`
modules: `Llama.forward` already calls a module's kernel wherever a layer holds one (the
hook the quantized layers use), so the forward pass itself is unchanged. The original
model is not modified. Where oneDNN cannot take the weights (no oneDNN in this torch, a
GPU tensor, a dtype it does not pack), `pack_model` returns the model itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.kernels import native
from labkit.models.llama import MATRICES, Llama, shallow_copy


def available(weight: torch.Tensor) -> bool:
    """Can oneDNN pack this weight here?"""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(torch.nn.Module):
    """x W^T with W reordered once for oneDNN. `.weight` keeps the plain tensor.

    With `native_gemv` (the default), inputs of at most `max_rows` rows (default
    `native.gemv_max_rows()`, read when the layer is made) go to labkit's C matrix-vector
    kernel instead, where it builds (`labkit.kernels.native`)."""

    def __init__(self, weight: torch.Tensor, native_gemv: bool = True, max_rows: int | None = None):
        super().__init__()
        self.weight, self.native_gemv = weight, native_gemv
        self.max_rows = native.gemv_max_rows() if max_rows is None else max_rows
        if self.max_rows < 0:
            raise ValueError(f"max_rows must be >= 0, got {self.max_rows}")
        # No batch-size hint: one packing serves one row (decode) and many (prefill).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            return F.linear(x, self.weight)
        if (self.native_gemv and x.numel() <= self.max_rows * x.shape[-1]
                and x.dtype == torch.float32 and native.load() is not None):
            return native.gemv(x, self.weight)  # decode: stream the plain weight
        return self.gemm(x)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T through oneDNN's kernel on the packed weight, whatever the rows (x float32 or
        the weight's dtype): the path `forward` takes beyond `max_rows`."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def pack_model(model, native_gemv: bool = True, max_rows: int | None = None):
    """A copy of `model` (a `Llama`) that multiplies by oneDNN-packed weights (and by the C
    matrix-vector kernel for up to `max_rows` rows, if `native_gemv`; default
    `native.gemv_max_rows()`), or `model` itself when the weights cannot be packed here (see
    the module docstring). The copy is kept on the model and reused while the model still
    holds the same weight tensors."""
    if not isinstance(model, Llama):  # another model (Gemma 3) runs on its own weights
        return model
    weights = _matrices(model)
    if not all(isinstance(w, torch.Tensor) and available(w) for w in weights):
        return model
    copies = model.__dict__.setdefault("_packed_copies", {})
    # A shallow copy of the model (labkit.experiments.compilation.slice_model) shares this dict:
    # the identity check below tells its weights from the original's.
    max_rows = native.gemv_max_rows() if max_rows is None else max_rows
    key = (native_gemv, max_rows, len(weights))
    cached = copies.get(key)
    if cached is not None and all(k.weight is w for k, w in zip(_matrices(cached), weights, strict=True)):
        return cached
    out = shallow_copy(model)
    out.layers = [layer.replaced(**{name: PackedLinear(getattr(layer, name), native_gemv, max_rows)
                                    for name in MATRICES})
                  for layer in model.layers]
    out.lm_head = PackedLinear(model.lm_head, native_gemv, max_rows)  # the embedding stays a tensor
    out.__dict__.pop("_packed_copies", None)
    copies[key] = out
    return out


def _matrices(model) -> list:
    return [getattr(layer, name) for layer in model.layers for name in MATRICES] + [model.lm_head]


def is_packed(model) -> bool:
    return isinstance(model.lm_head, PackedLinear)
