"""configuration_line names what runs, read from the objects: each check holds the line to
what the engine or model actually calls (kernel calls counted during a real step) or to a
setting changed on purpose. The reference costs are timed interleaved (call order recorded),
on engines that compute every prompt token each time (the engine's own token count)."""

import pytest
import torch

from conftest import needs_kernels
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.experiments.reference_costs import (CostSample, configuration_line, cost_table_rows, matmul_path,
                                              measure_reference_costs, reference_engines,
                                              summarize_costs, timer_for)
from labkit.kernels import native
from labkit.kernels.packed import pack_model
from labkit.sampling import SamplingParams
from labkit.util.environment import cpu_info

PROMPT = "The capital of France is"


def count_calls(monkeypatch, name: str) -> list[int]:
    """Count the calls of `native.<name>` from here on."""
    calls, real = [], getattr(native, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(native, name, counted)
    return calls


@needs_kernels
@pytest.mark.parametrize("fast_kernels", [True, False])
def test_line_names_the_kernels_a_decode_step_calls(model, monkeypatch, fast_kernels):
    engine = LLMEngine(model, EngineConfig(fast_kernels=fast_kernels, kv_cache_tokens=256))
    line = configuration_line(engine)
    gemv, attention = count_calls(monkeypatch, "gemv"), count_calls(monkeypatch, "paged_attention")
    engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3))
    assert ("labkit C gemv" in line) == bool(gemv)
    assert ("labkit C paged attention" in line) == bool(attention)
    assert ("PyTorch F.linear (model as loaded)" in line) == (not gemv)


@needs_kernels
@pytest.mark.parametrize("weights, words", [
    ("f32", "float32, oneDNN-packed + labkit C gemv"),
    ("bf16", "bfloat16 rows, labkit C kernel"),
    ("gguf", "Q4_1 blocks in place"),
    ("gguf-int8", "activations rounded to int8 blocks"),
])
def test_each_weight_mode_has_its_own_line(model, weights, words):
    line = configuration_line(EngineConfig(weights=weights), model)
    assert line.startswith("smollm2-135m; ") and f"engine weights {weights}: " in line
    assert words in line
    others = {"f32": "oneDNN-packed + labkit C gemv", "bf16": "bfloat16 rows", "gguf": "Q4_1 blocks",
              "gguf-int8": "int8"}
    assert not any(w in line for mode, w in others.items() if mode != weights and not
                   (weights == "gguf-int8" and mode == "gguf"))


def test_a_changed_config_changes_the_line(model):
    plain = configuration_line(EngineConfig(fast_kernels=False), model)
    assert "KV float32 in blocks of 16" in plain
    changed = configuration_line(EngineConfig(fast_kernels=False, kv_dtype="bf16", block_size=32), model)
    assert "KV bfloat16 in blocks of 32" in changed and changed != plain


def test_a_wrong_mode_name_fails(model):
    with pytest.raises(ValueError, match="weights must be one of"):
        configuration_line(EngineConfig(weights="q8"), model)
    with pytest.raises(ValueError, match="needs the model"):
        configuration_line(EngineConfig())


def test_threads_and_cpu_come_from_the_process(model):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = configuration_line(model)
        torch.set_num_threads(2)
        two = configuration_line(model)
    finally:
        torch.set_num_threads(before)
    assert "; 1 torch thread; " in one and "; 2 torch threads; " in two
    assert "; 1 and 2 torch threads; " in configuration_line(model, threads=(1, 2))
    with pytest.raises(ValueError, match="positive integers"):
        configuration_line(model, threads=0)
    assert one.endswith(cpu_info()["model"])


@needs_kernels
def test_bare_models_name_their_own_path(model, reference):
    assert "float32, PyTorch F.linear (model as loaded); SDPA causal" in configuration_line(model)
    assert matmul_path(pack_model(model, native_gemv=False)) == "float32, oneDNN-packed"
    assert matmul_path(pack_model(model)) == "float32, oneDNN-packed + labkit C gemv"
    line = configuration_line(reference)
    assert "transformers float32" in line and f"attention {reference.config._attn_implementation}" in line
    with pytest.raises(ValueError, match="neither"):
        configuration_line(object())


class RecordingTimer:
    """Records which subject ran, on how many threads, and returns made-up times."""

    def __init__(self, label, calls):
        self.label, self.calls = label, calls

    def prefill(self, ids):
        self.calls.append(("prefill", self.label, torch.get_num_threads(), len(ids)))

    def decode(self, ids, steps):
        self.calls.append(("decode", self.label, torch.get_num_threads(), len(ids)))
        return [0.01] * steps


class Shape:
    class config:
        vocab_size = 50


def test_configurations_are_interleaved_round_by_round():
    calls = []
    subjects = {"a": Shape(), "b": Shape()}
    timers = iter([RecordingTimer("a", calls), RecordingTimer("b", calls)])
    samples = measure_reference_costs(subjects, {"a": (1, 2), "b": (2,)}, lengths=(4, 8), context=3,
                                      steps=2, rounds=3, timer=lambda subject: next(timers))
    pairs = (("a", 1), ("a", 2), ("b", 2))
    warm = [(kind, label, threads, n) for label, threads in pairs
            for kind, n in (("decode", 3), ("prefill", 4))]
    one_round = [(kind, label, threads, n) for label, threads in pairs
                 for kind, n in (("decode", 3), ("prefill", 4), ("prefill", 8))]
    assert calls == warm + one_round * 3  # the untimed warm-up round, then three timed rounds
    assert [(s.label, s.threads, s.round) for s in samples] == [
        (label, threads, r) for r in range(3) for label, threads in (("a", 1), ("a", 2), ("b", 2))]
    with pytest.raises(ValueError, match="at least 3 rounds"):
        measure_reference_costs(subjects, {"a": (1,), "b": (1,)}, rounds=2, timer=lambda s: None)


def test_summary_is_the_median_and_range_over_rounds():
    samples = [CostSample("x", 2, r, d, {128: p}) for r, (d, p) in
               enumerate([(0.030, 0.002), (0.010, 0.001), (0.020, 0.004)])]
    (row,) = summarize_costs(samples)
    assert row["decode_step_ms"] == pytest.approx(20.0)
    assert (row["decode_step_ms_low"], row["decode_step_ms_high"]) == pytest.approx((10.0, 30.0))
    assert row["prefill_128_ms_per_token"] == pytest.approx(2.0)
    (cells,) = cost_table_rows([row])
    assert cells["decode step (ms), median (range)"] == "20.0 (10.0-30.0)"
    assert cells["prefill of 128 tokens (ms a token), median (range)"] == "2.00 (1.00-4.00)"


def test_engine_timer_computes_every_prompt_token_each_time(model):
    engine = reference_engines(model, 32)["engine, fast_kernels=False"]
    timer = timer_for(engine)
    ids = list(range(100, 120))
    for _ in range(2):  # the same prompt again: no prefix cache may shorten it
        before = engine.tokens_computed
        timer.prefill(ids)
        assert engine.tokens_computed - before == len(ids)
    before = engine.tokens_computed
    assert len(timer.decode(ids[:8], 3)) == 3
    assert engine.tokens_computed - before == 8 + 3
    assert not engine.requests  # every timed request released


def test_plain_and_transformers_timers_step_their_models(model, reference):
    for subject in (model, reference):
        timer = timer_for(subject)
        timer.prefill(list(range(100, 110)))
        times = timer.decode(list(range(100, 108)), 3)
        assert len(times) == 3 and all(t > 0 for t in times)
    with pytest.raises(ValueError, match="cannot time"):
        timer_for(object())


def test_an_engine_that_cannot_run_is_left_out_with_its_reason(monkeypatch):
    import labkit.experiments.reference_costs as costs

    def engine(model, config):  # the C kernels do not build: every mode but float32 refuses
        if config.weights != "f32":
            raise ValueError(f"weights={config.weights!r} needs labkit's C kernels")
        return config

    monkeypatch.setattr(costs, "LLMEngine", engine)
    skipped = {}
    engines = costs.reference_engines(object(), 32, skipped)
    assert set(engines) == {"engine, fast_kernels=False", "engine f32"}
    assert set(skipped) == {"engine bf16", "engine gguf", "engine gguf-int8"}
    assert all("C kernels" in reason for reason in skipped.values())
    with pytest.raises(ValueError, match="C kernels"):
        costs.reference_engines(object(), 32)
