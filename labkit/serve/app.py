"""The HTTP front end: OpenAI's routes in front of an `EngineClient`.

    POST /v1/completions, POST /v1/chat/completions   (JSON, or Server-Sent Events with stream)
    GET  /v1/models, /v1/models/{id}, /health, /metrics

A request is read with a size limit, parsed and checked (`labkit.serve.protocol`),
tokenized, and checked against the engine's limits before anything is submitted, so a bad
request costs no engine work and gets a 4xx in one shape (`labkit.serve.errors`). Each
prompt becomes one engine request with `n` samples. A client that goes away, streaming or
not, has its requests aborted at once; the engine frees their KV blocks in its next step.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from labkit.sampling import SamplingParams
from labkit.serve import prompt_ids, responses
from labkit.serve.access import install_request_ids
from labkit.serve.admission import QUEUE_POLICIES, AdmissionControl
from labkit.serve.calls import Call
from labkit.serve.engine_client import (SLOW_READER_POLICIES, EngineClient, EngineFailure, EngineRequest,
                                        EngineUnavailable, ResultStream)
from labkit.serve.errors import APIError, install_error_handlers, invalid
from labkit.serve.metrics import ServiceMetrics
from labkit.serve.openapi_schema import install_openapi
from labkit.serve.protocol import (ChatCompletionRequest, CompletionRequest, SamplingFields,
                                   check_content_type, parse_json_body, validate)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


@dataclass
class ServeSettings:
    model_name: str
    max_body_bytes: int = 1 << 20
    api_keys: list[str] = field(default_factory=list)   # empty: no authentication
    max_buffered_events: int = 1024                     # per stream, before the slow-reader policy
    slow_reader: str = "abort"
    retry_after_seconds: float = 1.0
    queue_policy: str = "bounded"                       # backpressure by default (chapter 26)
    max_queue: int | None = None                        # waiting requests; None: engine_concurrency
    default_deadline_ms: float | None = None
    request_timeout: float | None = 600.0               # s from arrival to the end; None: no limit
    max_concurrent_per_key: int | None = None           # open requests per API key; None: no limit
    sse_keepalive_seconds: float | None = 15.0          # a silent stream gets an SSE comment; None: never
    engine_concurrency: int = 64                        # the engine's max_num_seqs
    drain_timeout: float = 25.0                         # s that running requests get after SIGTERM
    log_prompts: bool = False                           # prompt and output text in the access log

    def __post_init__(self) -> None:
        if self.slow_reader not in SLOW_READER_POLICIES:
            raise ValueError(f"slow_reader must be one of {SLOW_READER_POLICIES}")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy must be one of {QUEUE_POLICIES}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError("request_timeout must be positive (None: no limit)")
        if self.max_concurrent_per_key is not None:
            if self.max_concurrent_per_key < 1:
                raise ValueError("max_concurrent_per_key must be at least 1")
            if not self.api_keys:
                raise ValueError("a limit per API key needs API keys (--api-key-file)")

    @property
    def queue_limit(self) -> int:
        """Requests that may wait: one full batch of the engine's by default."""
        return self.engine_concurrency if self.max_queue is None else self.max_queue


def tenant_of(api_key: str | None) -> str | None:
    """A tenant's prefix-cache scope, derived from its key (the key itself is never stored)."""
    return None if api_key is None else "tenant-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def cache_scope(tenant: str | None, cache_salt: str | None) -> str | None:
    if tenant is None:
        return cache_salt
    return tenant if cache_salt is None else f"{tenant}/{cache_salt}"


def build_app(client: EngineClient, tokenizer, settings: ServeSettings) -> FastAPI:
    metrics = ServiceMetrics(client, settings.model_name)
    token_text = responses.TokenText(tokenizer)
    admission = AdmissionControl(settings.queue_policy, settings.queue_limit, settings.engine_concurrency,
                                 None if settings.default_deadline_ms is None else settings.default_deadline_ms / 1e3)
    open_streams: dict[str, ResultStream] = {}
    open_per_key: Counter[str] = Counter()              # tenant -> open engine requests
    key_of_stream: dict[str, str] = {}
    draining = asyncio.Event()

    async def drain() -> None:
        """Stop taking requests, give the running ones `drain_timeout` seconds to finish, then
        end the rest with an error event (streams also get [DONE]). The caller then stops
        the server (labkit.serve.server)."""
        draining.set()
        deadline = time.monotonic() + settings.drain_timeout
        while open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for stream in list(open_streams.values()):
            stream.abort()
            stream.put(EngineFailure(f"the server is shutting down and the request did not finish within "
                                     f"the drain timeout of {settings.drain_timeout:g} s", code="shutting_down"))
        flushed = time.monotonic() + 5.0  # the handlers write their error and close
        while open_streams and time.monotonic() < flushed:
            await asyncio.sleep(0.05)

    def refuse_while_draining() -> None:
        if draining.is_set():
            raise APIError(503, "the server is shutting down: it finishes the requests it has and takes no "
                                "new ones; retry on another replica", "server_draining",
                           retry_after=settings.retry_after_seconds)

    def end(request_id: str, failure: EngineFailure) -> None:
        stream = open_streams.get(request_id)
        admission.done(request_id)
        if stream is not None:
            stream.abort()
            stream.put(failure)

    async def sweep() -> None:
        """Every 20 ms: drop what can no longer meet its deadline (drop-expired), and end what
        has run past --request-timeout."""
        while True:
            await asyncio.sleep(0.02)
            for request_id in admission.expired():
                end(request_id, EngineFailure("the request could no longer finish by its deadline; it was "
                                              "dropped from the queue", code="deadline_expired"))
            if settings.request_timeout is not None:
                for request_id in admission.older_than(settings.request_timeout):
                    end(request_id, EngineFailure(f"the request ran longer than this server's limit of "
                                                  f"{settings.request_timeout:g} s (--request-timeout)",
                                                  code="request_timeout"))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        sweeper = asyncio.create_task(sweep(), name="labkit-sweep")
        try:
            yield
        finally:
            sweeper.cancel()
            await client.stop()

    app = FastAPI(title="labkit", lifespan=lifespan)
    app.state.client, app.state.metrics, app.state.settings = client, metrics, settings
    app.state.admission = admission
    app.state.drain = drain
    install_error_handlers(app)
    install_request_ids(app, settings.log_prompts)
    install_openapi(app)

    def authenticate(request: Request) -> str | None:
        if not settings.api_keys:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "an API key is needed: send Authorization: Bearer <key>", "missing_api_key")
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in settings.api_keys):
            raise APIError(401, "the API key is not valid", "invalid_api_key")
        return key

    async def read_body(request: Request) -> dict:
        check_content_type(request.headers.get("content-type"))
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise invalid("Content-Length is not a number", code="invalid_header")
            if int(declared) > settings.max_body_bytes:
                raise APIError(413, f"the body is {declared} bytes; the limit is {settings.max_body_bytes}",
                               "body_too_large")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > settings.max_body_bytes:
                raise APIError(413, f"the body exceeds the limit of {settings.max_body_bytes} bytes",
                               "body_too_large")
        return parse_json_body(bytes(raw))

    def check_model(name: str) -> None:
        if name != settings.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{settings.model_name!r}", "model_not_found", "model")

    def sampling(fields: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if fields.temperature is None else fields.temperature,
            top_p=1.0 if fields.top_p is None else fields.top_p,
            top_k=fields.top_k or 0, min_p=fields.min_p or 0.0, max_tokens=max_tokens, seed=fields.seed,
            stop=fields.stop_strings, presence_penalty=fields.presence_penalty or 0.0,
            frequency_penalty=fields.frequency_penalty or 0.0, logprobs=logprobs,
            ignore_eos=bool(fields.ignore_eos), logit_bias=fields.bias_pairs, stop_token_ids=fields.stop_ids)

    def check_size(prompt_ids: list[int], max_tokens: int, param: str, n: int,
                   params: SamplingParams) -> None:
        if client.limits is None:
            raise APIError(503, "the engine is starting", "engine_unavailable",
                           retry_after=settings.retry_after_seconds)
        refused = client.limits.refusal(len(prompt_ids), max_tokens, n=n,
                                        stop_token_ids=params.stop_token_ids,
                                        logit_bias_ids=tuple(t for t, _ in params.logit_bias))
        if refused is not None:
            where = refused.param if refused.code in ("too_many_samples", "unknown_token") else param
            raise APIError(400, str(refused), refused.code, where)

    def deadline(request: Request, fields: SamplingFields, arrival: float) -> float | None:
        header = request.headers.get("x-deadline-ms")
        given = fields.deadline_ms
        if header is not None:
            try:
                from_header = float(header)
            except ValueError:
                raise invalid(f"X-Deadline-Ms must be a number of milliseconds, got {header!r}",
                              "X-Deadline-Ms") from None
            if not 0 < from_header <= 1e7:
                raise invalid("X-Deadline-Ms must be in (0, 1e7]", "X-Deadline-Ms")
            if given is not None and given != from_header:
                raise invalid("deadline_ms and X-Deadline-Ms disagree", "deadline_ms")
            given = from_header
        return admission.deadline_of(arrival, None if given is None else given / 1e3)

    def admit(encoded: list[list[int]], max_tokens: int, until: float | None, tenant: str | None) -> None:
        limit = settings.max_concurrent_per_key
        if limit is not None and open_per_key[tenant] + len(encoded) > limit:
            raise APIError(429, f"this API key has {open_per_key[tenant]} requests open; its limit is {limit} "
                                "(--max-concurrent-per-key)", "rate_limit_exceeded",
                           retry_after=settings.retry_after_seconds)
        refusal = admission.consider(sum(len(ids) for ids in encoded), max_tokens, until)
        if refusal is not None:
            raise APIError(refusal.status, refusal.message, refusal.code, retry_after=max(1.0, refusal.retry_after))

    def submit(request_id: str, ids: list[int], params: SamplingParams, n: int, salt: str | None,
               until: float | None, tenant: str | None) -> ResultStream:
        try:
            stream = client.submit(EngineRequest(request_id, ids, params, n, salt),
                                   max_buffered=settings.max_buffered_events, policy=settings.slow_reader)
        except EngineUnavailable as error:
            raise APIError(503, str(error), "engine_unavailable", retry_after=settings.retry_after_seconds) from None
        admission.admit(request_id, len(ids), params.max_tokens, until)
        open_streams[request_id] = stream
        if tenant is not None:
            open_per_key[tenant] += 1
            key_of_stream[request_id] = tenant
        return stream

    def closed(stream: ResultStream) -> None:
        if open_streams.pop(stream.request_id, None) is not None:
            admission.done(stream.request_id, stream.output)
        tenant = key_of_stream.pop(stream.request_id, None)
        if tenant is not None:
            open_per_key[tenant] -= 1
            if not open_per_key[tenant]:
                del open_per_key[tenant]

    def vocab_size() -> int | None:
        return client.limits.vocab_size if client.limits else None

    # -- routes ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        state = client.health()
        status = ("draining" if draining.is_set() else "ok" if client.ready else
                  "failed" if state.get("state") == "failed" else "starting")
        return JSONResponse({"status": status, **state}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "labkit",
                "max_model_len": client.limits.max_model_len if client.limits else None,
                "weights": client.weights}

    @app.get("/v1/models")
    async def models(request: Request):
        authenticate(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        authenticate(request)
        check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        marks = {"arrival": arrival}
        try:
            refuse_while_draining()
            key = authenticate(request)
            body = await read_body(request)
            marks["read"] = time.perf_counter()
            fields: CompletionRequest = validate(CompletionRequest, body)
            marks["parsed"] = time.perf_counter()
            check_model(fields.model)
            prompts = fields.prompt
            if isinstance(prompts, str) or isinstance(prompts[0], int):
                prompts = [prompts]
            try:
                encoded = await prompt_ids.completion_ids(prompts, tokenizer, vocab_size())
            except ValueError as error:
                raise invalid(str(error), "prompt") from None
            try:
                echo = await prompt_ids.prompt_texts(prompts, tokenizer) if fields.echo else None
            except ValueError as error:
                raise invalid(str(error), "echo") from None
            marks["tokenized"] = time.perf_counter()
            max_tokens = fields.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
            params = sampling(fields, max_tokens, fields.logprobs)
            for ids in encoded:
                check_size(ids, max_tokens, "prompt", fields.n or 1, params)
            until = deadline(request, fields, arrival)
            tenant = tenant_of(key)
            admit(encoded, max_tokens, until, tenant)
            response_id = f"cmpl-{uuid.uuid4().hex}"
            salt = cache_scope(tenant, fields.cache_salt)
            n = fields.n or 1
            streams = [submit(f"{response_id}-{p}", ids, params, n, salt, until, tenant)
                       for p, ids in enumerate(encoded)]
            marks["submitted"] = time.perf_counter()
        except APIError as error:
            metrics.count("completions", "refused" if error.status in (429, 503) else "client_error")
            raise
        call = Call("completions", response_id, int(time.time()), settings.model_name, streams, n,
                     fields.logprobs is not None, arrival, metrics, token_text, fields.user, marks,
                     admission.token, closed, keepalive_s=settings.sse_keepalive_seconds)
        call.echo = echo
        if fields.stream:
            usage = bool(fields.stream_options and fields.stream_options.include_usage)
            return call.stream(request, chat=False, include_usage=usage)
        return await call.answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        marks = {"arrival": arrival}
        try:
            refuse_while_draining()
            key = authenticate(request)
            body = await read_body(request)
            marks["read"] = time.perf_counter()
            fields: ChatCompletionRequest = validate(ChatCompletionRequest, body)
            marks["parsed"] = time.perf_counter()
            check_model(fields.model)
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text}
                        for m in fields.messages]
            try:
                ids = await prompt_ids.chat_ids(messages, tokenizer, vocab_size())
            except ValueError as error:
                raise invalid(str(error), "messages") from None
            marks["tokenized"] = time.perf_counter()
            limit = fields.max_completion_tokens or fields.max_tokens
            if client.limits is None:  # the rest of the context is not known yet
                raise APIError(503, "the engine is starting", "engine_unavailable",
                               retry_after=settings.retry_after_seconds)
            max_tokens = limit if limit is not None else max(1, client.limits.max_model_len - len(ids))
            logprobs = (fields.top_logprobs or 0) if fields.logprobs else None
            params = sampling(fields, max_tokens, logprobs)
            check_size(ids, max_tokens, "max_completion_tokens" if limit is not None else "messages",
                       fields.n or 1, params)
            until = deadline(request, fields, arrival)
            tenant = tenant_of(key)
            admit([ids], max_tokens, until, tenant)
            response_id = f"chatcmpl-{uuid.uuid4().hex}"
            salt = cache_scope(tenant, fields.cache_salt)
            n = fields.n or 1
            streams = [submit(response_id, ids, params, n, salt, until, tenant)]
            marks["submitted"] = time.perf_counter()
        except APIError as error:
            metrics.count("chat", "refused" if error.status in (429, 503) else "client_error")
            raise
        call = Call("chat", response_id, int(time.time()), settings.model_name, streams, n,
                     logprobs is not None, arrival, metrics, token_text, fields.user, marks,
                     admission.token, closed, fields.metadata, keepalive_s=settings.sse_keepalive_seconds)
        if fields.stream:
            usage = bool(fields.stream_options and fields.stream_options.include_usage)
            return call.stream(request, chat=True, include_usage=usage)
        return await call.answer(request, chat=True)

    return app
