"""labkit.experiments.kernel_timings: the chapter-18 comparisons measure what they say, on a tiny model."""

import json

import pytest
import torch

from conftest import TINY_LOGIT_ERROR, assert_greedy_near, greedy_reference_scores, make_tiny_llama, needs_kernels
from labkit.experiments import kernel_timings as kernels
from labkit.util.timing import Timing
from labkit.kernels import native
from labkit.kernels.packed import is_packed


def test_without_the_c_kernel_there_is_no_c_row(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: None)
    models = kernels.matrix_kernel_models(make_tiny_llama(seed=8))
    assert list(models) == ["F.linear (MKL)", "oneDNN, packed weights"]


@needs_kernels
def test_matrix_kernel_models_are_the_same_weights_three_ways():
    model = make_tiny_llama(seed=8)
    models = kernels.matrix_kernel_models(model)
    plain, onednn, gemv = models.values()
    assert list(models)[-1] == kernels.C_GEMV
    assert plain is model and is_packed(onednn) and is_packed(gemv)
    assert not onednn.lm_head.native_gemv and gemv.lm_head.native_gemv
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    for m in (onednn, gemv):
        torch.testing.assert_close(m(ids), model(ids), rtol=1e-5, atol=1e-4)


def test_random_pool_and_the_gathered_reference():
    config = make_tiny_llama().config
    pool, tables, lengths, q = kernels.random_pool(config, batch=3, longest=20, block_size=4, seed=1)
    assert tables.shape == (3, 5) and len(set(tables.flatten().tolist())) == 15  # own blocks
    out = kernels.gathered_attention(pool, tables, lengths, q)
    # Sequence 0 by hand: its first lengths[0] positions, keys un-transposed.
    n = int(lengths[0])
    keys = pool.keys[0][tables[0]].transpose(-1, -2).transpose(0, 1).reshape(config.num_kv_heads, -1, config.head_dim)[:, :n]
    values = pool.values[0][tables[0]].transpose(0, 1).reshape(config.num_kv_heads, -1, config.head_dim)[:, :n]
    scores = torch.einsum("hgd,hsd->hgs", q[0], keys) / config.head_dim ** 0.5
    torch.testing.assert_close(out[0], torch.einsum("hgs,hsd->hgd", scores.softmax(-1), values),
                               rtol=1e-5, atol=1e-6)


def test_decode_attention_timings_compare_the_two_ways():
    config = make_tiny_llama().config
    result = kernels.decode_attention_timings(config, batch=4, longest=30, repeats=2)
    assert isinstance(result["gather + SDPA"], Timing)
    if native.load() is None:
        assert result["C kernel"].startswith("NOT_RUN")
    else:
        assert isinstance(result["C kernel"], Timing) and result["max_abs_diff"] < kernels.ATTENTION_ERROR


def test_prefill_attention_timings_compare_the_two_ways():
    config = make_tiny_llama().config
    result = kernels.prefill_attention_timings(config, [5, 17, 1, 40], repeats=2)
    assert result["rows"] == 63 and isinstance(result["causal SDPA per prompt"], Timing)
    if native.load() is None:
        assert result["C kernel"].startswith("NOT_RUN")
    else:
        assert isinstance(result["C kernel"], Timing) and result["max_abs_diff"] < kernels.ATTENTION_ERROR


def test_attention_ways_are_timed_in_turns(monkeypatch):
    """Both ways of each attention timing go to one `measure_interleaved` call, so that a slow
    spell of the machine falls on both (the chapter's ratios rest on it)."""
    calls = []
    real = kernels.measure_interleaved

    def spy(runners, **kw):
        calls.append(list(runners))
        return real(runners, **kw)

    monkeypatch.setattr(kernels, "measure_interleaved", spy)
    config = make_tiny_llama().config
    decode = kernels.decode_attention_timings(config, batch=2, longest=8, repeats=2)
    prefill = kernels.prefill_attention_timings(config, [5, 3], repeats=2)
    c_kernel = ["C kernel"] if native.load() is not None else []
    assert calls == [["gather + SDPA"] + c_kernel, ["causal SDPA per prompt"] + c_kernel]
    assert len(decode["gather + SDPA"].samples) == len(prefill["causal SDPA per prompt"].samples) == 2


def test_bench_table_reads_a_summary(tmp_path):
    summary = {"figures": [
        {"name": "decode", "what": "w", "value": 30.0, "baseline": 15.0, "unit": "tokens/s", "ratio": 2.0,
         "target": ">= 2", "passed": True, "details": {}},
        {"name": "batch", "what": "v", "value": 100.0, "baseline": 50.0, "unit": "tokens/s", "ratio": 2.0,
         "target": ">= 3", "passed": False, "details": {}}],
        "quick": False, "threads": 2, "timestamp": "2026-11-30T12:00:00+0000",
        "environment": {"git": {"revision": "abc1234def", "dirty": False}}}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    table, facts = kernels.bench_table(path)
    assert table["met"].tolist() == ["yes", "NO"] and table["ratio"].tolist() == [2.0, 2.0]
    assert facts["revision"] == "abc1234def" and facts["threads"] == 2 and facts["quick"] is False
    with pytest.raises(FileNotFoundError):
        kernels.bench_table(tmp_path / "missing.json")


def test_matrix_bytes_counts_each_layer_and_the_head():
    model = make_tiny_llama(seed=9)  # hidden 32, 2 layers, 4 heads of 8, 2 KV heads, MLP 64
    per_layer = (32 + 2 * 16) * 32 + 32 * 32 + 2 * 64 * 32 + 32 * 64  # qkv, o, gate_up, down
    assert kernels.matrix_bytes(model) == 4 * (2 * per_layer + 97 * 32)


def test_kernel_steps_time_every_kernel_and_agree_on_tokens():
    model = make_tiny_llama(seed=10)
    timings, tokens = kernels.kernel_steps(model, [5, 6, 7], new_tokens=4, repeats=2)
    assert list(timings) == list(kernels.matrix_kernel_models(model))
    assert all(isinstance(t, Timing) for t in timings.values())
    # each kernel sums in its own order: the tokens agree up to the near-tie rule
    want, scores = greedy_reference_scores(model, [5, 6, 7], 4)
    assert_greedy_near([want] * len(tokens), list(tokens.values()), [scores] * len(tokens), TINY_LOGIT_ERROR,
                       what="every matrix kernel against the plain loop")
