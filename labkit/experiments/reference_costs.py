"""What one configuration costs, and the line that names it (chapter 6; every chapter that
times the engine or the model names its configuration by `configuration_line`).

A SmolLM2 decode step costs 14 ms in one chapter and 39 ms in another because the two ran
different code: the plain PyTorch model (`F.linear` on the weights as loaded) or the engine,
float32 weights packed for oneDNN with labkit's C matrix-vector kernel, bfloat16 rows or the
model file's Q4_1 blocks read in place, one thread or two. `configuration_line(...)` reads
what runs from the objects themselves (the layer modules the backend put in the model, the
KV pool's dtype and attention path, torch's thread count, the CPU), never from a label
somebody typed, so a chapter's line cannot claim a path it did not run.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.kernels import native
from labkit.kernels.bf16_weights import OneDNNBF16Linear
from labkit.kernels.gguf_blocks import BlockLinear, BlockLlama
from labkit.kernels.packed import PackedLinear
from labkit.util.environment import cpu_info

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
BLOCK_NAMES = {"Q4_1": "Q4_1", "Q4_1x8": "Q4_1", "Q8_0": "Q8_0", "BF16": "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def model_name(model) -> str:
    """The registry name labkit's loader gave the model, else its class (a transformers
    model: its class and the folder it came from, if any)."""
    name = getattr(model, "name", None)
    if name:
        return str(name)
    config = getattr(model, "config", None)
    source = getattr(config, "name_or_path", "") or ""
    return f"{type(model).__name__} {source}".strip()


def _first_matrix(model):
    """The first layer's fused attention input matrix: a tensor (the model as loaded) or the
    module a backend put in its place."""
    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no labkit layers to read the matmul path from")
    return layers[0].qkv


def dense_path(module) -> str:
    """The path of a product of many rows (prefill) through `module` or a plain weight."""
    if isinstance(module, torch.Tensor):
        return f"{dtype_name(module.dtype)} PyTorch F.linear"
    if isinstance(module, OneDNNBF16Linear):
        return "oneDNN bfloat16 GEMM"
    if isinstance(module, PackedLinear):
        return f"oneDNN-packed {dtype_name(module.weight.dtype)}"
    raise ValueError(f"no description for a {type(module).__name__} layer")


def matmul_path(model) -> str:
    """The weight format and the matrix products a labkit model runs: what its first layer
    holds, with the LM head's format where it differs."""
    first = _first_matrix(model)
    if isinstance(first, torch.Tensor):
        return f"{dtype_name(first.dtype)}, PyTorch F.linear (model as loaded)"
    if isinstance(first, PackedLinear):
        gemv = first.native_gemv and native.load() is not None
        return f"{dtype_name(first.weight.dtype)}, oneDNN-packed" + (" + labkit C gemv" if gemv else "")
    if isinstance(first, BlockLinear):
        head = model.lm_head
        if first.kind == "BF16":
            words = "bfloat16 rows, labkit C kernel"
        else:
            words = f"{BLOCK_NAMES[first.kind]} blocks in place, labkit C kernel"
            if isinstance(head, BlockLinear) and BLOCK_NAMES[head.kind] != BLOCK_NAMES[first.kind]:
                words += f" (LM head {BLOCK_NAMES[head.kind]})"
        if first.quantize_x:
            words += ", activations rounded to int8 blocks"
        if isinstance(model, BlockLlama):
            words += ", one C call a step"
        if first.max_rows < 1 << 40:  # bigger steps (prefill) go to the dense module
            words += f" of up to {first.max_rows} rows, more rows: {dense_path(first.dense)}"
        return words
    raise ValueError(f"no description for a {type(first).__name__} layer")


def engine_parts(engine: LLMEngine) -> list[str]:
    pool = engine.pool
    attention = ("labkit C paged attention" if pool.native
                 else "gather + SDPA (a whole prompt: SDPA causal)")
    if pool.windows is not None and any(w is not None for w in pool.windows):
        attention = "gather + SDPA with window masks"
    return [f"engine weights {engine.weights}: {matmul_path(engine.model)}",
            f"KV {dtype_name(pool.dtype)} in blocks of {pool.block_size}", attention]


def model_parts(model) -> list[str]:
    """A model called directly (no engine): its own matrices and attention."""
    if hasattr(model, "layers"):  # a labkit model: Llama (or one a backend prepared), Gemma 3
        attention = ("SDPA with window masks, contiguous KV cache" if hasattr(model.config, "layer_windows")
                     else "SDPA causal (enable_gqa), contiguous KV cache")
        return [matmul_path(model), attention]
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is None:
        raise ValueError(f"{type(model).__name__} is neither a labkit model nor a transformers model")
    weight = next(model.parameters())
    return [f"transformers {dtype_name(weight.dtype)}, nn.Linear", f"attention {implementation}"]


def configuration_line(subject, model=None) -> str:
    """One line naming what runs: model; weight mode and matmul path; KV dtype and block
    size (paged engine); attention path; torch threads; CPU model.

    `subject` is an `LLMEngine`, an `EngineConfig` (then `model` is the model it serves:
    an engine with a one-block pool is built to read what that config runs, and a weight
    mode that cannot run is the engine's ValueError) or a bare model (labkit's or
    transformers'), called directly."""
    if isinstance(subject, EngineConfig):
        if model is None:
            raise ValueError("an EngineConfig needs the model it serves")
        subject = LLMEngine(model, replace(subject, kv_cache_tokens=subject.block_size,
                                           fit_context_to_pool=False, max_model_len=None))
    elif model is not None:
        raise ValueError("a model goes with an EngineConfig only")
    if isinstance(subject, LLMEngine):
        name, parts = model_name(subject.model), engine_parts(subject)
    else:
        name, parts = model_name(subject), model_parts(subject)
    threads = torch.get_num_threads()
    cpu = cpu_info()["model"] or "CPU model unknown"
    return "; ".join([name, *parts, f"{threads} torch thread{'s' if threads != 1 else ''}", cpu])


__all__ = ["configuration_line", "matmul_path", "model_name", "dense_path", "dtype_name"]
