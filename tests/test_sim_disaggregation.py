"""The disaggregation simulator against closed forms, the real engine's scheduler, and the
orderings a transfer cost must respect."""

import math
import random

import pytest
import torch

from conftest import make_tiny_llama
from labkit.models.llama import KVCache
from labkit.experiments import engine_steps as es
from labkit.sim import disaggregation as dg

STEP = dg.StepTime(base_s=0.025, prefill_token_s=0.001, decode_seq_s=0.002)


def test_step_time_is_the_linear_form_and_refuses_an_empty_step():
    assert STEP(100, 3) == pytest.approx(0.025 + 0.1 + 0.006)
    with pytest.raises(ValueError):
        STEP(0, 0)


def test_fit_recovers_known_coefficients_and_reports_its_residuals():
    grid = [(p, d) for p in (0, 16, 64, 256) for d in (0, 1, 8, 32) if p or d]
    exact = [dg.StepSample(p, d, (STEP(p, d),) * 3) for p, d in grid]
    fit = dg.fit_step_time(exact)
    for got, want in zip((fit.model.base_s, fit.model.prefill_token_s, fit.model.decode_seq_s),
                         (STEP.base_s, STEP.prefill_token_s, STEP.decode_seq_s)):
        assert got == pytest.approx(want, rel=1e-9)
    assert fit.max_abs_relative < 1e-9
    rng = random.Random(0)
    noisy = [dg.StepSample(p, d, (STEP(p, d) * (1 + rng.uniform(-0.05, 0.05)),)) for p, d in grid]
    fit = dg.fit_step_time(noisy)
    assert 0 < fit.rms_relative < 0.05 and fit.max_abs_relative < 0.1
    assert len(fit.relative_residuals) == len(grid)


def test_kv_bytes_per_token_matches_a_real_cache():
    tiny = make_tiny_llama()
    for config in (tiny.config, _smollm2_config()):
        cache = KVCache.empty(config, 1, 4)
        want = cache.nbytes(1)
        assert dg.kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, 4) == want
    assert dg.kv_bytes_per_token(30, 3, 64, 4) == 46_080


def _smollm2_config():
    from labkit.models.gguf_file import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5,
                       max_position_embeddings=8192)


# -- one request alone: the closed form -----------------------------------------------------------
def test_one_request_colocated_equals_the_closed_form():
    for prompt, out in ((100, 5), (1300, 3), (512, 1)):
        sim = dg.simulate(dg.Colocated(2), [dg.SimRequest(1.5, prompt, out)], STEP)
        times = [t - 1.5 for t in sim.traces[0].token_s]
        assert times == pytest.approx(dg.solo_token_times(dg.Colocated(2), prompt, out, STEP))
    # written out by hand: 1300 tokens in chunks of 512, 512, 276
    ttft = STEP(512, 0) * 2 + STEP(276, 0)
    assert dg.solo_token_times(dg.Colocated(), 1300, 3, STEP) == pytest.approx(
        [ttft, ttft + STEP(0, 1), ttft + 2 * STEP(0, 1)])


@pytest.mark.parametrize("first_token", dg.FIRST_TOKEN)
def test_one_request_disaggregated_pays_the_transfer_once(first_token):
    link = dg.Link(bandwidth_bytes_s=1e8, latency_s=0.003)
    system = dg.Disaggregated(1, 1, kv_bytes_per_token=46_080, link=link, first_token=first_token)
    sim = dg.simulate(system, [dg.SimRequest(0.0, 200, 4)], STEP)
    transfer = 46_080 * 200 / 1e8 + 0.003
    first = STEP(200, 0) + (transfer if first_token == "after_transfer" else 0)
    second = STEP(200, 0) + transfer + STEP(0, 1)
    want = [first, second, second + STEP(0, 1), second + 2 * STEP(0, 1)]
    assert sim.traces[0].token_s == pytest.approx(want)
    assert dg.solo_token_times(system, 200, 4, STEP) == pytest.approx(want)
    assert sim.traces[0].transfer_s == pytest.approx(transfer)
    free = dg.Disaggregated(1, 1, link=dg.Link())
    assert dg.simulate(free, [dg.SimRequest(0.0, 200, 4)], STEP).traces[0].token_s == pytest.approx(
        dg.solo_token_times(dg.Colocated(1), 200, 4, STEP))


def test_a_prefill_workers_link_sends_one_cache_at_a_time():
    link = dg.Link(bandwidth_bytes_s=1e8, latency_s=0.004)
    system = dg.Disaggregated(1, 2, kv_bytes_per_token=1000, link=link)
    both = [dg.SimRequest(0.0, 100, 3), dg.SimRequest(0.0, 300, 3)]  # prefilled in one step
    first, second = dg.simulate(system, both, STEP).traces
    busy = [1000 * 100 / 1e8, 1000 * 300 / 1e8]
    assert first.transfer_s == pytest.approx(busy[0] + 0.004)
    assert second.transfer_s == pytest.approx(busy[0] + busy[1] + 0.004)  # queued behind it
    assert first.token_s[0] == second.token_s[0] == pytest.approx(STEP(400, 0))


def test_well_spaced_requests_each_see_an_idle_system():
    requests = [dg.SimRequest(100.0 * i, 20 + 37 * i, 2 + i) for i in range(6)]
    for system in (dg.Colocated(3), dg.Disaggregated(2, 1, link=dg.Link(1e9, 0.01))):
        sim = dg.simulate(system, requests, STEP)
        for r, trace in zip(requests, sim.traces):
            got = [t - r.arrival_s for t in trace.token_s]
            assert got == pytest.approx(dg.solo_token_times(system, r.prompt_tokens, r.output_tokens, STEP))


# -- the scheduler is the engine's --------------------------------------------------------------
def test_colocated_steps_are_the_real_engines_steps():
    tiny = make_tiny_llama(vocab=97)
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 70, (12,), generator=g).tolist()
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]
    outputs = torch.randint(1, 14, (12,), generator=g).tolist()
    batching = dg.Batching(max_batched_tokens=32, max_num_seqs=5)
    run = es.engine_saturation(tiny, prompts, outputs, batching)
    sim = dg.simulate(dg.Colocated(1, batching), dg.saturation_requests(prompts, outputs), STEP)
    assert [(s.prefill_tokens, s.decode_seqs) for s in sim.steps] == \
        [(s.prefill_tokens, s.decode_seqs) for s in run.steps]
    assert [len(t) for t in run.token_ids] == outputs
    assert run.wall_s > 0 and run.output_tokens_per_s > 0


def test_step_grid_on_a_tiny_engine_has_every_cell():
    tiny = make_tiny_llama(vocab=97)
    ids = torch.randint(0, 97, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    samples = es.measure_step_times(tiny, ids, [0, 8, 40], [0, 2, 5], repeats=2, warmup=1, context=16)
    cells = {(s.prefill_tokens, s.decode_seqs) for s in samples}
    assert cells == {(p, d) for p in (0, 8, 40) for d in (0, 2, 5)} - {(0, 0)}
    assert all(len(s.samples_s) == 2 and s.median_s > 0 for s in samples)


# -- invariants of a loaded run --------------------------------------------------------------------
def _busy_requests(count=200, rate=8.0, seed=0):
    return dg.poisson_requests(count, rate, seed, prompt_median=200, output_median=40, cap=1024)


def test_every_request_gets_its_tokens_within_the_limits():
    requests = _busy_requests()
    batching = dg.Batching(max_batched_tokens=256, max_num_seqs=8)
    for system in (dg.Colocated(3, batching),
                   dg.Disaggregated(1, 2, link=dg.Link(1e9, 0.001), prefill_batching=batching,
                                    decode_batching=batching)):
        sim = dg.simulate(system, requests, STEP)
        for r, t in zip(requests, sim.traces):
            assert len(t.token_s) == r.output_tokens
            assert t.token_s[0] > r.arrival_s and t.token_s == sorted(t.token_s)
            assert all(g > 0 for g in t.itls_s)
        assert all(s.prefill_tokens + s.decode_seqs <= 256 for s in sim.steps)
        assert all(s.decode_seqs <= 8 for s in sim.steps)
        total = sum(s.prefill_tokens for s in sim.steps)
        assert total == sum(r.prompt_tokens for r in requests)


def test_more_transfer_cost_never_helps_the_first_token():
    requests = _busy_requests(120)
    by_bw = {}
    for bw in (math.inf, 1e9, 1e8, 3e7, 1e7):
        for first in dg.FIRST_TOKEN:
            system = dg.Disaggregated(2, 2, link=dg.Link(bw, 0.002), first_token=first)
            by_bw[bw, first] = dg.simulate(system, requests, STEP).traces
    bws = [math.inf, 1e9, 1e8, 3e7, 1e7]
    for fast, slow in zip(bws, bws[1:]):
        a, b = by_bw[fast, "after_transfer"], by_bw[slow, "after_transfer"]
        assert all(y.ttft_s >= x.ttft_s - 1e-12 for x, y in zip(a, b))
        assert all(y.transfer_s >= x.transfer_s - 1e-12 for x, y in zip(a, b))
        # streamed from the prefill worker, the first token does not see the link at all
        assert [t.ttft_s for t in by_bw[fast, "prefill"]] == [t.ttft_s for t in by_bw[slow, "prefill"]]


# -- goodput -------------------------------------------------------------------------------------
def test_slo_and_goodput_count_what_met_both_bounds():
    trace = dg.RequestTrace(0.0, 10, 3, [0.5, 0.625, 1.0])  # binary fractions: exact gaps
    assert trace.ttft_s == 0.5 and trace.max_itl_s == 0.375
    assert dg.SLO(0.5, 0.375).met(trace)
    assert not dg.SLO(0.4, 1).met(trace) and not dg.SLO(1, 0.25).met(trace)
    result = dg.SimResult("x", [trace, dg.RequestTrace(0.0, 10, 1, [2.0])], [])
    row = dg.summarize(result, dg.SLO(1.0, 0.5), rate=4.0)
    assert row["slo_met"] == 1 and row["goodput_rps"] == 2.0
    rows = [{"system": "x", "rate_rps": r, "attainment": a} for r, a in ((1, 1), (2, 0.95), (3, 0.5))]
    assert dg.best_rate(rows, "x") == 2 and dg.best_rate(rows, "y") == 0.0


def test_disaggregation_wins_until_the_link_is_slow():
    # prefill chunks make colocated decode steps long; a decode-only pool keeps them short
    requests = dg.poisson_requests(200, 2.0, 0, prompt_median=300, output_median=60, cap=1024)
    slo = dg.SLO(ttft_s=2.0, itl_s=0.1)
    colocated = dg.summarize(dg.simulate(dg.Colocated(4), requests, STEP), slo, 2.0)
    fast = dg.summarize(dg.simulate(dg.Disaggregated(2, 2, link=dg.Link(1e9)), requests, STEP), slo, 2.0)
    slow = dg.summarize(dg.simulate(dg.Disaggregated(2, 2, link=dg.Link(2e7)), requests, STEP), slo, 2.0)
    assert fast["goodput_rps"] > colocated["goodput_rps"] > slow["goodput_rps"]


def test_scaled_slo_and_the_link_sweep_helpers():
    slo = dg.scaled_slo(STEP)
    assert slo.itl_s == round(3 * STEP(0, 1), 3) and slo.ttft_s == round(4 * STEP(512, 0), 1)
    requests = dg.poisson_requests(80, 2.0, 0, prompt_median=300, output_median=40, cap=1024)
    rows = dg.link_sweep(dg.Disaggregated(2, 2, link=dg.Link(latency_s=0.001)), requests, 2.0,
                         STEP, dg.SLO(2.0, 0.1), [1e10, 1e8, 1e6])
    assert [(r["first_token"], r["bandwidth_bytes_s"]) for r in rows] == \
        [(f, b) for f in dg.FIRST_TOKEN for b in (1e10, 1e8, 1e6)]
    fake = [{"first_token": "prefill", "bandwidth_bytes_s": b, "goodput_rps": g}
            for b, g in ((1e10, 2.0), (1e9, 1.8), (1e8, 0.5), (1e7, 1.5))]
    assert dg.slowest_winning_link(fake, "prefill", floor=1.0) == 1e9  # 1e7 is past a loss
    assert dg.slowest_winning_link(fake, "prefill", floor=3.0) is None


def test_solo_check_agrees_for_both_systems():
    row = dg.solo_check(dg.Colocated(2), 300, 6, STEP)
    assert row["equal"] and row["ttft_sim_s"] == pytest.approx(STEP(300, 0))
    assert row["per_token_sim_s"] == pytest.approx(STEP(0, 1))
    disagg = dg.Disaggregated(1, 1, link=dg.Link(1e8, 0.01))
    assert dg.solo_check(disagg, 300, 6, STEP)["equal"]
