"""`labkit serve` over real sockets: the official `openai` client and raw HTTP.

One server (engine in its own worker process, two API keys) serves the whole module. Every
answer is checked against an independent reference: the engine's simple generation loop
run in this process, the non-streamed answer, or the error shape. The tests that kill the
worker run last.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from conftest import GGUF_LOGIT_ERROR, assert_greedy_near, chosen_scores, greedy_reference_scores, served_token_ids
from labkit.engine.loop import generate
from labkit.kernels import native
from labkit.sampling import SamplingParams
from live_server import LiveServer

MODEL = "smollm2-135m"
KEYS = ("key-alpha", "key-beta")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# test keys\n" + "\n".join(KEYS) + "\n")
    with LiveServer("--model", MODEL, "--api-key-file", str(keys), "--kv-cache-tokens", "8192",
                    "--max-body-bytes", "65536") as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0, timeout=120)


def post(server, path, body=None, *, key=KEYS[0], raw: bytes | None = None, headers=None, method="POST"):
    sent = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    sent |= headers or {}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.request(method, server.url + path, content=content, headers=sent, timeout=120)


# -- answers ------------------------------------------------------------------------------

def test_health_and_models(server, client):
    health = server.get("/health").json()
    assert health["status"] == "ok" and health["engine"] == "worker" and health["worker_pid"] > 0
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    card = server.get(f"/v1/models/{MODEL}", headers={"Authorization": f"Bearer {KEYS[0]}"}).json()
    # no --weights: the file's blocks (float32's greedy tokens) where the C kernels load, else
    # float32 (the documented fallback, with a warning)
    weights = "gguf" if native.load() is not None else "f32"
    assert card["weights"] == weights and f"{weights} weights" in "".join(server.lines)
    if weights == "f32":
        assert "needs labkit's C kernels" in "".join(server.lines)  # the fallback says why


def test_a_greedy_completion_equals_the_engines_own_loop(client, model):
    prompt = "The capital of France is"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    reference = generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=12))
    assert answer.usage.prompt_tokens == len(reference.prompt_token_ids)
    # the server runs the file's blocks (gguf), the loop float32 (greedy_reference's path): two
    # numerical paths, equal up to the near-tie rule; the served tokens read from their spelling
    want, scores = greedy_reference_scores(model, reference.prompt_token_ids, len(reference.token_ids))
    assert want == reference.token_ids
    logprobs = answer.choices[0].logprobs
    served = served_token_ids(logprobs.tokens, want, scores, model.tokenizer)
    agreement = assert_greedy_near([want], [served], [scores], GGUF_LOGIT_ERROR,
                                   [chosen_scores(served, logprobs.token_logprobs[:len(served)])],
                                   what="the served answer against the engine's own loop")
    if agreement.exact:
        assert answer.choices[0].text == reference.text
        assert answer.usage.completion_tokens == len(reference.token_ids)
        assert answer.choices[0].finish_reason == reference.finish_reason


def test_a_streamed_chat_says_what_the_whole_answer_says(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_logprobs_name_the_chosen_token_among_the_most_likely(client):
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        best = max(entry.top_logprobs, key=lambda t: t.logprob)
        assert (best.token, best.logprob) == (entry.token, pytest.approx(entry.logprob))  # greedy: the argmax
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == answer.choices[0].message.content


def test_completion_logprobs_and_offsets(client):
    answer = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2)
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == answer.choices[0].text


def test_seeded_samples_are_reproducible_and_n_gives_indexed_choices(client):
    def ask():
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, n=3, seed=7,
                                         temperature=1.0)
    first, second = ask(), ask()
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # three streams, not one copied
    assert 3 <= first.usage.completion_tokens <= 30


def test_a_stop_string_ends_the_text_before_it(client, model):
    prompt = "1, 2, 3, 5, 8, 13, 21,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    assert "," in full  # the stop string is really inside the longer answer
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[","])
    assert answer.choices[0].text == full.split(",")[0] and answer.choices[0].finish_reason == "stop"


def test_a_list_of_prompts_gives_choices_in_prompt_then_sample_order(client):
    answer = client.completions.create(model=MODEL, prompt=["Red, green,", "One, two,"], max_tokens=3,
                                       temperature=0, n=2)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert answer.choices[0].text == answer.choices[1].text != answer.choices[2].text == answer.choices[3].text


def test_the_prefix_cache_is_shared_within_a_tenant_and_never_across(server):
    prompt = "A long shared preamble about inference engines and their caches. " * 8
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}

    def cached(key, salt=None):
        answer = post(server, "/v1/completions", body | ({"cache_salt": salt} if salt else {}), key=key)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(KEYS[0])
    assert cached(KEYS[0]) > 0
    assert cached(KEYS[1]) == 0
    assert cached(KEYS[0], "project-x") == 0 and cached(KEYS[0], "project-x") > 0


def test_requests_without_a_valid_key_get_401(server):
    for key in (None, "wrong"):
        answer = post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}, key=key)
        assert answer.status_code == 401
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_a_whole_answer_says_where_its_time_went(server):
    started = time.perf_counter()
    answer = post(server, "/v1/completions", {"model": MODEL, "prompt": COUNTING, "max_tokens": 16,
                                              "temperature": 0})
    elapsed_ms = (time.perf_counter() - started) * 1e3
    stages = dict(part.strip().split(";dur=") for part in answer.headers["server-timing"].split(","))
    assert list(stages) == ["read", "parse", "tokenize", "submit", "to-engine", "queue", "prefill", "decode",
                            "to-front-end", "serialize"]
    durations = {name: float(ms) for name, ms in stages.items()}
    assert all(ms >= 0 for ms in durations.values())
    assert sum(durations.values()) <= elapsed_ms  # the stages follow one another inside the request
    assert durations["decode"] > 0 and durations["prefill"] > 0  # (how they compare is the machine's)


def test_the_way_to_the_engine_does_not_include_the_step_in_progress(server):
    """A request that reaches the worker during a long step waits for that step in the queue:
    `to-engine` is the hop to the worker alone (its receiving thread notes the arrival)."""
    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 120)  # ~1,100 tokens
    body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 1, "temperature": 0,
            "cache_salt": f"long-{time.monotonic()}"}  # no cached prefix: a whole prefill
    finished = []
    long_request = threading.Thread(target=lambda: (post(server, "/v1/completions", body),
                                                    finished.append(time.perf_counter())))
    long_request.start()
    time.sleep(0.3)  # its prefill steps (hundreds of ms each on this CPU) are under way
    sent = time.perf_counter()
    answer = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                              "temperature": 0})
    long_request.join()
    stages = dict(part.strip().split(";dur=") for part in answer.headers["server-timing"].split(","))
    durations = {name: float(ms) for name, ms in stages.items()}
    assert durations["to-engine"] >= 0 and durations["queue"] >= 0, durations
    # Whether the long step was still running when the short request came depends on the
    # machine's speed: only where it ran on for 200 ms more is there a wait to place. Then it
    # must be in `queue`; a `to-engine` that counted the step would hold it and leave `queue`
    # near zero.
    if finished[0] - sent > 0.2:
        assert durations["queue"] > durations["to-engine"], durations


# -- awkward requests ------------------------------------------------------------------------

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy decoding goes on counting: no early end of sequence
GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
AWKWARD = [
    # (what, path, body or raw bytes, headers, status, code)
    ("not JSON", "/v1/completions", b"hello", {}, 400, "invalid_json"),
    ("truncated JSON", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "x"', {}, 400, "invalid_json"),
    ("a JSON array", "/v1/completions", b"[]", {}, 400, "invalid_json"),
    ("empty body", "/v1/completions", b"", {}, 400, "invalid_json"),
    ("NaN temperature", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "x", "temperature": NaN}',
     {}, 400, "invalid_json"),
    ("invalid UTF-8", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "\xc3\x28"}', {}, 400,
     "invalid_utf8"),
    ("form content type", "/v1/completions", b"model=x", {"Content-Type": "application/x-www-form-urlencoded"},
     415, "unsupported_media_type"),
    ("oversized body", "/v1/completions", json.dumps(GOOD | {"prompt": "x" * 70_000}).encode(), {}, 413,
     "body_too_large"),
    ("empty prompt", "/v1/completions", GOOD | {"prompt": ""}, {}, 400, "invalid_value"),
    ("misspelt option", "/v1/completions", GOOD | {"max_token": 5}, {}, 400, "unknown_parameter"),
    ("unsupported option", "/v1/completions", GOOD | {"suffix": "x"}, {}, 400, "unsupported_parameter"),
    ('"5" as max_tokens', "/v1/completions", GOOD | {"max_tokens": "5"}, {}, 400, "invalid_type"),
    ("5.0 as max_tokens", "/v1/completions", GOOD | {"max_tokens": 5.0}, {}, 400, "invalid_type"),
    ("true as max_tokens", "/v1/completions", GOOD | {"max_tokens": True}, {}, 400, "invalid_type"),
    ("negative max_tokens", "/v1/completions", GOOD | {"max_tokens": -1}, {}, 400, "invalid_value"),
    ("temperature 1e308", "/v1/completions", GOOD | {"temperature": 1e308}, {}, 400, "invalid_value"),
    ("huge max_tokens", "/v1/completions", GOOD | {"max_tokens": 10**9}, {}, 400, "context_length_exceeded"),
    ("token id out of vocabulary", "/v1/completions", GOOD | {"prompt": [10**7]}, {}, 400, "invalid_value"),
    ("prompt over the context", "/v1/completions", GOOD | {"prompt": [1] * 9000}, {}, 400,
     "context_length_exceeded"),
    ("unknown model", "/v1/completions", GOOD | {"model": "gpt-5"}, {}, 404, "model_not_found"),
    ("no messages", "/v1/chat/completions", CHAT | {"messages": []}, {}, 400, "invalid_value"),
    ("tool turn without its call id", "/v1/chat/completions",
     CHAT | {"messages": [{"role": "tool", "content": "x"}]}, {}, 400, "missing_required_parameter"),
    ("function tool without its function", "/v1/chat/completions", CHAT | {"tools": [{"type": "function"}]}, {},
     400, "missing_required_parameter"),
    ("top_logprobs without logprobs", "/v1/chat/completions", CHAT | {"top_logprobs": 2}, {}, 400,
     "invalid_value"),
    ("stream_options without stream", "/v1/chat/completions", CHAT | {"stream_options": {"include_usage": True}},
     {}, 400, "invalid_value"),
    ("chat sent to completions", "/v1/completions", CHAT, {}, 400, "unknown_parameter"),
    ("duplicate keys", "/v1/completions", b'{"model": "a", "model": "b", "prompt": "x"}', {}, 400,
     "invalid_json"),
    ("unknown route", "/v1/embeddings", GOOD, {}, 404, "unknown_route"),
    ("nested 10,000 deep", "/v1/completions", b"[" * 10_000 + b"]" * 10_000, {}, 400, "invalid_json"),
    # an unpaired surrogate escape is JSON but not text: the tokenizer could not take it (a 500 once)
    ("lone surrogate in a prompt", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "a\\ud800b"}', {},
     400, "invalid_unicode"),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\udc00"}]}', {}, 400, "invalid_unicode"),
    ("1e999 as temperature", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "x", "temperature": 1e999}',
     {}, 400, "invalid_json"),
]


@pytest.mark.parametrize("what, path, body, headers, status, code", AWKWARD, ids=[a[0] for a in AWKWARD])
def test_an_awkward_request_gets_the_documented_error(server, what, path, body, headers, status, code):
    raw = body if isinstance(body, bytes) else None
    answer = post(server, path, None if raw is not None else body, raw=raw, headers=headers)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code and error["message"]


def test_emoji_are_counted_in_tokens_not_characters(server):
    answer = post(server, "/v1/completions", GOOD | {"prompt": "🙂" * 1000, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] > 1000  # several byte-level tokens per emoji


def test_wrong_methods_get_405_with_allow(server):
    answer = post(server, "/v1/completions", GOOD, method="PUT")
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert answer.json()["error"]["code"] == "method_not_allowed"


def test_metrics_speak_prometheus(server):
    text = server.get("/metrics").text
    for name in ("labkit:num_requests_waiting", "labkit:num_requests_running", "labkit:kv_cache_usage_perc",
                 "labkit:kv_blocks_used", "labkit:kv_blocks_free", "labkit:prefix_cache_hits_total",
                 "labkit:num_preemptions_total", "labkit:time_to_first_token_seconds_bucket",
                 "labkit:inter_token_latency_seconds_bucket", "labkit:e2e_request_latency_seconds_bucket"):
        assert name in text, name
    assert f'labkit:requests_total{{model_name="{MODEL}",outcome="ok",route="completions"}}' in text
    assert server.metric('labkit:requests_total{outcome="client_error",route="completions"}') > 0


# -- clients that go away, workers that die ------------------------------------------------

def test_a_client_that_disconnects_has_its_blocks_freed(server):
    server.wait_until(server.idle)
    body = GOOD | {"max_tokens": 400, "stream": True, "prompt": COUNTING}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEYS[0]}"}) as answer:
        lines = answer.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.metric("labkit:kv_blocks_used") > 0
    freed_after = server.wait_until(server.idle, timeout=5)
    assert freed_after < 5
    assert server.metric('labkit:requests_total{outcome="cancelled",route="completions"}') >= 1


def test_a_non_streamed_client_that_disconnects_is_cancelled_too(server):
    server.wait_until(server.idle)
    body = GOOD | {"max_tokens": 400, "prompt": COUNTING}
    with pytest.raises(httpx.ReadTimeout):
        post_client = httpx.Client(timeout=httpx.Timeout(1.0))
        post_client.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"})
    post_client.close()
    server.wait_until(server.idle, timeout=5)


def _kill_worker(server) -> int:
    pid = server.get("/health").json()["worker_pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_and_comes_back(server, client):
    restarts = server.get("/health").json()["restarts"]
    stream = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=400,
                                       temperature=0, stream=True)
    received = []
    with pytest.raises(openai.APIError):
        for chunk in stream:
            received.append(chunk.choices[0].text)
            if len(received) == 3:
                _kill_worker(server)
    assert len(received) >= 3
    server.wait_until(lambda: server.get("/health").json()["restarts"] == restarts + 1 and server.ready(),
                      timeout=180, interval=0.2)
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                       temperature=0)
    assert answer.choices[0].text
    server.wait_until(server.idle)


def test_a_request_that_had_received_nothing_is_retried_once_after_a_worker_dies(server, client):
    server.wait_until(server.ready, timeout=180)
    outcome = {}

    def ask():
        try:
            outcome["answer"] = client.completions.create(model=MODEL, prompt=[1] * 1500, max_tokens=2,
                                                          temperature=0)
        except openai.APIError as error:
            outcome["error"] = error

    thread = threading.Thread(target=ask)
    thread.start()
    server.wait_until(lambda: server.get("/health").json()["open_requests"] >= 1, timeout=10, interval=0.01)
    _kill_worker(server)
    thread.join(240)
    assert "answer" in outcome, outcome.get("error")
    assert outcome["answer"].usage.completion_tokens >= 1
    assert server.ready()


def test_a_random_mix_with_a_worker_kill_ends_every_request_and_leaks_nothing(server):
    """Streams, clients that leave, bad requests and whole answers at once; the worker is
    killed while they run. Every request ends with an answer or an error in the one shape,
    and afterwards nothing runs, no block is held, and the server answers."""
    import random

    server.wait_until(server.ready, timeout=180)
    rng = random.Random(13)
    outcomes: dict[int, str] = {}
    auth = {"Authorization": f"Bearer {KEYS[0]}"}

    def one(i: int, kind: str) -> None:
        body = GOOD | {"prompt": f"{i}: " + COUNTING, "max_tokens": rng.randint(8, 60)}
        try:
            if kind == "bad":
                answer = httpx.post(server.url + "/v1/completions", json=body | {"n": "2"}, headers=auth, timeout=120)
                outcomes[i] = "refused" if answer.status_code == 400 else f"status {answer.status_code}"
            elif kind == "whole":
                answer = httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=240)
                ok = answer.status_code == 200 or (answer.status_code == 503 and "error" in answer.json())
                outcomes[i] = "ended" if ok else f"status {answer.status_code}"
            else:
                with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True},
                                  headers=auth, timeout=240) as answer:
                    lines = []
                    for line in answer.iter_lines():
                        if line:
                            lines.append(line)
                        if kind == "leave" and len(lines) >= 2:
                            break
                ended = kind == "leave" or (lines and lines[-1] == "data: [DONE]")
                outcomes[i] = "ended" if ended else f"cut off after {len(lines)} lines"
        except httpx.HTTPError as error:
            outcomes[i] = f"error {error!r}"

    kinds = [rng.choice(["bad", "whole", "stream", "leave"]) for _ in range(20)]
    threads = [threading.Thread(target=one, args=(i, k)) for i, k in enumerate(kinds)]
    for t in threads[:12]:
        t.start()
    server.wait_until(lambda: server.get("/health").json()["open_requests"] >= 3, timeout=30, interval=0.02)
    _kill_worker(server)
    for t in threads[12:]:
        t.start()
    for t in threads:
        t.join(300)
    assert len(outcomes) == len(kinds)
    for i, kind in enumerate(kinds):
        assert outcomes[i] == ("refused" if kind == "bad" else "ended"), (kind, outcomes[i])
    server.wait_until(lambda: server.ready() and server.idle(), timeout=180, interval=0.2)
    answer = post(server, "/v1/completions", GOOD)
    assert answer.status_code == 200
