"""The paging simulator's accounting, and the engine helpers on a tiny random Llama."""

import pytest

from conftest import TINY_LOGIT_ERROR, assert_greedy_near, greedy_reference_scores

from labkit.sim.paging import (Request, block_size_sweep, chat_requests, contiguous_greedy,
                               paged_matches_contiguous, parallel_sampling_blocks, preemption_trace,
                               simulate, trace_block_table)

REQS = chat_requests(400, seed=5)


@pytest.mark.parametrize("allocator,block", [("contiguous", 16), ("paged", 1), ("paged", 16), ("paged", 64)])
def test_accounting_holds_every_step(allocator, block):
    r = simulate(REQS, budget=8192, allocator=allocator, block_size=block)
    assert r.finished == len(REQS)
    assert r.steps == len(r.running) == len(r.stored) == len(r.held)
    for stored, held, running in zip(r.stored, r.held, r.running):
        assert 0 < stored <= held <= r.budget
        assert running >= 1
    assert r.waiting[-1] == 0


def test_every_request_runs_exactly_its_output():
    reqs = [Request(10, 5), Request(3, 1), Request(50, 40)]
    r = simulate(reqs, budget=4096, allocator="paged", block_size=16)
    # every step each running sequence generates one token, so steps x running = outputs
    assert sum(r.running) == sum(q.output for q in reqs)
    assert r.steps == max(q.output for q in reqs)


def test_contiguous_concurrency_is_budget_over_reservation():
    r = simulate(REQS, budget=32_768, allocator="contiguous", reserve=1024)
    assert r.max_running == 32768 // 1024
    assert r.mean_running == 32  # saturated steps: always full
    assert r.preemptions == 0


def test_contiguous_rejects_a_request_that_cannot_fit():
    with pytest.raises(ValueError):
        simulate([Request(1000, 100)], allocator="contiguous", reserve=1024)


def test_block_waste_is_below_one_block_per_sequence():
    for block in (1, 8, 32):
        r = simulate(REQS, budget=8192, allocator="paged", block_size=block)
        for stored, held, running in zip(r.stored, r.held, r.running):
            assert held - stored < block * running
        if block == 1:
            assert r.fragmentation == 0


def test_paged_holds_more_sequences_and_finishes_sooner():
    c = simulate(REQS, budget=8192, allocator="contiguous", reserve=1024)
    p = simulate(REQS, budget=8192, allocator="paged", block_size=16)
    assert p.mean_running > 2 * c.mean_running
    assert p.steps < c.steps
    assert p.utilisation > c.utilisation


def test_preemption_recomputes_and_still_finishes():
    reqs = [Request(8, 60) for _ in range(20)]
    r = simulate(reqs, budget=256, allocator="paged", block_size=16)
    assert r.finished == 20 and r.preemptions > 0 and r.recomputed_tokens > 0
    # the recomputation is work: counted on top of every prompt and output token
    assert r.tokens_computed == 20 * (8 + 60) + r.recomputed_tokens
    c = simulate(reqs, budget=2048, allocator="contiguous", reserve=68)
    assert c.preemptions == 0 and c.tokens_computed == 20 * (8 + 60)


def test_seeded_reproducibility():
    a = simulate(chat_requests(300, seed=9), budget=8192)
    b = simulate(chat_requests(300, seed=9), budget=8192)
    c = simulate(chat_requests(300, seed=10), budget=8192)
    assert a.summary() == b.summary() and a.running == b.running
    assert a.running != c.running


def test_block_size_sweep_rows():
    rows = block_size_sweep(REQS[:100], sizes=(1, 16, 128), budget=4096)
    assert [r["block_size"] for r in rows] == [1, 16, 128]
    assert rows[0]["entries_per_sequence"] > rows[2]["entries_per_sequence"]
    assert rows[0]["waste_per_sequence"] <= rows[2]["waste_per_sequence"]


# -- engine helpers on a tiny model ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from conftest import make_tiny_llama

    return make_tiny_llama(seed=3)


def test_trace_block_table_grows_a_block_at_a_time(tiny):
    from labkit.engine.llm_engine import EngineConfig, LLMEngine
    from labkit.sampling import SamplingParams

    engine = LLMEngine(tiny, EngineConfig(block_size=4, kv_cache_tokens=64))
    rows = trace_block_table(engine, list(range(1, 7)), SamplingParams(temperature=0.0, max_tokens=8,
                                                                        ignore_eos=True), steps=20)
    assert rows[-1]["status"] == "finished" and len(rows) == 8
    for row in rows[:-1]:
        assert len(row["block_table"]) == -(-row["computed"] // 4)
        assert row["blocks_used"] == len(row["block_table"])
        assert row["blocks_used"] + row["blocks_free"] == 16
    assert rows[-1]["blocks_used"] == 0


def test_parallel_sampling_shares_prompt_blocks(tiny):
    from labkit.sampling import SamplingParams

    got = parallel_sampling_blocks(tiny, list(range(1, 39)), 4,
                                   SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True),
                                   kv_tokens=512, block_size=8)
    assert got["peak_blocks_shared"] < got["peak_blocks_separate"]
    assert got["copies_on_write_shared"] == 3 and got["copies_on_write_separate"] == 0
    assert len(got["samples_shared"]) == 4


def test_preemption_trace_and_paged_equals_contiguous(tiny):
    from labkit.sampling import SamplingParams

    prompts = [list(range(1 + i, 13 + i)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs, transitions, stats = preemption_trace(tiny, prompts, params, kv_tokens=48, block_size=4)
    assert stats.preemptions > 0
    assert any(old == "running" and new == "preempted" for _, _, _, old, new in transitions)
    # the paged engine (preempted, recomputed, batched) against one contiguous cache: two
    # paths, equal up to the near-tie rule (contiguous_greedy is greedy_reference's loop: exact)
    refs = [greedy_reference_scores(tiny, p, 12) for p in prompts]
    assert [t for t, _ in refs] == [contiguous_greedy(tiny, p, 12) for p in prompts]
    assert_greedy_near([t for t, _ in refs], [o.token_ids for o in outs], [s for _, s in refs], TINY_LOGIT_ERROR,
                       what="a preempted paged engine against the contiguous cache")
    rows = paged_matches_contiguous(tiny, prompts, 12, kv_tokens=256, block_size=4)
    assert [r["contiguous"] for r in rows] == [t for t, _ in refs]
    assert_greedy_near([r["contiguous"] for r in rows], [r["paged"] for r in rows], [s for _, s in refs],
                       TINY_LOGIT_ERROR, what="one paged batch against the contiguous cache")


def test_scaled_requests_fit_their_reservation():
    from labkit.sim.paging import scaled_chat_requests

    reqs = scaled_chat_requests(200, 256, seed=1)
    assert all(r.prompt + r.output <= 256 for r in reqs)
    assert scaled_chat_requests(50, 1024, seed=2) == chat_requests(50, seed=2)


def test_engine_concurrency_reserved_vs_paged(tiny):
    from labkit.sim.paging import engine_concurrency

    prompts = [list(range(1 + i, 9 + i)) for i in range(10)]
    outputs = [8] * 10
    reserved = engine_concurrency(tiny, prompts, outputs, budget=128, reserve=64, block_size=8)
    paged = engine_concurrency(tiny, prompts, outputs, budget=128, reserve=None, block_size=8)
    assert reserved["max_running"] == 2
    assert paged["mean_running"] > reserved["mean_running"]
    assert paged["tokens"] == reserved["tokens"]


def test_engine_runs_count_recomputed_tokens_as_work(tiny):
    """The recomputation counted sequence by sequence equals what the paged run computed
    beyond the reserved one (which never preempts): an independent total."""
    from labkit.sim.paging import engine_concurrency

    prompts = [list(range(1 + i, 9 + i)) for i in range(10)]
    outputs = [8] * 10
    reserved = engine_concurrency(tiny, prompts, outputs, budget=128, reserve=64, block_size=8)
    paged = engine_concurrency(tiny, prompts, outputs, budget=128, reserve=None, block_size=8)
    assert reserved["preemptions"] == 0 and reserved["recomputed_tokens"] == 0
    assert paged["preemptions"] > 0
    assert paged["recomputed_tokens"] == paged["tokens_computed"] - reserved["tokens_computed"] > 0
    assert sum(paged["step_tokens"]) == paged["tokens_computed"]
    assert 0 < paged["recompute_s"] < sum(paged["step_s"]) <= paged["wall_s"]
    assert reserved["recompute_s"] == 0


def test_recompute_time_is_each_steps_token_share(tiny):
    """With a clock that advances one unit a call, every step lasts 1, so the attributed
    time is the sum over steps of recomputed tokens / tokens of the step."""
    import itertools

    from labkit.sim.paging import engine_concurrency

    ticks = itertools.count()
    prompts = [list(range(1 + i, 9 + i)) for i in range(10)]
    run = engine_concurrency(tiny, prompts, [8] * 10, budget=128, reserve=None, block_size=8,
                             clock=lambda: float(next(ticks)))
    assert run["step_s"] == [1.0] * run["steps"]
    assert run["wall_s"] == 2 * run["steps"] + 1  # a start, two reads a step, an end
    share = sum(r / n for r, n in zip(run["recomputed_per_step"], run["step_tokens"]))
    assert run["recompute_s"] == pytest.approx(share) and share > 0


def test_timed_engine_runs_interleave_and_repeat(tiny, monkeypatch):
    from labkit.sim import paging

    order = []
    monkeypatch.setattr(paging, "engine_concurrency",
                        lambda model, p, o, budget, reserve, block, logprobs: order.append(reserve) or {})
    runs = paging.timed_engine_runs(tiny, [[1, 2]], [2], 64, {"reserved": 32, "paged": None}, 3)
    assert order == [32, None] * 3 and [len(v) for v in runs.values()] == [3, 3]
    with pytest.raises(ValueError):
        paging.timed_engine_runs(tiny, [[1, 2]], [2], 64, {"paged": None}, 0)


def test_timed_summary_reads_the_repeats():
    from labkit.sim.paging import timed_summary

    runs = [{"steps": 10, "mean_running": 3.0, "preemptions": 2, "tokens_computed": 90,
             "recomputed_tokens": 12, "wall_s": w, "recompute_s": w / 10} for w in (2.0, 1.0, 4.0)]
    row = timed_summary("paged", runs)
    assert (row["wall_median_s"], row["wall_fastest_s"], row["wall_slowest_s"]) == (2.0, 1.0, 4.0)
    assert row["step_mean_ms"] == pytest.approx(200.0) and row["recompute_median_s"] == pytest.approx(0.2)
    assert row["recomputed_tokens"] == 12 and row["allocator"] == "paged"
