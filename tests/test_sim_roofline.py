"""The roofline model: closed-form op accounting and the max() of the ceilings."""

import pytest
import torch

from labkit.sim.roofline import (Machine, bound, elementwise_op, last_level_cache_bytes,
                                 matmul_op, measure_ceilings, measure_machine, parse_cache_size,
                                 predict)

MACHINE = Machine(peak_flops=100e9, bandwidth=10e9, overhead=5e-6, threads=2)


def test_matmul_accounting():
    op = matmul_op(2, 3, 4)
    assert op.flops == 2 * 2 * 3 * 4
    assert op.bytes == 4 * (2 * 4 + 4 * 3 + 2 * 3)
    assert matmul_op(2, 3, 4, torch.bfloat16).bytes == op.bytes / 2


def test_gemv_is_memory_bound_and_large_gemm_compute_bound():
    gemv = matmul_op(1, 49152, 576)  # one token through SmolLM2's LM head
    gemm = matmul_op(2048, 2048, 2048)
    assert bound(gemv, MACHINE) == "memory"
    assert bound(gemm, MACHINE) == "compute"
    assert gemv.intensity < MACHINE.ridge_point < gemm.intensity


def test_tiny_op_is_overhead_bound():
    assert bound(elementwise_op(8), MACHINE) == "overhead"


def test_prediction_is_overhead_plus_the_larger_ceiling():
    op = matmul_op(1, 4096, 4096)
    expected = 5e-6 + max(op.flops / 100e9, op.bytes / 10e9)
    assert predict(op, MACHINE) == pytest.approx(expected)
    assert predict(op, MACHINE) == pytest.approx(5e-6 + op.bytes / 10e9)


def test_cache_sizes():
    assert parse_cache_size("32768K") == 32 * 2**20
    assert parse_cache_size(" 32 MiB ") == 32 * 2**20
    assert parse_cache_size("512 KiB") == 512 * 2**10
    assert parse_cache_size("2M") == 2 * 2**20
    with pytest.raises(ValueError):
        parse_cache_size("lots")
    assert 2**16 <= last_level_cache_bytes() <= 2**34


def test_ceilings_are_best_runs():
    m, rows = measure_ceilings(1, gemm_size=128, stream_mbytes=4, repeats=3)
    assert {r["ceiling"] for r in rows} == {"peak", "bandwidth", "overhead"}
    assert m.peak_flops / 1e9 == max(r["value"] for r in rows if r["ceiling"] == "peak")
    assert m.bandwidth / 1e9 == max(r["value"] for r in rows if r["ceiling"] == "bandwidth")
    assert sum(r["used"] for r in rows) == 3 and m.threads == 1 and m.device == "cpu"


@pytest.mark.slow
def test_measured_ceilings_are_plausible():
    m = measure_machine(gemm_size=512, stream_mbytes=64)
    assert 1e9 < m.peak_flops < 1e14
    assert 1e8 < m.bandwidth < 1e13
    assert 0 < m.overhead < 1e-3
    # A large op's prediction is within an order of magnitude of its own ceiling measurement.
    op = matmul_op(512, 512, 512)
    assert predict(op, m) >= op.flops / m.peak_flops


def test_relation_word():
    from labkit.sim.roofline import relation_word
    assert relation_word(0.5) == "less than"
    assert relation_word(1.05) == "about the same as"
    assert relation_word(1.5) == "more than"
