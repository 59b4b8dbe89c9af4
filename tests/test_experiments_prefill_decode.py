"""labkit.experiments.prefill_decode: chunked prefill is exact, the two-request timeline is right, shares add up."""

import math

import pytest
import torch

from labkit.experiments import prefill_decode as phases
from labkit.models.gguf_file import LlamaConfig
from labkit.models.llama import Llama

TINY = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
                   rms_norm_eps=1e-5, max_position_embeddings=512)


def random_state(c: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face Llama names."""
    g = torch.Generator().manual_seed(seed)
    E, D, I = c.hidden_size, c.head_dim, c.intermediate_size

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    state = {"model.embed_tokens.weight": r(c.vocab_size, E), "model.norm.weight": 1 + r(E)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": 1 + r(E),
                  p + "post_attention_layernorm.weight": 1 + r(E),
                  p + "self_attn.q_proj.weight": r(c.num_heads * D, E),
                  p + "self_attn.k_proj.weight": r(c.num_kv_heads * D, E),
                  p + "self_attn.v_proj.weight": r(c.num_kv_heads * D, E),
                  p + "self_attn.o_proj.weight": r(E, c.num_heads * D),
                  p + "mlp.gate_proj.weight": r(I, E), p + "mlp.up_proj.weight": r(I, E),
                  p + "mlp.down_proj.weight": r(E, I)}
    return state


class CharTokenizer:
    """A toy tokenizer: one token per character (ids below the tiny vocabulary)."""

    eos_token_id = None

    def encode(self, text):
        return [ord(ch) % 97 for ch in text]

    def decode(self, ids, **_):
        return "".join(chr(65 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def tiny():
    model = Llama(TINY, random_state(TINY))
    model.tokenizer = CharTokenizer()
    return model


def ids(n, seed=1):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("chunk", [1, 7, 16, 40])
def test_chunked_prefill_equals_one_shot(tiny, chunk):
    prompt = ids(40)
    one_shot = tiny(torch.tensor([prompt]))
    chunked = phases.chunked_prefill(tiny, prompt, chunk)
    assert chunked.shape == one_shot.shape
    torch.testing.assert_close(chunked, one_shot, rtol=0, atol=1e-5)
    last = phases.chunked_prefill(tiny, prompt, chunk, last_only=True)
    torch.testing.assert_close(last, one_shot[:, -1:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 16])
def test_two_request_timeline_counts_and_gap(tiny, chunk):
    t = phases.two_request_timeline(tiny, ids(4), ids(64, seed=2), chunk=chunk,
                                    short_tokens=12, long_tokens=3, arrive_after=4)
    short, long = t["short"], t["long"]
    assert len(short["token_ids"]) == len(short["token_times"]) == 12
    assert len(long["token_ids"]) == len(long["token_times"]) == 3
    assert short["token_times"] == sorted(short["token_times"])
    kinds = [(name, kind, n) for name, kind, _, _, n in t["passes"]]
    prefill = [n for name, kind, n in kinds if name == "long" and kind == phases.PREFILL]
    assert sum(prefill) == 64 and len(prefill) == (1 if chunk is None else 4)
    # one forward pass per token, plus the long request's middle chunks
    assert len(kinds) == 12 + 3 + len(prefill) - 1
    # the short request's tokens equal those it makes alone (greedy, its own cache)
    alone = phases.two_request_timeline(tiny, ids(4), ids(8, seed=2), short_tokens=12,
                                        arrive_after=99)
    # (beside the long request its steps are batched: another numerical path, so up to the
    # near-tie rule against one sequence's greedy loop, as alone)
    from conftest import TINY_LOGIT_ERROR, assert_greedy_near, greedy_reference_scores

    want, scores = greedy_reference_scores(tiny, ids(4), 12)
    assert_greedy_near([want] * 2, [alone["short"]["token_ids"], short["token_ids"]], [scores] * 2,
                       TINY_LOGIT_ERROR, what="the short request alone and beside the long one")
    gaps = phases.gap_summary(t)
    assert gaps["before_gaps"] == 3 and gaps["during_gaps"] >= 1 and gaps["after_gaps"] >= 1
    # the gap that spans the long prefill contains all of its passes
    long_prefill = sum(d for name, kind, _, d, _ in t["passes"]
                       if name == "long" and kind == phases.PREFILL)
    if chunk is None:
        assert gaps["during_max_s"] >= long_prefill
    # last prefill logits equal a one-shot prefill's
    ref = tiny(torch.tensor([ids(64, seed=2)]))[0, -1]
    torch.testing.assert_close(long["last_logits"], ref, rtol=0, atol=1e-5)


def test_phase_shares_sum_to_one(tiny):
    records = phases.phase_shares(tiny, [8, 32], [1, 4], ids=ids(32), repeats=1)
    assert [(r["prompt"], r["reply"]) for r in records] == [(8, 1), (8, 4), (32, 1), (32, 4)]
    for r in records:
        assert r["reply_tokens"] == r["reply"]
        assert r["prefill_share"] + r["decode_share"] == pytest.approx(1.0)
        assert r["ttft_s"] + r["decode_s"] == pytest.approx(r["total_s"])
        assert 0 < r["prefill_share"] <= 1


def test_ttft_and_decode_curves(tiny):
    prompt = ids(65)
    ttft = phases.ttft_curve(tiny, [8, 32], repeats=2, ids=prompt)
    assert [r["length"] for r in ttft] == [8, 32] and [r["tokens"] for r in ttft] == [8, 32]
    for r in ttft:
        assert r["repeats"] == 2 and r["median_s"] > 0
        assert r["prefill_s"] <= r["median_s"] * 1.5
    dec = phases.decode_curve(tiny, [64, 4, 16], steps=3, ids=prompt)
    assert [r["position"] for r in dec] == [4, 16, 64] and all(r["repeats"] == 3 for r in dec)


def test_decode_step_at_a_position_is_a_real_continuation(tiny):
    """The rewound cache gives the same logits as running the p + 1 tokens from scratch."""
    prompt = ids(33)
    cache = tiny.new_cache(1, 33)
    tiny(torch.tensor([prompt]), cache=cache)
    cache.length = 20
    step = tiny(torch.tensor([[prompt[20]]]), cache=cache)[0, -1]
    full = tiny(torch.tensor([prompt[:21]]))[0, -1]
    torch.testing.assert_close(step, full, rtol=0, atol=1e-5)


def test_slopes_and_fit():
    n = [16, 32, 64, 128]
    s = phases.loglog_slopes(n, [x * 1e-3 for x in n])
    assert all(r["slope"] == pytest.approx(1.0) for r in s)
    q = phases.loglog_slopes(n, [x * x for x in n])
    assert all(r["slope"] == pytest.approx(2.0) for r in q)
    fit = phases.fit_linear_quadratic(n, [0.5 + 0.01 * x + 1e-4 * x * x for x in n])
    assert fit["a"] == pytest.approx(0.5, rel=1e-6) and fit["c"] == pytest.approx(1e-4, rel=1e-6)
    assert 0 < fit["quadratic_share_at_max"] < 1
    assert math.isclose(phases.fit_linear_quadratic(n, [1.0] * 4)["c"], 0.0, abs_tol=1e-12)


def test_reference_phase_times_on_the_cpu():
    """The GPU section's code path, exercised on the CPU with a tiny transformers Llama."""
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ref = LlamaForCausalLM(HFConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2)).eval()
    out = phases.reference_phase_times(ref, ids(16), [4, 16], device="cpu", repeats=1, steps=2)
    assert [r["length"] for r in out] == [4, 16] and all(r["decode_s"] > 0 for r in out)


def test_schedules_take_turns_and_the_verdict_follows_the_runs(tiny):
    got = phases.schedules_in_turns(tiny, ids(4), ids(32, seed=2), {"one pass": None, "chunks": 8}, rounds=3,
                                    short_tokens=6, long_tokens=2, arrive_after=2)
    for name in ("one pass", "chunks"):
        assert len(got[name]["ttft_s"]) == len(got[name]["prefill_s"]) == 3
        assert len(got[name]["worst_gap_s"]) == 3
        last_gap = phases.gap_summary(got[name]["timeline"])["worst_gap_s"]
        assert got[name]["worst_gap_s"][-1] == last_gap
        assert got[name]["ttft_s"][-1] == phases.long_request_times(got[name]["timeline"])["ttft_s"]
    assert got["chunks"]["timeline"]["chunk"] == 8 and got["one pass"]["timeline"]["chunk"] is None
    faster = phases.chunking_verdict([1.0, 1.02, 0.98], [2.0, 2.1, 1.9])
    assert faster.startswith("chunking did not cost it") and "all 3 runs of each" in faster
    assert phases.chunking_verdict([2.0, 2.1, 1.9], [1.0, 1.02, 0.98]).startswith("chunking cost it")
    assert "within the noise" in phases.chunking_verdict([1.0, 1.2, 0.9], [1.05, 0.92, 1.15])
    # the bootstrap interval excludes 1 here, but one chunked run was slower than one
    # one-pass run: no direction is claimed
    overlap = phases.chunking_verdict([1.0, 1.0, 1.0, 1.0, 1.6], [2.0, 2.0, 2.0, 2.0, 1.5])
    assert "within the noise" in overlap and ":" not in overlap  # the prose puts it after a colon


def test_prefill_scores_follow_what_the_model_hands_sdpa(tiny, monkeypatch):
    """The score count is read independently off the real calls: a spy on SDPA counts, per
    call, the lower triangle for `is_causal` (the kernel skips the masked half) and the whole
    [T, S] rectangle otherwise (a mask, or a single query), in one pass and in chunks."""
    real = torch.nn.functional.scaled_dot_product_attention
    counted = []

    def spy(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        steps, keys = q.shape[-2], k.shape[-2]
        if is_causal:
            assert steps == keys and attn_mask is None
            counted.append(steps * (steps + 1) // 2)
        else:
            counted.append(steps * keys)
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    prompt = ids(10)
    for chunk in (None, 10, 4, 3, 1):
        counted.clear()
        phases.chunked_prefill(tiny, prompt, chunk or len(prompt))
        assert sum(counted) == TINY.num_layers * phases.prefill_scores(10, chunk), chunk
    # by hand: one pass 10 x 11 / 2 = 55; chunks of 4: 4 x 5 / 2 + 4 x 8 + 2 x 10 = 62
    assert phases.prefill_scores(10) == 55 and phases.prefill_scores(10, 4) == 62
    assert phases.scored_share(8, 8) == phases.scored_share(8, 100) == 1.0
    assert phases.scored_share(10, 4) == pytest.approx(62 / 55)
    with pytest.raises(ValueError):
        phases.scored_share(8, 0)


def test_decode_line_fits_every_position_and_bounds_its_ratio():
    positions = [16, 256, 1024, 4096]
    samples = [[0.020, 0.030, 0.021, 0.019, 0.040],  # a noisy first position
               [0.022, 0.021, 0.023, 0.022, 0.022],
               [0.025, 0.026, 0.024, 0.025, 0.025],
               [0.034, 0.035, 0.033, 0.034, 0.034]]
    line = phases.decode_line(positions, samples)
    # independent: the closed-form least-squares line through the medians
    import statistics
    meds = [statistics.median(s) for s in samples]
    mp, mt = statistics.fmean(positions), statistics.fmean(meds)
    b = (sum((p - mp) * (t - mt) for p, t in zip(positions, meds))
         / sum((p - mp) ** 2 for p in positions))
    a = mt - b * mp
    assert line["a_s"] == pytest.approx(a) and line["b_s"] == pytest.approx(b)
    assert line["ratio"] == pytest.approx((a + b * 4096) / (a + b * 16))
    assert line["low"] < line["ratio"] < line["high"]
    assert phases.decode_line(positions, samples) == pytest.approx(line)  # seeded
    with pytest.raises(ValueError):
        phases.decode_line([16, 16], samples[:2])
    with pytest.raises(ValueError):
        phases.decode_line([16, 32], [[0.1, 0.1], [0.1, 0.1]])


def test_default_schedule_gives_compare_enough_repeats():
    from labkit.util.compare import MIN_SAMPLES

    for length in (16, 512, 1024, 2048, 4096, 8192):
        warmup, repeats = phases.default_schedule(length)
        assert repeats >= MIN_SAMPLES and warmup >= 0


def test_decode_growth_words_claim_a_side_only_outside_the_interval():
    def line(ratio, low, high):
        return {"ratio": ratio, "low": low, "high": high, "confidence": 0.95}

    assert "more than the bytes" in phases.decode_growth_words(line(1.58, 1.45, 1.70), 1.35)
    assert "less than the bytes" in phases.decode_growth_words(line(1.10, 1.02, 1.20), 1.35)
    # the ratio lies above the bytes' but its interval does not: no side is claimed
    about = phases.decode_growth_words(line(1.58, 1.30, 1.80), 1.35)
    assert "about as the bytes" in about and "within the noise" in about
    assert "about as the bytes" in phases.decode_growth_words(line(1.20, 1.05, 1.40), 1.35)


def test_gap_verdict_claims_a_direction_only_when_the_runs_are_apart():
    assert phases.gap_verdict([0.4, 0.45, 0.42], [3.2, 3.3, 3.25]).startswith("7.7 times shorter")
    assert phases.gap_verdict([3.2, 3.3, 3.25], [0.4, 0.45, 0.42]).startswith("longer chunked")
    # the bootstrap interval excludes 1, but one chunked run was longer than a one-pass run
    overlap = phases.gap_verdict([1.0, 1.0, 1.0, 1.0, 1.6], [2.0, 2.0, 2.0, 2.0, 1.5])
    assert overlap.startswith("not clearly shorter")


def test_position_agreement_excuses_only_near_ties():
    ref = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 1.0, 1.001], [5.0, 0.0, 0.0]]])
    same = phases.position_agreement(ref, ref.clone())
    assert same.ok and same.exact == 3 and same.excused == 0
    # position 1: the reference's top two differ by 0.001; a path 0.002 off may flip them
    flipped = ref.clone()
    flipped[0, 1, 1] += 0.002
    near = phases.position_agreement(ref, flipped)
    assert near.ok and near.exact == 2 and near.excused == 1  # default tolerance 2 x 0.002
    # the same flip with a stated tolerance below the gap fails
    assert not phases.position_agreement(ref, flipped, tolerance=0.0005).ok
    # a flip at a wide gap is never excused, and later positions are still compared
    wide = ref.clone()
    wide[0, 0, 1] += 1.5
    summary = phases.position_agreement(ref, wide, tolerance=0.01)
    assert not summary.ok and summary.failed == 1 and summary.exact == 2
    with pytest.raises(ValueError):
        phases.position_agreement(ref, ref[:, :2])


def test_position_agreement_at_the_stated_tolerance_can_fail():
    """The default tolerance comes from these two tensors and excuses any flip: here a path
    0.01 off flips a gap of 0.015 (within 2 x 0.01). At the book's stated tolerance, twice
    the float32 logit error of 1e-3, the same flip fails, as chapter 9's check needs."""
    from labkit.experiments.path_agreement import LOGIT_ERROR, tolerance

    ref = torch.tensor([[1.0, 1.015, 0.0], [3.0, 0.0, 0.0]])
    cand = ref.clone()
    cand[0, 0] += 0.01
    cand[0, 1] -= 0.01
    assert phases.position_agreement(ref, cand).excused == 1  # the vacuous default
    stated = phases.position_agreement(ref, cand, tolerance=tolerance())
    assert tolerance() == 2 * LOGIT_ERROR and not stated.ok and stated.failed == 1
    tie = torch.tensor([[1.0, 1.0001, 0.0]])  # a gap of 1e-4, flipped by 2e-4: within 2e-3
    flipped = torch.tensor([[1.0002, 1.0001, 0.0]])
    assert phases.position_agreement(tie, flipped, tolerance=tolerance()).excused == 1


def test_attention_prefill_calls_are_the_calls_the_model_makes(tiny, monkeypatch):
    """`prefill_attention_calls` must time what the model hands SDPA, call for call: a spy
    records each call's query and key lengths, causal flag and mask, in the model's chunked
    prefill (one layer's share) and in the helper, for one pass and for chunks."""
    real = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def spy(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        mask = None if attn_mask is None else attn_mask.tolist()
        seen.append((tuple(q.shape), tuple(k.shape), is_causal, mask))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k, v = phases.prefill_attention_inputs(TINY, 10)
    for chunk in (None, 4, 3):
        seen.clear()
        phases.chunked_prefill(tiny, ids(10), chunk or 10)
        per_layer = seen[::TINY.num_layers]  # each pass calls every layer in turn: layer 0's
        seen.clear()
        phases.prefill_attention_calls(q, k, v, chunk)
        assert seen == per_layer, chunk


def test_attention_prefill_times_take_turns(monkeypatch):
    order = []
    monkeypatch.setattr(phases, "prefill_attention_calls",
                        lambda q, k, v, chunk=None: order.append("chunked" if chunk else "one"))
    got = phases.attention_prefill_times(TINY, 8, 4, rounds=3, warmup=1)
    assert order == ["one", "chunked"] * 4
    assert sorted(got) == ["chunked", "one pass"] and all(len(s) == 3 for s in got.values())


def test_the_drawn_round_is_the_median_one(tiny, monkeypatch):
    """The chapter draws and quotes the round whose long-request TTFT is the median, never
    the last (which may be the slowest)."""
    assert phases.median_index([2.0, 3.0, 1.0]) == 0
    assert phases.median_index([5.0, 1.0, 3.0, 2.0]) == 3  # the lower middle of four
    ttfts = iter([2.0, 9.0, 3.0, 8.0, 1.0, 7.0])  # one pass, chunks, one pass, ...

    def fake(model, short, long, chunk=None, **kwargs):
        t = next(ttfts)
        return {"chunk": chunk, "arrival": 0.0, "passes": [("long", phases.PREFILL, 0.0, t, 4)],
                "short": {"token_times": [0.0, t + 0.1]}, "long": {"token_times": [t]}}

    monkeypatch.setattr(phases, "two_request_timeline", fake)
    got = phases.schedules_in_turns(tiny, ids(2), ids(4), {"one pass": None, "chunks": 2},
                                    rounds=3)
    assert phases.long_request_times(got["one pass"]["median_timeline"])["ttft_s"] == 2.0
    assert phases.long_request_times(got["chunks"]["median_timeline"])["ttft_s"] == 8.0
    assert len(got["chunks"]["timelines"]) == 3


def test_each_token_keeps_the_scores_it_was_chosen_from(tiny):
    t = phases.two_request_timeline(tiny, ids(4), ids(12, seed=2), chunk=5, short_tokens=5,
                                    long_tokens=2, arrive_after=2)
    for name in ("short", "long"):
        steps = t[name]["step_logits"]
        assert [int(s.argmax()) for s in steps] == t[name]["token_ids"]


def test_decode_growth_needs_the_practical_margin():
    def line(ratio, low, high):
        return {"ratio": ratio, "low": low, "high": high, "confidence": 0.95}

    tight = line(1.37, 1.36, 1.39)  # clears 1.35 by 0.01: noise between sections
    assert "more than the bytes" in phases.decode_growth_words(tight, 1.35)
    words = phases.decode_growth_words(tight, 1.35, margin=0.05)
    assert "about as the bytes" in words and "within 5% of it" in words
    assert "more than the bytes" in phases.decode_growth_words(line(1.5, 1.45, 1.55), 1.35, 0.05)
    assert "less than the bytes" in phases.decode_growth_words(line(1.2, 1.18, 1.25), 1.35, 0.05)


def test_slope_dips_name_where_the_slope_fell():
    slopes = phases.loglog_slopes([16, 32, 64, 128, 256], [1.0, 1.3, 2.4, 4.0, 6.0])
    dips = phases.slope_dips(slopes)
    assert [(d["from"], d["to"]) for d in dips] == [(64, 128), (128, 256)]
    assert all(d["slope"] < d["before"] for d in dips)
    assert phases.slope_dips(phases.loglog_slopes([1, 2, 4], [1.0, 1.5, 3.0])) == []


def test_decode_bend_is_claimed_only_when_both_stretches_grow():
    positions = [16, 64, 256, 512, 1024, 2048, 3072, 4096]
    bent = [50.0, 50.2, 50.7, 51.4, 52.8, 55.6, 61.0, 67.5]  # 2.7 us, then 5.9 us a position
    assert "steepens past about 2,048" in phases.decode_bend_words(positions, bent)
    straight = [50 + 0.003 * p for p in positions]
    assert "no bend" in phases.decode_bend_words(positions, straight)
    noisy = [60.0, 40.0, 39.0, 38.0]  # falling: negative growth is noise, never a bend
    assert "no bend" in phases.decode_bend_words([16, 128, 256, 512], noisy)
