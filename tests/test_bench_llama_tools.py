"""llama.cpp's own tools as bench peers (`labkit.bench.llama_tools`): a clear reason when
they are not built, and where they are, llama-bench's record and an F32 file that holds
exactly the weights labkit's f32 mode multiplies by."""

import gguf
import numpy as np
import pytest
import torch

from labkit.bench import llama_tools
from labkit.models import registry


def test_missing_tools_give_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv(llama_tools.TOOLS_VARIABLE, str(tmp_path))
    reason = llama_tools.why_not_llama_tools()
    assert "llama-bench and llama-quantize not built in" in reason and "make peers" in reason
    (tmp_path / "llama-bench").write_text("#!/bin/sh\n")
    (tmp_path / "llama-bench").chmod(0o755)
    assert "llama-quantize not built" in llama_tools.why_not_llama_tools()


needs_tools = pytest.mark.skipif(llama_tools.why_not_llama_tools() is not None,
                                 reason=str(llama_tools.why_not_llama_tools()))


@pytest.mark.slow
@needs_tools
def test_the_f32_file_holds_the_models_float32_weights(model):
    """llama-quantize's F32 copy of the model file, read back with `gguf`: layer 0's value
    projection (stored as is; GGUF permutes the query and key rows for llama.cpp's RoPE) is
    labkit's float32 weight, the dequantized blocks, element for element."""
    reader = gguf.GGUFReader(str(llama_tools.f32_gguf("smollm2-135m")))
    tensors = {t.name: t for t in reader.tensors}
    v = tensors["blk.0.attn_v.weight"]
    assert v.tensor_type == gguf.GGMLQuantizationType.F32
    stored = torch.from_numpy(np.array(v.data, dtype=np.float32)).reshape(model.config.num_kv_heads
                                                                        * model.config.head_dim, -1)
    q_rows = model.config.num_heads * model.config.head_dim
    kv_rows = model.config.num_kv_heads * model.config.head_dim
    assert torch.equal(stored, model.layers[0].qkv[q_rows + kv_rows:])


@pytest.mark.slow
@needs_tools
def test_llama_bench_times_generation_on_the_model_file():
    record = llama_tools.llama_bench(registry.fetch("smollm2-135m"), threads=2, tokens=8)
    assert record["n_gen"] == 8 and record["avg_ts"] > 0 and record["build_commit"]
    assert llama_tools.describe(record)["engine"] == "llama.cpp llama-bench"
