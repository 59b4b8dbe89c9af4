"""Which kernels run here (`labkit.kernels.dispatch`), and the bfloat16 GEMM through oneDNN
that it chooses where the CPU multiplies bfloat16 natively: correct on any CPU."""

import pytest
import torch
import torch.nn.functional as F

from conftest import needs_kernels
from labkit.kernels import dispatch, native
from labkit.kernels.bf16_weights import OneDNNBF16Linear, bf16_model
from labkit.kernels.gguf_blocks import round_to_bf16


def onednn_bf16_refusal() -> str | None:
    """Why torch's oneDNN bfloat16 linear refuses this CPU (it needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT: an AVX2 machine, or oneDNN held to AVX2), or None where it runs."""
    if not torch.backends.mkldnn.is_available():
        return "no oneDNN in this torch"
    try:
        OneDNNBF16Linear(torch.ones(4, 32))(torch.ones(1, 32))
    except RuntimeError as error:
        if "bf16 path needs" in str(error):
            return str(error)
        raise
    return None


ONEDNN_BF16_REFUSAL = onednn_bf16_refusal()  # probed once, at collection
needs_onednn_bf16 = pytest.mark.skipif(ONEDNN_BF16_REFUSAL is not None,
                                       reason=f"oneDNN's bfloat16 linear does not run here: {ONEDNN_BF16_REFUSAL}")


def test_the_report_names_what_runs(monkeypatch):
    report = dispatch.dispatch_report()
    assert report["c_kernels"]["loaded"] == (native.load() is not None)
    assert report["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    line = dispatch.dispatch_line(report)
    assert line.startswith("Kernels: ") and report["aten_cpu_capability"] in line
    off = {**report, "c_kernels": {"loaded": False, "why_not": "switched off by LABKIT_NATIVE=0",
                                   "flags": [], "features": []}}
    assert "not in use (switched off by LABKIT_NATIVE=0)" in dispatch.dispatch_line(off)


@needs_kernels
def test_the_build_reports_the_paths_it_compiled(tmp_path):
    portable = native.compile_library(tmp_path, ("-O2", "-march=x86-64", "-fopenmp", "-shared", "-fPIC"))
    assert native.build_features(portable) == []  # the plain C loops, nothing else
    haswell = native.compile_library(tmp_path, ("-O2", "-march=haswell", "-fopenmp", "-shared", "-fPIC"))
    assert native.build_features(haswell) == ["AVX2+FMA intrinsics", "F16C conversions"]


def test_the_arch_can_be_chosen(monkeypatch):
    monkeypatch.setenv(native.ARCH_ENV, "x86-64")
    assert "-march=x86-64" in native.default_flags() and "-march=native" not in native.default_flags()
    monkeypatch.setenv(native.ARCH_ENV, "x86-64; rm -rf /")
    with pytest.raises(RuntimeError, match="-march"):
        native.default_flags()


def test_the_bf16_gemm_choice_follows_the_cpu_and_the_caps(monkeypatch):
    monkeypatch.delenv(dispatch.FORCE_BF16_GEMM_ENV, raising=False)
    for name in dispatch.ONEDNN_ISA_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(dispatch, "isa_flags", lambda: ["avx2", "fma"])
    assert not dispatch.bf16_gemm_native()  # an AVX2 CPU: oneDNN would emulate bfloat16
    monkeypatch.setattr(dispatch, "isa_flags", lambda: ["avx2", "avx512f", "amx_bf16"])
    assert dispatch.bf16_gemm_native() == torch.backends.mkldnn.is_available()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN held below its bfloat16 code
    assert not dispatch.bf16_gemm_native()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert dispatch.bf16_gemm_native() == torch.backends.mkldnn.is_available()
    monkeypatch.setenv(dispatch.FORCE_BF16_GEMM_ENV, "f32")
    assert not dispatch.bf16_gemm_native()
    monkeypatch.setenv(dispatch.FORCE_BF16_GEMM_ENV, "avx")
    with pytest.raises(ValueError):
        dispatch.bf16_gemm_native()


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [5, 64])
def test_onednn_bf16_gemm_is_the_rounded_product_rounded_once_more(rows):
    """Whatever ISA oneDNN picks (AMX, AVX512-BF16, emulation on AVX-512 without it), its bfloat16 GEMM
    multiplies the rounded operands with float32 sums and rounds the product to bfloat16:
    within half a bfloat16 step (at most 2^-8 of the value) of the float64 product of the rounded
    values."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 320, generator=g), torch.randn(rows, 320, generator=g)
    want = F.linear(round_to_bf16(x).double(), round_to_bf16(w).double())
    got = OneDNNBF16Linear(w)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    assert ((got.double() - want).abs() <= 2.0 ** -8 * want.abs() + 1e-4).all()
    assert (got.double() - F.linear(x, w).double()).abs().max() > 1e-3  # the rounding is there


@needs_onednn_bf16
def test_a_prefill_on_onednn_bf16_is_as_close_to_float32_as_the_float32_gemm_path(model):
    """The bf16 model's prefill (every product beyond a few rows) through oneDNN's bfloat16
    GEMM and through its float32 GEMM on the rounded values: each as far from float32 as
    the other (bfloat16 activations make both paths chaotic at their own scale: see
    test_kernels_bf16), and the same greedy choice wherever float32's margin is wide."""
    ids = torch.tensor([model.tokenizer.encode("The capital of France is a city that has long been known for")])
    f32 = model(ids)[0]
    onednn = bf16_model(model, onednn_bf16=True)(ids)[0]
    emulated = bf16_model(model, onednn_bf16=False)(ids)[0]
    apart, apart_emulated = (onednn - f32).abs().mean(), (emulated - f32).abs().mean()
    assert 1e-2 < apart < 1.5 * apart_emulated and apart_emulated < 1.5 * apart
    two = f32.topk(2, dim=-1).values
    wide = (two[:, 0] - two[:, 1]) > 1.0  # far beyond what bfloat16 moves a logit by
    assert wide.sum() > 5 and torch.equal(onednn.argmax(-1)[wide], f32.argmax(-1)[wide])
