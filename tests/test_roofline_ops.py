"""The op catalogue: closed-form FLOPs/bytes, runnable callables, and a decode step as ops."""

import pytest
import torch

from labkit.models.gguf_file import LlamaConfig
from labkit.sim.roofline import Machine, predict
from labkit.sim.roofline_ops import (bmm, catalogue, copy, decode_step_ops, decode_step_timer,
                                     elementwise, gather, gemm, gemv_from_memory, jump_reading,
                                     largest_step_jump, measure_catalogue, measure_decode_steps,
                                     measure_step_products, predict_decode_step,
                                     products_vs_step, rmsnorm, smollm2_weight_shapes, softmax,
                                     residence, step_products_timer, from_memory_reading)
from labkit.util.machine import memory_read_buffer_bytes

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
    rows = measure_catalogue(catalogue("tiny"), MACHINE, repeats=2, warmup=1, llc_bytes=4096,
                             memory_bytes=4 * 4096)
    assert len(rows) == 10
    for r in rows:
        assert r["measured_s"] > 0 and r["ratio"] == pytest.approx(r["measured_s"] / r["predicted_s"])
        assert 0 < r["best_s"] <= r["measured_s"]
    assert [r["in_cache"] for r in rows] == [True] * 9 + [False]
    assert [r["residence"] for r in rows] == ["cache"] * 9 + ["memory"]
    assert len(measure_catalogue(catalogue("tiny"), MACHINE, repeats=1, max_bytes=300)) < 10


def test_gemv_from_memory_rotates_through_copies_beyond_the_cache():
    entry = gemv_from_memory(24, 16, "g", llc_bytes=4096, memory_bytes=4 * 4096)
    assert entry.op.flops == 2 * 24 * 16 and entry.kind == "gemv from memory"
    assert entry.footprint_bytes >= 4 * 4096          # the copies reach the memory rule
    assert residence(entry.footprint_bytes, 4096, 4 * 4096) == "memory"
    assert entry.footprint_bytes % entry.op.bytes == 0
    call = entry.make()
    outs = [call() for _ in range(int(entry.footprint_bytes // entry.op.bytes) + 1)]
    assert not torch.equal(outs[0], outs[1])          # the next call uses another copy ...
    torch.testing.assert_close(outs[0], outs[-1])     # ... and the rotation comes back round
    assert gemm(1, 24, 16).footprint_bytes == gemm(1, 24, 16).op.bytes


def test_full_catalogue_has_each_weight_from_memory():
    ops = catalogue("full", llc_bytes=32 * 2**20)
    memory = [o for o in ops if o.kind == "gemv from memory"]
    # one definition: the rotation reaches the book's rule for a read from memory
    rule = memory_read_buffer_bytes(32 * 2**20)
    assert len(memory) == 5 and all(o.footprint_bytes >= rule for o in memory)
    assert all(residence(o.footprint_bytes, 32 * 2**20) == "memory" for o in memory)


def test_residence_has_one_definition_of_the_cache_and_of_memory():
    llc = 300 * 2**20
    rule = memory_read_buffer_bytes(llc)
    assert residence(llc, llc) == "cache"                      # fits: in the cache
    assert residence(llc + 1, llc) == "partly cached"          # over once the cache ...
    assert residence(2 * llc, llc) == "partly cached"          # ... and twice: not yet memory
    assert residence(rule, llc) == "memory"


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


class _CountingWeight:
    """A weight slot held as a module (as labkit's packed and quantized kernels are): counts
    its calls and the rows it is given."""

    def __init__(self, out: int, k: int, calls: list):
        self.shape, self.calls = (out, k), calls
        self.weight = torch.randn(out, k)

    def __call__(self, x):
        self.calls.append(tuple(x.shape))
        return torch.nn.functional.linear(x, self.weight)


def _fake_model(layers=3, hidden=8, calls=None):
    from types import SimpleNamespace
    calls = [] if calls is None else calls
    shapes = {"qkv": (3 * hidden, hidden), "o_proj": (hidden, hidden),
              "gate_up": (4 * hidden, hidden), "down": (hidden, 2 * hidden)}
    blocks = [SimpleNamespace(**{n: _CountingWeight(*shape, calls) for n, shape in shapes.items()})
              for _ in range(layers)]
    return SimpleNamespace(layers=blocks, lm_head=torch.randn(40, hidden)), calls


def test_step_products_run_every_matrix_of_the_step_once_at_the_batch():
    fake, calls = _fake_model()
    out = step_products_timer(fake, 5)()
    # 4 matrices a layer, each once, each with [batch, 1, its input width]; then the LM head
    assert calls == [(5, 1, 8), (5, 1, 8), (5, 1, 8), (5, 1, 16)] * 3
    assert out.shape == (5, 1, 40)
    rows = measure_step_products(fake, [1, 2], rounds=3, threads=1)
    per_layer = 3 * 8 * 8 + 8 * 8 + 4 * 8 * 8 + 8 * 16
    assert [r["batch"] for r in rows] == [1, 2]
    assert rows[0]["weight_bytes"] == 4 * (3 * per_layer + 40 * 8)
    for r in rows:
        assert r["low_s"] <= r["products_s"] <= r["high_s"]
        assert r["weight_gbs"] == pytest.approx(r["weight_bytes"] / r["products_s"] / 1e9)


def test_largest_step_jump_says_who_carries_it():
    steps = [{"batch": b, "measured_s": t} for b, t in ((1, .026), (2, .027), (4, .042), (8, .050))]
    products = [{"batch": b, "products_s": t} for b, t in ((1, .019), (2, .0195), (4, .033), (8, .038))]
    jump = largest_step_jump(steps, products)
    # 2 -> 4 is the largest ratio (1.56x; 4 -> 8 is 1.19x); the products carry 90% of it
    assert (jump["from_batch"], jump["to_batch"]) == (2, 4)
    assert jump["products_share"] == pytest.approx((.033 - .0195) / (.042 - .027))
    assert "the jump is the products'" in jump_reading(jump)
    flat = [{"batch": r["batch"], "products_s": .019} for r in products]
    rest = jump_reading(largest_step_jump(steps, flat))
    assert "only 0% of the step's growth" in rest and "in the rest of the step" in rest
    falling = [{"batch": b, "measured_s": t} for b, t in ((1, .03), (2, .02))]
    assert "did not grow" in jump_reading(largest_step_jump(falling, products[:2]))
    with pytest.raises(ValueError):
        largest_step_jump(steps[:1], products)


def test_from_memory_reading_names_ops_that_beat_the_memory_ceiling():
    def row(name, ratio, residence="memory", nbytes=113e6):
        return {"name": name, "ratio": ratio, "residence": residence, "bytes": nbytes,
                "measured_s": nbytes / 30e9 * ratio, "footprint_bytes": 1e9}
    held = from_memory_reading([row("qkv", 1.20), row("lm_head", 1.05), row("x", 0.2, "cache")],
                               30e9, 300 * 2**20)
    assert held.startswith("None of the 2 ops") and "lm_head, took 1.05×" in held
    beat = from_memory_reading([row("qkv", 1.20), row("lm_head", 0.95)], 30e9, 300 * 2**20)
    assert beat.startswith("1 of the 2 ops") and "lm_head, took 0.95×" in beat
    assert "partly cache-resident" in beat and "31.6 GB/s" in beat
    assert "No op" in from_memory_reading([row("x", 0.2, "cache")], 30e9, 300 * 2**20)
