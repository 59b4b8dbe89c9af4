"""From a registry name to a ready model: fetch, dequantize once, cache, assemble.

The first load reads the GGUF, dequantizes every tensor to float32 and writes them as
safetensors (in Hugging Face names, so the `transformers` reference can load the same
file). Later loads read that file back, which takes about a second.

The GGUF's `general.architecture` decides how its config and weights are read and which
forward pass runs them (`ARCHITECTURES`); the cache's config.json records it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from labkit.models import registry
from labkit.models.gemma3 import Gemma3, Gemma3Config, gemma3_config_from_gguf, gemma3_state_dict
from labkit.models.gguf_file import (LlamaConfig, dequantized_state_dict, field_value,
                                     llama_config_from_gguf, open_reader)
from labkit.models.llama import Llama

CACHE_FORMAT = "dequant-f32-v1"
ModelConfig = LlamaConfig | Gemma3Config


@dataclass(frozen=True)
class Architecture:
    """One GGUF architecture: its config, how the config and the float32 weights (in Hugging
    Face names) are read from the file, and the forward pass that runs them."""

    config_class: type
    config_from_gguf: Callable  # reader -> config
    state_dict_from_gguf: Callable  # (reader, config) -> {name: float32 array}
    model_class: type  # (config, state, dtype=) -> model


ARCHITECTURES = {
    "llama": Architecture(LlamaConfig, llama_config_from_gguf, dequantized_state_dict, Llama),
    # Gemma's weights need nothing from the config (no RoPE row permutation to undo).
    "gemma3": Architecture(Gemma3Config, gemma3_config_from_gguf,
                           lambda reader, config: gemma3_state_dict(reader), Gemma3),
}


def architecture_of(config) -> Architecture:
    return next(arch for arch in ARCHITECTURES.values() if isinstance(config, arch.config_class))


@dataclass
class LoadReport:
    """Where the time of a load went (seconds), and whether the cache was warm."""

    warm_cache: bool
    seconds: dict[str, float] = field(default_factory=dict)


def dequant_dir(name: str) -> Path:
    return registry.model_dir(name) / CACHE_FORMAT


def ensure_dequantized(name: str = registry.DEFAULT_MODEL) -> tuple[Path, ModelConfig, bool]:
    """Return (safetensors path, config, was_already_cached), building the cache if needed."""
    from safetensors.numpy import save_file

    out_dir = dequant_dir(name)
    weights, config_path = out_dir / "model.safetensors", out_dir / "config.json"
    if weights.exists() and config_path.exists():
        saved = json.loads(config_path.read_text())
        # A cache written before the registry had a second architecture holds a Llama and
        # does not say so.
        arch = ARCHITECTURES[saved.pop("architecture", "llama")]
        return weights, arch.config_class(**saved), True
    gguf = registry.fetch(name)
    reader = open_reader(gguf)
    arch_name = field_value(reader, "general.architecture")
    if arch_name not in ARCHITECTURES:
        raise ValueError(f"{name}: no forward pass for GGUF architecture {arch_name!r} "
                         f"(known: {', '.join(ARCHITECTURES)})")
    arch = ARCHITECTURES[arch_name]
    config = arch.config_from_gguf(reader)
    state = arch.state_dict_from_gguf(reader, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = weights.with_suffix(f".tmp{os.getpid()}")
    save_file(state, str(tmp), metadata={"source_sha256": registry.get_spec(name).gguf_sha256})
    os.replace(tmp, weights)
    tmp_cfg = config_path.with_suffix(f".tmp{os.getpid()}")
    tmp_cfg.write_text(json.dumps({"architecture": arch_name, **config.to_dict()}, indent=2))
    os.replace(tmp_cfg, config_path)
    return weights, config, False


def load_state_dict(name: str = registry.DEFAULT_MODEL) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """The dequantized float32 weights in Hugging Face names, and our config."""
    from safetensors.torch import load_file

    path, config, _ = ensure_dequantized(name)
    return load_file(str(path)), config


def load_tokenizer(name: str = registry.DEFAULT_MODEL):
    from labkit.tokenizer import Tokenizer

    return Tokenizer.from_gguf(registry.fetch(name))


def load_model(name: str = registry.DEFAULT_MODEL, dtype: torch.dtype = torch.float32,
               with_tokenizer: bool = True):
    """Load `name` with our hand-written forward pass.

    Returns the module of the GGUF's architecture (`Llama`, `Gemma3`): call it on token ids
    [batch, seq] for logits [batch, seq, vocab]; `.config` is the config, `.tokenizer` the
    tokenizer and `.load_report` says where the load time went.
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    path, config, warm = ensure_dequantized(name)
    timings["fetch_and_dequantize"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    from safetensors.torch import load_file
    state = load_file(str(path))
    timings["read_weights"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = architecture_of(config).model_class(config, state, dtype=dtype)
    model.name = name
    del state
    timings["assemble"] = time.perf_counter() - t0
    if with_tokenizer:
        t0 = time.perf_counter()
        model.tokenizer = load_tokenizer(name)
        timings["tokenizer"] = time.perf_counter() - t0
    model.load_report = LoadReport(warm_cache=warm, seconds=timings)
    return model
