"""The engine core driven by commands: concurrent streams each get exactly their own tokens,
abort and a failing step leave no block behind, bad input is refused before it is queued,
and the state the core and engine keep is bounded."""

import threading

import pytest
import torch

from conftest import assert_solo_greedy, make_tiny_llama, stream_sample
from labkit.engine.core import EngineCore, StreamEnd
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.sampling import SamplingParams

VOCAB = 97


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(vocab=VOCAB)


def new_core(model, **config):
    return EngineCore(LLMEngine(model, EngineConfig(block_size=4, kv_cache_tokens=256, **config)))


def prompts(seed, count):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 30, (count,), generator=g)]


def assert_clean(engine):
    engine.check_invariants()
    assert not engine.requests and engine.stats().blocks_used == 0


def test_concurrent_streams_each_get_their_own_tokens(tiny):
    core = new_core(tiny)
    batch = prompts(1, 6)
    lengths = [5, 12, 3, 9, 7, 11]
    got: dict[int, list] = {}
    core.start()
    try:
        streams = [core.add(p, SamplingParams(temperature=0.0, max_tokens=n, logprobs=0))
                   for p, n in zip(batch, lengths)]

        def read(i):
            got[i] = list(streams[i])

        readers = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
        for r in readers:
            r.start()
        for r in readers:
            r.join(60)
    finally:
        core.shutdown()
    for i, (p, n) in enumerate(zip(batch, lengths)):
        events = got[i]
        assert {e.request_id for e in events} == {streams[i].request_id}
        # batched, paged, through the fast kernels: solo greedy up to the near-tie rule
        assert_solo_greedy(tiny, [p], [stream_sample(events)], n)
        assert events[-1].finished and events[-1].finish_reason == "length"
        assert streams[i].output.token_ids == [e.token_id for e in events]
    assert core.open_requests == 0
    assert_clean(core.engine)


def test_interleaved_engine_streams_lose_nothing(tiny):
    """Two `LLMEngine.stream` generators read in turns in one thread: whichever runs the step,
    the other's tokens are kept for it."""
    engine = LLMEngine(tiny, EngineConfig(block_size=4, kv_cache_tokens=256))
    a, b = prompts(2, 2)
    first = engine.stream(a, SamplingParams(temperature=0.0, max_tokens=10, logprobs=0))
    second = engine.stream(b, SamplingParams(temperature=0.0, max_tokens=6, logprobs=0))
    events = {0: [], 1: []}
    live = {0: first, 1: second}
    while live:
        for key in list(live):
            event = next(live[key], None)
            if event is None:
                del live[key]
            else:
                events[key].append(event)
    assert_solo_greedy(tiny, [a, b], [stream_sample(events[0]), stream_sample(events[1])], [10, 6])
    assert_clean(engine)


def test_close_aborts_and_frees_blocks(tiny):
    core = new_core(tiny)
    keep, drop = prompts(3, 2)
    kept = core.add(keep, SamplingParams(temperature=0.0, max_tokens=8, logprobs=0))
    dropped = core.add(drop, SamplingParams(temperature=0.0, max_tokens=40), n=2)
    core.run_once()
    core.run_once()
    assert core.engine.stats().blocks_used > 0
    dropped.close()
    core.run_until_idle()
    items = []
    while not dropped.finished:
        items.append(dropped.get(timeout=1))
    assert isinstance(items[-1], StreamEnd)
    assert {s.finish_reason for s in dropped.output.samples} == {"abort"}
    assert_solo_greedy(tiny, [keep], [stream_sample(kept)], 8)
    dropped.close()  # closing an ended stream changes nothing
    core.run_until_idle()
    assert_clean(core.engine)


def test_bad_input_is_refused_before_it_is_queued(tiny):
    core = new_core(tiny)
    for prompt, kwargs in [([], {}), ([VOCAB], {}), ([1, 2], {"n": 0}), ([1] * 300, {})]:
        with pytest.raises(ValueError):
            core.add(prompt, SamplingParams(temperature=0.0, max_tokens=4), **kwargs)
    assert core.open_requests == 0
    core.add([1, 2, 3], request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        core.add([4, 5], request_id="x")
    core.run_until_idle()
    assert core.open_requests == 0
    assert_clean(core.engine)


def test_a_failing_step_ends_its_streams_and_leaks_nothing(tiny, monkeypatch):
    core = new_core(tiny)
    streams = [core.add(p, SamplingParams(temperature=0.0, max_tokens=6)) for p in prompts(4, 3)]
    core.run_once()

    def broken(plan, samples):
        raise RuntimeError("the worker died")

    monkeypatch.setattr(core.engine.runner, "run", broken)
    core.run_until_idle()
    for s in streams:
        with pytest.raises(RuntimeError, match="the worker died"):
            list(s)
    assert core.open_requests == 0
    assert_clean(core.engine)


def test_state_is_bounded(tiny):
    core = new_core(tiny, transition_log=25)
    for round_ in range(4):
        streams = [core.add(p, SamplingParams(temperature=0.0, max_tokens=3)) for p in prompts(10 + round_, 8)]
        core.run_until_idle()
        assert all(s.get(timeout=1) for s in streams)
    assert core.open_requests == 0
    assert len(core.engine.transitions) == 25
    assert_clean(core.engine)


def test_a_command_keeps_the_arrival_it_was_given(tiny):
    from labkit.engine.core import AddRequest, RequestStream

    core = new_core(tiny)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    given = core.engine.clock() - 5.0  # reached the engine's process five seconds ago
    stamped = RequestStream("stamped", core)
    core.submit(AddRequest("stamped", prompts(7, 1)[0], params, arrival_time=given), stamped)
    unstamped = core.add(prompts(8, 1)[0], params)
    before = core.engine.clock()
    core.run_until_idle()
    while not (stamped.finished and unstamped.finished):
        for stream in (stamped, unstamped):
            if not stream.finished:
                stream.get(timeout=1)
    assert stamped.output.arrival_time == given
    assert before <= unstamped.output.arrival_time <= core.engine.clock()  # applied by the loop
    assert_clean(core.engine)
