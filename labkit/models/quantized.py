"""The Llama model with quantized weights, built from a loaded model.

Two paths give the same numbers by different arithmetic:

- `quantize_model(model, scheme, ...)` returns a copy of the `Llama` whose matrices are
  quantized and immediately dequantized back to float32 ("fake quantization"). It runs the
  unchanged float32 forward pass, so it measures what quantization does to the model's
  *behaviour* (perplexity, tokens) at float32 speed.
- `QuantizedLlama(model, scheme, ...)` keeps the matrices quantized and multiplies with
  PyTorch's CPU weight-only kernels (`QuantizedInt8Linear`, `QuantizedInt4Linear`): the path
  whose *speed* we measure. Its forward pass is `Llama.forward`, whose `linear` calls the
  layer's quantized kernel.

The two agree up to float rounding (the kernel dequantizes the same integers and scales);
`tests/test_models_quantized.py` checks it.
"""

from __future__ import annotations

import torch

from labkit.kernels.quant import (QuantizedInt4Linear, QuantizedInt8Linear, quantize_int4,
                                  quantize_int8)
from labkit.models.llama import MATRICES, LayerWeights, Llama, shallow_copy
EMBEDDING_SIDES = ("none", "input", "output", "both")

KERNEL_LOGIT_ERROR = 2e-3
"""Stated bound on |logit difference| between `quantize_model(model, s, g)` and
`QuantizedLlama(model, s, g, dtype=torch.float32)` on the same tokens, as a share of the
reference's largest |logit|. Both multiply by the same integers and float32 scales; only
float32 rounding separates them: the int8 kernel applies each row's scale after its sums
where fake quantization multiplies by the dequantized weights, and the int4 kernel rebuilds
(q - 8) * s + z inside its own loop, in its own order of sums. Two float32 paths of this
model differ by about 1e-5 in logits of up to about 30
(:data:`labkit.experiments.path_agreement.LOGIT_ERROR` states 1e-3), far below this share
(0.06 at a logit of 30): room for the kernels' other orders of sums, not for a different
product. Stated, not fitted to one run; chapter 12 and the tests assert it, and chapter 12
glues the difference each run measured."""


def quantize_weight(w: torch.Tensor, scheme: str, group_size: int = 64):
    """`Int8Weight` (per output channel) or `Int4Weight` (groups of `group_size` inputs)."""
    if scheme == "int8":
        return quantize_int8(w)
    if scheme == "int4":
        return quantize_int4(w, group_size)
    raise ValueError(f"unknown scheme {scheme!r}: use 'int8' or 'int4'")


def fake_quantize(w: torch.Tensor, scheme: str, group_size: int | None = 64) -> torch.Tensor:
    """quantize then dequantize: the float32 weights a quantized kernel really multiplies by.

    scheme "bf16" rounds to bfloat16; "int4" with group_size None uses one scale and zero
    point for the whole matrix (per tensor: the crudest choice).
    """
    return _round_trip(w, scheme, group_size, with_step=False)[0].to(w.dtype).contiguous()


def _round_trip(w: torch.Tensor, scheme: str, group_size: int | None, with_step: bool = True):
    """(dequantized float32 weights, the step of the grid each weight was rounded to, or
    None if not `with_step`)."""
    w = w.float()
    if scheme == "bf16":  # spacing of bf16 numbers: 2^(e-8) for |w| in [2^(e-1), 2^e)
        step = torch.ldexp(torch.ones_like(w), torch.frexp(w).exponent - 8) if with_step else None
        return w.to(torch.bfloat16).float(), step
    if scheme == "int4" and group_size is None:
        qw = quantize_int4(w.reshape(1, -1), w.numel())
        return qw.dequantize().view_as(w), qw.scale.expand_as(w)
    qw = quantize_weight(w, scheme, group_size)
    step = None
    if with_step:
        step = qw.scale[:, None] if scheme == "int8" else qw.scale.repeat_interleave(group_size, 1)
        step = step.expand_as(w)
    return qw.dequantize(), step


def quantize_model(model: Llama, scheme: str = "int8", group_size: int | None = 64,
                   embedding: str = "none", layers: bool = True) -> Llama:
    """A copy of `model` with fake-quantized weights (the original is left untouched).

    layers: quantize the four matrices of every layer (norm vectors stay float32).
    embedding: which use of the tied embedding matrix sees quantized values: "input" (the
    token lookup), "output" (the LM head), "both", or "none". The two sides then hold
    different tensors, which is the point of the experiment.
    """
    if embedding not in EMBEDDING_SIDES:
        raise ValueError(f"embedding must be one of {EMBEDDING_SIDES}")
    new = shallow_copy(model)  # shares config, tokenizer, norms and RoPE tables
    if layers:
        new.layers = [layer.replaced(**{name: fake_quantize(getattr(layer, name), scheme, group_size)
                                        for name in MATRICES})
                      for layer in model.layers]
    if embedding != "none":  # one Parameter, so "both" keeps the two sides tied
        q = torch.nn.Parameter(fake_quantize(model.lm_head, scheme, group_size), requires_grad=False)
        if embedding in ("input", "both"):
            new.embed = q
        if embedding in ("output", "both"):
            new.lm_head = q
    return new


class QuantizedLlama(Llama):
    """`Llama` with every layer matrix multiplied by a weight-only kernel.

    scheme "int8" / "int4" quantizes the four matrices of each layer (and the LM head if
    `quantize_head`); everything else (embedding, norms, RoPE tables, KV cache, activations)
    is cast to `dtype`. PyTorch's CPU weight-only kernels are fast with bfloat16 activations
    and fall back to slow code with float32 ones, hence the default; `dtype=torch.float32`
    computes the same numbers as `quantize_model` up to float rounding. scheme None keeps
    `F.linear` on the (cast) float weights. The forward pass is `Llama.forward` itself:
    its `linear` calls a module's kernel where a layer holds a module instead of a tensor.
    """

    def __init__(self, model: Llama, scheme: str | None = "int8", group_size: int = 64,
                 dtype: torch.dtype = torch.bfloat16, use_kernel: bool = True,
                 quantize_head: bool = False):
        torch.nn.Module.__init__(self)
        self.config, self.tokenizer = model.config, model.tokenizer  # dtype: the embedding's
        self.scheme, self.group_size = scheme, group_size
        self.embed, self.final_norm = model.embed.to(dtype), model.final_norm.to(dtype)
        self.register_buffer("rope_cos", model.rope_cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.to(dtype), persistent=False)
        make = lambda w: _linear(w, scheme, group_size, dtype, use_kernel)  # noqa: E731
        self.layers = [LayerWeights(attn_norm=layer.attn_norm.to(dtype),
                                    mlp_norm=layer.mlp_norm.to(dtype),
                                    **{name: make(getattr(layer, name)) for name in MATRICES})
                       for layer in model.layers]
        head = model.lm_head
        if quantize_head:
            self.lm_head = make(head)
        elif head is model.embed:  # tied: one cast copy serves both
            self.lm_head = self.embed
        else:
            self.lm_head = head.to(dtype).contiguous()


def _linear(w: torch.Tensor, scheme: str | None, group_size: int = 64,
            dtype: torch.dtype = torch.float32, use_kernel: bool = True):
    if scheme is None:  # plain float weights, multiplied by F.linear
        return w.to(dtype).contiguous()
    if scheme == "int8":
        return QuantizedInt8Linear(w, use_kernel=use_kernel)
    if scheme == "int4":
        return QuantizedInt4Linear(w, group_size, use_kernel=use_kernel)
    raise ValueError(f"unknown scheme {scheme!r}")


# -- the closed forms: bytes and error bounds -----------------------------------------------

def stored_bytes(rows: int, cols: int, scheme: str, group_size: int = 64) -> int:
    """Bytes of one [rows, cols] matrix as stored, scales and zero points included.

    float32: 4 rc; bfloat16: 2 rc; int8: rc + 4 r (one float32 scale per row);
    int4: rc / 2 + 8 rc / g (4-bit values two per byte, a float32 scale and zero per group).
    """
    n = rows * cols
    if scheme == "int4":
        return n // 2 + 8 * n // group_size
    return {"float32": 4 * n, "bfloat16": 2 * n, "int8": n + 4 * rows}[scheme]


def storage_rows(model: Llama, group_sizes: tuple[int, ...] = (64, 32)) -> list[dict]:
    """Bytes of each group of tensors stored as float32, bfloat16, int8 and int4 (one column
    per group size). Norm vectors are never quantized: float32 except in the bf16 column."""
    layers = model.layers
    groups = {"attention": [t for ly in layers for t in (ly.qkv, ly.o_proj)],
              "mlp": [t for ly in layers for t in (ly.gate_up, ly.down)],
              "embedding (tied)": [model.embed],
              "norms": [t for ly in layers for t in (ly.attn_norm, ly.mlp_norm)] + [model.final_norm]}
    columns = [("float32", "float32", 0), ("bfloat16", "bfloat16", 0), ("int8", "int8", 0)]
    columns += [(f"int4_g{g}", "int4", g) for g in group_sizes]
    rows = []
    for group, tensors in groups.items():
        row = {"group": group, "parameters": sum(t.numel() for t in tensors)}
        for column, scheme, g in columns:
            row[column] = sum(stored_bytes(*t.shape, scheme, g) if t.dim() == 2 else
                              t.numel() * (2 if scheme == "bfloat16" else 4) for t in tensors)
        rows.append(row)
    return rows


def gguf_group(name: str) -> str:
    """The `storage_rows` group of a GGUF tensor name."""
    if name.startswith("token_embd"):
        return "embedding (tied)"
    if "norm" in name:
        return "norms"
    return "attention" if ".attn_" in name else "mlp"


def quantization_step(w: torch.Tensor, scheme: str, group_size: int | None = 64) -> torch.Tensor:
    """The step of the grid each weight of `w` is rounded to, one value per weight: the
    row's scale (int8), the group's (int4; the whole matrix's if group_size is None), or
    the spacing of bfloat16 numbers near the weight, 2^(e-8) for |w| in [2^(e-1), 2^e)."""
    return _round_trip(w, scheme, group_size)[1]


def error_over_bound(w: torch.Tensor, scheme: str, group_size: int | None = 64) -> torch.Tensor:
    """|dequantized - w| / (step / 2) for every weight: at most 1 by construction."""
    back, step = _round_trip(w, scheme, group_size)
    err = (back - w.float()).abs()
    return torch.where(step > 0, 2 * err / step, torch.zeros_like(err))


def reconstruction_error(weights, scheme: str, group_size: int | None = 64) -> dict:
    """How far the stored weights are from the originals, beside the closed-form bound.

    `weights` is one matrix or a list (e.g. the same matrix of every layer; the figures are
    then over all of them). The bound on |error| is half a quantization step
    (`quantization_step`). If the rounding errors spread uniformly over [-step/2, step/2],
    their RMS is step / sqrt(12): `rms_rel_predicted`. RMS values are relative to the RMS
    of the weights.
    """
    sums = dict(err2=0.0, w2=0.0, step2=0.0, n=0, exact=0, max_abs=0.0, max_bound=0.0, ratio=0.0)
    for w in weights if isinstance(weights, (list, tuple)) else [weights]:
        w = w.float()
        back, step = _round_trip(w, scheme, group_size)
        err = back - w
        ratio = torch.where(step > 0, 2 * err.abs() / step, torch.zeros_like(err))
        sums["err2"] += err.double().pow(2).sum().item()
        sums["w2"] += w.double().pow(2).sum().item()
        sums["step2"] += step.double().pow(2).sum().item()
        sums["n"] += w.numel()
        sums["exact"] += int((err == 0).sum())
        sums["max_abs"] = max(sums["max_abs"], err.abs().max().item())
        sums["max_bound"] = max(sums["max_bound"], step.max().item() / 2)
        sums["ratio"] = max(sums["ratio"], ratio.max().item())
    return {
        "rms_rel": (sums["err2"] / sums["w2"]) ** 0.5,
        "rms_rel_predicted": (sums["step2"] / 12 / sums["w2"]) ** 0.5,
        "max_abs": sums["max_abs"],
        "max_bound": sums["max_bound"],
        "max_error_over_bound": sums["ratio"],
        "exact_fraction": sums["exact"] / sums["n"],
        "weights": sums["n"],
    }
