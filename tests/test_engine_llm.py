"""LLMEngine on a tiny random Llama: a greedy request's tokens are the same alone, in any
batch, after a prefix-cache hit and after preemption (the engine's paged, batched path against
one sequence through a contiguous cache: equal up to the near-tie rule, `assert_solo_greedy`);
parallel samples share blocks; abort, bad input and streaming leave no block behind."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import assert_solo_greedy, make_tiny_llama, stream_sample
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.scheduler import SchedulerConfig
from labkit.engine.sequence import Status
from labkit.sampling import SamplingParams

VOCAB = 97


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(vocab=VOCAB)


def engine(model, tokens=256, block=4, **sched):
    return LLMEngine(model, EngineConfig(block_size=block, kv_cache_tokens=tokens,
                                         scheduler=SchedulerConfig(**sched)))


def prompts(seed, count, longest=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest, (count,), generator=g)
    return [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in lengths]


def greedy(n):
    """Greedy, with each token's log-probability: the near-tie rule measures the paths' error."""
    return SamplingParams(temperature=0.0, max_tokens=n, logprobs=0)


@pytest.mark.parametrize("sched", [dict(), dict(max_batched_tokens=7), dict(chunked_prefill=False),
                                   dict(batching="static", static_batch_size=3), dict(policy="shortest")])
def test_batched_greedy_equals_solo(tiny, sched):
    ps = prompts(0, 8)
    eng = engine(tiny, **sched)
    outs = eng.generate(ps, greedy(12))
    assert_solo_greedy(tiny, ps, [o.samples[0] for o in outs], 12)
    assert all(o.samples[0].finish_reason == "length" for o in outs)
    eng.check_invariants()
    assert eng.stats().blocks_used == 0 and eng.stats().blocks_free == eng.blocks.num_blocks


def test_preemption_recomputes_and_keeps_the_tokens(tiny):
    ps = prompts(1, 10, longest=30)
    eng = engine(tiny, tokens=96, max_num_seqs=10)  # far too few blocks for 10 at once
    outs = eng.generate(ps, greedy(16))
    assert eng.stats().preemptions > 0
    assert_solo_greedy(tiny, ps, [o.samples[0] for o in outs], 16)
    states = {(t[3], t[4]) for t in eng.transitions}
    assert ("running", "preempted") in states and ("preempted", "running") in states
    eng.check_invariants()


def test_prefix_hit_gives_the_same_tokens_faster(tiny):
    shared = prompts(2, 1, longest=2)[0] + list(range(32))
    eng = engine(tiny)
    cold = eng.generate([shared + [5]], greedy(8))[0]
    warm = eng.generate([shared + [6]], greedy(8))[0]
    assert cold.cached_prompt_tokens == 0 and warm.cached_prompt_tokens >= 32
    assert_solo_greedy(tiny, [shared + [6]], warm.samples, 8)
    assert eng.stats().prefix_hits >= 8


def test_salt_scopes_the_prefix_cache(tiny):
    ids = list(range(40))
    eng = engine(tiny)
    eng.add_request(ids, greedy(2), cache_salt="a", request_id="a1")
    while eng.has_unfinished():
        eng.step()
    eng.add_request(ids, greedy(2), cache_salt="b", request_id="b1")
    eng.add_request(ids, greedy(2), cache_salt="a", request_id="a2")
    while eng.has_unfinished():
        eng.step()
    assert eng.output("b1").cached_prompt_tokens == 0
    assert eng.output("a2").cached_prompt_tokens == 36


def test_parallel_samples_share_the_prompt_and_draw_different_streams(tiny):
    eng = engine(tiny)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    out = eng.generate([list(range(10))], params, n=4)[0]
    assert len(out.samples) == 4
    assert len({tuple(s.token_ids) for s in out.samples}) > 1
    assert eng.stats().copies_on_write >= 1  # 10 tokens: the partial third block was shared
    again = engine(tiny).generate([list(range(10))], params, n=4)[0]  # the same path and steps: exact
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in out.samples]
    alone = engine(tiny).generate([list(range(10))], params, n=1)[0]
    assert alone.token_ids == out.samples[0].token_ids  # sample 0 is the seed's own stream


def test_sampled_request_is_the_same_in_any_batch(tiny):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=3)
    alone = engine(tiny).generate([list(range(20))], params)[0].token_ids
    crowd = engine(tiny, max_batched_tokens=9).generate(prompts(3, 5) + [list(range(20))],
                                                         [greedy(6)] * 5 + [params])
    assert crowd[-1].token_ids == alone


def test_abort_frees_everything_and_other_requests_continue(tiny):
    eng = engine(tiny)
    keep = eng.add_request(list(range(12)), greedy(10))
    drop = eng.add_request(list(range(30, 50)), greedy(10), n=2)
    for _ in range(3):
        eng.step()
    assert eng.abort(drop) and not eng.abort(drop) and not eng.abort("no such id")
    assert all(s.status is Status.ABORTED for s in eng.requests[drop].seqs)
    eng.check_invariants()
    while eng.has_unfinished():
        eng.step()
    assert_solo_greedy(tiny, [list(range(12))], eng.output(keep).samples, 10)
    assert eng.output(drop).samples[0].finish_reason == "abort"
    eng.check_invariants()


def test_closing_a_stream_aborts_its_request(tiny):
    eng = engine(tiny)
    events = eng.stream(list(range(8)), greedy(20))
    first = [next(events) for _ in range(3)]
    assert_solo_greedy(tiny, [list(range(8))], [stream_sample(first)], 3)
    events.close()
    assert not eng.has_unfinished() and not eng.requests
    eng.check_invariants()


def test_full_stream_ends_with_a_finished_event(tiny):
    eng = engine(tiny)
    events = list(eng.stream(list(range(8)), greedy(5)))
    assert_solo_greedy(tiny, [list(range(8))], [stream_sample(events)], 5)
    assert events[-1].finished and events[-1].finish_reason == "length"
    assert not any(e.finished for e in events[:-1])


def test_stop_token_ends_a_sample_without_emitting_it(tiny):
    ids = list(range(8))
    # the engine's own free run (the same path as the stopped one: exact), held to the solo run
    free = engine(tiny).generate([ids], greedy(6))[0]
    assert_solo_greedy(tiny, [ids], free.samples, 6)
    expected = free.token_ids
    stop = expected[3]
    out = engine(tiny).generate([ids], SamplingParams(temperature=0.0, max_tokens=6,
                                                      stop_token_ids=(stop,)))[0]
    assert out.token_ids == expected[:expected.index(stop)]
    assert out.samples[0].finish_reason == "stop"


@pytest.mark.parametrize("bad, message", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[VOCAB]), r"\[0, 97\)"),
    (dict(prompt=[1, -1]), r"\[0, 97\)"),
    (dict(prompt=[1, 2.0]), r"\[0, 97\)"),
    (dict(prompt=[1], n=0), "n must be"),
    (dict(prompt=[1] * 500, params=SamplingParams(max_tokens=20)), "context"),
    (dict(prompt=[1] * 200, params=SamplingParams(max_tokens=100)), "KV blocks"),
    (dict(prompt=[1], n=9), "more than the 8 sequences"),
    (dict(prompt=[1], params=SamplingParams(stop_token_ids=(3, VOCAB))), r"stop token ids \[97\]"),
])
def test_bad_requests_are_refused_and_change_nothing(tiny, bad, message):
    eng = engine(tiny, tokens=256, max_num_seqs=8)
    with pytest.raises(ValueError, match=message):
        eng.add_request(bad["prompt"], bad.get("params"), n=bad.get("n", 1))
    assert not eng.requests and not eng.has_unfinished() and eng.stats().blocks_used == 0
    eng.add_request([1, 2], request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([3], request_id="x")


@pytest.mark.parametrize("prompt_tokens, max_tokens, n, stops, code, param", [
    (250, 6, 1, (), None, None),                        # exactly the pool: admitted
    (250, 7, 1, (), "kv_budget_exceeded", "max_tokens"),
    (299, 2, 1, (), "context_length_exceeded", "max_tokens"),
    (300, 1, 1, (), "context_length_exceeded", "prompt"),
    (512, 1, 1, (), "context_length_exceeded", "prompt"),
    (10, 10, 8, (), None, None),
    (10, 10, 9, (), "too_many_samples", "n"),
    (10, 10, 1, (VOCAB - 1,), None, None),
    (10, 10, 1, (-1,), "unknown_token", "stop_token_ids"),
])
def test_admission_names_what_the_runtime_cannot_do(tiny, prompt_tokens, max_tokens, n, stops, code, param):
    # the tiny model's context is 300 positions here, the pool 64 blocks of 4 tokens
    eng = LLMEngine(tiny, EngineConfig(block_size=4, kv_cache_tokens=256, max_model_len=300,
                                       scheduler=SchedulerConfig(max_num_seqs=8)))
    refused = eng.limits.refusal(prompt_tokens, max_tokens, n=n, stop_token_ids=stops)
    assert (refused and (refused.code, refused.param)) == ((code, param) if code else None)
    if code is None and prompt_tokens + max_tokens <= 20:  # a small admitted one runs
        out = eng.generate([[1] * prompt_tokens], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 stop_token_ids=stops), n=n)[0]
        assert len(out.samples) == n and eng.stats().blocks_used == 0


def test_reservation_admits_fewer_sequences_than_paging(tiny):
    ps = [[1] * 10 for _ in range(12)]

    def peak(**sched):
        eng = engine(tiny, tokens=256, max_num_seqs=64, **sched)
        for p in ps:
            eng.add_request(p, greedy(4))
        most = 0
        while eng.has_unfinished():
            eng.step()
            most = max(most, len(eng.scheduler.running))
        return most

    assert peak(reserve_tokens=128) == 2 and peak() == 12


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_add_step_abort_sequences_never_leak_a_block(tiny, data):
    eng = engine(tiny, tokens=data.draw(st.sampled_from([48, 96, 256])),
                 max_batched_tokens=data.draw(st.integers(1, 40)),
                 chunked_prefill=data.draw(st.booleans()),
                 policy=data.draw(st.sampled_from(["fcfs", "shortest"])))
    expected = {}
    for _ in range(data.draw(st.integers(1, 25))):
        action = data.draw(st.sampled_from(["add", "step", "step", "abort"]))
        if action == "add":
            ids = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
            n = data.draw(st.integers(1, 3))
            rid = eng.add_request(ids, greedy(data.draw(st.integers(1, 6))), n=n)
            expected[rid] = ids
        elif action == "step":
            eng.step()
        elif expected:
            eng.abort(data.draw(st.sampled_from(sorted(expected))))
        eng.check_invariants()
    while eng.has_unfinished():
        eng.step()
        eng.check_invariants()
    assert eng.stats().blocks_used == 0  # cached blocks left behind count as free
    for rid, ids in expected.items():
        out = eng.output(rid)
        # An abort may land after some samples finished: every sample, finished or cut off,
        # is a prefix of the solo greedy run (up to the near-tie rule).
        assert_solo_greedy(tiny, [ids] * len(out.samples), out.samples)
