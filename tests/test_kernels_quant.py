"""Quantizers against their closed-form error bounds; kernels against the reference path."""

import pytest
import torch

from labkit.kernels.quant import (QuantizedInt4Linear, QuantizedInt8Linear, error_bound,
                                  quantize_int4, quantize_int8)


@pytest.fixture
def weight():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g) * 0.05
    w[3, 7] = 0.9  # an outlier: it sets its row's (int8) or group's (int4) scale
    return w


def test_int8_error_within_half_a_step(weight):
    qw = quantize_int8(weight)
    err = (qw.dequantize() - weight).abs()
    assert (err <= error_bound(qw)[:, None] + 1e-7).all()
    assert qw.q.dtype == torch.int8 and qw.q.abs().max() <= 127


def test_int4_error_within_half_a_step(weight):
    qw = quantize_int4(weight, group_size=64)
    err = (qw.dequantize() - weight).abs().view(96, 4, 64)
    assert (err <= error_bound(qw)[..., None] + 1e-7).all()
    assert int(qw.q.max()) <= 15


def test_int4_group_extremes_are_exact(weight):
    # The group minimum maps to q=0 exactly; the maximum to q=15 (up to float rounding).
    qw = quantize_int4(weight, group_size=64)
    w = weight.view(96, 4, 64)
    d = qw.dequantize().view(96, 4, 64)
    assert torch.allclose(d.amin(-1), w.amin(-1), atol=1e-6)
    assert torch.allclose(d.amax(-1), w.amax(-1), atol=1e-6)


def test_outlier_costs_its_own_row_only(weight):
    qw = quantize_int8(weight)
    err = (qw.dequantize() - weight).abs().amax(dim=1)
    assert err[3] > 3 * err[torch.arange(96) != 3].max()


def test_storage_bytes(weight):
    assert quantize_int8(weight).nbytes == 96 * 256 + 96 * 4
    assert quantize_int4(weight, 64).nbytes == 96 * 256 // 2 + 2 * 96 * 4 * 4


def test_bad_group_size_is_refused(weight):
    with pytest.raises(ValueError, match="multiple"):
        quantize_int4(weight, group_size=48 + 1)


@pytest.mark.parametrize("layer", [QuantizedInt8Linear, QuantizedInt4Linear])
@pytest.mark.parametrize("batch", [1, 7])
def test_kernel_equals_reference_path(weight, layer, batch):
    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(1))
    fast, slow = layer(weight), layer(weight, use_kernel=False)
    assert fast.use_kernel, "this torch should have the CPU weight-only kernel"
    assert torch.allclose(fast(x), slow(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layer", [QuantizedInt8Linear, QuantizedInt4Linear])
def test_quantized_linear_is_close_to_float(weight, layer):
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    exact = x @ weight.t()
    approx = layer(weight)(x)
    rel = (approx - exact).norm() / exact.norm()
    assert rel < (0.02 if layer is QuantizedInt8Linear else 0.2)


def test_kernel_handles_leading_dims(weight):
    x = torch.randn(2, 3, 256)
    assert QuantizedInt8Linear(weight)(x).shape == (2, 3, 96)
    assert QuantizedInt4Linear(weight)(x).shape == (2, 3, 96)
