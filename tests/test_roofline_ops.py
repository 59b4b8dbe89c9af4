"""The op catalogue: closed-form FLOPs/bytes, runnable callables, and a decode step as ops."""

import pytest
import torch

from labkit.models.gguf_file import LlamaConfig
from labkit.sim.roofline import Machine, predict
from labkit.sim.roofline_ops import (bmm, catalogue, copy, decode_step_ops, decode_step_timer,
                                     elementwise, gather, gemm, gemv_from_memory,
                                     measure_catalogue, measure_decode_steps,
                                     predict_decode_step, products_vs_step, rmsnorm,
                                     smollm2_weight_shapes, softmax)

MACHINE = Machine(peak_flops=100e9, bandwidth=10e9, overhead=5e-6, threads=2)
SMOL = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                   num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5,
                   rms_norm_eps=1e-5, max_position_embeddings=8192)


def test_closed_forms():
    assert gemm(2, 3, 4).op.flops == 2 * 2 * 3 * 4
    assert gemm(2, 3, 4).op.bytes == 4 * (2 * 4 + 3 * 4 + 2 * 3)
    assert bmm(5, 2, 3, 4).op.flops == 5 * 2 * 2 * 3 * 4
    assert bmm(5, 2, 3, 4).op.bytes == 4 * 5 * (2 * 4 + 4 * 3 + 2 * 3)
    assert elementwise("add", 10).op.bytes == 4 * 30 and elementwise("add", 10).op.flops == 10
    assert elementwise("silu", 10).op.bytes == 4 * 20
    assert softmax(3, 7).op.bytes == 4 * 2 * 21 and softmax(3, 7).op.flops == 5 * 21
    assert rmsnorm(3, 16).op.bytes == 4 * (2 * 48 + 16)
    assert gather(5, 50, 8).op.flops == 0 and gather(5, 50, 8).op.bytes == 4 * 2 * 40 + 8 * 5
    assert copy(64).op.bytes == 4 * 128


def test_tiny_catalogue_runs_with_consistent_shapes():
    for entry in catalogue("tiny"):
        out = entry.make()()
        assert tuple(out.shape) == entry.out_shape, entry.name
        assert torch.isfinite(out).all(), entry.name


def test_full_catalogue_has_at_least_50_distinct_ops():
    ops = catalogue("full")
    assert len(ops) >= 50
    assert len({o.name for o in ops}) == len(ops)
    assert {"gemm", "gemv", "bmm", "elementwise", "softmax", "rmsnorm", "gather",
            "copy"} <= {o.kind for o in ops}
    shapes = smollm2_weight_shapes()
    assert shapes["qkv"] == (960, 576) and shapes["lm_head"] == (49152, 576)


def test_measure_catalogue_rows():
    rows = measure_catalogue(catalogue("tiny"), MACHINE, repeats=2, warmup=1, llc_bytes=4096)
    assert len(rows) == 10
    for r in rows:
        assert r["measured_s"] > 0 and r["ratio"] == pytest.approx(r["measured_s"] / r["predicted_s"])
        assert 0 < r["best_s"] <= r["measured_s"]
    assert [r["in_cache"] for r in rows] == [True] * 9 + [False]
    assert len(measure_catalogue(catalogue("tiny"), MACHINE, repeats=1, max_bytes=300)) < 10


def test_gemv_from_memory_rotates_through_copies_beyond_the_cache():
    entry = gemv_from_memory(24, 16, "g", llc_bytes=4096)
    assert entry.op.flops == 2 * 24 * 16 and entry.kind == "gemv from memory"
    assert entry.footprint_bytes >= 2 * 4096          # the copies together exceed 2x the cache
    assert entry.footprint_bytes % entry.op.bytes == 0
    call = entry.make()
    outs = [call() for _ in range(int(entry.footprint_bytes // entry.op.bytes) + 1)]
    assert not torch.equal(outs[0], outs[1])          # the next call uses another copy ...
    torch.testing.assert_close(outs[0], outs[-1])     # ... and the rotation comes back round
    assert gemm(1, 24, 16).footprint_bytes == gemm(1, 24, 16).op.bytes


def test_full_catalogue_has_each_weight_from_memory():
    ops = catalogue("full", llc_bytes=32 * 2**20)
    memory = [o for o in ops if o.kind == "gemv from memory"]
    assert len(memory) == 5 and all(o.footprint_bytes > 2 * 32 * 2**20 for o in memory)


def test_decode_step_ops_accounting():
    ops = decode_step_ops(SMOL, batch=1, position=0)
    assert len(ops) == 1 + 30 * 14 + 2
    linear_flops = sum(o.flops for o in ops if o.name.endswith(("qkv", "o_proj", "gate_up",
                                                                 "down", "lm_head")))
    params = 30 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536) + 49152 * 576
    assert linear_flops == 2 * params
    b1 = predict_decode_step(SMOL, 1, 31, MACHINE)
    b8 = predict_decode_step(SMOL, 8, 31, MACHINE)
    assert b8["flops"] > 7.9 * b1["flops"]          # FLOPs grow with batch ...
    assert b8["bytes"] < 1.5 * b1["bytes"]          # ... weights are read once per step
    assert b1["per_op_s"] == pytest.approx(sum(predict(o, MACHINE)
                                               for o in decode_step_ops(SMOL, 1, 31)))
    assert b1["per_op_s"] > b1["whole_step_s"]


@pytest.mark.slow
def test_decode_step_timer_runs_at_fixed_position(model):
    ids = model.tokenizer.encode("The capital of France is")
    step = decode_step_timer(model, 3, ids)
    a, b = step(), step()
    assert a.shape == (3, 1, model.config.vocab_size)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[0], a[2])


@pytest.mark.slow
def test_measure_decode_steps_interleaved(model):
    ids = model.tokenizer.encode("The capital of France is")
    machine = Machine(peak_flops=100e9, bandwidth=10e9, overhead=5e-6, threads=2)
    rows = measure_decode_steps(model, [1, 2], ids, machine, rounds=3, threads=2)
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rounds"] == 3 and r["low_s"] <= r["measured_s"] <= r["high_s"] <= r["max_s"]
        assert r["ratio_whole"] == pytest.approx(r["measured_s"] / r["whole_step_s"])


def test_products_vs_step_reads_a_share_only_inside_the_gap():
    # the stored run: products 33.3 ms, step 26.4 ms, prediction 18.6 ms: no "189% of the gap"
    over = products_vs_step(26.4e-3, 18.6e-3, 33.3e-3)
    assert "took longer than the whole step" in over and "of the gap" not in over
    assert "accounts for 50% of the gap" in products_vs_step(30e-3, 20e-3, 25e-3)
    assert "accounts for 0% of the gap" in products_vs_step(30e-3, 20e-3, 15e-3)
    assert "no gap" in products_vs_step(18e-3, 20e-3, 25e-3)
