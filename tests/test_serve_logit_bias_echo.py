"""`logit_bias`, `echo`, `stop_token_ids` and stop strings over real sockets.

One server for the module (SmolLM2-135M, engine in its worker). The official `openai` client
sends the fields (vLLM's `stop_token_ids` through `extra_body`, as vLLM's documentation does),
raw HTTP the ones the service refuses. References: the service's own answer without the field,
read through its raw log-probabilities (the bias acts on the logits after them, so a -100 bias
on the greedy token hands the step to the runner-up those log-probabilities name; a +100 bias
makes every token the biased one), the prompt's own text for `echo`, and the non-streamed
answer for a stream.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from labkit.models.loader import load_tokenizer
from labkit.serve.responses import TokenText

MODEL = "smollm2-135m"
SERVER_ARGS = ("--model", MODEL, "--kv-cache-tokens", "4096")   # the `server` fixture's (serve_fixtures)
PROMPT = "The capital of France is"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokens():
    """The model's tokenizer, and each token's text (as the service spells it in logprobs) -> id,
    for the texts that only one token has."""
    tokenizer = load_tokenizer(MODEL)
    spell = TokenText(tokenizer)
    ids: dict[str, list[int]] = {}
    for token_id in range(tokenizer.vocab_size):
        ids.setdefault(spell.text(token_id), []).append(token_id)
    return tokenizer, {text: found[0] for text, found in ids.items() if len(found) == 1}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def streamed_text(chunks) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices)


# -- logit_bias ------------------------------------------------------------------------------

def test_a_minus_100_bias_hands_the_greedy_step_to_the_runner_up(openai_client, tokens):
    _, id_of = tokens
    plain = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                             logprobs=2)
    first = plain.choices[0].logprobs.tokens[0]
    ranked = sorted(plain.choices[0].logprobs.top_logprobs[0].items(), key=lambda kv: -kv[1])
    assert ranked[0][0] == first and ranked[0][1] - ranked[1][1] > 1e-3  # no near tie at step 0
    bias = {str(id_of[first]): -100}
    banned = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                              logprobs=2, logit_bias=bias)
    assert banned.choices[0].logprobs.tokens[0] == ranked[1][0]
    assert first not in banned.choices[0].logprobs.tokens
    assert banned.choices[0].text != plain.choices[0].text
    # the reported logprobs are the raw ones, before the bias: step 0's are the unbiased answer's
    unbiased = plain.choices[0].logprobs.top_logprobs[0]
    assert banned.choices[0].logprobs.top_logprobs[0] == pytest.approx(unbiased)
    streamed = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                logit_bias=bias, stream=True)
    assert streamed_text(streamed) == banned.choices[0].text


def test_a_plus_100_bias_forces_its_token_on_both_routes(openai_client, tokens):
    _, id_of = tokens
    forced = " Paris"
    bias = {str(id_of[forced]): 100}
    answer = openai_client.completions.create(model=MODEL, prompt="Say something:", max_tokens=5,
                                              temperature=0, logit_bias=bias)
    assert answer.choices[0].text == forced * 5 and answer.choices[0].finish_reason == "length"
    # sampled at temperature 1 too: every other token is e^-100 times less likely, or less
    sampled = openai_client.completions.create(model=MODEL, prompt="Say something:", max_tokens=5,
                                               temperature=1.0, seed=3, n=2, logit_bias=bias)
    assert [c.text for c in sampled.choices] == [forced * 5] * 2
    chat = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_completion_tokens=4, temperature=0, logit_bias=bias)
    assert chat.choices[0].message.content == forced * 4
    chunks = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_completion_tokens=4, temperature=0, logit_bias=bias,
                                                   stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == forced * 4


def test_an_empty_bias_changes_nothing(openai_client):
    def ask(**extra):
        return openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                **extra).choices[0].text
    assert ask(logit_bias={}) == ask() == ask(logit_bias={"0": 0})


# -- stop_token_ids -----------------------------------------------------------------------------

def test_stop_token_ids_end_the_text_before_the_token(openai_client, tokens):
    _, id_of = tokens
    plain = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                             logprobs=0)
    spelled = plain.choices[0].logprobs.tokens
    at = next(i for i in range(2, len(spelled)) if spelled[i] in id_of and spelled[i] not in spelled[:i])
    stop = id_of[spelled[at]]
    answer = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                              extra_body={"stop_token_ids": [stop]})
    assert answer.choices[0].text == "".join(spelled[:at]) and answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == at
    streamed = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                stream=True, extra_body={"stop_token_ids": [stop]})
    assert streamed_text(streamed) == answer.choices[0].text
    chat_plain = openai_client.chat.completions.create(model=MODEL,
                                                       messages=[{"role": "user", "content": "Hi"}],
                                                       max_completion_tokens=6, temperature=0, logprobs=True)
    chat_tokens = [e.token for e in chat_plain.choices[0].logprobs.content]
    at = next(i for i in range(1, len(chat_tokens)) if chat_tokens[i] in id_of and chat_tokens[i] not in
              chat_tokens[:i])
    chat = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_completion_tokens=6, temperature=0,
                                                 extra_body={"stop_token_ids": [id_of[chat_tokens[at]]]})
    assert chat.choices[0].message.content == "".join(chat_tokens[:at])
    assert chat.choices[0].finish_reason == "stop"


# -- echo ---------------------------------------------------------------------------------------

def test_echo_puts_the_prompt_before_the_same_sampled_text(openai_client):
    def ask(**extra):
        return openai_client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"],
                                                max_tokens=8, temperature=1.0, seed=5, n=2, **extra)
    plain, echoed = ask(), ask(echo=True)
    prompts = [PROMPT, PROMPT, "Once upon a time", "Once upon a time"]  # choice p * n + i
    assert [c.text for c in echoed.choices] == [p + c.text for p, c in zip(prompts, plain.choices)]
    assert echoed.usage == plain.usage  # the echoed prompt is no completion token
    chunks = list(ask(echo=True, stream=True))
    by_choice = {}
    for chunk in chunks:
        for choice in chunk.choices:
            by_choice[choice.index] = by_choice.get(choice.index, "") + choice.text
    assert [by_choice[i] for i in range(4)] == [c.text for c in echoed.choices]
    first = {}
    for chunk in chunks:  # the prompt comes whole, at the start of each choice's first chunk
        for choice in chunk.choices:
            first.setdefault(choice.index, choice.text)
    assert all(first[i].startswith(prompts[i]) for i in range(4))


def test_echo_of_token_ids_is_their_text(openai_client, tokens):
    tokenizer, _ = tokens
    ids = tokenizer.encode(PROMPT)
    plain = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    echoed = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text
    assert tokenizer.decode(ids) == PROMPT


# -- stop strings in streams ----------------------------------------------------------------------

STREAM_PROMPT = "Paris, the capital of France, is a city of art, of light, and of the river Seine. In Paris,"


def spanning_stop(openai_client) -> str:
    """A stop string the greedy answer holds, which starts inside one token and ends in another."""
    plain = openai_client.completions.create(model=MODEL, prompt=STREAM_PROMPT, max_tokens=30, temperature=0,
                                             logprobs=0)
    spelled, text = plain.choices[0].logprobs.tokens, plain.choices[0].text
    for k in range(2, len(spelled) - 1):
        before, after = "".join(spelled[:k]), spelled[k]
        stop = before[-2:] + after[:2]
        if len(spelled[k - 1]) >= 2 and len(after) >= 2 and text.find(stop) == len(before) - 2:
            return stop
    raise AssertionError(f"no token boundary to put a stop string across in {spelled}")


@pytest.mark.parametrize("stop", [[","], [" the", "\n\n"], ["France is", "capital of"], "spanning"])
def test_a_stream_with_stop_strings_says_what_the_whole_answer_says(openai_client, stop):
    prompt, spanning = STREAM_PROMPT, stop == "spanning"
    if spanning:
        stop = [spanning_stop(openai_client)]
    whole = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                             stop=stop)
    chunks = list(openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                                   stop=stop, stream=True))
    text = streamed_text(chunks)
    assert text == whole.choices[0].text
    assert not any(s in text for s in stop)  # nor was any part of a stop string sent and taken back
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    unstopped = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
    assert unstopped.choices[0].text.startswith(text)
    if whole.choices[0].finish_reason == "stop":
        rest = unstopped.choices[0].text[len(text):]
        assert any(rest.startswith(s) for s in stop)
    if spanning:
        assert whole.choices[0].finish_reason == "stop"
    # with logprobs, each streamed token's text_offset is the whole answer's, held-back text or not
    whole = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                             stop=stop, logprobs=1)
    chunks = list(openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                                   stop=stop, logprobs=1, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == whole.choices[0].logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.choices[0].logprobs.text_offset


# -- refusals -------------------------------------------------------------------------------------

VOCAB = 49152  # SmolLM2's


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, param, code", [
    ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {" 1": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"1": 100.5}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"1": -101}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"1": "5"}}, "logit_bias", "invalid_type"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias", "unknown_token"),
    ({"logit_bias": {"1" * 40: 1}}, "logit_bias", "unknown_token"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids", "unknown_token"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "invalid_value"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids[0]", "invalid_type"),
])
def test_a_bad_bias_or_stop_id_gets_a_400_naming_it(server, path, extra, param, code):
    asked = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": PROMPT}
    answer = post(server, path, {"model": MODEL, "max_tokens": 2} | asked | extra)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert set(answer.json()) == {"error"}


def test_a_bias_at_the_vocabularys_last_id_is_taken(server):
    last = VOCAB - 1
    answer = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                              "logit_bias": {str(last): -100}, "stop_token_ids": [last]})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("extra, param, code", [
    ({"echo": True, "logprobs": 0}, "echo", "unsupported_parameter"),
    ({"echo": 1}, "echo", "invalid_type"),
    ({"echo": "true"}, "echo", "invalid_type"),
])
def test_echo_refusals(server, extra, param, code):
    answer = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2} | extra)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


def test_echo_is_completions_only_and_the_official_client_sees_the_refusal(server, openai_client):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "echo": True}
    answer = post(server, "/v1/chat/completions", chat)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "unknown_parameter"
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1)
    assert refused.value.body["param"] == "echo"


def test_nothing_is_left_in_the_engine(server):
    server.wait_until(server.idle, timeout=30)
    assert json.loads(server.get("/health").text)["status"] == "ok"
