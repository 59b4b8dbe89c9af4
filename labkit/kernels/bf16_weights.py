"""bfloat16 weights: the model's matrices rounded to bfloat16, multiplied by activations
rounded to bfloat16, every product and sum in float32.

A bfloat16 keeps float32's 8 exponent bits and 7 of its 23 mantissa bits: half the bytes,
the same range, about three significant decimal digits. The product of two bfloat16 values
is exact in float32, so a bfloat16 GEMM with float32 accumulation (oneDNN's on CPUs with
AVX-512 BF16 or AMX) computes the same numbers as a float32 GEMM on the rounded operands,
up to the order of the sums. `bf16_model` computes those numbers two ways:

- a step of a few rows (decode) reads the bfloat16 rows in place with labkit's C kernel
  (`native.gemv_blocks(..., "BF16")`, `csrc/bf16.c`): half the bytes float32 weights take,
  which is what a decode step is bound by; each layer runs in one C call (`BlockLlama`);
- a bigger step (prefill, a large batch) rounds x to bfloat16 and multiplies through
  oneDNN. Where the CPU multiplies bfloat16 natively (AVX512-BF16, AMX;
  `labkit.kernels.dispatch.bf16_gemm_native`) that is oneDNN's bfloat16 GEMM on packed
  bfloat16 weights (`OneDNNBF16Linear`), whose output PyTorch hands back in bfloat16: one
  more rounding, of the product, than the other paths make. Elsewhere (an AVX2 CPU, where
  oneDNN would emulate bfloat16 slowly) it is oneDNN's float32 GEMM on a packed float32
  copy of the rounded weights: the same numbers, float32 out.

The embedding is rounded too (the LM head is tied to it); the norms stay float32.
"""

from __future__ import annotations

import torch

from labkit.kernels.dispatch import bf16_gemm_native
from labkit.kernels.gguf_blocks import BlockLinear, BlockLlama, default_max_rows, round_to_bf16
from labkit.kernels.packed import pack_model
from labkit.models.llama import MATRICES, shallow_copy


class OneDNNBF16Linear(torch.nn.Module):
    """x W^T on oneDNN's bfloat16 GEMM: W packed once in bfloat16, x rounded to bfloat16,
    float32 sums, the product rounded to bfloat16 (what PyTorch returns) and widened back.
    On AVX512-BF16 or AMX oneDNN runs native instructions; it computes the same numbers
    (slowly) anywhere, which is how the tests hold it to the float32 path on any CPU."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, None, "none", [], "")
        return y.to(x.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def bf16_rows(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, n] rounded to bfloat16, as uint8 [out, 2 n] (what the BF16 kernel reads)."""
    return weight.to(torch.bfloat16).contiguous().view(torch.uint8)


def rounded_model(model):
    """A copy of `model` (a float32 `Llama` with plain tensor weights) whose matrices and
    embedding are rounded to bfloat16 values, kept in float32. The original is unchanged."""
    weights = [getattr(layer, m) for layer in model.layers for m in MATRICES] + [model.embed, model.lm_head]
    if not all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 for w in weights):
        raise ValueError("weights='bf16' rounds a float32 model with plain tensor weights")
    out = shallow_copy(model)
    out.__dict__.pop("_packed_copies", None)  # the original's packed copies are not these weights
    out.layers = [layer.replaced(**{m: round_to_bf16(getattr(layer, m)) for m in MATRICES})
                  for layer in model.layers]
    out.embed = round_to_bf16(model.embed)
    out.lm_head = out.embed if model.lm_head is model.embed else round_to_bf16(model.lm_head)
    return out


def bf16_model(model, max_rows: int | None = None, onednn_bf16: bool | None = None):
    """A copy of `model` on bfloat16 weights (module docstring): `BlockLinear`s of kind "BF16"
    for steps of up to `max_rows` rows (default: `native.MAX_ROWS`), oneDNN beyond: its
    bfloat16 GEMM with `onednn_bf16` (default: where the CPU has native bfloat16,
    `dispatch.bf16_gemm_native()`), else its float32 GEMM on the rounded weights."""
    rows = default_max_rows(False, max_rows)
    rounded = rounded_model(model)
    if bf16_gemm_native() if onednn_bf16 is None else onednn_bf16:
        dense = shallow_copy(rounded)
        dense.layers = [layer.replaced(**{m: OneDNNBF16Linear(getattr(layer, m)) for m in MATRICES})
                        for layer in rounded.layers]
        dense.lm_head = OneDNNBF16Linear(rounded.lm_head)
    else:
        dense = pack_model(rounded, native_gemv=False)
    out = shallow_copy(dense)
    out.layers = [layer.replaced(**{m: BlockLinear("BF16", bf16_rows(getattr(plain, m)), getattr(layer, m),
                                                   max_rows=rows) for m in MATRICES})
                  for plain, layer in zip(rounded.layers, dense.layers)]
    out = BlockLlama.from_llama(out, quantize_x=False, max_rows=rows)
    out.lm_head = BlockLinear("BF16", bf16_rows(rounded.lm_head), dense.lm_head, max_rows=rows)
    return out
