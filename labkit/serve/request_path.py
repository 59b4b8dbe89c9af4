"""What every protocol's routes share, from the request's bytes to the engine's streams.

An adapter (`labkit.serve.openai_routes`, ...) parses its own wire format and answers in it;
between the two it goes through one `RequestPath`, built once per app, which owns what must
be the same whatever the protocol: refusing while draining, the API key and its tenant, the
body's size and content type, the model's name, the engine's limits, deadlines, admission
(queue and per-key limits), submitting, and the bookkeeping of open streams that the drain,
the sweeper and the per-key counts read. The adapter hands it one `EngineWork`, and gets the
engine's streams back from `start`.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

from fastapi import Request

from labkit.sampling import SamplingParams
from labkit.serve import responses
from labkit.serve.admission import AdmissionControl
from labkit.serve.calls import Call
from labkit.serve.engine_client import (EngineClient, EngineFailure, EngineRequest, EngineUnavailable,
                                        ResultStream)
from labkit.serve.errors import APIError, invalid
from labkit.serve.metrics import ServiceMetrics
from labkit.serve.protocol import check_content_type, parse_json_body
from labkit.serve.settings import ServeSettings, cache_scope


@dataclass
class EngineWork:
    """One HTTP request's engine work, as an adapter hands it over: one engine request per
    prompt, each with `n` samples, all with the same sampling parameters."""

    route: str                          # the metrics' route label: "completions", "chat", ...
    response_id: str
    prompts: list[list[int]]            # token ids, checked against the engine's limits
    params: SamplingParams
    marks: dict[str, float]             # perf_counter times: "arrival", "read", "parsed", "tokenized"
    n: int = 1
    cache_salt: str | None = None       # the client's own; the tenant's scope is added to it
    deadline: float | None = None       # admission's clock (`RequestPath.deadline`)
    tenant: str | None = None
    numbered: bool = False              # engine request ids "<response_id>-<p>" (else one prompt)

    def __post_init__(self) -> None:
        if not self.prompts or (len(self.prompts) > 1 and not self.numbered):
            raise ValueError("one prompt, or numbered engine requests for several")

    @property
    def request_ids(self) -> list[str]:
        if self.numbered:
            return [f"{self.response_id}-{p}" for p in range(len(self.prompts))]
        return [self.response_id]


class RequestPath:
    """The shared request path of one app (see the module's docstring)."""

    def __init__(self, client: EngineClient, tokenizer, settings: ServeSettings):
        self.client, self.tokenizer, self.settings = client, tokenizer, settings
        self.metrics = ServiceMetrics(client, settings.model_name)
        self.token_text = responses.TokenText(tokenizer)
        deadline_ms = settings.default_deadline_ms
        default_deadline = None if deadline_ms is None else deadline_ms / 1e3
        self.admission = AdmissionControl(settings.queue_policy, settings.queue_limit,
                                          settings.engine_concurrency, default_deadline)
        self.open_streams: dict[str, ResultStream] = {}
        self.open_per_key: Counter[str] = Counter()      # tenant -> open engine requests
        self.key_of_stream: dict[str, str] = {}
        self.draining = asyncio.Event()

    # -- the app's life ------------------------------------------------------------------
    @asynccontextmanager
    async def lifespan(self, app):
        await self.client.start()
        sweeper = asyncio.create_task(self.sweep(), name="labkit-sweep")
        try:
            yield
        finally:
            sweeper.cancel()
            await self.client.stop()

    async def drain(self) -> None:
        """Stop taking requests, give the running ones `drain_timeout` seconds to finish, then
        end the rest with an error event (streams also get [DONE]). The caller then stops
        the server (labkit.serve.server)."""
        self.draining.set()
        timeout = self.settings.drain_timeout
        deadline = time.monotonic() + timeout
        while self.open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for stream in list(self.open_streams.values()):
            stream.abort()
            stream.put(EngineFailure(f"the server is shutting down and the request did not finish within "
                                     f"the drain timeout of {timeout:g} s", code="shutting_down"))
        flushed = time.monotonic() + 5.0  # the handlers write their error and close
        while self.open_streams and time.monotonic() < flushed:
            await asyncio.sleep(0.05)

    def end(self, request_id: str, failure: EngineFailure) -> None:
        stream = self.open_streams.get(request_id)
        self.admission.done(request_id)
        if stream is not None:
            stream.abort()
            stream.put(failure)

    async def sweep(self) -> None:
        """Every 20 ms: drop what can no longer meet its deadline (drop-expired), and end what
        has run past --request-timeout."""
        timeout = self.settings.request_timeout
        while True:
            await asyncio.sleep(0.02)
            for request_id in self.admission.expired():
                self.end(request_id, EngineFailure("the request could no longer finish by its deadline; it "
                                                   "was dropped from the queue", code="deadline_expired"))
            if timeout is not None:
                for request_id in self.admission.older_than(timeout):
                    self.end(request_id, EngineFailure(f"the request ran longer than this server's limit of "
                                                       f"{timeout:g} s (--request-timeout)",
                                                       code="request_timeout"))

    # -- checks, in the order a route makes them -------------------------------------------
    def refuse_while_draining(self) -> None:
        if self.draining.is_set():
            raise APIError(503, "the server is shutting down: it finishes the requests it has and takes no "
                                "new ones; retry on another replica", "server_draining",
                           retry_after=self.settings.retry_after_seconds)

    def authenticate(self, request: Request) -> str | None:
        """The request's API key (None without --api-key-file): `Authorization: Bearer <key>`
        as OpenAI's clients send it, else `X-Api-Key: <key>` as Anthropic's do."""
        if not self.settings.api_keys:
            return None
        header = request.headers.get("authorization")
        if header is not None:
            scheme, _, key = header.partition(" ")
            if scheme.lower() != "bearer":
                key = ""
        else:
            key = request.headers.get("x-api-key", "")
        if not key:
            raise APIError(401, "an API key is needed: send Authorization: Bearer <key> "
                                "(or X-Api-Key: <key>)", "missing_api_key")
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.settings.api_keys):
            raise APIError(401, "the API key is not valid", "invalid_api_key")
        return key

    async def read_body(self, request: Request) -> dict:
        limit = self.settings.max_body_bytes
        check_content_type(request.headers.get("content-type"))
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise invalid("Content-Length is not a number", code="invalid_header")
            if int(declared) > limit:
                raise APIError(413, f"the body is {declared} bytes; the limit is {limit}", "body_too_large")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise APIError(413, f"the body exceeds the limit of {limit} bytes", "body_too_large")
        return parse_json_body(bytes(raw))

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.settings.model_name!r}", "model_not_found", "model")

    @property
    def vocab_size(self) -> int | None:
        return self.client.limits.vocab_size if self.client.limits else None

    def max_model_len(self) -> int:
        """The engine's context length; 503 while the engine is starting (it is not known yet)."""
        if self.client.limits is None:
            raise APIError(503, "the engine is starting", "engine_unavailable",
                           retry_after=self.settings.retry_after_seconds)
        return self.client.limits.max_model_len

    def check_size(self, prompt_ids: list[int], max_tokens: int, param: str, n: int,
                   stop_token_ids: tuple[int, ...] = (), logit_bias_ids: tuple[int, ...] = ()) -> None:
        """400 for what the engine cannot do; `param` names the field of a size refusal (the
        request's own words for its prompt or limit), the others name their own field."""
        self.max_model_len()
        refused = self.client.limits.refusal(len(prompt_ids), max_tokens, n=n, stop_token_ids=stop_token_ids,
                                             logit_bias_ids=logit_bias_ids)
        if refused is not None:
            where = refused.param if refused.code in ("too_many_samples", "unknown_token") else param
            raise APIError(400, str(refused), refused.code, where)

    def deadline(self, request: Request, given_ms: float | None, arrival: float) -> float | None:
        """The request's deadline from its body's `deadline_ms` or the X-Deadline-Ms header."""
        header = request.headers.get("x-deadline-ms")
        if header is not None:
            try:
                from_header = float(header)
            except ValueError:
                raise invalid(f"X-Deadline-Ms must be a number of milliseconds, got {header!r}",
                              "X-Deadline-Ms") from None
            if not 0 < from_header <= 1e7:
                raise invalid("X-Deadline-Ms must be in (0, 1e7]", "X-Deadline-Ms")
            if given_ms is not None and given_ms != from_header:
                raise invalid("deadline_ms and X-Deadline-Ms disagree", "deadline_ms")
            given_ms = from_header
        return self.admission.deadline_of(arrival, None if given_ms is None else given_ms / 1e3)

    # -- admission and the engine ----------------------------------------------------------
    def admit(self, prompts: list[list[int]], max_tokens: int, until: float | None,
              tenant: str | None) -> None:
        limit, retry = self.settings.max_concurrent_per_key, self.settings.retry_after_seconds
        if limit is not None and self.open_per_key[tenant] + len(prompts) > limit:
            raise APIError(429, f"this API key has {self.open_per_key[tenant]} requests open; its limit is "
                                f"{limit} (--max-concurrent-per-key)", "rate_limit_exceeded",
                           retry_after=retry)
        refusal = self.admission.consider(sum(len(ids) for ids in prompts), max_tokens, until)
        if refusal is not None:
            raise APIError(refusal.status, refusal.message, refusal.code,
                           retry_after=max(1.0, refusal.retry_after))

    def submit(self, request_id: str, ids: list[int], params: SamplingParams, n: int, salt: str | None,
               until: float | None, tenant: str | None) -> ResultStream:
        try:
            stream = self.client.submit(EngineRequest(request_id, ids, params, n, salt),
                                        max_buffered=self.settings.max_buffered_events,
                                        policy=self.settings.slow_reader)
        except EngineUnavailable as error:
            raise APIError(503, str(error), "engine_unavailable",
                           retry_after=self.settings.retry_after_seconds) from None
        self.admission.admit(request_id, len(ids), params.max_tokens, until)
        self.open_streams[request_id] = stream
        if tenant is not None:
            self.open_per_key[tenant] += 1
            self.key_of_stream[request_id] = tenant
        return stream

    def start(self, work: EngineWork) -> list[ResultStream]:
        """Admit the work (or refuse it: APIError) and submit one engine request per prompt."""
        self.admit(work.prompts, work.params.max_tokens, work.deadline, work.tenant)
        salt = cache_scope(work.tenant, work.cache_salt)
        # Stamped before the send: the worker stamps its arrival on receipt, which can come
        # before the send returns, so a later stamp would make "to-engine" negative.
        work.marks["submitted"] = time.perf_counter()
        return [self.submit(request_id, ids, work.params, work.n, salt, work.deadline, work.tenant)
                for request_id, ids in zip(work.request_ids, work.prompts)]

    def closed(self, stream: ResultStream) -> None:
        if self.open_streams.pop(stream.request_id, None) is not None:
            self.admission.done(stream.request_id, stream.output)
        tenant = self.key_of_stream.pop(stream.request_id, None)
        if tenant is not None:
            self.open_per_key[tenant] -= 1
            if not self.open_per_key[tenant]:
                del self.open_per_key[tenant]

    def call(self, work: EngineWork, streams: list[ResultStream], *, logprobs: bool = False,
             user: str | None = None, metadata: dict[str, str] | None = None) -> Call:
        """The started work as a `Call`: its events, accounting and end (labkit.serve.calls)."""
        return Call(work.route, work.response_id, int(time.time()), self.settings.model_name, streams, work.n,
                    logprobs, work.marks["arrival"], self.metrics, self.token_text, user, work.marks,
                    self.admission.token, self.closed, metadata,
                    keepalive_s=self.settings.sse_keepalive_seconds)

    async def receive(self, request: Request, parse: Callable[[dict], Any], marks: dict[str, float], *,
                      model_of: Callable[[Any], str] = lambda fields: fields.model) -> tuple[str | None, Any]:
        """What every route does first, in this order: refuse while draining, authenticate, read
        the body within its limit, parse it (`parse`: the protocol's own rules and error shape)
        and check the model. `marks` gets the read and parsed times. Returns the API key and
        what `parse` returned."""
        self.refuse_while_draining()
        key = self.authenticate(request)
        body = await self.read_body(request)
        marks["read"] = time.perf_counter()
        fields = parse(body)
        marks["parsed"] = time.perf_counter()
        self.check_model(model_of(fields))
        return key, fields

    @contextmanager
    def refusals_counted(self, route: str):
        """Count a refused request (APIError before its work started) in the route's metrics."""
        try:
            yield
        except APIError as error:
            self.metrics.count(route, "refused" if error.status in (429, 503) else "client_error")
            raise
