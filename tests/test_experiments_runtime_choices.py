"""Chapter 24's runtimes: each computes the same function as the baseline (a tiny random
Llama's greedy tokens, and its logits within rounding), and the comparison of two runs
finds the first differing step and the margins there."""

import pytest
import torch

from conftest import make_tiny_llama, needs_kernels
from labkit.engine.backends import ReferenceBackend
from labkit.experiments import runtime_choices as rc
from labkit.experiments.path_agreement import BF16_LOGIT_ERROR, LOGIT_ERROR
from labkit.kernels import gguf_blocks, native
from labkit.models.llama import grouped_attention
from labkit.util.near_tie import flip_tolerance

VOCAB = 97
NEW = 10


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(vocab=VOCAB, layers=3)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 23, 1, 40, 17)]


@pytest.fixture(scope="module")
def baseline(tiny, prompts):
    return rc.contiguous_runtime(tiny, prompts, NEW)


def test_baseline_is_plain_greedy(tiny, prompts, baseline):
    for prompt, run in zip(prompts, baseline):
        ids = list(prompt)
        for _ in range(NEW):
            ids.append(int(tiny(torch.tensor([ids]))[0, -1].argmax()))
        assert run.tokens == ids[len(prompt):]
        assert [t for t, _ in run.top[0]][:1] == run.tokens[:1] and len(run.top[0]) == rc.TOP


@pytest.mark.parametrize("name", ["chunk 1", "chunk 7", "math", "static", "padded", "engine",
                                  "engine C attention", "engine together"])
def test_every_runtime_computes_the_baseline_function(tiny, prompts, baseline, name):
    runs = {
        "chunk 1": lambda: rc.contiguous_runtime(tiny, prompts, NEW, chunk=1),
        "chunk 7": lambda: rc.contiguous_runtime(tiny, prompts, NEW, chunk=7),
        "math": lambda: rc.contiguous_runtime(tiny, prompts, NEW, cache_type=rc.MathAttentionCache),
        "static": lambda: rc.contiguous_runtime(tiny, prompts, NEW, cache_type=rc.StaticShapeCache),
        "padded": lambda: rc.padded_batch_runtime(tiny, prompts, NEW),
        "engine": lambda: rc.engine_runtime(tiny, prompts, NEW, backend=ReferenceBackend()),
        "engine C attention": lambda: rc.engine_runtime(tiny, prompts, NEW, backend=rc.NativeAttentionBackend()),
        "engine together": lambda: rc.engine_runtime(tiny, prompts, NEW, together=True,
                                                     backend=ReferenceBackend()),
    }[name]()
    # greedy tokens equal up to the near-tie rule, for a stated error of 1e-4 (checked below)
    rows = rc.compare_runs(baseline, runs, tolerance=flip_tolerance(1e-4))
    assert rc.agreement_summary(rows).ok, rc.agreement_summary(rows).describe()
    for row in rows:
        assert row.prompt_end_change < 1e-4
    # every shared step's top-20 agrees, not only the argmax
    for base, run, row in zip(baseline, runs, rows):
        shared = len(base.tokens) if row.identical else row.first_step + 1
        for a, b in zip(base.top[:shared], run.top[:shared]):
            assert [t for t, _ in a[:5]] == [t for t, _ in b[:5]] or abs(a[4][1] - a[5][1]) < 1e-4
            assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-4


def test_math_attention_equals_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((2, 2, 3, 6, 8), (2, 2, 9, 8), (2, 2, 9, 8)))
    cache = rc.MathAttentionCache(torch.zeros(1, 2, 2, 9, 8), torch.zeros(1, 2, 2, 9, 8), length=3)
    cache.keys[0, :, :, :3], cache.values[0, :, :, :3] = k[:, :, :3], v[:, :, :3]
    out = cache.attend(0, q, k[:, :, 3:], v[:, :, 3:])
    assert torch.allclose(out, grouped_attention(q, k, v, 3), atol=1e-6)


def test_padding_is_invisible_to_real_tokens(tiny, prompts, baseline):
    # the same prompts padded with different ids must give the same runs
    runs = rc.padded_batch_runtime(tiny, prompts, NEW, pad_id=1)
    other = rc.padded_batch_runtime(tiny, prompts, NEW, pad_id=50)
    # the same path with other pad ids: exactly equal; against the baseline (another
    # numerical path), equal up to the near-tie rule
    assert [r.tokens for r in runs] == [r.tokens for r in other]
    assert rc.agreement_summary(rc.compare_runs(baseline, runs, tolerance=flip_tolerance(1e-4))).ok


def test_compare_runs_finds_the_first_difference():
    def run(tokens, margins):
        return rc.GreedyRun(tokens, [[(t, 0.0), (t + 1, -m)] for t, m in zip(tokens, margins)])

    base = run([1, 2, 3, 4], [0.5, 0.01, 0.2, 0.3])
    same = run([1, 2, 3, 4], [0.5, 0.01, 0.2, 0.3])
    moved = run([1, 9, 3, 4], [0.5, 0.002, 0.2, 0.3])
    moved.top[1] = [(9, 0.0), (2, -0.002)]
    rows = rc.compare_runs([base, base], [same, moved])
    assert rows[0].identical and rows[0].first_step is None and rows[0].excused is None
    assert (rows[1].first_step, rows[1].baseline_token, rows[1].runtime_token) == (1, 2, 9)
    assert rows[1].baseline_margin == pytest.approx(0.01) and rows[1].runtime_margin == pytest.approx(0.002)
    # token 2 moved by 0.002 only (the runtime's measured error), and the default tolerance
    # (twice the stated float32 bound, 2e-3) is below the gap of 0.01: not excused
    assert rows[1].flip_change == pytest.approx(0.002)
    assert rc.runtime_error([base, base], [same, moved]) == pytest.approx(0.002)
    assert rows[1].gap == pytest.approx(0.01) and rows[1].excused is False
    summary = rc.agreement_summary(rows)
    assert (summary.exact, summary.excused, summary.failed) == (1, 0, 1)
    assert rc.margins([base]) == pytest.approx([0.5, 0.01, 0.2, 0.3])


def test_the_tolerance_comes_from_a_stated_bound_not_from_the_run_it_judges():
    def run(tokens, margins):
        return rc.GreedyRun(tokens, [[(t, 0.0), (t + 1, -m)] for t, m in zip(tokens, margins)])

    base = run([1, 2, 3], [0.5, 0.004, 0.2])
    flipped = run([1, 3, 7], [0.5, 0.001, 0.2])
    flipped.top[0] = [(1, 0.003), (2, -0.5)]  # a change of 0.003 on a shared step
    flipped.top[1] = [(3, 0.0), (2, -0.001)]  # the runner-up taken, at a gap of 0.004
    # the flip step is a shared step too (same tokens before it): token 3 moved by 0.004,
    # so twice the run's own error (0.008) would excuse its own flip whatever the gap
    assert rc.runtime_error([base], [flipped]) == pytest.approx(0.004)
    # the default is twice the stated float32 bound (2e-3), below the gap: not excused
    row = rc.compare_runs([base], [flipped])[0]
    assert row.agreement.tolerance == pytest.approx(2 * LOGIT_ERROR) and row.excused is False
    # a stated bound of 0.003 excuses the gap of 0.004, but the measured error (0.004) is
    # above that bound, so the chapter's check (error <= bound) fails the runtime
    row = rc.compare_runs([base], [flipped], tolerance=flip_tolerance(0.003))[0]
    assert row.first_step == 1 and row.gap == pytest.approx(0.004) and row.excused
    assert rc.runtime_error([base], [flipped]) > 0.003


def test_each_runtime_states_its_error_bound():
    bounds = {c.name: c.logit_error for c in rc.choices()}
    assert bounds.pop("bfloat16") == BF16_LOGIT_ERROR
    assert set(bounds.values()) == {LOGIT_ERROR}


def test_counting_passes_counts_each_path_and_restores_both(monkeypatch):
    def forward(self, input_ids, *args, **kwargs):
        return "forward"

    def layers(x, *args, **kwargs):
        return "layers"

    monkeypatch.setattr(gguf_blocks.BlockLlama, "forward", forward)
    monkeypatch.setattr(native, "decoder_layers_blocks", layers)
    with rc.counting_passes() as count:
        assert gguf_blocks.BlockLlama.forward(None, torch.zeros(1, 7, dtype=torch.long)) == "forward"
        assert gguf_blocks.BlockLlama.forward(None, torch.zeros(1, 2, dtype=torch.long)) == "forward"
        assert native.decoder_layers_blocks(torch.zeros(2, 8), None) == "layers"
    assert (count.passes, count.block) == ([7, 2], [2])
    assert gguf_blocks.BlockLlama.forward is forward and native.decoder_layers_blocks is layers


@needs_kernels
def test_bf16_prefill_takes_onednn_and_one_token_steps_the_c_layers(model):
    prompt = model.tokenizer.encode("The three primary colours of light are red, green and")
    assert len(prompt) > native.MAX_ROWS
    with rc.counting_passes() as count:
        rc.engine_runtime(model, [prompt], 3, weights="bf16")
    assert count.passes == [len(prompt), 1, 1] and count.block == [1, 1]


def test_bf16_path_names_the_gemm_of_each_machine():
    amx = rc.bf16_path({"available": True, "bf16_gemm_native": True, "amx": True})
    assert "bfloat16 GEMM (AMX)" in amx and "rounds each product" in amx
    avx512 = rc.bf16_path({"available": True, "bf16_gemm_native": True, "amx": False}, short=True)
    assert "AVX512-BF16" in avx512
    avx2 = rc.bf16_path({"available": True, "bf16_gemm_native": False, "amx": False})
    assert "float32 GEMM" in avx2 and "bfloat16 GEMM (" not in avx2


def test_top_logprobs_breaks_ties_by_lower_id():
    logits = torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0] + [-5.0] * 30)
    top = rc.top_logprobs(logits, k=4)
    assert [t for t, _ in top] == [1, 3, 4, 2]
    assert sum(torch.tensor([lp for _, lp in rc.top_logprobs(logits, k=35)]).exp()) == pytest.approx(1.0)


def test_a_runtime_that_needs_the_c_kernels_says_so_where_they_are_off(monkeypatch):
    from labkit.kernels import native

    names = {c.name for c in rc.choices() if c.needs_native}
    assert {"bfloat16", "the model file's blocks", "C attention kernel"} <= names
    plain = next(c for c in rc.choices() if c.name == "chunked prefill, 64")
    assert rc.unavailable(plain) is None
    monkeypatch.setattr(native, "load", lambda: None)
    monkeypatch.setattr(native, "why_unavailable", lambda: "switched off")
    bf16 = next(c for c in rc.choices() if c.name == "bfloat16")
    assert "switched off" in rc.unavailable(bf16) and rc.unavailable(plain) is None


def test_a_chunk_that_holds_the_prompt_repeats_the_baseline_bit_for_bit(tiny, prompts, baseline):
    # chapter 24 counts such runs apart: identical by construction, they test nothing
    choice = next(c for c in rc.choices() if c.name == "chunked prefill, 16")
    runs = choice.run(tiny, prompts, NEW)
    repeats = [choice.repeats_baseline(len(p)) for p in prompts]
    assert repeats == [True, False, True, False, False]  # prompts of 5, 23, 1, 40, 17 tokens
    for base, run, same in zip(baseline, runs, repeats):
        if same:
            assert base.tokens == run.tokens and base.top == run.top
    # the prompts it cuts run another computation: their scores differ in some bit
    assert any(b.top != r.top for b, r, same in zip(baseline, runs, repeats) if not same)
    assert not any(c.repeats_baseline(1) for c in rc.choices() if c.prefill_chunk is None)
