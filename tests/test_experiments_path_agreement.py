"""Chapters 13-18's comparisons of two numerical paths under the near-tie rule
(`labkit.experiments.path_agreement`), and the helpers that collect each path's scores."""

import pytest
import torch

from labkit.experiments import path_agreement as pa


def steps(*rows):
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


def test_the_tolerance_is_twice_the_stated_error():
    assert pa.tolerance() == pytest.approx(2 * pa.LOGIT_ERROR)
    assert pa.tolerance(0.5) == pytest.approx(1.0)


def test_a_flip_inside_the_tolerance_is_excused_and_counted():
    scores = steps([5.0, 5.0 - 0.5 * pa.LOGIT_ERROR, 1.0], [0.0, 3.0, 1.0])
    result = pa.check(pa.compare([[0, 1]], [[1, 2]], [scores]))
    assert result.ok and result.excused == 1 and result.exact == 0
    assert "parted at a near-tie" in pa.phrase(result, "prompts")


def test_a_flip_beyond_the_tolerance_fails_the_check():
    scores = steps([5.0, 4.9, 1.0])
    with pytest.raises(AssertionError, match="NOT excused"):
        pa.check(pa.compare([[0]], [[1]], [scores]))


def test_a_measured_error_beyond_the_stated_one_fails_the_check():
    ref = steps([5.0, 1.0, 0.0], [0.0, 4.0, 1.0])
    cand = steps([5.0 + 10 * pa.LOGIT_ERROR, 1.0, 0.0], [0.0, 4.0, 1.0])
    result = pa.compare([[0, 1]], [[0, 1]], [ref], [cand])
    assert result.ok and result.max_score_error == pytest.approx(10 * pa.LOGIT_ERROR, rel=1e-3)
    with pytest.raises(AssertionError, match="more than the stated"):
        pa.check(result)
    assert pa.check(result, logit_error=20 * pa.LOGIT_ERROR) is result


def test_log_probs_keep_the_gaps_and_engine_scores_need_logprobs():
    logits = steps([2.0, 1.0, 0.5])
    lp = pa.log_probs(logits)[0]
    assert float(lp[0] - lp[1]) == pytest.approx(1.0)
    assert float(torch.logsumexp(lp, 0)) == pytest.approx(0.0, abs=1e-6)

    class Sample:
        top_logprobs = None

    class Output:
        samples = [Sample()]

    with pytest.raises(ValueError, match="logprobs"):
        pa.engine_scores(Output())


def test_phrases_say_how_many_parted():
    same = steps([3.0, 1.0])
    equal = pa.compare([[0], [0]], [[0], [0]], [same, same])
    assert pa.phrase(equal, "runs") == ("all 2 runs gave the same tokens throughout "
                                        "(none parted at a near-tie)")
    one = pa.compare([[0]], [[0]], [same])
    assert pa.phrase(one, "requests").startswith("the request gave the same tokens")
    assert pa.error_text(one) == "not measured"
    tie = steps([3.0, 3.0 - pa.LOGIT_ERROR])
    mixed = pa.summary(list(equal.sequences) + list(pa.compare([[0]], [[1]], [tie]).sequences))
    assert pa.phrase(mixed, "runs").startswith("2 of 3 runs gave the same tokens throughout and "
                                               "1 parted at a near-tie")


# -- the chapters' helpers, on a tiny random Llama ------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from conftest import make_tiny_llama

    return make_tiny_llama(seed=3)


def test_paged_against_contiguous_reports_the_rule_and_the_error(tiny):
    from labkit.sim.paging import paged_matches_contiguous

    prompts = [list(range(1 + i, 13 + i)) for i in range(3)]
    rows = paged_matches_contiguous(tiny, prompts, 8, kv_tokens=256, block_size=4)
    result = pa.check(pa.summary([r["agreement"] for r in rows]))
    assert all(r["agree"] for r in rows) and result.max_score_error is not None
    assert all(r["same"] == r["agreement"].exact for r in rows)


def test_a_preempted_engine_against_the_contiguous_loop(tiny):
    import dataclasses

    from labkit.sampling import SamplingParams
    from labkit.sim.paging import against_contiguous, contiguous_reference, preemption_trace

    prompts = [list(range(2 + 5 * i, 14 + 5 * i)) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    outs, _, stats = preemption_trace(tiny, prompts, params, kv_tokens=40, block_size=4)
    assert stats.preemptions > 0
    result = pa.check(against_contiguous(tiny, prompts, outs, 10))
    assert len(result.sequences) == 3 and result.max_score_error is not None
    tokens, scores = contiguous_reference(tiny, prompts[0], 10)
    assert len(scores) == 10 and int(scores[0].argmax()) == tokens[0]
    # an output whose tokens leave the loop's where its gap is wide must fail the check
    step = next(i for i in range(10) if float(scores[i].topk(2).values.diff().abs()) > pa.tolerance())
    wrong = list(outs[0].token_ids)
    wrong[step] = int(scores[step].topk(2).indices[1])
    bad = dataclasses.replace(outs[0], samples=[dataclasses.replace(outs[0].samples[0], token_ids=wrong)])
    with pytest.raises(AssertionError, match="NOT excused"):
        pa.check(against_contiguous(tiny, prompts[:1], [bad], 10))


def test_engine_concurrency_keeps_scores_when_asked(tiny):
    from labkit.sim.paging import engine_concurrency

    prompts = [list(range(1 + i, 9 + i)) for i in range(6)]
    runs = [engine_concurrency(tiny, prompts, [6] * 6, budget=128, reserve=reserve, block_size=8,
                               logprobs=5) for reserve in (64, None)]
    assert all(len(s) == 6 for run in runs for s in run["scores"])
    pa.check(pa.compare(runs[0]["tokens"], runs[1]["tokens"], runs[0]["scores"], runs[1]["scores"]))
    assert engine_concurrency(tiny, prompts[:2], [2, 2], budget=128, reserve=None)["scores"] is None


def test_compiled_module_runs_keep_logits_and_compare(tiny):
    from labkit.experiments.compilation import agreement, forward_step, greedy_decode, greedy_run

    static = greedy_run(tiny, forward_step, [3, 4, 5], 6, static=True, max_len=16)
    contiguous = greedy_run(tiny, forward_step, [3, 4, 5], 6, static=False)
    assert len(static.logits) == 6 and greedy_decode(tiny, forward_step, [3, 4, 5], 6, False)[0] == contiguous.token_ids
    result = pa.check(agreement(contiguous, static))
    assert result.max_score_error is not None and result.max_score_error <= pa.LOGIT_ERROR


def test_kernel_agreement_compares_every_way_with_the_reference(tiny):
    from labkit.experiments.kernel_timings import kernel_agreement, kernel_runs, matrix_kernel_models

    timings, runs = kernel_runs(tiny, [5, 6, 7], new_tokens=4, repeats=2)
    assert list(runs) == list(timings) == list(matrix_kernel_models(tiny))
    result = pa.check(kernel_agreement(runs))
    assert len(result.sequences) == len(runs) - 1


def test_speculative_runs_against_the_one_token_loop(tiny):
    from labkit.engine.loop import greedy_decode
    from labkit.experiments.speculation import plain_agreement, verification_error

    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    run = greedy_decode(tiny, prompt, 8, keep_logits=True)
    assert verification_error(tiny, prompt, run.token_ids, run.logits, 4) <= pa.LOGIT_ERROR
    records = [{"text_type": "t", "prompt": 0, "token_ids": run.token_ids},
               {"text_type": "t", "prompt": 0, "token_ids": run.token_ids[:3] + [0] * 5}]
    summary, error = plain_agreement(tiny, {"t": [prompt]}, records, width=4)
    assert summary.sequences[0].exact and error <= pa.LOGIT_ERROR
    # the second "run" leaves the loop's tokens at position 3, where no near-tie explains it
    gap = float(run.logits[3][run.token_ids[3]] - run.logits[3][0])
    assert gap > pa.tolerance() and not summary.sequences[1].ok


def test_inductor_cache_is_kept_apart_per_cpu_capability(monkeypatch):
    import os

    from labkit.experiments.compilation import inductor_cache_for_this_cpu

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    path = inductor_cache_for_this_cpu()
    assert torch.backends.cpu.get_cpu_capability().lower() in os.path.basename(path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == path
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/somewhere-chosen")
    assert inductor_cache_for_this_cpu() == "/tmp/somewhere-chosen"
