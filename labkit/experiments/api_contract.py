"""The engine behind HTTP, tested from outside: awkward requests, where a request's time
goes, and why a limit must be counted in tokens.

Chapter 25 sends the same catalogue to two services, our `labkit serve` app and the
deliberately naive foil of `labkit.serve.naive`, and judges every answer by the
catalogue's own rule:

* :func:`build_catalogue`: the awkward requests as data. Each :class:`AwkwardRequest` holds
  the exact bytes, method, path and content type it sends, and what a correct service must
  answer (:class:`Expect`): an error status with its code in the error shape of the route's
  protocol (OpenAI's, or Anthropic's on `/v1/messages`), or a 200 whose body has a property
  that can be checked.
* :func:`send_catalogue`: send every request to a base URL with raw httpx, one row
  (:class:`Answer`) per request: status, error code or a short excerpt, which documented error
  shape the body has (if any), whether the answer is correct by the rule.
* :func:`classify`: what kind of answer a row is (200 and correct, 200 but wrong, an error in
  another shape, a 500, ...); :data:`CATEGORIES` lists them. :func:`missing_route_404s` picks
  out the 404s a service gave only because it has no route at a request's path.
* :class:`StoppableReference`: the foil's model with a switch, so that a harness can end a
  runaway `generate` (the foil cannot stop one itself) and go on to the next request.
* :func:`parse_server_timing`, :func:`profile_stages`, :func:`detokenize_timing`: the stages of
  whole answers from their `Server-Timing` header, and the share of the decode stage that is
  incremental detokenization (it happens inside the engine's decode steps).
* :func:`cjk_text`, :func:`emoji_text`, :func:`ascii_text`: texts of a given number of
  characters, to set a character limit beside a token budget.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

import httpx

from labkit.engine.output import OutputProcessor
from labkit.sampling import SamplingParams
from labkit.util.palette import OKABE_ITO
from labkit.util.timing import Timing, measure

# -- what a correct service answers -----------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What came back: status, headers and the raw body (None status: no answer in time)."""

    status: int | None
    headers: dict[str, str]
    body: bytes

    def json(self):
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError):
            return None


def error_shape(reply: Reply) -> dict | None:
    """The `error` object if the body is OpenAI's error shape
    (`{"error": {"message": str, "type": str, "param": ..., "code": ...}}`), else None."""
    body = reply.json()
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return None
    error = body["error"]
    if not {"message", "type", "param", "code"} <= set(error):
        return None
    if not (isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)):
        return None
    return error


def anthropic_error_shape(reply: Reply) -> dict | None:
    """The `error` object if the body is Anthropic's error shape
    (`{"type": "error", "error": {"type": str, "message": str}}`), else None."""
    body = reply.json()
    if not isinstance(body, dict) or body.get("type") != "error" or not isinstance(body.get("error"), dict):
        return None
    error = body["error"]
    if not (isinstance(error.get("type"), str) and isinstance(error.get("message"), str)
            and error["message"]):
        return None
    return error


def documented_error(reply: Reply) -> tuple[str | None, str | None]:
    """(the error shape's name, its code) if the body is a documented error shape: OpenAI's
    (its `code`) or Anthropic's (its error `type`, which is all the code that shape has);
    (None, None) otherwise."""
    error = error_shape(reply)
    if error is not None:
        return "openai", error["code"]
    error = anthropic_error_shape(reply)
    return ("anthropic", error["type"]) if error is not None else (None, None)


Check = Callable[[Reply], str | None]  # None: the property holds; a string: what is wrong


@dataclass(frozen=True)
class Expect:
    """One acceptable answer: `status`, with `code` in `shape` (OpenAI's error shape, or
    "anthropic": Anthropic's, whose error `type` is its code) for an error, or with `check`
    holding for a 200. `rule` says it in words."""

    status: int
    code: str | None = None
    rule: str = ""
    check: Check | None = None
    shape: str = "openai"

    def judge(self, reply: Reply) -> str | None:
        """None if `reply` is this answer, else what differs."""
        if reply.status != self.status:
            return f"status {reply.status}, expected {self.status}"
        if self.status >= 400:
            shape, code = documented_error(reply)
            if shape != self.shape:
                return f"not {'Anthropic' if self.shape == 'anthropic' else 'OpenAI'}'s error shape"
            if code != self.code:
                return f"code {code}, expected {self.code}"
            return None
        return self.check(reply) if self.check is not None else None


@dataclass(frozen=True)
class AwkwardRequest:
    name: str
    group: str
    body: bytes
    expect: tuple[Expect, ...]           # any one of them is correct
    method: str = "POST"
    path: str = "/v1/completions"
    content_type: str | None = "application/json"
    costly: bool = False                 # a service without limits does long or unbounded work

    @property
    def rule(self) -> str:
        return " or ".join(e.rule or (f"{e.status} {e.code}" if e.code else str(e.status)) for e in self.expect)

    def judge(self, reply: Reply) -> tuple[bool, str]:
        faults = [e.judge(reply) for e in self.expect]
        return (True, "") if None in faults else (False, faults[0])


def error(status: int, code: str) -> tuple[Expect, ...]:
    return (Expect(status, code, f"{status} {code}"),)


def anthropic_error(status: int, error_type: str) -> tuple[Expect, ...]:
    return (Expect(status, error_type, f"{status} {error_type} (Anthropic's shape)", shape="anthropic"),)


# -- checks of a 200 -------------------------------------------------------------------------

def completion_check(*, choices: int = 1, max_tokens: int = 16, prompt_tokens: int | None = None,
                     also: Callable[[dict], str | None] | None = None) -> Check:
    """A text completion with `choices` choices (indexes 0..choices-1), text in each,
    1..max_tokens output tokens per choice, `prompt_tokens` counted in tokens (if given)."""
    def check(reply: Reply) -> str | None:
        body = reply.json()
        if not isinstance(body, dict) or body.get("object") != "text_completion":
            return "not a text completion"
        got = body.get("choices") or []
        if [c.get("index") for c in got] != list(range(choices)):
            return f"{len(got)} choice(s), expected {choices}"
        if not all(isinstance(c.get("text"), str) for c in got):
            return "a choice without text"
        usage = body.get("usage") or {}
        if not 1 <= usage.get("completion_tokens", 0) <= choices * max_tokens:
            return f"{usage.get('completion_tokens')} tokens, expected 1 to {choices * max_tokens}"
        if prompt_tokens is not None and usage.get("prompt_tokens") != prompt_tokens:
            return f"prompt_tokens {usage.get('prompt_tokens')}, expected {prompt_tokens}"
        return also(body) if also is not None else None
    return check


def chat_check(reply: Reply) -> str | None:
    body = reply.json()
    if not isinstance(body, dict) or body.get("object") != "chat.completion":
        return "not a chat completion"
    message = (body.get("choices") or [{}])[0].get("message") or {}
    if message.get("role") != "assistant" or not isinstance(message.get("content"), str):
        return "no assistant message"
    return None


def stream_check(reply: Reply) -> str | None:
    """Server-Sent Events: JSON chunks with choices, then `data: [DONE]`."""
    if not reply.headers.get("content-type", "").startswith("text/event-stream"):
        return "not an event stream"
    events = [line[6:] for line in reply.body.decode("utf-8", "replace").splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "the stream does not end with [DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    if not chunks or any("choices" not in c for c in chunks):
        return "no completion chunks"
    return None


def tokens_check(expected: list[int]) -> Check:
    """A /tokenize answer: exactly `expected` (the tokenizer's own ids), counted right."""
    def check(reply: Reply) -> str | None:
        body = reply.json()
        if not isinstance(body, dict) or body.get("tokens") != expected:
            return "not the tokenizer's ids"
        return None if body.get("count") == len(expected) else f"count {body.get('count')}"
    return check


def models_check(model: str) -> Check:
    def check(reply: Reply) -> str | None:
        body = reply.json()
        ids = [m.get("id") for m in body.get("data", [])] if isinstance(body, dict) else []
        return None if model in ids else "the model list does not name the model"
    return check


# -- the catalogue -----------------------------------------------------------------------------

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"   # greedy decoding goes on counting


def greedy_margins(reference, tokenizer, prompt: str, tokens: int) -> tuple[str, list[float]]:
    """`tokens` greedy tokens of `prompt` from a `transformers` model, as text, and the
    reference's top-two logit margin at each step. Where every margin is wider than the
    near-tie tolerance (:mod:`labkit.util.near_tie`), the book's rule asks another path for
    exactly these tokens, so a served greedy answer can be held to this text."""
    import torch

    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.inference_mode():
        out = reference.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
    top = torch.topk(torch.stack(out.scores)[:, 0].float(), 2, dim=-1).values
    return (tokenizer.decode(out.sequences[0, ids.shape[1]:].tolist()),
            (top[:, 0] - top[:, 1]).tolist())


def _raw(obj) -> bytes:
    return json.dumps(obj).encode()


def build_catalogue(model: str, tokenizer, *, context_tokens: int, vocab_size: int,
                    greedy_text: Callable[[str, int], str] | None = None,
                    emoji: int = 4000) -> list[AwkwardRequest]:
    """The awkward requests, with what a correct service answers to each.

    `context_tokens` is the model's context (the prompt-over-the-context request sends one
    token more); `greedy_text(prompt, max_tokens)` is an independent greedy continuation that
    the temperature-0 answer must equal (None: that answer is only checked for shape)."""
    good = {"model": model, "prompt": "Hello", "max_tokens": 4}
    hello = len(tokenizer.encode("Hello"))
    ok = Expect(200, rule="200: 1 choice, 1-4 tokens", check=completion_check(max_tokens=4, prompt_tokens=hello))
    faces = "\U0001F642" * emoji
    face_tokens = len(tokenizer.encode(faces))

    def same_as_greedy(body: dict) -> str | None:
        if greedy_text is None:
            return None
        expected = greedy_text(COUNTING, 4)
        text = body["choices"][0]["text"]
        return None if text == expected else f"text {text!r}, greedy is {expected!r}"

    def no_comma(body: dict) -> str | None:
        choice = body["choices"][0]
        if "," in choice["text"]:
            return f"the stop string is in the text {choice['text']!r}"
        if choice.get("finish_reason") != "stop" and body["usage"]["completion_tokens"] < 16:
            return "ended early without finish_reason stop"
        return None

    def with_logprobs(body: dict) -> str | None:
        lp = body["choices"][0].get("logprobs") or {}
        tops = lp.get("top_logprobs") or []
        if len(lp.get("tokens") or []) != body["usage"]["completion_tokens"] or not tops:
            return "no logprobs per token"
        return None if all(1 <= len(t) <= 2 for t in tops) else "not 2 alternatives per token"

    P = "application/json"
    rows = [
        # the body
        ("not JSON", "body", b"hello", error(400, "invalid_json")),
        ("empty body", "body", b"", error(400, "invalid_json")),
        ("a JSON array", "body", b"[]", error(400, "invalid_json")),
        ("truncated JSON", "body", _raw(good)[:-1], error(400, "invalid_json")),
        ("NaN temperature", "body", _raw(good)[:-1] + b', "temperature": NaN}', error(400, "invalid_json")),
        ("Infinity temperature", "body", _raw(good)[:-1] + b', "temperature": Infinity}',
         error(400, "invalid_json")),
        ("duplicate keys", "body", _raw(good)[:-1] + b', "max_tokens": 3}', error(400, "invalid_json")),
        ("nested 10,000 deep", "body", _raw(good)[:-1] + b', "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
         error(400, "invalid_json")),
        ("invalid UTF-8", "body", _raw(good | {"prompt": "@"}).replace(b"@", b"\xc3\x28"),
         error(400, "invalid_utf8")),
        ("form content type", "body", b"model=x&prompt=Hello", error(415, "unsupported_media_type"),
         "application/x-www-form-urlencoded"),
        ("no content type", "body", _raw(good), error(415, "unsupported_media_type"), None),
        ("oversized body (1 MiB)", "body", _raw(good | {"user": "x" * (1 << 20)}), error(413, "body_too_large")),
        # types
        ('"5" as max_tokens', "types", _raw(good | {"max_tokens": "5"}), error(400, "invalid_type")),
        ("5.0 as max_tokens", "types", _raw(good | {"max_tokens": 5.0}), error(400, "invalid_type")),
        ("true as max_tokens", "types", _raw(good | {"max_tokens": True}), error(400, "invalid_type")),
        ('"0.7" as temperature', "types", _raw(good | {"temperature": "0.7"}), error(400, "invalid_type")),
        ("a number as prompt", "types", _raw(good | {"prompt": 5}), error(400, "invalid_type")),
        # values
        ("negative max_tokens", "values", _raw(good | {"max_tokens": -1}), error(400, "invalid_value")),
        ("max_tokens 0", "values", _raw(good | {"max_tokens": 0}), error(400, "invalid_value")),
        ("temperature -1", "values", _raw(good | {"temperature": -1}), error(400, "invalid_value")),
        ("temperature 1e308", "values", _raw(good | {"temperature": 1e308}), error(400, "invalid_value")),
        ("top_p 0", "values", _raw(good | {"top_p": 0}), error(400, "invalid_value")),
        ("n 1000", "values", _raw(good | {"n": 1000}), error(400, "invalid_value")),
        ("empty prompt", "values", _raw(good | {"prompt": ""}), error(400, "invalid_value")),
        ("token id out of vocabulary", "values", _raw(good | {"prompt": [vocab_size]}), error(400, "invalid_value")),
        ("negative token id", "values", _raw(good | {"prompt": [-1]}), error(400, "invalid_value")),
        # names
        ("misspelt option (max_tokns)", "names", _raw({"model": model, "prompt": "Hello", "max_tokns": 2}),
         error(400, "unknown_parameter")),
        ("unsupported option (suffix)", "names", _raw(good | {"suffix": "!"}),
         error(400, "unsupported_parameter")),
        ("no prompt", "names", _raw({"model": model, "max_tokens": 4}), error(400, "missing_required_parameter")),
        ("no model", "names", _raw({"prompt": "Hello", "max_tokens": 4}), error(400, "missing_required_parameter")),
        ("unknown model", "names", _raw(good | {"model": "gpt-5"}), error(404, "model_not_found")),
        # sizes
        ("huge max_tokens (1e9)", "sizes", _raw(good | {"max_tokens": 10**9}), error(400, "context_length_exceeded"),
         P, True),
        ("prompt over the context", "sizes", _raw(good | {"prompt": [1] * (context_tokens + 1)}),
         error(400, "context_length_exceeded"), P, True),
        (f"{emoji:,} emoji", "sizes", _raw(good | {"prompt": faces}),
         error(400, "context_length_exceeded")
         + (Expect(200, rule=f"200 with prompt_tokens {face_tokens:,}",
                   check=completion_check(max_tokens=4, prompt_tokens=face_tokens)),), P, True),
        # routes
        ("unknown route", "routes", _raw(good), error(404, "unknown_route"), P, False, "POST", "/v1/embeddings"),
        ("wrong method (PUT)", "routes", _raw(good), error(405, "method_not_allowed"), P, False, "PUT"),
        ("list the models", "routes", b"", (Expect(200, rule="200 naming the model", check=models_check(model)),),
         None, False, "GET", "/v1/models"),
        ("chat without messages", "routes", _raw({"model": model, "messages": []}), error(400, "invalid_value"),
         P, False, "POST", "/v1/chat/completions"),
        ("responses without input", "routes", _raw({"model": model}),
         error(400, "missing_required_parameter"), P, False, "POST", "/v1/responses"),
        ("tokenize (no BOS)", "routes",
         _raw({"model": model, "prompt": "Hello", "add_special_tokens": False}),
         (Expect(200, rule="200 with the tokenizer's ids", check=tokens_check(tokenizer.encode("Hello"))),),
         P, False, "POST", "/tokenize"),
        ("tokenize without prompt", "routes", _raw({"model": model}),
         error(400, "missing_required_parameter"), P, False, "POST", "/tokenize"),
        ("a model not served (/v1/models/gpt-5)", "routes", b"", error(404, "model_not_found"),
         None, False, "GET", "/v1/models/gpt-5"),
        # Anthropic's Messages route: its own error shape and statuses (415 is its 400)
        ("messages: not JSON", "messages", b"hello", anthropic_error(400, "invalid_request_error"),
         P, False, "POST", "/v1/messages"),
        ("messages: form content type", "messages", b"model=x", anthropic_error(400, "invalid_request_error"),
         "application/x-www-form-urlencoded", False, "POST", "/v1/messages"),
        # correct requests
        ("a correct request", "correct", _raw(good), (ok,)),
        ("temperature 0", "correct", _raw(good | {"prompt": COUNTING, "temperature": 0}),
         (Expect(200, rule="200 with the greedy text", check=completion_check(max_tokens=4, also=same_as_greedy)),)),
        ("max_tokens null", "correct", _raw(good | {"max_tokens": None}),
         (Expect(200, rule="200: 1-16 tokens (the default)", check=completion_check(max_tokens=16)),)),
        ('stop as a bare string ","', "correct", _raw({"model": model, "prompt": COUNTING, "max_tokens": 16,
                                                       "stop": ",", "seed": 0}),
         (Expect(200, rule='200 with no "," in the text', check=completion_check(max_tokens=16, also=no_comma)),)),
        ("n = 2", "correct", _raw(good | {"n": 2}),
         (Expect(200, rule="200 with 2 choices", check=completion_check(choices=2, max_tokens=4)),)),
        ("two prompts", "correct", _raw(good | {"prompt": ["Hello", "Goodbye"]}),
         (Expect(200, rule="200 with 2 choices", check=completion_check(choices=2, max_tokens=4)),)),
        ("logprobs 2", "correct", _raw(good | {"logprobs": 2}),
         (Expect(200, rule="200 with 2 logprobs per token", check=completion_check(max_tokens=4, also=with_logprobs)),)),
        ("stream true", "correct", _raw(good | {"stream": True}),
         (Expect(200, rule="200: events, then [DONE]", check=stream_check),)),
        ("a chat completion", "correct", _raw({"model": model, "max_tokens": 4,
                                               "messages": [{"role": "user", "content": "Hi"}]}),
         (Expect(200, rule="200 with an assistant message", check=chat_check),), P, False, "POST",
         "/v1/chat/completions"),
        ("a streamed chat", "correct", _raw({"model": model, "max_tokens": 4, "stream": True,
                                             "messages": [{"role": "user", "content": "Hi"}]}),
         (Expect(200, rule="200: events, then [DONE]", check=stream_check),), P, False, "POST",
         "/v1/chat/completions"),
    ]
    out = []
    for row in rows:
        name, group, body, expect, *rest = row
        fields = dict(zip(("content_type", "costly", "method", "path"), rest))
        out.append(AwkwardRequest(name, group, body, expect, **fields))
    return out


# The catalogue's rules are `labkit serve`'s own (labkit/serve/README.md). Most follow OpenAI's
# API; these requests are refused by a policy of ours, not by a behaviour of OpenAI's API or a
# rule of JSON. A foil's 200 to one of them is wrong only by our rules.
LABKIT_POLICY = {
    "duplicate keys": "valid JSON (RFC 8259: names SHOULD be unique), which we refuse",
    "nested 10,000 deep": "valid JSON; RFC 8259 lets a parser limit the depth, and ours does",
    "oversized body (1 MiB)": "our own limit on a body (--max-body-bytes)",
    "top_p 0": "OpenAI's API accepts a top_p of 0; ours asks for 0 < top_p <= 1",
    "unsupported option (suffix)": "OpenAI's completions take suffix; ours takes only its do-nothing value "
                                   '"" and refuses any other by name',
}


# -- sending it --------------------------------------------------------------------------------

@dataclass
class Answer:
    """One request's row: what came back and how it reads against the catalogue."""

    request: str
    group: str
    status: int | None         # None: no answer within the timeout
    code: str | None           # the error code, when the body is a documented error shape
    excerpt: str               # the code, a 200's summary, or the start of another body
    shape: str | None          # "openai" or "anthropic": the documented error shape; None: another
    correct: bool
    fault: str                 # what differs from the rule ("" when correct)
    seconds: float
    rule: str = ""

    @property
    def category(self) -> str:
        return classify(self)

    @property
    def documented_shape(self) -> bool:
        return self.shape is not None


def summarize_200(reply: Reply) -> str:
    body = reply.json()
    if not isinstance(body, dict):
        text = reply.body.decode("utf-8", "replace")
        return f"{text.count('data: ')} events" if text.startswith("data: ") else text[:40]
    if body.get("object") == "list":
        return f"{len(body.get('data', []))} model(s)"
    if isinstance(body.get("tokens"), list):   # /tokenize: ids, not choices
        return f"{len(body['tokens'])} token id(s)"
    choices, usage = body.get("choices") or [], body.get("usage") or {}
    return f"{len(choices)} choice(s), {usage.get('completion_tokens')} tokens"


def excerpt_of(reply: Reply, width: int = 48) -> str:
    if reply.status is None:
        return reply.body.decode()
    shape, code = documented_error(reply)
    if shape is not None:
        return str(code)
    if reply.status == 200:
        return summarize_200(reply)
    text = reply.body.decode("utf-8", "replace").replace("\n", " ")
    return text if len(text) <= width else text[:width - 3] + "..."


def send_one(base_url: str, request: AwkwardRequest, timeout_s: float) -> Reply:
    """One request on a connection of its own (a server may close a connection after a 500,
    and a reused one would then fail the next request). No answer: status None."""
    headers = {"Content-Type": request.content_type} if request.content_type else {}
    try:
        with httpx.Client(timeout=timeout_s) as client:
            r = client.request(request.method, base_url + request.path, content=request.body, headers=headers)
    except httpx.TimeoutException:
        return Reply(None, {}, b"(no answer in time)")
    except httpx.TransportError as failure:
        return Reply(None, {}, f"(connection failed: {type(failure).__name__})".encode())
    return Reply(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)


def send_catalogue(base_url: str, requests: Sequence[AwkwardRequest], *, timeout_s: float = 120.0,
                   costly_timeout_s: float | None = None,
                   on_timeout: Callable[[AwkwardRequest], None] | None = None) -> list[Answer]:
    """Send each request in turn (raw httpx, the exact bytes) and judge its answer.

    `costly_timeout_s` bounds the requests marked costly (a service without limits may work on
    them for minutes, or without end). When a request gets no answer in time, `on_timeout` is
    called before the next one: a service that works on one request at a time would otherwise
    make every later request wait behind it."""
    rows = []
    for request in requests:
        limit = costly_timeout_s if request.costly and costly_timeout_s is not None else timeout_s
        started = time.perf_counter()
        reply = send_one(base_url, request, limit)
        seconds = time.perf_counter() - started
        if reply.status is None:
            if on_timeout is not None:
                on_timeout(request)
            correct, (shape, code) = False, (None, None)
            fault = f"{reply.body.decode()[1:-1]} ({limit:g} s allowed)"
        else:
            (correct, fault), (shape, code) = request.judge(reply), documented_error(reply)
        rows.append(Answer(request.name, request.group, reply.status, code, excerpt_of(reply), shape, correct,
                           fault, seconds, request.rule))
    return rows


# -- reading the answers -----------------------------------------------------------------------

CATEGORIES = ("200, correct", "error, as documented", "200, wrong", "4xx, another shape",
              "4xx, other status or code", "500", "no answer in time")


def classify(answer: Answer) -> str:
    """The kind of answer a row is, one of :data:`CATEGORIES`."""
    if answer.status is None:
        return "no answer in time"
    if answer.correct:
        return "200, correct" if answer.status == 200 else "error, as documented"
    if 200 <= answer.status < 300:
        return "200, wrong"
    if answer.status >= 500:
        return "500"
    return "4xx, other status or code" if answer.documented_shape else "4xx, another shape"


def category_counts(answers: Sequence[Answer]) -> dict[str, int]:
    counts = {c: 0 for c in CATEGORIES}
    for a in answers:
        counts[classify(a)] += 1
    return counts


def missing_route_404s(requests: Sequence[AwkwardRequest], answers: Sequence[Answer],
                       served_paths: Collection[str]) -> list[str]:
    """The requests a service answered 404 only because it has no route at their path: a route
    the catalogue means to exist (not the unknown-route probe, whose rule is that 404). A foil
    built for one route fails these for the route it lacks, not for how it handles a request."""
    if [r.name for r in requests] != [a.request for a in answers]:
        raise ValueError("the answers are not to these requests")
    return [r.name for r, a in zip(requests, answers)
            if a.status == 404 and r.path not in served_paths
            and not any(e.status == 404 and e.code == "unknown_route" for e in r.expect)]


def side_by_side(foil: Sequence[Answer], ours: Sequence[Answer]) -> list[dict]:
    """One row per request: the rule, then each service's status, answer and verdict."""
    if [a.request for a in foil] != [a.request for a in ours]:
        raise ValueError("the two runs did not send the same requests")

    def status(a: Answer) -> str:
        return "-" if a.status is None else str(a.status)

    return [{"request": f.request, "a correct answer": o.rule,
             "foil: status": status(f), "foil: answer": f.excerpt, "foil: verdict": classify(f),
             "ours: status": status(o), "ours: answer": o.excerpt, "ours: verdict": classify(o)}
            for f, o in zip(foil, ours)]


@contextmanager
def serving(engine, tokenizer, model_name: str, **settings):
    """Our service over `engine` (in this process, on a thread) for the length of a block;
    yields its base URL. The engine outlives the service, so a chapter can serve it again."""
    from labkit.serve.app import ServeSettings, build_app
    from labkit.serve.engine_client import InProcessEngine
    from labkit.serve.server import BackgroundServer

    app = build_app(InProcessEngine(engine), tokenizer, ServeSettings(model_name, **settings))
    with BackgroundServer(app) as server:
        yield server.url


# -- the foil's switch -------------------------------------------------------------------------

class Unplugged(RuntimeError):
    """Raised inside the foil's forward pass once the harness has pulled its plug."""


class StoppableReference:
    """A `transformers` model that the harness can stop in the middle of `generate`.

    The foil runs `generate` under one lock and never stops a request whose client has gone, so
    a request for 10^9 tokens would hold the service for good. `stop()` makes the next decoder
    layer raise (a pre-hook on every layer: it works in a long prefill too), waits until that
    `generate` has ended, and re-arms. Everything else is the wrapped model's."""

    def __init__(self, model):
        self.model = model
        self._pulled = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self.stops = 0
        self._handles = [layer.register_forward_pre_hook(self._check) for layer in model.model.layers]

    def _check(self, module, args):
        if self._pulled.is_set():
            raise Unplugged("the harness stopped this generate")

    def generate(self, *args, **kwargs):
        self._idle.clear()
        try:
            return self.model.generate(*args, **kwargs)
        finally:
            self._idle.set()

    def stop(self, wait_s: float = 120.0) -> bool:
        """End the running `generate`, if any; True when none is running afterwards."""
        self._pulled.set()
        try:
            ended = self._idle.wait(wait_s)
        finally:
            self._pulled.clear()
        self.stops += 1
        return ended

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __getattr__(self, name):
        return getattr(self.model, name)


@contextmanager
def quiet(*loggers: str, level: int = logging.CRITICAL):
    """Raise the level of `loggers` while a block runs (the foil's 500s log a traceback each)."""
    saved = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(level)
    try:
        yield
    finally:
        for name, old in saved.items():
            logging.getLogger(name).setLevel(old)


# -- where a request's time goes ---------------------------------------------------------------

STAGES = ("read", "parse", "tokenize", "submit", "to-engine", "queue", "prefill", "decode", "to-front-end",
          "serialize")


def parse_server_timing(header: str) -> dict[str, float]:
    """`name;dur=ms, ...` -> {name: ms}, in the header's order."""
    out = {}
    for part in header.split(","):
        name, _, params = part.strip().partition(";")
        values = dict(p.strip().split("=", 1) for p in params.split(";") if "=" in p)
        if not name or "dur" not in values:
            raise ValueError(f"not a Server-Timing entry with a duration: {part!r}")
        out[name.strip()] = float(values["dur"])
    return out


@dataclass
class StageProfile:
    """Repeated whole answers for one prompt: per repeat, each stage (ms), the client's wall
    time (ms) and what the stages do not cover (`other`: HTTP, uvicorn, the client)."""

    prompt_tokens: int
    max_tokens: int
    samples: list[dict[str, float]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    clamped: list[tuple[str, ...]] = field(default_factory=list)  # per repeat: see stage_sample

    def median(self, stage: str) -> float:
        return statistics.median(s[stage] for s in self.samples)

    @property
    def clamped_repeats(self) -> int:
        """Repeats in which some span was negative and reads as zero (:func:`stage_sample`)."""
        return sum(1 for c in self.clamped if c)

    def quantile(self, stage: str, q: float) -> float:
        return Timing(stage, [s[stage] for s in self.samples], 0, 0).quantile(q)


def stage_sample(header: str, wall_ms: float) -> tuple[dict[str, float], tuple[str, ...]]:
    """One repeat's stages (ms) from its `Server-Timing` header, with the client's `wall` and
    `other` (wall less every stage), and the names of the spans that read zero.

    The service writes a negative span as zero (it clamps), so a stage of exactly 0 at the
    header's 1 µs resolution is a span whose end was stamped before its start (two stages
    overlapped), or one under half a microsecond; and stages that add up to more than the
    client's wall time leave `other` negative, which is clamped here too. Either way the
    clamp is named in the second element, so a caller can count and report it."""
    stages = parse_server_timing(header)
    other = wall_ms - sum(stages.values())
    clamped = tuple(name for name, ms in stages.items() if ms == 0.0)
    if other < 0:
        clamped += ("other",)
    return stages | {"wall": wall_ms, "other": max(0.0, other)}, clamped


def profile_stages(base_url: str, model: str, prompt_ids: Sequence[int], *, max_tokens: int = 32,
                   repeats: int = 5, warmup: int = 1, timeout_s: float = 600.0) -> StageProfile:
    """Send the same greedy whole-answer request `warmup + repeats` times (output fixed at
    `max_tokens` with `ignore_eos`) and keep each repeat's `Server-Timing` stages."""
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    profile = StageProfile(len(prompt_ids), max_tokens)
    with httpx.Client(timeout=timeout_s) as client:
        for i in range(warmup + repeats):
            started = time.perf_counter()
            r = client.post(base_url + "/v1/completions", json=body)
            wall = (time.perf_counter() - started) * 1e3
            r.raise_for_status()
            if i < warmup:
                continue
            sample, clamped = stage_sample(r.headers["server-timing"], wall)
            profile.samples.append(sample)
            profile.clamped.append(clamped)
            answer = r.json()
            profile.texts.append(answer["choices"][0]["text"])
            details = answer["usage"].get("prompt_tokens_details") or {}
            profile.cached_tokens.append(details.get("cached_tokens") or 0)
    return profile


def detokenize_timing(tokenizer, token_ids: Sequence[int], *, repeats: int = 20, warmup: int = 2) -> Timing:
    """Seconds to pass `token_ids` one by one through the engine's `OutputProcessor` (stop
    checks and incremental detokenization), as the decode steps do for one sample."""
    params = SamplingParams(temperature=0.0, max_tokens=len(token_ids), ignore_eos=True)

    def feed() -> str:
        processor = OutputProcessor(tokenizer, params)
        for token in token_ids:
            processor.add(token)
        return processor.text

    return measure(feed, name="detokenize", repeats=repeats, warmup=warmup, tokens=len(token_ids))


# -- a character limit vs a token budget -------------------------------------------------------

CJK_PARAGRAPH = (
    "推理服务把一个训练好的模型放在网络接口后面。客户端发来一段文字，服务先把它切成词元，再交给引擎。"
    "引擎在预填充阶段一次读完整个提示，然后在解码阶段一个一个地生成新的词元。每个词元都要在缓存里占一块"
    "内存，所以限制请求的大小时，只数字符是不够的：同样长的一段中文、一串表情符号和一段英文，变成词元以后"
    "数量相差很多，花的时间和内存也相差很多。一个认真的服务按词元计算预算，在做任何工作之前就拒绝放不下的"
    "请求，并且用同一种格式说明原因。"
)


def _cut(text: str, characters: int) -> str:
    return (text * math.ceil(characters / len(text)))[:characters]


def cjk_text(characters: int) -> str:
    """`characters` characters of Chinese prose (one paragraph written for this book, repeated)."""
    return _cut(CJK_PARAGRAPH, characters)


def emoji_text(characters: int, emoji: str = "\U0001F642") -> str:
    return emoji * characters


def ascii_text(source: str, characters: int) -> str:
    """The first `characters` characters of ASCII prose `source`."""
    if not source.isascii():
        raise ValueError("the source text is not ASCII")
    return _cut(source, characters)



@dataclass
class BudgetProbe:
    """A text sent to the service as a prompt: what the service did, and the prefill (ms) of
    each repeat it served."""

    status: int
    code: str | None
    prompt_tokens: int | None
    prefill_ms: list[float]


def probe_budget(base_url: str, model: str, text: str, *, repeats: int = 1, timeout_s: float = 600.0) -> BudgetProbe:
    """Send `text` `repeats` times for one greedy token; stop at the first refusal."""
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0}
    prefill, tokens = [], None
    with httpx.Client(timeout=timeout_s) as client:
        for _ in range(repeats):
            r = client.post(base_url + "/v1/completions", json=body)
            if r.status_code != 200:
                error = error_shape(Reply(r.status_code, {}, r.content))
                return BudgetProbe(r.status_code, error and error["code"], None, [])
            tokens = r.json()["usage"]["prompt_tokens"]
            prefill.append(parse_server_timing(r.headers["server-timing"])["prefill"])
    return BudgetProbe(200, None, tokens, prefill)


def prefill_spread(prefill_ms: Sequence[float]) -> dict[str, float]:
    """A probe's prefill times as table columns: the median and the fastest and slowest
    repeat (NaN for a refused probe, which has none), so that a table of medians keeps its
    spread."""
    if not prefill_ms:
        return {"prefill (ms)": math.nan, "prefill min (ms)": math.nan, "prefill max (ms)": math.nan}
    return {"prefill (ms)": statistics.median(prefill_ms), "prefill min (ms)": min(prefill_ms),
            "prefill max (ms)": max(prefill_ms)}


TREND_MIN_TOKENS = 250   # below this, a prefill's fixed cost spread over few tokens sets its cost per token
PER_TOKEN_RISE = 1.2     # a fitted change of the per-token cost smaller than this factor is no trend


@dataclass(frozen=True)
class PrefillTrend:
    """A straight line through prefill's cost per prompt token (ms) against prompt tokens,
    fitted over the prompts of at least `min_tokens` tokens, read at its two ends."""

    points: int
    min_tokens: int
    first_tokens: int
    last_tokens: int
    first_ms: float          # the line's cost per token at first_tokens
    last_ms: float           # ... and at last_tokens
    rise: float              # the factor a change must reach to count as one

    @property
    def growth(self) -> float:
        return self.last_ms / self.first_ms

    @property
    def direction(self) -> str:
        """"rose", "fell" or "flat" (a change within a factor of `rise` either way)."""
        if self.growth >= self.rise:
            return "rose"
        return "fell" if self.growth <= 1 / self.rise else "flat"


def prefill_trend(tokens: Sequence[int], prefill_ms: Sequence[float], *, min_tokens: int = TREND_MIN_TOKENS,
                  rise: float = PER_TOKEN_RISE) -> PrefillTrend:
    """Fit prefill's cost per prompt token against prompt tokens, over every prompt of at least
    `min_tokens` tokens with a measured prefill (NaN: not served, left out). A line through
    all those points, not the ratio of two of them: one noisy prompt cannot set the verdict,
    and the shortest prompts, where a fixed cost spread over few tokens dominates, are left
    out. Attention makes the per-token cost grow with the length; a line that rises by
    `rise` or more over the range says it does at these lengths."""
    points = sorted((int(t), ms / t) for t, ms in zip(tokens, prefill_ms) if t >= min_tokens and math.isfinite(ms))
    if len({t for t, _ in points}) < 2:
        raise ValueError(f"need prompts of at least two lengths >= {min_tokens} tokens, got {points}")
    slope, intercept = statistics.linear_regression([t for t, _ in points], [c for _, c in points])
    first, last = points[0][0], points[-1][0]
    first_ms, last_ms = intercept + slope * first, intercept + slope * last
    if first_ms <= 0 or last_ms <= 0:
        raise ValueError(f"the fitted cost per token is not positive over {first}-{last} tokens: {points}")
    return PrefillTrend(len(points), min_tokens, first, last, first_ms, last_ms, rise)


# -- figures -----------------------------------------------------------------------------------

def plot_categories(ax, counts: dict[str, dict[str, int]]) -> None:
    """One horizontal bar per service: how many of its answers fell in each of
    :data:`CATEGORIES` (the first two kinds are the right ones). A kind no service gave is
    left out of the bars and the legend; each kind keeps its colour either way."""
    names = list(counts)
    for row, name in enumerate(names):
        left = 0
        for k, category in enumerate(CATEGORIES):
            if not any(c[category] for c in counts.values()):
                continue
            n = counts[name][category]
            ax.barh(row, n, left=left, color=OKABE_ITO[k % len(OKABE_ITO)],
                    label=category if row == 0 else None)
            left += n
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set(xlabel="requests")
    ax.grid(axis="y", visible=False)
    # three columns below the axes: four ran past the figure's edges
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8, frameon=False)


STAGE_FLOOR_MS = 1e-3   # the Server-Timing header's resolution: a zero is drawn here on the log axis


def plot_stages(ax, stages) -> None:
    """Median of each stage per prompt length, as a point on a log axis (a bar's length means
    nothing there), whiskers from min to max; a zero (a clamped span, :func:`stage_sample`)
    is drawn at :data:`STAGE_FLOOR_MS`.
    `stages`: rows with "prompt (tokens)", "stage", "median (ms)", "min (ms)", "max (ms)"."""
    lengths = sorted(set(stages["prompt (tokens)"]))
    names = [s for s in dict.fromkeys(stages["stage"]) if s != "wall"]
    height = 0.8 / len(lengths)
    for k, n in enumerate(lengths):
        rows = stages[stages["prompt (tokens)"] == n].set_index("stage").loc[names]
        y = [i + k * height for i in range(len(names))]
        median = rows["median (ms)"].clip(lower=STAGE_FLOOR_MS)
        low = (median - rows["min (ms)"].clip(lower=STAGE_FLOOR_MS)).clip(lower=0)
        high = (rows["max (ms)"].clip(lower=STAGE_FLOOR_MS) - median).clip(lower=0)
        ax.errorbar(median, y, xerr=[low, high], fmt="o", ms=4, lw=0.8, capsize=2,
                    color=OKABE_ITO[k % len(OKABE_ITO)], label=f"{n:,}-token prompt")
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names)
    ax.set_ylim(len(names) - 0.2, -0.6)
    ax.set_xscale("log")
    ax.set(xlabel="time (ms, log scale)")
    ax.grid(axis="y", visible=False)
    ax.legend(fontsize=8, loc="lower right")
