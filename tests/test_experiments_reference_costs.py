"""configuration_line names what runs, read from the objects: each check holds the line to
what the engine or model actually calls (kernel calls counted during a real step) or to a
setting changed on purpose."""

import pytest
import torch

from conftest import needs_kernels
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.experiments.reference_costs import configuration_line, matmul_path
from labkit.kernels import native
from labkit.kernels.packed import pack_model
from labkit.sampling import SamplingParams
from labkit.util.environment import cpu_info

PROMPT = "The capital of France is"


def count_calls(monkeypatch, name: str) -> list[int]:
    """Count the calls of `native.<name>` from here on."""
    calls, real = [], getattr(native, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(native, name, counted)
    return calls


@needs_kernels
@pytest.mark.parametrize("fast_kernels", [True, False])
def test_line_names_the_kernels_a_decode_step_calls(model, monkeypatch, fast_kernels):
    engine = LLMEngine(model, EngineConfig(fast_kernels=fast_kernels, kv_cache_tokens=256))
    line = configuration_line(engine)
    gemv, attention = count_calls(monkeypatch, "gemv"), count_calls(monkeypatch, "paged_attention")
    engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3))
    assert ("labkit C gemv" in line) == bool(gemv)
    assert ("labkit C paged attention" in line) == bool(attention)
    assert ("PyTorch F.linear (model as loaded)" in line) == (not gemv)


@needs_kernels
@pytest.mark.parametrize("weights, words", [
    ("f32", "float32, oneDNN-packed + labkit C gemv"),
    ("bf16", "bfloat16 rows, labkit C kernel"),
    ("gguf", "Q4_1 blocks in place"),
    ("gguf-int8", "activations rounded to int8 blocks"),
])
def test_each_weight_mode_has_its_own_line(model, weights, words):
    line = configuration_line(EngineConfig(weights=weights), model)
    assert line.startswith("smollm2-135m; ") and f"engine weights {weights}: " in line
    assert words in line
    others = {"f32": "oneDNN-packed + labkit C gemv", "bf16": "bfloat16 rows", "gguf": "Q4_1 blocks",
              "gguf-int8": "int8"}
    assert not any(w in line for mode, w in others.items() if mode != weights and not
                   (weights == "gguf-int8" and mode == "gguf"))


def test_a_changed_config_changes_the_line(model):
    plain = configuration_line(EngineConfig(fast_kernels=False), model)
    assert "KV float32 in blocks of 16" in plain
    changed = configuration_line(EngineConfig(fast_kernels=False, kv_dtype="bf16", block_size=32), model)
    assert "KV bfloat16 in blocks of 32" in changed and changed != plain


def test_a_wrong_mode_name_fails(model):
    with pytest.raises(ValueError, match="weights must be one of"):
        configuration_line(EngineConfig(weights="q8"), model)
    with pytest.raises(ValueError, match="needs the model"):
        configuration_line(EngineConfig())


def test_threads_and_cpu_come_from_the_process(model):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = configuration_line(model)
        torch.set_num_threads(2)
        two = configuration_line(model)
    finally:
        torch.set_num_threads(before)
    assert "; 1 torch thread; " in one and "; 2 torch threads; " in two
    assert one.endswith(cpu_info()["model"])


@needs_kernels
def test_bare_models_name_their_own_path(model, reference):
    assert "float32, PyTorch F.linear (model as loaded); SDPA causal" in configuration_line(model)
    assert matmul_path(pack_model(model, native_gemv=False)) == "float32, oneDNN-packed"
    assert matmul_path(pack_model(model)) == "float32, oneDNN-packed + labkit C gemv"
    line = configuration_line(reference)
    assert "transformers float32" in line and f"attention {reference.config._attn_implementation}" in line
    with pytest.raises(ValueError, match="neither"):
        configuration_line(object())
