"""The model's matrices multiplied in the GGUF file's own blocks.

The model file stores every layer matrix as Q4_1 blocks (32 weights: a 16-bit step, a 16-bit
minimum and 4 bits a weight, 5 bits a weight in all) and the tied embedding / LM head as Q8_0
(8 bits a weight and a 16-bit scale per 32). The float32 weights the rest of labkit uses are
these blocks dequantized once (`labkit.models.gguf_file`). A decode step reads every weight
once, so it is bound by the bytes it reads: 538 MB a token in float32, 96 MB in the file's
blocks (5.6 times fewer). `block_model` gives the engine a copy of the model whose matrices
read the blocks in place for a step of a few rows (labkit's C kernels, `native.gemv_blocks`)
and multiply larger steps (prefill, big batches) by the oneDNN-packed float32 weights: the
same numbers, since the float32 weights are exactly the blocks' values; only the order of
the sums differs. With `quantize_x` the kernels also round the activations to 8 bits a
block (llama.cpp's scheme), and the float32 path rounds them the same way.

`dequantize` is a plain PyTorch reading of both formats, which the tests hold to `gguf`'s
reference dequantization and the kernels to.
"""

from __future__ import annotations

import sys
from typing import Protocol

import torch
import torch.nn.functional as F

from labkit.kernels import native
from labkit.kernels.packed import pack_model
from labkit.models.llama import MATRICES, Llama, rms_norm, shallow_copy

# GGUF tensor names (after `gguf_file.hf_name`) of each fused matrix of a layer, in the
# order `LayerWeights` concatenates their rows.
FUSED_PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "o_proj": ("self_attn.o_proj",),
               "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
               "down": ("mlp.down_proj",)}


def dequantize(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """float32 [out, n] from uint8 blocks [out, row bytes] of `kind` (Q4_1 or Q8_0)."""
    per_block, block_bytes = native.BLOCK_FORMATS[kind]
    out = blocks.shape[0]
    b = blocks.reshape(out, -1, block_bytes)
    scale = b[..., 0:2].contiguous().view(torch.float16).float()  # [out, blocks, 1]
    if kind == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (scale * q).reshape(out, -1)
    low = b[..., 2:4].contiguous().view(torch.float16).float()
    nibbles = b[..., 4:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()  # weights 0..15, then 16..31
    return (scale * q + low).reshape(out, -1)


def round_to_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 kernels see it, in float32: each block of 32 values scaled by
    max |x| / 127 and rounded to whole steps (halves to even).

    The two paths then agree to float32's last bits, but not always in the tokens: a value
    a last bit away from a half step rounds the other way, a whole step's difference that
    the layers above carry on. That is why "gguf-int8" runs the kernels at every step
    (`default_max_rows`); this path serves a BlockLinear told to hand big steps on."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    scaled = blocks * inverse
    return (torch.round(scaled) * step).reshape(x.shape)


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest bfloat16 (halves to even), kept in x's dtype: what the BF16
    kernel does to x before it multiplies."""
    return x.to(torch.bfloat16).to(x.dtype)


def default_max_rows(quantize_x: bool, max_rows: int | None = None) -> int:
    """Up to how many rows of x a product reads the blocks, unless told: a few with float32
    x (beyond that oneDNN's float32 GEMM is faster); every step with 8-bit x, whose kernel
    on regrouped blocks beat that GEMM at every size measured (gate_up at 64 rows: 0.83 ms
    against 1.51 on this book's 2-core machine) and whose one path for every step keeps a
    request's numbers independent of the batch it shares."""
    if max_rows is not None:
        return max_rows
    return sys.maxsize if quantize_x else native.MAX_ROWS


def regroup_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks [out, n / 32 * 20] with each eight rows' bytes regrouped for the 8-bit
    kernel (`Q4_1x8`, described in csrc/gguf_blocks.c): per eight rows and block, the eight
    steps, the eight minimums, then four runs of each row's next four bytes of nibbles. The
    same bytes, reordered; the shape is unchanged."""
    out, row_bytes = blocks.shape
    if out % 8 or row_bytes % 20:
        raise ValueError(f"Q4_1 blocks of {out} rows cannot be regrouped by eight")
    groups, nb = out // 8, row_bytes // 20
    b = blocks.reshape(groups, 8, nb, 20).permute(0, 2, 1, 3)  # [groups, block, row, bytes]
    nibbles = b[..., 4:].reshape(groups, nb, 8, 4, 4).permute(0, 1, 3, 2, 4)  # [.., run, row, 4]
    parts = (b[..., 0:2].reshape(groups, nb, 16), b[..., 2:4].reshape(groups, nb, 16),
             nibbles.reshape(groups, nb, 128))
    return torch.cat(parts, dim=-1).reshape(out, row_bytes).contiguous()


class BlockLinear(torch.nn.Module):
    """x W^T with W kept as GGUF blocks (or bfloat16 rows, kind "BF16"): up to `max_rows`
    rows of x read them in place (C kernel; `quantize_x` rounds x to 8 bits a block first,
    "BF16" rounds x to bfloat16); more rows go to `dense`, a module computing the same
    product on float32 weights of the same values, after the same rounding of x."""

    def __init__(self, kind: str, blocks: torch.Tensor, dense: torch.nn.Module | torch.Tensor,
                 quantize_x: bool = False, max_rows: int | None = None):
        super().__init__()
        if kind not in native.BLOCK_FORMATS:
            raise ValueError(f"no kernel for {kind!r} blocks")
        if kind == "Q4_1" and quantize_x and blocks.shape[0] % 8 == 0:
            kind, blocks = "Q4_1x8", regroup_q4_1(blocks)  # the 8-bit kernel's order
        self.kind, self.blocks, self.dense = kind, blocks.contiguous(), dense
        self.quantize_x, self.max_rows = quantize_x, default_max_rows(quantize_x, max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype == torch.float32 and x.numel() <= self.max_rows * x.shape[-1]
                and native.load() is not None):
            return native.gemv_blocks(x, self.blocks, self.kind, self.quantize_x)
        if self.quantize_x:  # the same rounding on every path: one model, whatever the batch
            x = round_to_int8_blocks(x)
        elif self.kind == "BF16":
            x = round_to_bf16(x)
        dense = self.dense
        return dense(x) if isinstance(dense, torch.nn.Module) else torch.nn.functional.linear(x, dense)

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads: the blocks."""
        return self.blocks.numel()

    @property
    def shape(self) -> torch.Size:
        per_block, block_bytes = native.BLOCK_FORMATS[self.kind]
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1] // block_bytes * per_block))


def fused_blocks(raw: dict[str, tuple[str, object]], layer: int, matrix: str) -> tuple[str, torch.Tensor]:
    """One fused matrix of a layer (`MATRICES`) from `gguf_file.raw_blocks`: its parts' rows
    one after another, as `LayerWeights` fuses the float32 ones."""
    parts = [raw[f"model.layers.{layer}.{name}.weight"] for name in FUSED_PARTS[matrix]]
    kinds = {kind for kind, _ in parts}
    if len(kinds) != 1:
        raise ValueError(f"layer {layer} {matrix}: parts in different formats {sorted(kinds)}")
    return kinds.pop(), torch.cat([torch.from_numpy(data) for _, data in parts])


def block_model(model, raw: dict[str, tuple[str, object]], quantize_x: bool = False,
                max_rows: int | None = None):
    """A copy of `model` (a `Llama` whose float32 weights are the file's blocks dequantized)
    whose layer matrices and LM head are `BlockLinear`s over the file's blocks (steps of up
    to `max_rows` rows; `quantize_x`: x rounded to 8 bits), with the oneDNN-packed float32
    weights (`pack_model`) for steps of more rows. Raises ValueError when a matrix is in a
    format without a kernel or its blocks do not match its shape."""
    def linear(kind, blocks, dense):
        return BlockLinear(kind, blocks, dense, quantize_x, max_rows)

    dense = pack_model(model, native_gemv=False)
    out = shallow_copy(dense)
    layers = []
    for index, layer in enumerate(dense.layers):
        swapped = {}
        for matrix in MATRICES:
            kind, blocks = fused_blocks(raw, index, matrix)
            swapped[matrix] = _checked(linear(kind, blocks, getattr(layer, matrix)),
                                       getattr(model.layers[index], matrix).shape, f"layer {index} {matrix}")
        layers.append(layer.replaced(**swapped))
    out.layers = layers
    out = BlockLlama.from_llama(out, quantize_x, default_max_rows(quantize_x, max_rows))
    head = "lm_head.weight" if "lm_head.weight" in raw else "model.embed_tokens.weight"  # tied
    kind, data = raw[head]
    out.lm_head = _checked(linear(kind, torch.from_numpy(data), dense.lm_head), model.lm_head.shape, "LM head")
    return out


def _checked(linear: BlockLinear, shape: torch.Size, what: str) -> BlockLinear:
    if linear.shape != shape:
        raise ValueError(f"{what}: blocks hold {tuple(linear.shape)}, the weight is {tuple(shape)}")
    return linear


class PagedSteps(Protocol):
    """A cache that lets a kernel run whole layers on its pool (the engine's `PagedBatch`)."""
    native: bool

    def native_pool(self) -> native.PagedLayer: ...


class BlockLlama(Llama):
    """A `Llama` on the file's blocks whose steps of up to `max_rows` rows (a few with float32
    x, every step with 8-bit x: `default_max_rows`) on a paged pool with labkit's kernels
    run every layer in one C call (`native.decoder_layers_blocks`, `decoder_layer_blocks`
    layer after layer): the same arithmetic as `decoder_layer`, without PyTorch's cost per
    small operation, which was larger than the 4-bit matrix products themselves, or
    Python's per call into C. Every other step is `Llama.forward`."""

    @classmethod
    def from_llama(cls, model: Llama, quantize_x: bool, max_rows: int) -> "BlockLlama":
        out = cls.__new__(cls)
        out.__dict__ = model.__dict__  # the module's state, shared as `shallow_copy` shares it
        out.quantize_x, out.max_rows, out._fused = quantize_x, max_rows, None
        return out

    def fused_layers(self) -> list[native.BlockLayerWeights] | None:
        """Each layer's weights for the C layer, or None when a matrix is not on blocks."""
        if self._fused is None:
            fused = []
            for layer in self.layers:
                mats = [getattr(layer, m) for m in MATRICES]
                if not all(isinstance(m, BlockLinear) for m in mats):
                    return None
                fused.append(native.BlockLayerWeights(layer.attn_norm.contiguous(), layer.mlp_norm.contiguous(),
                                                      tuple(m.blocks for m in mats), tuple(m.kind for m in mats),
                                                      self.quantize_x))
            self._fused, self._all_layers = fused, native.BlockModelWeights(fused)
        return self._fused

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: PagedSteps | None = None, last_only: bool = False,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        batch, steps = input_ids.shape
        if (batch != 1 or steps > self.max_rows or not getattr(cache, "native", False)
                or not hasattr(cache, "native_pool") or self.fused_layers() is None):
            return super().forward(input_ids, cache=cache, last_only=last_only, rows=rows)
        c = self.config
        positions = cache.positions(steps, self.rope_cos.shape[0])
        cos, sin = self.rope_cos[positions].contiguous(), self.rope_sin[positions].contiguous()
        x = F.embedding(input_ids[0], self.embed).contiguous()  # [steps, hidden]
        native.decoder_layers_blocks(x, self._all_layers, c, cos, sin, cache.native_pool())
        cache.advance(steps)
        x = x[None]
        if last_only:
            x = x[:, -1:]
        elif rows is not None:
            x = x[:, rows]
        return self.lm_head(rms_norm(x, self.final_norm, c.rms_norm_eps))
