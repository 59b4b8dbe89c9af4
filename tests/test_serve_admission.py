"""Admission control: the policies' decisions by hand, then each policy on a live service."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.scheduler import SchedulerConfig
from labkit.serve.admission import AdmissionControl, ServiceEstimator
from labkit.serve.app import ServeSettings, build_app
from labkit.serve.engine_client import InProcessEngine
from labkit.serve.server import BackgroundServer


def estimator(prefill=0.001, decode=0.02) -> ServiceEstimator:
    return ServiceEstimator(prefill, decode, observed=1)


def test_bounded_refuses_once_max_queue_requests_wait():
    control = AdmissionControl("bounded", max_queue=2, estimator=estimator())
    for i in range(2):
        assert control.consider(10, 10, None, now=0.0) is None
        control.admit(f"r{i}", 10, 10, None, now=0.0)
    refusal = control.consider(10, 10, None, now=0.0)
    assert (refusal.status, refusal.code) == (503, "queue_full")
    control.token("r0")  # r0 started: one waits now
    assert control.consider(10, 10, None, now=0.0) is None


def test_unbounded_takes_everything():
    control = AdmissionControl("unbounded", max_queue=0)
    for i in range(50):
        assert control.consider(10, 10, 0.001, now=0.0) is None
        control.admit(f"r{i}", 10, 10, 0.001, now=0.0)


def test_admit_by_estimate_refuses_what_cannot_finish_in_time():
    # One engine sequence at a time: a request of 100 prompt + 50 output tokens costs
    # 0.1 + 1.0 = 1.1 s; with two such requests ahead the newcomer finishes at 3.3 s.
    control = AdmissionControl("admit-by-estimate", concurrency=1, estimator=estimator())
    control.admit("a", 100, 50, None, now=0.0)
    control.admit("b", 100, 50, None, now=0.0)
    assert control.work_ahead_s() == pytest.approx(2.2)
    assert control.consider(100, 50, deadline=3.4, now=0.0) is None
    refusal = control.consider(100, 50, deadline=3.2, now=0.0)
    assert (refusal.status, refusal.code) == (503, "deadline_unreachable")
    assert refusal.retry_after == pytest.approx(2.2)
    assert control.consider(100, 50, deadline=None, now=0.0) is None  # no deadline, no refusal


def test_drop_expired_names_waiting_requests_past_saving():
    control = AdmissionControl("drop-expired", max_queue=8, estimator=estimator())
    control.admit("late", 100, 50, deadline=1.0, now=0.0)    # needs 1.1 s
    control.admit("fine", 100, 50, deadline=5.0, now=0.0)
    control.admit("running", 100, 50, deadline=0.5, now=0.0)
    control.token("running")                                   # started: never dropped
    assert control.expired(now=0.0) == ["late"]
    assert control.expired(now=4.0) == ["late", "fine"]


def test_the_estimator_learns_moving_averages_from_engine_times():
    e = ServiceEstimator(weight=0.5)
    out = SimpleNamespace(first_scheduled_time=10.0, first_token_time=10.2, finish_time=11.2,
                          prompt_token_ids=[0] * 100, cached_prompt_tokens=0,
                          samples=[SimpleNamespace(token_ids=[0] * 11)])
    e.observe(out)  # the first observation replaces the prior
    assert (e.prefill_s_per_token, e.decode_s_per_token) == (pytest.approx(0.002), pytest.approx(0.1))
    out.first_token_time, out.finish_time = 10.4, 10.9
    e.observe(out)
    assert e.prefill_s_per_token == pytest.approx((0.002 + 0.004) / 2)
    assert e.decode_s_per_token == pytest.approx((0.1 + 0.05) / 2)


def test_unknown_policies_are_refused():
    with pytest.raises(ValueError):
        AdmissionControl("random")
    with pytest.raises(ValueError):
        ServeSettings("m", queue_policy="lifo")


@pytest.fixture(scope="module")
def one_at_a_time(model):
    """The engine runs one sequence at a time, as the source's service did."""
    def serve(policy: str, **settings):
        config = EngineConfig(kv_cache_tokens=4096, scheduler=SchedulerConfig(max_num_seqs=1))
        client = InProcessEngine(LLMEngine(model, config))
        app = build_app(client, model.tokenizer, ServeSettings("smollm2-135m", queue_policy=policy,
                                                                 engine_concurrency=1, **settings))
        return BackgroundServer(app), client
    return serve


def burst(url: str, count: int, body: dict, headers=None) -> list[httpx.Response]:
    answers = [None] * count

    def send(i):
        answers[i] = httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=120)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return answers


def learn(url: str) -> float:
    """Serve one request (the estimator learns from it); its seconds, to scale deadlines by."""
    import time

    start = time.perf_counter()
    assert httpx.post(url + "/v1/completions", json=BODY, timeout=60).status_code == 200
    return time.perf_counter() - start


BODY = {"model": "smollm2-135m", "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 24, "temperature": 0,
        "ignore_eos": True}


@pytest.mark.slow
def test_a_bounded_live_queue_answers_503_with_retry_after(one_at_a_time):
    server, client = one_at_a_time("bounded", max_queue=2)
    with server:
        answers = burst(server.url, 8, BODY)
    refused = [a for a in answers if a.status_code == 503]
    served = [a for a in answers if a.status_code == 200]
    assert refused and served and len(refused) + len(served) == 8
    for a in refused:
        assert a.json()["error"]["code"] == "queue_full" and int(a.headers["retry-after"]) >= 1
    assert client.core.engine.stats().blocks_used == 0


@pytest.mark.slow
def test_admit_by_estimate_refuses_at_arrival_and_serves_in_time(one_at_a_time):
    server, client = one_at_a_time("admit-by-estimate")
    with server:
        service = learn(server.url)
        answers = burst(server.url, 8, BODY | {"deadline_ms": 2.5 * service * 1e3})  # 2 or 3 fit
        header = httpx.post(server.url + "/v1/completions", json=BODY, headers={"X-Deadline-Ms": "1"},
                            timeout=60)
    assert header.status_code == 503 and header.json()["error"]["code"] == "deadline_unreachable"
    codes = sorted(a.status_code for a in answers)
    assert 503 in codes and 200 in codes, codes
    assert all(a.json()["error"]["code"] == "deadline_unreachable" for a in answers if a.status_code == 503)


@pytest.mark.slow
def test_drop_expired_drops_from_the_queue_with_503(one_at_a_time):
    server, client = one_at_a_time("drop-expired", max_queue=16)
    with server:
        service = learn(server.url)
        answers = burst(server.url, 8, BODY | {"deadline_ms": 2.5 * service * 1e3})  # 2 or 3 fit
    dropped = [a for a in answers if a.status_code == 503]
    assert dropped and any(a.status_code == 200 for a in answers)
    assert all(a.json()["error"]["code"] == "deadline_expired" for a in dropped)
    assert client.core.engine.stats().blocks_used == 0 and not client.core.engine.requests


# -- limits by default: the queue, a request's time, a key's share -------------------------

def test_the_default_is_a_bounded_queue_of_one_engine_batch():
    settings = ServeSettings("m", engine_concurrency=12)
    assert settings.queue_policy == "bounded" and settings.queue_limit == 12
    assert ServeSettings("m", max_queue=3).queue_limit == 3
    assert settings.request_timeout == 600.0
    with pytest.raises(ValueError, match="API keys"):
        ServeSettings("m", max_concurrent_per_key=2)
    with pytest.raises(ValueError):
        ServeSettings("m", request_timeout=0)


def test_older_than_names_the_requests_past_the_limit():
    control = AdmissionControl("bounded")
    control.admit("old", 5, 10, None, now=100.0)
    control.admit("new", 5, 10, None, now=104.0)
    assert control.older_than(3.0, now=105.0) == ["old"]
    assert control.older_than(10.0, now=105.0) == []


LONG = {"model": "smollm2-135m", "prompt": "1, 2, 3,", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited(model):
    config = EngineConfig(kv_cache_tokens=4096)
    client = InProcessEngine(LLMEngine(model, config))
    app = build_app(client, model.tokenizer, ServeSettings("smollm2-135m", api_keys=["key-a", "key-b"],
                                                           request_timeout=2.0, max_concurrent_per_key=1))
    with BackgroundServer(app) as server:
        yield server, client


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.slow
def test_a_request_past_the_request_timeout_is_ended_and_frees_its_blocks(limited):
    server, client = limited
    whole = httpx.post(server.url + "/v1/completions", json=LONG, headers=auth("key-a"), timeout=60)
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "request_timeout"
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=LONG | {"stream": True}, headers=auth("key-a"),
                      timeout=60) as answer:
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"request_timeout"' in events[-2]
    assert len(events) > 2  # it streamed tokens before the limit
    for _ in range(100):
        if client.core.engine.stats().blocks_used == 0:
            break
        time.sleep(0.05)
    assert client.core.engine.stats().blocks_used == 0


@pytest.mark.slow
def test_a_key_over_its_concurrency_limit_gets_429_and_other_keys_are_served(limited):
    server, _ = limited
    short = {"model": "smollm2-135m", "prompt": "1, 2, 3,", "max_tokens": 2, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=LONG | {"stream": True},
                      headers=auth("key-a"), timeout=60) as answer:
        lines = answer.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it runs (until the 2 s limit)
        second = httpx.post(server.url + "/v1/completions", json=short, headers=auth("key-a"), timeout=60)
        other = httpx.post(server.url + "/v1/completions", json=short, headers=auth("key-b"), timeout=60)
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(second.headers["retry-after"]) >= 1
    assert other.status_code == 200
    # its first request was closed by the client (noticed at the next token): the count goes back down
    for _ in range(100):
        after = httpx.post(server.url + "/v1/completions", json=short, headers=auth("key-a"), timeout=60)
        if after.status_code != 429:
            break
        time.sleep(0.05)
    assert after.status_code == 200
