"""Chapter 24's runtimes: each computes the same function as the baseline (a tiny random
Llama's greedy tokens, and its logits within rounding), and the comparison of two runs
finds the first differing step and the margins there."""

import pytest
import torch

from conftest import make_tiny_llama
from labkit.engine.backends import ReferenceBackend
from labkit.experiments import runtime_choices as rc
from labkit.models.llama import grouped_attention

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
    for row in rc.compare_runs(baseline, runs):
        assert row.identical, row
        assert row.prompt_end_change < 1e-4
    # every step's top-20 agrees, not only the argmax
    for base, run in zip(baseline, runs):
        for a, b in zip(base.top, run.top):
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
    assert [r.tokens for r in runs] == [r.tokens for r in other] == [r.tokens for r in baseline]


def test_compare_runs_finds_the_first_difference():
    def run(tokens, margins):
        return rc.GreedyRun(tokens, [[(t, 0.0), (t + 1, -m)] for t, m in zip(tokens, margins)])

    base = run([1, 2, 3, 4], [0.5, 0.01, 0.2, 0.3])
    same = run([1, 2, 3, 4], [0.5, 0.01, 0.2, 0.3])
    moved = run([1, 9, 3, 4], [0.5, 0.002, 0.2, 0.3])
    moved.top[1] = [(9, 0.0), (2, -0.002)]
    rows = rc.compare_runs([base, base], [same, moved])
    assert rows[0].identical and rows[0].first_step is None and rows[0].change_covers_margin is None
    assert (rows[1].first_step, rows[1].baseline_token, rows[1].runtime_token) == (1, 2, 9)
    assert rows[1].baseline_margin == pytest.approx(0.01) and rows[1].runtime_margin == pytest.approx(0.002)
    # token 2 moved by 0.002 only, too little to undo a margin of 0.01: inconsistent runs
    assert rows[1].flip_change == pytest.approx(0.002) and rows[1].change_covers_margin is False
    assert rc.margins([base]) == pytest.approx([0.5, 0.01, 0.2, 0.3])


def test_top_logprobs_breaks_ties_by_lower_id():
    logits = torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0] + [-5.0] * 30)
    top = rc.top_logprobs(logits, k=4)
    assert [t for t, _ in top] == [1, 3, 4, 2]
    assert sum(torch.tensor([lp for _, lp in rc.top_logprobs(logits, k=35)]).exp()) == pytest.approx(1.0)
