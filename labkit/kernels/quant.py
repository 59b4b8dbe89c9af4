"""Weight quantization: int8 per output channel and int4 in groups, and linear layers that
compute with the quantized weights.

int8, symmetric per channel: each output row r keeps a scale s_r = max|w_r| / 127 and
q = round(w / s_r) in [-127, 127]. The reconstruction error of any weight is at most s_r / 2.

int4, asymmetric per group of `group_size` consecutive inputs: each group keeps its minimum
m and a step s = (max - min) / 15, and q = round((w - m) / s) in [0, 15]. The error is at
most s / 2. We store the zero point the way PyTorch's int4 CPU kernel wants it
(w = (q - 8) * s + z, so z = m + 8 s) so the same numbers feed both paths.

Each `Quantized*Linear` computes with PyTorch's CPU weight-only kernels where this torch has
them (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) and otherwise dequantizes and
calls `F.linear` (the reference path, also used by the tests to check the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float [out]

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


@dataclass
class Int4Weight:
    q: torch.Tensor  # uint8 values 0..15, [out, in] (unpacked; 2 per byte when stored)
    scale: torch.Tensor  # float [out, in // group_size]
    zero: torch.Tensor  # float [out, in // group_size], w = (q - 8) * scale + zero
    group_size: int

    def dequantize(self) -> torch.Tensor:
        out, inp = self.q.shape
        q = self.q.float().view(out, inp // self.group_size, self.group_size)
        w = (q - 8) * self.scale[..., None] + self.zero[..., None]
        return w.view(out, inp)

    @property
    def nbytes(self) -> int:
        """Bytes as stored: two 4-bit values per byte plus the scales and zero points."""
        return self.q.numel() // 2 + self.scale.nbytes + self.zero.nbytes


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_int4(weight: torch.Tensor, group_size: int = 64) -> Int4Weight:
    out, inp = weight.shape
    if inp % group_size:
        raise ValueError(f"input width {inp} is not a multiple of the group size {group_size}")
    w = weight.float().view(out, inp // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    zero = lo + 8 * scale
    return Int4Weight(q.view(out, inp), scale, zero, group_size)


def error_bound(weight) -> torch.Tensor:
    """Closed-form worst-case |w - dequantize(quantize(w))| per stored scale: half a step."""
    return weight.scale / 2


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


class QuantizedInt8Linear(torch.nn.Module):
    """y = x W^T with W stored as int8 per-channel."""

    def __init__(self, weight: torch.Tensor, use_kernel: bool = True):
        super().__init__()
        self.weight = quantize_int8(weight)
        self.use_kernel = use_kernel and _has_op("_weight_int8pack_mm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and x.device.type == "cpu":
            shape = x.shape
            flat = x.reshape(-1, shape[-1])
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight.q,
                                                   self.weight.scale.to(x.dtype))
            return y.reshape(*shape[:-1], -1)
        return F.linear(x, self.weight.dequantize().to(x.dtype))


class QuantizedInt4Linear(torch.nn.Module):
    """y = x W^T with W stored as int4 in groups of `group_size` inputs."""

    def __init__(self, weight: torch.Tensor, group_size: int = 64, use_kernel: bool = True):
        super().__init__()
        self.weight = quantize_int4(weight, group_size)
        self.use_kernel = use_kernel and _has_op("_weight_int4pack_mm_for_cpu")
        if self.use_kernel:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                self.weight.q.to(torch.int32), 1)
            # The kernel wants [groups, out, 2] with (scale, zero) pairs.
            self.scales_and_zeros = torch.stack(
                [self.weight.scale.t(), self.weight.zero.t()], dim=-1).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and x.device.type == "cpu":
            shape = x.shape
            flat = x.reshape(-1, shape[-1])
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.packed, self.weight.group_size, self.scales_and_zeros.to(x.dtype))
            return y.reshape(*shape[:-1], -1)
        return F.linear(x, self.weight.dequantize().to(x.dtype))
