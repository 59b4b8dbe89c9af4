"""`labkit bench lowbit` on the real model in quick sizes: the weights modes decode, and a
peer that is not installed makes its row NOT_RUN with the reason, never a miss."""

import pytest

import labkit
from labkit.bench import lowbit
from labkit.bench.suite import Bench, figure
from labkit.eval import eval_text
from conftest import needs_kernels


@pytest.mark.slow
@needs_kernels
def test_lowbit_decode_without_llama_cpp_marks_its_row_not_run(monkeypatch):
    """The real model in quick sizes: every weights mode decodes, and with llama.cpp absent
    (the binding and its own tools) the comparisons with it are NOT_RUN with the reason,
    not misses."""
    monkeypatch.setattr(lowbit, "why_not_llama_cpp", lambda: "llama-cpp-python is not installed")
    monkeypatch.setattr(lowbit.llama_tools, "why_not_llama_tools", lambda: "llama-bench not built")
    model = labkit.load_model()
    quick = Bench(model, model.tokenizer.encode(eval_text())[:2000], reference=None, quick=True)
    figures = lowbit.decode(quick, figure)
    assert [f.passed is None for f in figures] == [False, False, False, True, True]
    assert [f.not_run for f in figures[-2:]] == ["llama-cpp-python is not installed", "llama-bench not built"]
    assert all(f.value > 0 for f in figures)
    assert set(figures[0].details["tokens_per_s"]) == {"f32", "bf16", "gguf", "gguf-int8"}


@pytest.mark.slow
@needs_kernels
def test_lowbit_batch_without_vllm_marks_its_row_not_run(monkeypatch):
    """The batch workload in quick sizes in every mode; with vLLM absent its comparison is
    NOT_RUN with the reason, and the modes' own figures are measured."""
    monkeypatch.setattr(lowbit, "why_not_vllm", lambda: "no vLLM venv at .venv-vllm: make peers")
    model = labkit.load_model()
    quick = Bench(model, model.tokenizer.encode(eval_text())[:2000], reference=None, quick=True)
    figures = lowbit.batch(quick, figure)
    assert [f.passed is None for f in figures] == [False, False, True]
    assert figures[-1].not_run.startswith("no vLLM venv")
    # every request agrees with its solo run, parting only at a near-tie (counted, never hidden)
    same = figures[1]
    assert same.value == same.baseline > 0, same.details["agreement"]
    assert same.details["equal"] + same.details["excused"] == same.value


def test_without_the_c_kernels_every_lowbit_row_is_not_run_with_the_reason(monkeypatch):
    """Every low-precision mode runs on labkit's C kernels and a named mode never falls back
    to float32, so where they do not load each section reports NOT_RUN with why, instead of
    failing (or timing float32 under a low-precision name)."""
    monkeypatch.setattr(lowbit.native, "load", lambda: None)
    monkeypatch.setattr(lowbit.native, "why_unavailable", lambda: "switched off by LABKIT_NATIVE=0")
    quick = Bench(model=None, text_ids=[], quick=True)  # nothing may be run: no model is needed
    figures = [*lowbit.decode(quick, figure), *lowbit.batch(quick, figure), *lowbit.quality(quick, figure)]
    assert len(figures) == len(lowbit.LOW_BITS) + 2
    assert all(f.passed is None and "LABKIT_NATIVE=0" in f.not_run for f in figures)
    assert all("C kernels" in f.not_run for f in figures)
