"""Chapter 25's contract experiments: the catalogue's rules, the classifier, the Server-Timing
reader, the foil's switch, and (slow) the whole catalogue against our service and the foil."""

from __future__ import annotations

import json
import threading
import time

import pytest

from labkit.experiments import api_contract as ac

MODEL = "smollm2-135m"


def reply(status, body, headers=None) -> ac.Reply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return ac.Reply(status, headers or {"content-type": "application/json"}, raw)


def openai_error(code, status=400):
    return reply(status, {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": code}})


def completion(texts, tokens, prompt_tokens=1, **choice):
    return reply(200, {"object": "text_completion",
                       "choices": [{"index": i, "text": t, "finish_reason": "length", **choice}
                                   for i, t in enumerate(texts)],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens}})


def answer(status, correct, shape=False) -> ac.Answer:
    return ac.Answer("r", "g", status, None, "", "openai" if shape else None, correct, "", 0.0)


def anthropic_error(error_type, status=400):
    return reply(status, {"type": "error", "error": {"type": error_type, "message": "m"}})


# -- the classifier -----------------------------------------------------------------------------

@pytest.mark.parametrize("status, correct, shape, category", [
    (200, True, False, "200, correct"),
    (400, True, True, "error, as documented"),
    (200, False, False, "200, wrong"),              # e.g. "5" silently read as 5
    (422, False, False, "4xx, another shape"),      # a framework's detail list
    (404, False, False, "4xx, another shape"),
    (400, False, True, "4xx, other status or code"),
    (500, False, False, "500"),
    (503, False, True, "500"),
    (None, False, False, "no answer in time"),
])
def test_classify_names_each_kind_of_answer(status, correct, shape, category):
    assert ac.classify(answer(status, correct, shape)) == category


def test_category_counts_cover_every_answer_once():
    rows = [answer(200, True), answer(200, False), answer(500, False), answer(422, False), answer(None, False)]
    counts = ac.category_counts(rows)
    assert sum(counts.values()) == len(rows) and list(counts) == list(ac.CATEGORIES)
    assert counts["200, wrong"] == counts["500"] == counts["no answer in time"] == 1


# -- the rules ----------------------------------------------------------------------------------

def test_error_shape_is_openais_and_nothing_else():
    assert ac.error_shape(openai_error("invalid_json"))["code"] == "invalid_json"
    assert ac.error_shape(reply(422, {"detail": [{"type": "json_invalid"}]})) is None   # FastAPI's
    assert ac.error_shape(reply(404, {"detail": "Not Found"})) is None
    assert ac.error_shape(reply(500, b"Internal Server Error")) is None
    assert ac.error_shape(reply(400, {"error": "a string"})) is None
    assert ac.error_shape(reply(400, {"error": {"message": "", "type": "x", "param": None, "code": "c"}})) is None
    assert ac.error_shape(reply(400, {"error": {"message": "m", "type": "x", "code": "c"}})) is None  # no param
    extra = {"error": {"message": "m", "type": "x", "param": None, "code": "c"}, "detail": 1}
    assert ac.error_shape(reply(400, extra)) is None


def test_documented_error_names_the_shape_and_its_code():
    assert ac.documented_error(openai_error("invalid_json")) == ("openai", "invalid_json")
    assert ac.documented_error(anthropic_error("overloaded_error", 529)) == ("anthropic", "overloaded_error")
    assert ac.error_shape(anthropic_error("invalid_request_error")) is None        # not OpenAI's
    assert ac.documented_error(reply(400, {"type": "error", "error": {"type": "x", "message": ""}})) == (None, None)
    assert ac.documented_error(reply(400, {"type": "message", "error": {"type": "x", "message": "m"}})) == \
        (None, None)
    assert ac.documented_error(reply(404, {"detail": "Not Found"})) == (None, None)


def test_the_messages_route_must_answer_in_anthropics_shape(catalogue):
    not_json = catalogue["messages: not JSON"]
    assert not_json.path == "/v1/messages"
    assert not_json.judge(anthropic_error("invalid_request_error")) == (True, "")
    assert not_json.judge(openai_error("invalid_request_error")) == (False, "not Anthropic's error shape")
    assert not not_json.judge(anthropic_error("api_error"))[0]                      # right shape, wrong type
    form = catalogue["messages: form content type"]
    assert not form.judge(anthropic_error("invalid_request_error", 415))[0]         # Anthropic has no 415
    assert not catalogue["not JSON"].judge(anthropic_error("invalid_json"))[0]     # OpenAI's routes: its shape


def test_tokenize_must_give_the_tokenizers_ids(catalogue, model):
    ids = model.tokenizer.encode("Hello")
    check = catalogue["tokenize (no BOS)"]
    assert check.path == "/tokenize"
    assert check.judge(reply(200, {"count": len(ids), "max_model_len": 8192, "tokens": ids}))[0]
    assert not check.judge(reply(200, {"count": len(ids) + 1, "max_model_len": 8192, "tokens": [1] + ids}))[0]
    assert not check.judge(reply(200, {"count": 5, "max_model_len": 8192, "tokens": ids}))[0]


def test_tokenize_and_the_models_route_each_have_a_refusal(catalogue):
    bare = catalogue["tokenize without prompt"]
    assert (bare.method, bare.path) == ("POST", "/tokenize") and "prompt" not in json.loads(bare.body)
    assert bare.judge(openai_error("missing_required_parameter")) == (True, "")
    assert not bare.judge(reply(404, {"detail": "Not Found"}))[0]            # a foil without the route
    unknown = catalogue["a model not served (/v1/models/gpt-5)"]
    assert (unknown.method, unknown.path) == ("GET", "/v1/models/gpt-5")
    assert unknown.judge(openai_error("model_not_found", 404)) == (True, "")
    assert not unknown.judge(reply(404, {"detail": "Not Found"}))[0]


def test_a_tokenize_answer_reads_as_its_ids_not_as_choices():
    ids = reply(200, {"count": 2, "max_model_len": 2048, "tokens": [19556, 28]})
    assert ac.excerpt_of(ids) == "2 token id(s)"
    assert ac.excerpt_of(completion(["a"], 3)) == "1 choice(s), 3 tokens"


def test_missing_route_404s_are_the_404s_for_routes_the_service_lacks(catalogue):
    names = ["list the models", "unknown route", "not JSON", "tokenize without prompt",
             "chat without messages"]
    requests = [catalogue[n] for n in names]
    statuses = [404, 404, 404, 404, 400]    # "not JSON" 404 on a route it has; chat: a 400 where it has none
    answers = [ac.Answer(n, r.group, s, None, "", None, False, "", 0.0)
               for n, r, s in zip(names, requests, statuses)]
    missing = ac.missing_route_404s(requests, answers, {"/v1/completions"})
    assert missing == ["list the models", "tokenize without prompt"]   # not the unknown-route probe
    assert ac.missing_route_404s(requests, answers, {"/v1/completions", "/v1/models", "/tokenize"}) == []
    with pytest.raises(ValueError):
        ac.missing_route_404s(requests[1:], answers, {"/v1/completions"})


@pytest.fixture(scope="module")
def catalogue(model):
    return {r.name: r for r in ac.build_catalogue(MODEL, model.tokenizer, context_tokens=model.max_positions,
                                                  vocab_size=model.config.vocab_size,
                                                  greedy_text=lambda prompt, n: " 9, 10")}


def test_the_catalogue_has_the_sources_requests_and_more(catalogue):
    assert len(catalogue) >= 29
    for name in ("not JSON", "empty prompt", "misspelt option (max_tokns)", "NaN temperature", "4,000 emoji",
                 '"5" as max_tokens', "5.0 as max_tokens", "true as max_tokens", "temperature 0"):
        assert name in catalogue
    assert all(r.expect and r.rule for r in catalogue.values())
    assert b"NaN" in catalogue["NaN temperature"].body
    assert len(json.loads(catalogue["prompt over the context"].body)["prompt"]) == 8193


def test_a_lax_200_is_wrong_and_the_documented_error_is_right(catalogue):
    five = catalogue['"5" as max_tokens']
    assert five.judge(completion(["abc"], 5)) == (False, "status 200, expected 400")
    assert five.judge(openai_error("invalid_type")) == (True, "")
    assert not five.judge(openai_error("invalid_value"))[0]                        # right status, wrong code
    assert not five.judge(reply(400, {"detail": "bad"}))[0]                        # right status, wrong shape
    assert not catalogue["temperature 0"].judge(reply(500, b"Internal Server Error"))[0]


def test_a_200_must_have_its_property(catalogue, model):
    hello = len(model.tokenizer.encode("Hello"))
    good = catalogue["a correct request"]
    assert good.judge(completion(["x"], 4, hello))[0]
    assert not good.judge(completion(["x"], 5, hello))[0]                         # more than max_tokens
    assert not good.judge(completion(["x"], 4, 4000))[0]                          # prompt miscounted
    n2 = catalogue["n = 2"]
    assert n2.judge(completion(["a", "b"], 8))[0] and not n2.judge(completion(["a"], 4))[0]   # n ignored
    greedy = catalogue["temperature 0"]
    assert greedy.judge(completion([" 9, 10"], 4))[0] and not greedy.judge(completion([" 9, 11"], 4))[0]
    stop = catalogue['stop as a bare string ","']
    assert stop.judge(completion([" 9"], 2, finish_reason="stop"))[0]
    assert not stop.judge(completion([" 9, 10, 11"], 16))[0]                        # stop ignored
    logprobs = catalogue["logprobs 2"]
    assert not logprobs.judge(completion(["x"], 1, hello))[0]                       # logprobs ignored


def test_the_emoji_request_takes_a_token_count_or_a_refusal(catalogue, model):
    emoji = catalogue["4,000 emoji"]
    tokens = len(model.tokenizer.encode("\U0001F642" * 4000))
    assert tokens == 8000  # two byte-level tokens per emoji: 4,000 characters, 8,000 tokens
    assert emoji.judge(openai_error("context_length_exceeded"))[0]
    assert emoji.judge(completion(["x"], 4, tokens))[0]
    assert not emoji.judge(completion(["x"], 4, 4000))[0]                           # counted in characters


def test_the_catalogue_streams_on_both_text_routes(catalogue):
    def asks_to_stream(request) -> bool:
        if b'"stream"' not in request.body or request.name == "nested 10,000 deep":
            return False
        body = ac.Reply(200, {}, request.body).json()
        return isinstance(body, dict) and body.get("stream") is True
    streamed = {r.path for r in catalogue.values() if asks_to_stream(r)}
    assert streamed == {"/v1/completions", "/v1/chat/completions"}
    assert all(e.check is ac.stream_check for r in catalogue.values() if asks_to_stream(r) for e in r.expect)


def test_a_stream_needs_chunks_and_done():
    events = b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'
    assert ac.stream_check(reply(200, events, {"content-type": "text/event-stream"})) is None
    assert ac.stream_check(reply(200, events[:-15], {"content-type": "text/event-stream"})) is not None
    assert ac.stream_check(reply(200, events, {"content-type": "application/json"})) is not None


def test_side_by_side_needs_the_same_requests():
    a, b = answer(200, True), answer(500, False)
    row, = ac.side_by_side([b], [a])
    assert row["foil: verdict"] == "500" and row["ours: verdict"] == "200, correct"
    with pytest.raises(ValueError):
        ac.side_by_side([b], [ac.Answer("other", "g", 200, None, "", False, True, "", 0.0)])


# -- timings and texts ---------------------------------------------------------------------------

def test_parse_server_timing_keeps_order_and_values():
    header = "read;dur=0.120, parse;dur=1.5, prefill;desc=\"x\";dur=30.000"
    assert ac.parse_server_timing(header) == {"read": 0.12, "parse": 1.5, "prefill": 30.0}
    assert list(ac.parse_server_timing(header)) == ["read", "parse", "prefill"]
    with pytest.raises(ValueError):
        ac.parse_server_timing("read;desc=x")


def test_stage_sample_names_every_clamped_span():
    sample, clamped = ac.stage_sample("read;dur=0.100, to-engine;dur=0.000, decode;dur=5.000", 6.0)
    assert sample["other"] == pytest.approx(0.9) and sample["wall"] == 6.0
    assert clamped == ("to-engine",)                          # the service wrote a negative span as 0
    sample, clamped = ac.stage_sample("read;dur=0.100, submit;dur=3.000, decode;dur=5.000", 6.0)
    assert sample["other"] == 0.0 and clamped == ("other",)   # stages longer than the wall time
    assert ac.stage_sample("read;dur=0.100, decode;dur=5.000", 6.0)[1] == ()
    profile = ac.StageProfile(16, 4, clamped=[(), ("other",), (), ("to-engine", "other")])
    assert profile.clamped_repeats == 2


def test_prefill_trend_fits_every_long_prompt_not_two_ends():
    # a cost of 0.5 ms per token plus attention's 1e-3 ms per token pair: per token it rises
    tokens = [30, 250, 500, 1000, 2000, 2600]
    prefill = [60 + 0.5 * t + 1e-3 * t * t for t in tokens[:-1]] + [float("nan")]  # 2,600: refused
    trend = ac.prefill_trend(tokens, prefill)
    assert (trend.points, trend.first_tokens, trend.last_tokens) == (4, 250, 2000)  # 30 and NaN left out
    assert trend.direction == "rose" and trend.growth > 1.2
    assert trend.first_ms == pytest.approx(0.5 + 0.25 + 60 / 250, rel=0.1)  # a line, not the curve
    # the two ends alone (30 and 2,000 tokens) cost the same per token: the fixed 60 ms spread
    # over 30 tokens hides the rise that the line over the long prompts shows
    assert prefill[0] / 30 == pytest.approx(prefill[4] / 2000, rel=0.01)
    flat = ac.prefill_trend([300, 600, 1200], [2.0 * t for t in (300, 600, 1200)])
    assert flat.direction == "flat" and flat.growth == pytest.approx(1.0)
    fell = ac.prefill_trend([300, 600, 1200], [600 + t for t in (300, 600, 1200)])
    assert fell.direction == "fell"                          # a fixed cost spread over more tokens
    with pytest.raises(ValueError):
        ac.prefill_trend([30, 300, 300], [50.0, 600.0, 610.0])  # one length at or over 250


def test_prefill_spread_keeps_the_median_and_both_ends():
    assert ac.prefill_spread([30.0, 10.0, 20.0, 90.0]) == {"prefill (ms)": 25.0, "prefill min (ms)": 10.0,
                                                          "prefill max (ms)": 90.0}
    refused = ac.prefill_spread([])
    assert len(refused) == 3 and all(v != v for v in refused.values())       # NaN: nothing ran


def test_labkit_policy_names_requests_of_the_catalogue(catalogue):
    assert set(ac.LABKIT_POLICY) <= set(catalogue)
    assert all(catalogue[name].expect[0].status >= 400 for name in ac.LABKIT_POLICY)


def test_plots_leave_out_empty_kinds_and_draw_stages_as_points():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    counts = {c: 0 for c in ac.CATEGORIES}
    fig, ax = plt.subplots()
    ac.plot_categories(ax, {"a": counts | {"500": 2}, "b": counts | {"200, correct": 1}})
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["200, correct", "500"]                 # kinds nobody gave are not drawn
    plt.close(fig)
    stages = pd.DataFrame([{"prompt (tokens)": 16, "stage": s, "median (ms)": m, "min (ms)": lo,
                            "max (ms)": hi} for s, m, lo, hi in
                           [("parse", 0.05, 0.04, 1.3), ("to-engine", 0.4, 0.0, 0.9),
                            ("wall", 10.0, 9.0, 11.0)]])
    fig, ax = plt.subplots()
    ac.plot_stages(ax, stages)
    assert not ax.patches and ax.get_xscale() == "log"        # points, no bars on a log axis
    assert ax.get_xlim()[0] <= ac.STAGE_FLOOR_MS               # the clamped zero is on the axis
    plt.close(fig)


def test_detokenize_timing_feeds_every_token(model):
    ids = model.tokenizer.encode("Les modèles prédisent 東京 🙂 the next word.")
    timing = ac.detokenize_timing(model.tokenizer, ids, repeats=3, warmup=0)
    assert len(timing.samples) == 3 and timing.meta["tokens"] == len(ids) and timing.median > 0


def test_texts_have_the_asked_number_of_characters(model):
    assert len(ac.cjk_text(4000)) == len(ac.emoji_text(4000)) == 4000
    assert all("\u3000" <= c <= "\u9fff" or c in "，。：、" or "\uff00" <= c <= "\uffef" for c in ac.cjk_text(500))
    assert ac.ascii_text("abc ", 10) == "abc abc ab"
    with pytest.raises(ValueError):
        ac.ascii_text("naïve", 3)


# -- the foil's switch ---------------------------------------------------------------------------

def tiny_transformers_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=100_000)
    return LlamaForCausalLM(config).eval()


def test_stop_ends_a_runaway_generate_and_rearms():
    import torch

    model = ac.StoppableReference(tiny_transformers_llama())
    outcome = {}

    def run():
        try:
            model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=10**9, do_sample=True, eos_token_id=None,
                           pad_token_id=0)
            outcome["ended"] = "finished"
        except ac.Unplugged:
            outcome["ended"] = "stopped"

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.5)
    assert worker.is_alive()                          # 10^9 tokens: it would not end by itself
    assert model.stop(wait_s=30)
    worker.join(5)
    assert outcome == {"ended": "stopped"} and model.stops == 1
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape[1] <= 6                          # re-armed: the next generate runs normally
    model.close()


# -- the whole catalogue, over real sockets (slow) -----------------------------------------------

@pytest.fixture(scope="module")
def full_catalogue(model):
    from labkit.engine.loop import generate
    from labkit.sampling import SamplingParams

    def greedy(prompt, n):
        return generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=n)).text

    return ac.build_catalogue(MODEL, model.tokenizer, context_tokens=model.max_positions,
                              vocab_size=model.config.vocab_size, greedy_text=greedy)


@pytest.mark.slow
def test_our_service_answers_every_request_of_the_catalogue_correctly(model, full_catalogue):
    from labkit.engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=4096, max_model_len=2048))
    with ac.serving(engine, model.tokenizer, MODEL) as url:
        rows = ac.send_catalogue(url, full_catalogue, timeout_s=300)
    wrong = [(a.request, a.status, a.excerpt, a.fault) for a in rows if not a.correct]
    assert wrong == []
    assert all(a.documented_shape for a in rows if a.status != 200)
    assert {a.request for a in rows if a.shape == "anthropic"} == {"messages: not JSON", "messages: form content type"}
    engine.check_invariants()
    with ac.serving(engine, model.tokenizer, MODEL) as url:   # the engine can be served again
        again = ac.send_catalogue(url, [r for r in full_catalogue if r.name == "a correct request"])
    assert again[0].correct


@pytest.mark.slow
def test_the_foil_is_lax_and_crashes_where_the_chapter_says(model, reference, full_catalogue):
    import torch

    from labkit.serve.naive import build_naive_app
    from labkit.serve.server import BackgroundServer

    names = ['"5" as max_tokens', "misspelt option (max_tokns)", "temperature 0", "not JSON", "unknown route",
             "a correct request", "prompt over the context", "list the models", "tokenize without prompt"]
    picked = [r for r in full_catalogue if r.name in names]
    foil = ac.StoppableReference(reference)
    torch.manual_seed(0)   # the foil samples from torch's global generator
    try:
        app = build_naive_app(MODEL, foil, model.tokenizer)
        with BackgroundServer(app) as server, ac.quiet("uvicorn.error"):
            answers = ac.send_catalogue(server.url, picked, costly_timeout_s=2,
                                        on_timeout=lambda r: foil.stop())
        rows = {a.request: a for a in answers}
    finally:
        foil.close()
    assert rows['"5" as max_tokens'].category == "200, wrong" and rows['"5" as max_tokens'].excerpt.endswith("5 tokens")
    assert rows["misspelt option (max_tokns)"].excerpt.endswith("16 tokens")      # the default, not 2
    assert rows["temperature 0"].category == "500"
    assert rows["not JSON"].category == rows["unknown route"].category == "4xx, another shape"
    assert rows["a correct request"].category == "200, correct"
    assert rows["prompt over the context"].category == "no answer in time" and foil.stops == 1
    # only the routes it lacks: not the unknown-route probe, nor its 422 to "not JSON"
    served = {route.path for route in app.routes}
    assert ac.missing_route_404s(picked, answers, served) == ["list the models", "tokenize without prompt"]


def test_greedy_margins_gives_the_text_and_each_steps_top_two_gap():
    import torch
    from types import SimpleNamespace

    class Tokenizer:
        def encode(self, text):
            return [7, 8]

        def decode(self, ids):
            return "|".join(map(str, ids))

    scores = (torch.tensor([[0.0, 5.0, 4.5, 1.0]]), torch.tensor([[3.0, 0.0, 2.999, -1.0]]))
    seen = {}

    def generate(ids, **kw):
        seen.update(kw, ids=ids.tolist())
        sequences = torch.tensor([[7, 8, 1, 0]])
        return SimpleNamespace(sequences=sequences, scores=scores)

    text, margins = ac.greedy_margins(SimpleNamespace(generate=generate), Tokenizer(), "hi", 2)
    assert text == "1|0"                       # only the new tokens, decoded
    assert seen["ids"] == [[7, 8]] and seen["max_new_tokens"] == 2 and not seen["do_sample"]
    assert margins == pytest.approx([0.5, 0.001], abs=1e-5)   # top minus runner-up, per step
