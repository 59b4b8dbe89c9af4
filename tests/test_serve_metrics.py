"""`/metrics` as operators chart it, X-Request-Id, and the access log.

The first tests need no model: the names, types and labels `/metrics` exposes (vLLM's under
a `labkit:` prefix) and the request-id rule. The rest start one `labkit serve` (engine in its
worker, `--log-level info`), send a known set of requests, and check every counter and every
histogram's count against what the server answered (`usage`, `finish_reason`), read with
prometheus_client's own parser.
"""

from __future__ import annotations

import collections
import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from labkit.engine.llm_engine import EngineStats
from labkit.serve.access import request_id_problem
from labkit.serve.metrics import FinishedRequest, ServiceMetrics, one_two_five
from live_server import LiveServer

MODEL = "smollm2-135m"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_blocks_used", "kv_blocks_free")
ENGINE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "engine_steps")
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "request_params_n", "request_params_max_tokens")
# one observation per engine request (one prompt, all its n samples) whose output arrived
PER_REQUEST = tuple(h for h in HISTOGRAMS if h not in ("time_to_first_token_seconds", "inter_token_latency_seconds"))


class FakeClient:
    restarts, hangs = 2, 1

    def __init__(self, stats):
        self._stats = stats

    def stats(self):
        return self._stats


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


STATS = EngineStats(blocks_total=8, blocks_used=2, blocks_free=6, waiting=1, running=3, prefix_queries=4,
                    prefix_hits=2, preemptions=5, copies_on_write=0, evictions=0, steps=9, tokens_computed=70,
                    prefix_query_tokens=64, prefix_hit_tokens=32)


def test_the_metrics_are_vllms_names_under_the_labkit_prefix_each_with_model_name():
    metrics = ServiceMetrics(FakeClient(STATS), "m")
    metrics.finished(FinishedRequest(10, 4, 4, 1, 16, 0.5, 0.01, 0.1, 0.3))
    found = families(metrics.render().decode())
    want = ({f"labkit:{g}": "gauge" for g in GAUGES} | {f"labkit:{c}": "counter" for c in ENGINE_COUNTERS}
            | {f"labkit:{h}": "histogram" for h in HISTOGRAMS}
            | {f"labkit:{c}": "counter" for c in ("prompt_tokens", "generation_tokens", "request_success",
                                                   "requests", "engine_restarts", "engine_hangs")})
    assert {name: found[name].type for name in want} == want
    assert not [n for n in found if not n.startswith("labkit:")]
    for family in found.values():
        for sample in family.samples:
            assert sample.labels.get("model_name") == "m", sample
    exposed = {s.name for f in found.values() for s in f.samples}
    for name in ("labkit:prompt_tokens_total", "labkit:generation_tokens_total", "labkit:num_preemptions_total",
                 "labkit:prefix_cache_queries_total", "labkit:prefix_cache_hits_total",
                 "labkit:request_success_total", "labkit:time_to_first_token_seconds_count"):
        assert name in exposed, name
    reasons = {s.labels["finished_reason"] for s in found["labkit:request_success"].samples
               if s.name.endswith("_total")}
    assert reasons == {"stop", "length", "abort", "error"}
    value = {s.name: s.value for f in found.values() for s in f.samples if len(s.labels) == 1}
    assert value["labkit:kv_cache_usage_perc"] == 0.25 and value["labkit:num_requests_running"] == 3
    assert value["labkit:prefix_cache_queries_total"] == 64 and value["labkit:prefix_cache_hits_total"] == 32
    assert value["labkit:engine_restarts_total"] == 2 and value["labkit:engine_hangs_total"] == 1
    assert value["labkit:request_time_per_output_token_seconds_sum"] == pytest.approx(0.1)  # 0.3 s / (4 - 1)
    assert value["labkit:request_inference_time_seconds_sum"] == pytest.approx(0.4)


def test_the_engines_gauges_are_absent_while_it_restarts():
    found = families(ServiceMetrics(FakeClient(None), "m").render().decode())
    for name in GAUGES + ENGINE_COUNTERS:
        assert found[f"labkit:{name}"].samples == [], name
    assert found["labkit:engine_restarts"].samples[0].value == 2  # the front end's own count stays


def test_token_buckets_are_vllms_one_two_five():
    assert one_two_five(100) == (1, 2, 5, 10, 20, 50, 100)


@pytest.mark.parametrize("value, ok", [("abc-123", True), ("a b~", True), ("x" * 128, True), ("", False),
                                       ("x" * 129, False), ("é", False), ("a\tb", False), ("a\x7f", False)])
def test_a_request_id_is_1_to_128_printable_ascii_characters(value, ok):
    assert (request_id_problem(value) is None) is ok


# -- one live server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    with LiveServer("--model", MODEL, "--kv-cache-tokens", "8192", "--log-level", "info") as live:
        yield live


def post(server, body, path="/v1/completions", headers=None):
    return httpx.post(server.url + path, json={"model": MODEL, "temperature": 0} | body, headers=headers,
                      timeout=120)


def stream(server, body, path="/v1/completions", headers=None):
    """(usage, finish reasons by choice, X-Request-Id) of a streamed answer read to [DONE]."""
    sent = {"model": MODEL, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}} | body
    reasons, usage = {}, None
    with httpx.stream("POST", server.url + path, json=sent, headers=headers, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice["finish_reason"]:
                    reasons[choice["index"]] = choice["finish_reason"]
        return usage, [reasons[i] for i in sorted(reasons)], answer.headers["x-request-id"]


def histogram(m: dict, name: str, part: str = "count") -> float:
    return m[f"labkit:{name}_{part}"]


def delta(after: dict, before: dict, name: str) -> float:
    return after[name] - before[name]


@pytest.mark.slow
def test_every_counter_counts_the_requests_actually_sent(server):
    server.wait_until(server.idle, timeout=30)
    before = server.metrics()
    prompts = choices = prompt_tokens = output_tokens = n_sum = max_tokens_sum = 0
    reasons = collections.Counter()

    def tally(usage, finish_reasons, *, n=1, n_prompts=1, max_tokens):
        nonlocal prompts, choices, prompt_tokens, output_tokens, n_sum, max_tokens_sum
        prompts += n_prompts
        choices += len(finish_reasons)
        n_sum += n * n_prompts
        max_tokens_sum += max_tokens * n_prompts
        prompt_tokens += usage["prompt_tokens"]
        output_tokens += usage["completion_tokens"]
        reasons.update(finish_reasons)

    # whole, and hitting max_tokens
    whole = post(server, {"prompt": COUNTING, "max_tokens": 12}).json()
    assert whole["choices"][0]["finish_reason"] == "length"
    tally(whole["usage"], ["length"], max_tokens=12)
    # whole, stopping on a stop string taken from the answer above
    stop = whole["choices"][0]["text"].split(",")[2]
    stopped = post(server, {"prompt": COUNTING, "max_tokens": 12, "stop": [stop]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop", (stop, stopped)
    tally(stopped["usage"], ["stop"], max_tokens=12)
    # streamed
    usage, finish, _ = stream(server, {"prompt": "The capital of France is", "max_tokens": 7})
    tally(usage, finish, max_tokens=7)
    # n = 2
    two = post(server, {"prompt": "Once upon a time", "max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 3}).json()
    tally(two["usage"], [c["finish_reason"] for c in two["choices"]], n=2, max_tokens=6)
    # a list of two prompts, streamed
    usage, finish, _ = stream(server, {"prompt": ["Hello, my name is", "The sky is"], "max_tokens": 5})
    tally(usage, finish, n_prompts=2, max_tokens=5)
    # chat, whole
    chat = post(server, {"messages": [{"role": "user", "content": "Say hi."}], "max_completion_tokens": 6},
                path="/v1/chat/completions").json()
    tally(chat["usage"], [c["finish_reason"] for c in chat["choices"]], max_tokens=6)
    # refused before the engine: counted by route and outcome only
    refused = post(server, {"prompt": "x", "max_tokens": -1})
    assert refused.status_code == 400

    server.wait_until(server.idle, timeout=30)
    after = server.metrics()
    assert delta(after, before, "labkit:prompt_tokens_total") == prompt_tokens
    assert delta(after, before, "labkit:generation_tokens_total") == output_tokens
    for reason in ("stop", "length", "abort", "error"):
        series = f'labkit:request_success_total{{finished_reason="{reason}"}}'
        assert delta(after, before, series) == reasons[reason], reason
    assert choices == 1 + 1 + 1 + 2 + 2 + 1
    for name in PER_REQUEST:
        assert delta(after, before, f"labkit:{name}_count") == prompts, name
    assert delta(after, before, "labkit:time_to_first_token_seconds_count") == prompts
    assert delta(after, before, "labkit:inter_token_latency_seconds_count") == output_tokens - choices
    assert delta(after, before, "labkit:request_prompt_tokens_sum") == prompt_tokens
    assert delta(after, before, "labkit:request_generation_tokens_sum") == output_tokens
    assert delta(after, before, "labkit:request_params_n_sum") == n_sum
    assert delta(after, before, "labkit:request_params_max_tokens_sum") == max_tokens_sum
    ok = 'labkit:requests_total{outcome="ok",route="%s"}'
    assert delta(after, before, ok % "completions") == 5 and delta(after, before, ok % "chat") == 1
    assert delta(after, before, 'labkit:requests_total{outcome="client_error",route="completions"}') == 1
    assert after["labkit:kv_cache_usage_perc"] == 0 and after["labkit:num_requests_running"] == 0
    queue, prefill = (delta(after, before, f"labkit:request_{s}_time_seconds_sum") for s in ("queue", "prefill"))
    decode, inference = (delta(after, before, f"labkit:request_{s}_time_seconds_sum") for s in ("decode", "inference"))
    assert queue >= 0 and prefill > 0 and decode > 0 and inference == pytest.approx(prefill + decode)


@pytest.mark.slow
def test_a_client_that_disconnects_is_counted_as_abort(server):
    server.wait_until(server.idle, timeout=30)
    before = server.metrics()
    sized = post(server, {"prompt": COUNTING, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as answer:
        assert next(answer.iter_lines()).startswith("data: ")
    cancelled = 'labkit:requests_total{outcome="cancelled",route="completions"}'
    server.wait_until(lambda: server.metric(cancelled) == before[cancelled] + 1, timeout=10)
    server.wait_until(server.idle, timeout=10)
    after = server.metrics()
    assert delta(after, before, 'labkit:request_success_total{finished_reason="abort"}') == 1
    assert delta(after, before, 'labkit:request_success_total{finished_reason="length"}') == 1  # the sizing one
    assert delta(after, before, "labkit:prompt_tokens_total") == 2 * sized  # the aborted one's prompt ran
    assert 1 + 1 <= delta(after, before, "labkit:generation_tokens_total") < 1 + 400
    assert delta(after, before, "labkit:time_to_first_token_seconds_count") == 2
    assert delta(after, before, "labkit:e2e_request_latency_seconds_count") == 1  # no output: not observed
    assert after["labkit:kv_cache_usage_perc"] == 0


@pytest.mark.slow
def test_a_repeated_prompt_hits_the_prefix_cache_in_tokens(server):
    server.wait_until(server.idle, timeout=30)
    prompt = "A prefix-cache probe about lighthouses and their keepers: " + ", ".join(str(i) for i in range(40))
    before = server.metrics()
    first = post(server, {"prompt": prompt, "max_tokens": 1}).json()["usage"]
    second = post(server, {"prompt": prompt, "max_tokens": 1}).json()["usage"]
    after = server.metrics()
    length = first["prompt_tokens"]
    assert length > 32 and second["prompt_tokens_details"]["cached_tokens"] == (length - 1) // 16 * 16
    assert delta(after, before, "labkit:prefix_cache_queries_total") == 2 * length
    assert delta(after, before, "labkit:prefix_cache_hits_total") == (length - 1) // 16 * 16


# -- X-Request-Id and the access log -----------------------------------------------------------

@pytest.mark.slow
def test_the_request_id_is_echoed_generated_and_checked(server):
    given = {"X-Request-Id": "ops-trace-42"}
    assert post(server, {"prompt": "Hi", "max_tokens": 2}, headers=given).headers["x-request-id"] == "ops-trace-42"
    assert stream(server, {"prompt": "Hi", "max_tokens": 2}, headers=given)[2] == "ops-trace-42"
    error = post(server, {"prompt": "Hi", "max_tokens": -1}, headers=given)
    assert error.status_code == 400 and error.headers["x-request-id"] == "ops-trace-42"
    fresh = post(server, {"prompt": "Hi", "max_tokens": 2})
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"])
    assert fresh.headers["x-request-id"] != fresh.json()["id"]
    bad = post(server, {"prompt": "Hi", "max_tokens": 2}, headers={"X-Request-Id": "x" * 129})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "X-Request-Id" and bad.json()["error"]["code"] == "invalid_header"
    assert re.fullmatch(r"[0-9a-f]{32}", bad.headers["x-request-id"])


def access_lines(server, request_id: str) -> list[dict]:
    out = []
    for line in list(server.lines):
        if "labkit.serve.access: " in line:
            entry = json.loads(line.split("labkit.serve.access: ", 1)[1])
            if entry["request_id"] == request_id:
                out.append(entry)
    return out


@pytest.mark.slow
def test_one_access_line_per_request_without_text(server):
    prompt = "The access log should not hold this prompt"
    answer = post(server, {"prompt": prompt, "max_tokens": 3}, headers={"X-Request-Id": "access-ok"})
    refused = post(server, {"prompt": prompt, "max_tokens": -1}, headers={"X-Request-Id": "access-refused"})
    server.wait_until(lambda: access_lines(server, "access-ok") and access_lines(server, "access-refused"))
    [line] = access_lines(server, "access-ok")
    usage = answer.json()["usage"]
    assert line["route"] == "completions" and line["status"] == 200 and line["outcome"] == "ok"
    assert line["prompt_tokens"] == usage["prompt_tokens"] and line["output_tokens"] == usage["completion_tokens"]
    assert line["finish_reasons"] == [answer.json()["choices"][0]["finish_reason"]]
    assert line["response_id"] == answer.json()["id"]
    assert 0 < line["ttft_s"] <= line["e2e_s"] and line["client"].startswith("127.0.0.1:")
    assert set(line) >= {"time", "method", "request_id"} and "prompts" not in line
    [no] = access_lines(server, "access-refused")
    assert no["status"] == refused.status_code == 400 and no["outcome"] == "client_error"
    assert not any(prompt in text for text in server.lines)
    # the front end's own line maps the body's id to the request id
    assert any(f"{answer.json()['id']} request_id=access-ok" in text for text in server.lines)


def test_the_middleware_checks_echoes_and_logs_without_a_model(caplog):
    import asyncio

    from fastapi import FastAPI

    from labkit.serve.access import RequestIds, RequestRecord
    from labkit.serve.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestIds)
    app.get("/v1/models")(lambda: {"data": []})
    app.get("/health")(lambda: {"status": "ok"})

    async def run():
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5555))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get("/v1/models", headers={"X-Request-Id": "abc"}),
                    await client.get("/v1/models", headers={"X-Request-Id": "x" * 129}),
                    await client.get("/health"))

    with caplog.at_level("INFO", logger="labkit.serve.access"):
        good, bad, health = asyncio.run(run())
    assert good.status_code == 200 and good.headers["x-request-id"] == "abc"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
    assert re.fullmatch(r"[0-9a-f]{32}", health.headers["x-request-id"])
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "labkit.serve.access"]
    assert [(x["route"], x["status"], x["outcome"]) for x in lines] == [("/v1/models", 200, "ok"),
                                                                        ("/v1/models", 400, "client_error")]
    assert lines[0]["request_id"] == "abc" and lines[0]["client"] == "127.0.0.1:5555"
    record = RequestRecord("r", "POST", "/v1/completions", None, log_prompts=True, quiet=False,
                           response_done=True, prompts=["secret"], outputs=["said"])
    with caplog.at_level("INFO", logger="labkit.serve.access"):
        record.emit()
    last = json.loads(caplog.records[-1].getMessage())
    assert last["prompts"] == ["secret"] and last["outputs"] == ["said"] and last["route"] == "completions"
