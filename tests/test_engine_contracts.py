"""Engine v0's typed contracts and the reference checks of its parts (chapter 6).

Every check must pass on labkit's real part and FAIL on a deliberately broken one: a check
that cannot fail proves nothing.
"""

import pytest
import torch

from conftest import PROMPTS, SMOL_LOGIT_ERROR, assert_greedy_near, greedy_reference_scores
from labkit.experiments import part_checks as checks
from labkit.experiments import sampler_streams
from labkit.engine.contracts import (LogitsModel, EngineModel, Loop, Sampler, TokenizerLike, TransformersAdapter,
                                     conformance_problems, conforms)
from labkit.engine.loop import generate
from labkit.sampling import SamplingParams, sample

SETTINGS = [SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.7, top_p=0.9),
            SamplingParams(temperature=1.3, top_k=50, top_p=0.95)]


@pytest.fixture(scope="module")
def next_logits(model):
    """A broad real next-token distribution (many plausible words after 'there was a')."""
    return model(torch.tensor([model.tokenizer.encode("Once upon a time, there was a")]))[0, -1]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    from labkit.models.registry import fetch

    path = fetch("smollm2-135m")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# --------------------------------------------------------------------------- contracts


def test_labkit_parts_conform(model):
    assert conforms(model.tokenizer, TokenizerLike)
    assert conforms(model, LogitsModel)
    assert conforms(model, EngineModel)
    assert conforms(sample, Sampler)
    assert conforms(generate, Loop)


def test_parts_do_not_conform_to_other_parts_contracts(model):
    assert not conforms(model, TokenizerLike)
    assert not conforms(model.tokenizer, LogitsModel)
    assert not conforms(sample, Loop)  # seed= and step= are required keywords
    assert not conforms(generate, Sampler)


class _NoDecode:
    eos_token_id = 2

    def encode(self, text):
        return [1]


class _NoCache:
    def __call__(self, input_ids, cache=None, last_only=False):
        return torch.zeros(1, 1, 4)


class _NoStep:
    def __call__(self, logits, params, *, seed):
        return 0


class _Swallows:
    def __call__(self, *args, **kwargs):
        return 0


def test_an_object_missing_a_method_does_not_conform(model):
    assert not conforms(_NoDecode(), TokenizerLike)
    assert conformance_problems(_NoDecode(), TokenizerLike) == ["missing decode"]
    assert not conforms(_NoCache(), LogitsModel)
    assert "missing new_cache" in conformance_problems(_NoCache(), LogitsModel)
    # A model without a tokenizer is a LogitsModel but not what generate() takes.
    bare = TransformersAdapter(model=None)
    assert conforms(bare, LogitsModel) and not conforms(bare, EngineModel)


def test_signatures_are_checked_not_just_names():
    assert isinstance(_NoStep(), Sampler)  # runtime_checkable only sees that __call__ exists
    assert not conforms(_NoStep(), Sampler)
    # Arguments that only reach *args / **kwargs could be silently ignored: not conforming.
    assert isinstance(_Swallows(), Sampler) and not conforms(_Swallows(), Sampler)


def test_nested_part_must_conform(model):
    class WithBadTokenizer(TransformersAdapter):
        pass

    adapter = WithBadTokenizer(model=None, tokenizer=_NoDecode())
    assert conformance_problems(adapter, EngineModel) == ["tokenizer: missing decode"]


def test_transformers_model_conforms_only_through_the_adapter(model, reference):
    assert not conforms(reference, LogitsModel)
    assert "missing new_cache" in conformance_problems(reference, LogitsModel)
    adapter = TransformersAdapter(reference, tokenizer=model.tokenizer)
    assert conforms(adapter, LogitsModel) and conforms(adapter, EngineModel)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    ours = generate(model, PROMPTS[1], params)
    want, scores = greedy_reference_scores(model, ours.prompt_token_ids, len(ours.token_ids))  # the loop: exact
    assert want == ours.token_ids
    # transformers through the adapter is another implementation: equal up to the near-tie rule
    assert_greedy_near([want], [generate(adapter, PROMPTS[1], params).token_ids], [scores], SMOL_LOGIT_ERROR,
                       what="transformers through the adapter against labkit's model")


@pytest.mark.slow
def test_transformers_tokenizer_conforms(hf_tokenizer):
    assert conforms(hf_tokenizer, TokenizerLike)


# --------------------------------------------------------------------------- reference checks


@pytest.mark.slow
def test_tokenizer_check_passes_and_fails(model, hf_tokenizer):
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog.", "東京 and café, 😀"]
    assert checks.check_tokenizer(model.tokenizer, hf_tokenizer, texts).passed
    the = model.tokenizer.encode(" the")[0]
    bad = checks.check_tokenizer(checks.broken_tokenizer(model.tokenizer, the), hf_tokenizer, texts)
    assert not bad.passed and bad.details["ids_differ"] == [texts[1]]
    # The documented difference: transformers' GGUF tokenizer splits a run of spaces before a digit.
    assert not checks.check_tokenizer(model.tokenizer, hf_tokenizer, ["Room  101"]).passed


def test_tokenizer_check_fails_on_a_fake_reference(model):
    class Reference:  # agrees on ids, decodes differently
        def encode(self, text, add_special_tokens=False):
            return model.tokenizer.encode(text)

        def decode(self, ids):
            return model.tokenizer.decode(ids).upper()

    assert checks.check_tokenizer(model.tokenizer, model.tokenizer, ["a b"]).passed
    result = checks.check_tokenizer(model.tokenizer, Reference(), ["a b"])
    assert not result.passed and result.details["text_differs"] == ["a b"]


def test_backend_check_passes_and_fails(model, reference):
    prompts = [model.tokenizer.encode(PROMPTS[1])]
    good = checks.check_backend(model, reference, prompts)
    assert good.passed, good.measured
    assert good.details["positions"] == 2 * len(prompts[0])  # with and without the cache
    bad = checks.check_backend(checks.broken_backend(model, scale=1e-2), reference, prompts)
    assert not bad.passed and bad.details["max_abs_diff"] > 1e-3
    assert conforms(checks.broken_backend(model), EngineModel)  # the contract cannot see it


def test_sampler_check_passes_and_fails(next_logits):
    good = checks.check_sampler(sample, next_logits, SETTINGS, draws=8)
    assert good.passed, good.measured
    assert good.details["max_abs_prob_diff"] <= 1e-6
    sampler, distribution = checks.broken_sampler()
    assert conforms(sampler, Sampler)
    bad = checks.check_sampler(sampler, next_logits, SETTINGS, distribution=distribution, draws=8)
    assert not bad.passed
    assert bad.details["kept_set_mismatches"] == 2 and bad.details["draws_outside"] > 0
    # The draws alone catch it too, with the right distribution function.
    assert not checks.check_sampler(sampler, next_logits, SETTINGS[:1], draws=8).passed


def test_reference_distribution_greedy_is_one_hot(next_logits):
    probs = checks.reference_distribution(next_logits, SamplingParams(temperature=0.0))
    assert probs.sum() == 1 and int(probs.argmax()) == int(next_logits.argmax())


def test_loop_check_passes_and_fails(model, reference):
    good = checks.check_loop(generate, model, reference, PROMPTS[1:2], max_tokens=4)
    assert good.passed, good.measured
    broken = checks.broken_loop(generate)
    assert conforms(broken, Loop)
    bad = checks.check_loop(broken, model, reference, PROMPTS[1:2], max_tokens=4)
    assert not bad.passed and bad.details["first_divergence"] == [0]


def test_check_result_row():
    row = checks.CheckResult("x", "y", "z", "m", False).row()
    assert row == {"part": "x", "reference": "y", "check": "z", "measured": "m", "verdict": "FAIL"}


# --------------------------------------------------------------------------- random streams


def test_stream_counts():
    assert sampler_streams.distinct_streams(100, 32, scheme="naive") == 131
    assert sampler_streams.distinct_streams(100, 32) == 3200


def test_stream_draws_naive_depends_only_on_seed_plus_step():
    naive = sampler_streams.stream_draws(5, 6, scheme="naive")
    assert naive.shape == (5, 6)
    assert all(naive[r, k] == naive[r + 1, k - 1] for r in range(4) for k in range(1, 6))
    fixed = sampler_streams.stream_draws(5, 6)
    assert not any(fixed[r, k] == fixed[r + 1, k - 1] for r in range(4) for k in range(1, 6))


def test_shifted_copies_under_the_naive_scheme(next_logits):
    params = SamplingParams(temperature=1.0)
    a = sampler_streams.fixed_logits_tokens(next_logits, params, seed=1, steps=32, scheme="naive")
    b = sampler_streams.fixed_logits_tokens(next_logits, params, seed=2, steps=32, scheme="naive")
    assert sampler_streams.shifted_matches(a, b) == 31 and len(set(a)) > 10
    a = sampler_streams.fixed_logits_tokens(next_logits, params, seed=1, steps=32)
    b = sampler_streams.fixed_logits_tokens(next_logits, params, seed=2, steps=32)
    assert sampler_streams.shifted_matches(a, b) < 5


def test_shifted_matches_counts():
    assert sampler_streams.shifted_matches([1, 2, 3, 4], [2, 3, 4, 9]) == 3
    assert sampler_streams.shifted_matches([1, 2, 3], [1, 2, 3]) == 0


# --------------------------------------------------------------------------- baseline


def test_baseline_throughput_fields(model):
    row = checks.baseline_throughput(model, PROMPTS[1], threads=1, new_tokens=3, repeats=1, warmup=0)
    assert row["threads"] == 1 and row["new_tokens"] == 3 and row["repeats"] == 1
    assert row["request_s"] > 0 and row["prefill_ms"] > 0 and row["decode_tokens_per_s"] > 0
    assert row["tokens_per_s"] == pytest.approx(3 / row["request_s"])
    assert all(len(row[f"{stage}_samples_s"]) == 1 for stage in checks.BASELINE_STAGES)
