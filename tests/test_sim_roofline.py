"""The roofline model: closed-form op accounting and the max() of the ceilings."""

import pytest
import torch

from labkit.sim.roofline import (Machine, bound, elementwise_op, matmul_op, measure_machine,
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


@pytest.mark.slow
def test_measured_ceilings_are_plausible():
    m = measure_machine(gemm_size=512, stream_mbytes=64)
    assert 1e9 < m.peak_flops < 1e14
    assert 1e8 < m.bandwidth < 1e13
    assert 0 < m.overhead < 1e-3
    # A large op's prediction is within an order of magnitude of its own ceiling measurement.
    op = matmul_op(512, 512, 512)
    assert predict(op, m) >= op.flops / m.peak_flops
