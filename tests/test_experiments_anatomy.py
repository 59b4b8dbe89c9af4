"""labkit.experiments.anatomy: the GGUF's bytes located one by one, the tensor inventory, the
runtime buffers against their closed form, tied weights, and the cold-start timer."""

import numpy as np
import pytest
import torch

from labkit.experiments import anatomy
from labkit.models import registry
from labkit.models.gguf_file import byte_accounting, open_reader


@pytest.fixture(scope="module")
def gguf_path():
    return registry.fetch("smollm2-135m")


@pytest.fixture(scope="module")
def reader(gguf_path):
    return open_reader(gguf_path)


@pytest.fixture(scope="module")
def accounting(gguf_path, reader):
    return byte_accounting(gguf_path, reader)


def test_layout_tiles_the_file(gguf_path, reader, accounting):
    layout = anatomy.file_layout(gguf_path, reader)
    assert layout["contiguous"]
    assert layout["covered_bytes"] == layout["file_bytes"] == gguf_path.stat().st_size
    parts = anatomy.byte_parts(layout)
    assert sum(p["bytes"] for p in parts) == accounting["file_bytes"]
    coarse = anatomy.summarize_parts(parts)
    # located byte by byte, the parts agree with the accounting that takes padding as a remainder
    assert coarse["tensor data"] == accounting["tensor_bytes"]
    assert coarse["tokenizer"] == accounting["tokenizer_bytes"]
    assert coarse["other metadata"] == accounting["other_metadata_bytes"]
    assert coarse["header"] == accounting["header_bytes"] == 24
    assert coarse["tensor descriptions"] == accounting["tensor_info_bytes"]
    assert coarse["alignment padding"] == accounting["alignment_padding_bytes"]
    by_type = {p["part"].split(": ")[1]: p["bytes"] for p in parts if p["part"].startswith("tensor data")}
    assert by_type == accounting["tensor_bytes_by_type"]


def _write_small_gguf(path):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.answer", 42)
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    writer.add_tensor("a.weight", np.arange(3, dtype=np.float32))  # 12 bytes: padding follows
    writer.add_tensor("b.weight", np.ones((2, 5), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_layout_counts_padding_and_catches_extra_bytes(tmp_path):
    path = tmp_path / "small.gguf"
    _write_small_gguf(path)
    layout = anatomy.file_layout(path)
    parts = {p["part"]: p["bytes"] for p in anatomy.byte_parts(layout)}
    assert layout["contiguous"] and layout["covered_bytes"] == path.stat().st_size
    assert parts["alignment padding"] > 0
    assert parts["tensor data: F32"] == 12 + 40
    assert parts["tokenizer: chat template"] > len("{{ messages }}")
    acc = byte_accounting(path)
    assert parts["alignment padding"] == acc["alignment_padding_bytes"]
    with open(path, "ab") as handle:  # bytes nobody accounts for: the check must fail
        handle.write(b"\x01" * 100)
    assert not anatomy.file_layout(path)["contiguous"]


def test_inventory_totals(reader, accounting, model):
    rows = anatomy.tensor_inventory(reader)
    assert sum(r["bytes"] for r in rows) == accounting["tensor_bytes"]
    assert sum(r["parameters"] for r in rows) == accounting["parameters_stored"] == model.num_parameters()
    assert sum(r["count"] for r in rows) == len(reader.tensors)
    groups = {r["group"]: r for r in rows}
    assert groups["token embedding"]["shape"] == (49152, 576)
    assert groups["attention k projection"]["count"] == 30
    assert groups["attention k projection"]["shape"] == (192, 576)  # 3 KV heads x 64
    assert "LM head" not in groups  # tied: the file has no output.weight
    assert all(r["learned"] for r in rows)


def test_quant_summary_bits(reader):
    rows = {r["quant_type"]: r for r in anatomy.quant_summary(reader)}
    assert rows["Q4_1"]["bits_per_parameter"] == 5.0  # 32 nibbles + fp16 scale + fp16 min
    assert rows["Q8_0"]["bits_per_parameter"] == 8.5  # 32 int8 + fp16 scale
    assert rows["F32"]["bits_per_parameter"] == 32.0
    assert rows["all"]["float32_bytes"] == 4 * rows["all"]["parameters"]
    assert rows["all"]["bfloat16_bytes"] == 2 * rows["all"]["parameters"]


def test_tokenizer_summary(reader):
    info = anatomy.tokenizer_summary(reader)
    assert info["vocab_size"] == 49152 and info["merges"] == 48900
    assert info["bos"] == (1, "<|im_start|>") and info["eos"] == (2, "<|im_end|>")
    assert info["add_bos_token"] is False
    assert info["token_types"]["control"] == len(info["control_tokens"]) == 17


def test_rope_tables_equal_closed_form(model):
    c = model.config
    positions = [0, 1, 7, 100, 1000]
    cos, sin = anatomy.rope_closed_form(positions, c.rope_theta, c.head_dim)
    assert np.abs(model.rope_cos[positions].double().numpy() - cos).max() < 2e-5
    assert np.abs(model.rope_sin[positions].double().numpy() - sin).max() < 2e-5
    # float32 angles lose precision as the position grows: within p * eps at position p
    every = np.arange(model.rope_cos.shape[0])
    cos_all, sin_all = anatomy.rope_closed_form(every, c.rope_theta, c.head_dim)
    err = np.maximum(np.abs(model.rope_cos.double().numpy() - cos_all).max(1),
                     np.abs(model.rope_sin.double().numpy() - sin_all).max(1))
    assert (err <= every * np.finfo(np.float32).eps + 1e-7).all()
    assert err.max() < 1e-3
    # the frequencies: cos(pos * theta^(-2i/d)) for i in the first half of a head
    i, pos = 5, 7
    assert model.rope_cos[pos, i].item() == pytest.approx(np.cos(pos * c.rope_theta ** (-2 * i / c.head_dim)), abs=1e-6)


def test_runtime_buffers(model):
    rows = {r["name"]: r for r in anatomy.runtime_buffers(model, prompt_tokens=10, max_len=32)}
    c = model.config
    assert rows["rope_cos"]["bytes"] == c.max_position_embeddings * c.head_dim * 4
    assert rows["causal mask"]["bytes"] == c.group_size * 10 * 10
    assert rows["KV cache (keys + values)"]["bytes"] == model.new_cache(1, 32).keys.nbytes * 2
    assert not any(r["learned"] for r in rows.values())


def test_tied_weights(model, reference):
    ours = anatomy.tied_weights(model)
    assert [r["names"] for r in ours] == [["embed", "lm_head"]]
    assert model.lm_head.data_ptr() == model.embed.data_ptr()
    theirs = anatomy.tied_weights(reference)
    assert [sorted(r["names"]) for r in theirs] == [["lm_head.weight", "model.embed_tokens.weight"]]
    assert ours[0]["bytes"] == theirs[0]["bytes"] == 49152 * 576 * 4


def test_tied_weights_none_when_untied():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    assert anatomy.tied_weights(net) == []
    net[1].weight = net[0].weight
    assert [r["names"] for r in anatomy.tied_weights(net)] == [["0.weight", "1.weight"]]


def test_first_divergence():
    assert anatomy.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert anatomy.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert anatomy.first_divergence([1, 2], [1, 2, 3]) == 2


def test_tensor_group():
    assert anatomy.tensor_group("blk.12.attn_q.weight") == "attn_q"
    assert anatomy.tensor_group("token_embd.weight") == "token_embd"
    assert anatomy.metadata_category("tokenizer.ggml.merges") == "tokenizer: BPE merges"
    assert anatomy.metadata_category("llama.block_count") == "other metadata"


def test_cold_start_refuses_a_used_cache(tmp_path):
    (tmp_path / "something").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        anatomy.cold_start_stages("smollm2-135m", tmp_path)


@pytest.mark.slow
def test_cold_start_stages(tmp_path):
    stages = anatomy.cold_start_stages("smollm2-135m", tmp_path / "cache", repeats=1)
    for key in anatomy.COLD_STAGES + ("later_call", "warm_load"):
        assert stages[key] > 0, key
    assert stages["warm_cache_was_warm"]
    assert stages["cold_request"] == pytest.approx(sum(stages[k] for k in anatomy.COLD_STAGES))
    assert (tmp_path / "cache" / "models" / "smollm2-135m" / "dequant-f32-v1" / "model.safetensors").exists()
    assert stages["dequantize"] > stages["warm_cache_check"]


def test_plot_stacked_bar():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    bars = anatomy.plot_stacked_bar(ax, [("a", 3e6), ("b", 1e6), ("tiny", 10)], scale=1e6, unit_label="MB")
    assert len(bars) == 3
    assert ax.get_xlim()[1] == pytest.approx(4.00001)
    assert [t.get_text() for t in ax.texts] == ["a", "b"]  # "tiny" is too narrow to label
    plt.close(fig)
