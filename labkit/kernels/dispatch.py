"""Which kernels run on this machine, chosen at run time and reported.

The same labkit runs on an AVX2 laptop and on a Xeon with AVX-512 and AMX. Three things
decide which code does the arithmetic, and a chapter whose figures depend on them prints
:func:`dispatch_line`:

- labkit's own C kernels (`labkit.kernels.native`): compiled on the reader's machine with
  ``-march=native``, so the compiler picks the vector paths the CPU has (AVX2 + FMA
  intrinsics, 16-lane vectors with AVX-512); :func:`native.build_features` asks the built
  library which it compiled. ``LABKIT_NATIVE=0`` switches them off, ``LABKIT_NATIVE_ARCH``
  builds for another -march (``x86-64``: the plain loops).
- PyTorch's own CPU kernels (ATen), which dispatch on the CPU at run time
  (``torch.backends.cpu.get_cpu_capability()``: DEFAULT, AVX2, AVX512 ...).
- oneDNN, the library PyTorch multiplies packed matrices with, which picks AMX, AVX-512 or
  AVX2 code itself. Where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX) and
  oneDNN is not capped below that (``ONEDNN_MAX_CPU_ISA``), a bfloat16 GEMM through it is
  several times a float32 one; elsewhere oneDNN emulates bfloat16 and gains nothing, so
  labkit multiplies the rounded values in float32 instead (:func:`bf16_gemm_native`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from labkit.kernels import native
from labkit.util.machine import isa_flags

ONEDNN_ISA_ENVS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
FORCE_BF16_GEMM_ENV = "LABKIT_BF16_GEMM"  # "onednn" or "f32": override the choice (tests, the matrix)


def onednn_isa_cap() -> str | None:
    """oneDNN's ISA ceiling as the environment sets it (None: no cap)."""
    for name in ONEDNN_ISA_ENVS:
        value = os.environ.get(name, "").strip()
        if value:
            return value.upper()
    return None


def bf16_gemm_native() -> bool:
    """Whether a bfloat16 GEMM through oneDNN runs on native bfloat16 instructions here:
    the CPU has AVX512-BF16 or AMX-BF16, oneDNN is in this torch, and no ISA cap forbids
    them. ``LABKIT_BF16_GEMM=onednn`` or ``=f32`` overrides the answer."""
    forced = os.environ.get(FORCE_BF16_GEMM_ENV, "").strip().lower()
    if forced in ("onednn", "f32"):
        return forced == "onednn"
    if forced:
        raise ValueError(f"{FORCE_BF16_GEMM_ENV}={forced!r}: use 'onednn' or 'f32'")
    if not torch.backends.mkldnn.is_available() or not set(isa_flags()) & {"avx512_bf16", "amx_bf16"}:
        return False
    cap = onednn_isa_cap()
    return cap is None or cap == "ALL" or any(key in cap for key in ("BF16", "AMX", "AVX10"))


def dispatch_report() -> dict[str, Any]:
    """What runs here: the C kernels (built or not, flags, compiled paths), ATen's CPU
    capability, oneDNN (available, ISA cap, native bfloat16 GEMM, AMX)."""
    lib = native.load()
    report: dict[str, Any] = {
        "c_kernels": {
            "loaded": lib is not None,
            "why_not": native.why_unavailable(),
            "flags": list(native.build_flags() or ()),
            "features": native.build_features(lib) if lib is not None else [],
            # float32 products of up to this many rows take the C gemv (0 where it is not built)
            "gemv_max_rows": native.gemv_max_rows() if lib is not None else 0,
        },
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn": {
            "available": bool(torch.backends.mkldnn.is_available()),
            "isa_cap": onednn_isa_cap(),
            "bf16_gemm_native": bf16_gemm_native(),
            "amx": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
        },
    }
    return report


def dispatch_line(report: dict[str, Any] | None = None) -> str:
    """One sentence: 'Kernels: labkit's C kernels built here (-march=native: AVX2+FMA
    intrinsics, 16-lane (AVX-512) attention vectors); PyTorch's on AVX512; oneDNN's
    bfloat16 GEMM native (AMX).'"""
    report = report or dispatch_report()
    c = report["c_kernels"]
    if c["loaded"]:
        march = next((f[len("-march="):] for f in c["flags"] if f.startswith("-march=")), "?")
        paths = ", ".join(c["features"]) or "plain C loops"
        kernels = f"labkit's C kernels built here (-march={march}: {paths})"
    else:
        kernels = f"labkit's C kernels not in use ({c['why_not']}), library kernels instead"
    onednn = report["onednn"]
    if not onednn["available"]:
        bf16 = "no oneDNN in this torch"
    elif onednn["bf16_gemm_native"]:
        bf16 = "oneDNN's bfloat16 GEMM native" + (" (AMX)" if onednn["amx"] else " (AVX512-BF16)")
    else:
        bf16 = "oneDNN without native bfloat16 (bfloat16 products run in float32)"
    cap = f", oneDNN capped at {onednn['isa_cap']}" if onednn["isa_cap"] else ""
    return f"Kernels: {kernels}; PyTorch's on {report['aten_cpu_capability']}; {bf16}{cap}."


__all__ = ["bf16_gemm_native", "dispatch_line", "dispatch_report", "onednn_isa_cap", "FORCE_BF16_GEMM_ENV"]
