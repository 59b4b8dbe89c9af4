"""labkit.experiments.speculation: the closed forms of when speculation pays, and the sweep's
plumbing on a tiny random Llama (no tokenizer)."""

import math

import pytest
import torch

from conftest import TINY_LOGIT_ERROR, assert_greedy_near, greedy_reference_scores, make_tiny_llama
from labkit.experiments.speculation import (RULES, CountedModule, add_predictions, break_even_alpha,
                                            break_even_text, chapter_sweep, chi_square_pvalue,
                                            draft_agreement, draft_cost_per_guess, first_token_draws,
                                            interleaved, make_drafter, overlap, pass_costs,
                                            pooled_speedups, predicted_speedup, prose_passages,
                                            speculation_sweep)
from labkit.engine.speculative import LayerSkipDrafter, NgramDrafter


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(vocab=61, layers=3)


def plain_greedy(model, ids, params):
    cache = model.new_cache(1, len(ids) + params.max_tokens)
    logits = model(torch.tensor([ids]), cache=cache, last_only=True)[0, -1]
    out = []
    for _ in range(params.max_tokens):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([[out[-1]]]), cache=cache)[0, -1]
    return out


def test_predicted_speedup_closed_forms():
    assert predicted_speedup(0.0, 4, 1.0) == 1.0            # every guess fails, free verification
    assert predicted_speedup(1.0, 4, 1.0) == 5.0            # every guess accepted: k + 1 tokens
    assert predicted_speedup(0.5, 2, 1.0) == pytest.approx(1.75)
    assert predicted_speedup(0.5, 2, 1.25, 0.25) == pytest.approx(1.75 / 1.75)
    assert predicted_speedup(0.0, 3, 2.0) == 0.5            # a CPU pass that costs twice a step
    with pytest.raises(ValueError):
        predicted_speedup(0.5, 2, 0.0)


def test_break_even_alpha():
    assert break_even_alpha(4, 1.0) == 0.0                  # flat verification: never slower
    assert break_even_alpha(1, 1.5) == pytest.approx(0.5, abs=1e-6)    # 1 + a = 1.5
    golden = (math.sqrt(5) - 1) / 2                          # 1 + a + a^2 = 2
    assert break_even_alpha(2, 2.0) == pytest.approx(golden, abs=1e-6)
    assert math.isnan(break_even_alpha(2, 4.0))             # even alpha = 1 gives 3 < 4
    assert break_even_alpha(2, 1.0, 0.5) == pytest.approx(golden, abs=1e-6)


def test_prose_passages_are_whole_paragraphs():
    class Words:
        def encode(self, text):
            return text.split()

    text = "\n\n".join(f"paragraph {i} " + "word " * 30 for i in range(20))
    out = prose_passages(text, 2, Words(), min_tokens=60, stride=5)
    assert len(out) == 2 and out[0].startswith("paragraph 0") and out[1].startswith("paragraph 5")
    assert all(len(p.split()) >= 60 and p.endswith("\n\n") for p in out)


def test_make_drafter(tiny):
    assert isinstance(make_drafter(tiny, "ngram"), NgramDrafter)
    d = make_drafter(tiny, "layerskip-2")
    assert isinstance(d, LayerSkipDrafter) and d.layers == 2
    with pytest.raises(ValueError):
        make_drafter(tiny, "small-model")


def test_draft_agreement_full_depth_is_one(tiny):
    from labkit.sampling import SamplingParams

    prompt = [3, 4, 5, 6, 3, 4]
    target = plain_greedy(tiny, prompt, SamplingParams(temperature=0.0, max_tokens=12))
    agree = draft_agreement(tiny, [1, 3], prompt, target)
    assert agree[3] == 1.0 and 0.0 <= agree[1] <= 1.0


def test_pass_costs_records(tiny):
    rows = pass_costs(tiny, list(range(1, 20)), [2, 4], draft_layers=[1], repeats=2, warmup=0)
    assert [(r["what"], r["tokens"]) for r in rows] == [("target", 1), ("target", 2), ("target", 4),
                                                         ("draft-1", 1)]
    assert rows[0]["relative"] == 1.0 and rows[-1]["layers"] == 1
    assert all(r["median_s"] > 0 and len(r["samples"]) == 2 for r in rows)


def test_interleaved_takes_one_sample_per_round():
    calls = []
    timings = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3)
    assert calls == ["a", "b"] * 3 and len(timings["a"].samples) == 3


def test_sweep_plumbing_on_tiny_model(tiny):
    prompts = {"repetitive": [[5, 6, 7, 8] * 4], "other": [[9, 1, 30, 2, 44]]}
    rows = speculation_sweep(tiny, prompts, [("ngram", 2), ("layerskip-1", 1)], new_tokens=10,
                             rounds=1, plain=plain_greedy)
    assert len(rows) == 6
    assert all(r["tokens"] == 10 for r in rows)
    # a verification reads k + 1 rows at once, a plain step one: two numerical paths, so the
    # tokens agree with plain greedy up to the near-tie rule (`equal_to_plain` records whether
    # they were equal throughout, a fact of the run)
    refs = {(t, i): greedy_reference_scores(tiny, ids, 10)
            for t, items in prompts.items() for i, ids in enumerate(items)}
    assert_greedy_near([refs[r["text_type"], r["prompt"]][0] for r in rows], [r["token_ids"] for r in rows],
                       [refs[r["text_type"], r["prompt"]][1] for r in rows], TINY_LOGIT_ERROR,
                       what="the sweep's runs against plain greedy")
    assert {(r["drafter"], r["k"]) for r in rows} == {("none", 0), ("ngram", 2), ("layerskip-1", 1)}
    plain = [r for r in rows if r["drafter"] == "none"]
    assert all(r["speedup"] == 1.0 and r["tokens_per_verification"] == 1.0 for r in plain)
    spec = [r for r in rows if r["drafter"] != "none"]
    assert all(1.0 <= r["tokens_per_verification"] <= r["k"] + 1 for r in spec)
    predicted = add_predictions(rows, {2: 1.1, 3: 1.2}, {"layerskip-1": 0.3})
    assert len(predicted) == 4 and all(r["predicted_speedup"] > 0 for r in predicted)


def test_chapter_sweep_runs_layerskip_on_first_prompts_only(tiny):
    prompts = {"a": [[5, 6, 7, 5, 6], [8, 9, 8, 9]]}
    rows = chapter_sweep(tiny, prompts, [1], 1, [1], new_tokens=4, rounds=1,
                         plain=plain_greedy)
    seen = {(r["prompt"], r["drafter"]) for r in rows}
    assert seen == {(0, "none"), (0, "ngram"), (0, "layerskip-1"), (1, "none"), (1, "ngram")}


def test_rejection_rule_keeps_p_and_the_controls_do_not():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    assert overlap(p, q) == pytest.approx(0.1 + 0.2 + 0.15 + 0.05)
    draws = 3000
    counts = {rule: first_token_draws(p, q, draws, rule, seed=1) for rule in RULES}
    assert all(float(c.sum()) == draws for c in counts.values())
    assert chi_square_pvalue(counts["rejection"], p)[0] > 1e-3
    assert chi_square_pvalue(counts["resample_from_p"], p)[0] < 1e-6
    assert chi_square_pvalue(counts["draft_only"], p)[0] < 1e-6
    with pytest.raises(ValueError):
        first_token_draws(p, q, 1, "bogus")


def test_chi_square_folds_small_bins():
    probs = torch.tensor([0.5, 0.49, 0.005, 0.005])
    counts = torch.tensor([50.0, 49.0, 1.0, 0.0])
    pvalue, bins = chi_square_pvalue(counts, probs)
    assert bins == 2 and pvalue > 0.5  # the two rare tokens: one rest bin, too small, folded


def test_break_even_text():
    assert break_even_text(float("nan")).startswith("cannot break even")
    assert break_even_text(0.0) == "pays even if every guess fails"
    assert break_even_text(0.284) == "breaks even at an acceptance rate of 0.28"


def test_layerskip_drafter_counts_its_passes(tiny):
    from labkit.engine.speculative import speculative_generate
    from labkit.sampling import SamplingParams

    prompt = [3, 4, 5, 6, 3, 4]
    d = make_drafter(tiny, "layerskip-3")  # all layers: every guess is accepted
    assert isinstance(d.model, CountedModule)
    tokens, stats = speculative_generate(tiny, prompt, SamplingParams(temperature=0.0, max_tokens=9),
                                         d, k=2)
    # (the draft steps one row, the verification three: a guess could fail only at a near-tie,
    # and the plain run has none within the tolerance on this prompt)
    from labkit.util.near_tie import flip_tolerance, top_two_margins

    _, scores = greedy_reference_scores(tiny, prompt, 9)
    assert min(top_two_margins(scores)) > flip_tolerance(TINY_LOGIT_ERROR)
    assert stats.acceptance_rate == 1.0
    # 3 verifications of 2 guesses, each followed by a catch-up pass over the last guess
    # (except the last verification, after which generation stops); plus the prompt's prefill
    assert stats.proposed == 6 and d.model.passes == 1 + 6 + 2


def test_sweep_records_samples_and_draft_passes(tiny):
    prompts = {"rep": [[5, 6, 7, 8] * 4, [9, 1, 9, 1, 9, 1]]}
    rows = speculation_sweep(tiny, prompts, [("ngram", 2), ("layerskip-3", 2)], new_tokens=8,
                             rounds=3, plain=plain_greedy)
    assert all(len(r["samples_s"]) == 3 for r in rows)
    skip = [r for r in rows if r["drafter"] == "layerskip-3"]
    assert all(r["draft_passes"] > r["proposed"] for r in skip)  # full depth: catch-ups
    assert all(r["draft_passes"] == 0 for r in rows if r["drafter"] != "layerskip-3")
    costs = draft_cost_per_guess(rows, step_s=1.0)
    assert len(costs) == 2 and all(c["passes_per_guess"] > 1 for c in costs)
    pooled = {(p["drafter"], p["k"]): p for p in pooled_speedups(rows)}
    assert set(pooled) == {("ngram", 2), ("layerskip-3", 2)}
    assert all(p["prompts"] == 2 and p["low_x"] <= p["speedup_x"] <= p["high_x"] for p in pooled.values())
    assert all(p["verdict"] in ("faster", "slower", "within the noise") for p in pooled.values())


def test_pooled_speedups_sum_rounds_over_prompts():
    def rec(prompt, drafter, samples):
        return {"text_type": "t", "prompt": prompt, "drafter": drafter, "k": 0 if drafter == "none" else 2,
                "samples_s": samples, "proposed": 4, "accepted": 2, "verifications": 4,
                "draft_share": 0.0}

    rows = [rec(0, "none", [1.0, 1.1, 0.9, 1.0]), rec(1, "none", [2.0, 2.0, 2.1, 1.9]),
            rec(0, "ngram", [0.5, 0.55, 0.45, 0.5]), rec(1, "ngram", [1.0, 1.0, 1.05, 0.95])]
    (p,) = pooled_speedups(rows)
    assert p["speedup_x"] == pytest.approx(2.0) and p["verdict"] == "faster"
    assert p["relation"] == "faster than" and p["acceptance_rate"] == 0.5
    noisy = [rec(0, "none", [1.0, 1.2, 0.8]), rec(0, "ngram", [1.1, 0.9, 1.0])]
    assert pooled_speedups(noisy)[0]["verdict"] == "within the noise"


def test_cost_relation_claims_a_difference_only_beyond_the_margin():
    from labkit.experiments.speculation import COST_MARGIN, cost_relation

    # chapter 17's full run: a draft pass cost 0.68 of a step in the runs, 0.82 timed alone;
    # a guess 0.83: the first is a difference beyond 15%, the second is not
    assert cost_relation(0.68, 0.82) == "less than"
    assert cost_relation(0.83, 0.82) == "about the same as"
    assert cost_relation(0.82 * (1 + COST_MARGIN) * 1.01, 0.82) == "more than"
    assert cost_relation(0.82 * (1 + COST_MARGIN) * 0.99, 0.82) == "about the same as"
    assert cost_relation(1.0, 1.1, margin=0.05) == "less than"
    with pytest.raises(ValueError):
        cost_relation(0.0, 1.0)


def test_dispatch_reading_names_the_kernel_switch():
    from labkit.experiments.speculation import dispatch_reading

    # the full run's pass costs (time / one decode step) by tokens per pass
    run = {1: 1.0, 2: 1.198, 3: 1.654, 4: 1.701, 5: 1.390, 6: 1.412, 7: 1.436}
    text = dispatch_reading(4, run)
    assert "passes of 1 to 4 tokens went through labkit's C" in text
    assert "5 or more through oneDNN" in text
    assert "Passes of 3 and 4 tokens" in text and "1.65 and 1.70 against 1.39" in text
    assert "k = 2 and 3" in text and "not of the text" in text
    flat = {n: 1.0 + 0.05 * n for n in range(1, 8)}
    assert "no hump" in dispatch_reading(4, flat) and "not of the text" not in dispatch_reading(4, flat)
    assert "do not reach" in dispatch_reading(4, {1: 1.0, 2: 1.2})
    off = dispatch_reading(0, run)
    assert "no pass went through labkit's C" in off and "oneDNN's blocked" not in off


def test_best_setting_reading_says_edge_and_overlap():
    from labkit.experiments.speculation import best_setting_reading

    def row(k, low, high, text_type="repetitive"):
        return {"text_type": text_type, "drafter": "ngram", "k": k, "low_x": low, "high_x": high}

    # the full run's repetitive rows: k = 8 best, at the edge, overlapping k = 6
    rows = [row(1, 1.09, 1.19), row(2, 1.07, 1.18), row(4, 1.34, 1.44), row(6, 1.40, 1.50),
            row(8, 1.46, 1.58), row(8, 0.1, 5.0, text_type="prose")]
    text = best_setting_reading(rows, rows[4])
    assert "largest lookahead tried" in text and "overlaps that of k = 6," in text
    inside = [row(1, 1.0, 1.1), row(4, 1.5, 1.6), row(8, 1.2, 1.3)]
    text = best_setting_reading(inside, inside[1])
    assert "within the lookaheads tried (1 to 8)" in text and "lies above" in text


def test_c_kernel_rows_is_the_dispatch_the_passes_take(monkeypatch):
    import torch.nn.functional as F

    from labkit.experiments.speculation import c_kernel_rows
    from labkit.kernels import native
    from labkit.kernels.packed import available, pack_model

    if not available(torch.zeros(1)):
        pytest.skip("no oneDNN in this torch")
    model = make_tiny_llama(seed=7)
    packed = pack_model(model)
    assert c_kernel_rows(model) == 0                              # plain tensors: no C kernel
    assert c_kernel_rows(pack_model(model, native_gemv=False)) == 0
    monkeypatch.setitem(native._state, "lib", None)               # no C library here
    monkeypatch.setitem(native._state, "why", "switched off by the test")
    assert c_kernel_rows(packed) == 0
    # with a (fake) C library, record the rows each C call carried
    seen = []

    def fake_gemv(x, weight):
        seen.append(x.numel() // x.shape[-1])
        return F.linear(x, weight)

    monkeypatch.setitem(native._state, "lib", object())
    monkeypatch.setattr(native, "gemv", fake_gemv)
    rows = c_kernel_rows(packed)
    assert rows == native.gemv_max_rows()  # the setting when the model was packed
    assert c_kernel_rows(pack_model(model, max_rows=3)) == 3
    took_c = {}
    with torch.inference_mode():
        for n in range(1, rows + 3):
            cache = packed.new_cache(1, 16)
            packed(torch.tensor([[1, 2, 3]]), cache=cache)
            seen.clear()
            packed(torch.tensor([list(range(4, 4 + n))]), cache=cache)
            took_c[n] = bool(seen)
    assert took_c == {n: n <= rows for n in range(1, rows + 3)}
