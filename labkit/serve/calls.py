"""One HTTP request's engine requests, answered whole (JSON) or as Server-Sent Events.

A `Call` merges the events of its engine requests in arrival order, feeds admission control
(first token, end), records latencies, and aborts whatever is unfinished when the client
goes away or the stream ends for any reason. The wire format is the caller's: OpenAI's
completion and chat shapes are built in (`answer`, `stream`); another protocol may hand
`stream_as` its `StreamWriter`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from labkit.engine.llm_engine import RequestOutput, TokenEvent
from labkit.serve import responses
from labkit.serve.access import RequestRecord, record_of
from labkit.serve.engine_client import EngineFailure, ResultStream
from labkit.serve.errors import APIError, ErrorShape, invalid
from labkit.serve.metrics import FinishedRequest, ServiceMetrics

log = logging.getLogger("labkit.serve")


async def until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def outcome_of(error: BaseException) -> str:
    if getattr(error, "code", None) == "deadline_expired":
        return "dropped"
    return "client_error" if failure_error(error).status < 500 else "failed"


STOPPED_ON_PURPOSE = ("deadline_expired", "request_timeout", "shutting_down")


def cut_reason(error: BaseException | None) -> str | None:
    """The finish reason (`labkit:request_success_total`) of the samples a request had not
    finished when it ended: None for a request the engine refused (nothing ran); "abort" when
    it was stopped on purpose (the client went away or read too slowly, its deadline or the
    request timeout passed, the shutdown's drain ended it); "error" when the engine failed it
    (a worker that died, a step that raised)."""
    if isinstance(error, ValueError):
        return None
    if error is None or getattr(error, "client_error", False) or getattr(error, "code", None) in STOPPED_ON_PURPOSE:
        return "abort"
    return "error"


def failure_error(error: BaseException) -> APIError:
    if isinstance(error, ValueError):
        return invalid(str(error))
    if isinstance(error, EngineFailure) and error.client_error:
        return APIError(400, str(error), error.code)
    return APIError(503, str(error), getattr(error, "code", "engine_failure"), retry_after=1.0)


class StreamWriter(Protocol):
    """One protocol's Server-Sent Events frames, each a whole frame (ending in a blank line)."""

    def opening(self) -> list[str]: ...                             # before any token
    def event(self, index: int, event: TokenEvent) -> list[str]: ...  # a choice's token or end
    def closing(self, outputs: list[RequestOutput]) -> list[str]: ...  # after every choice ended
    def failure(self, error: APIError) -> list[str]: ...            # the engine failed mid-stream
    def ending(self) -> list[str]: ...                              # last of all, ended well or not


@dataclass
class Call:
    """One HTTP request's engine requests, answered whole or as a stream."""

    route: str
    response_id: str
    created: int
    model: str
    streams: list[ResultStream]
    n: int
    logprobs: bool
    arrival: float
    metrics: ServiceMetrics
    tokens: responses.TokenText
    user: str | None = None
    marks: dict[str, float] = field(default_factory=dict)  # perf_counter times (the engine's clock too)
    on_token: object = None        # admission control: a request started / ended
    on_closed: object = None
    metadata: dict[str, str] | None = None  # chat's `metadata`: informational, like `user`
    record: RequestRecord | None = None     # its access-log line (labkit.serve.access)
    keepalive_s: float | None = 15.0        # a stream silent this long gets an SSE comment
    echo: list[str] | None = None           # completions' `echo`: each prompt's text, put before its choices'
    replies: object = None                  # chat: reads tool calls (labkit.serve.openai_tools.ChatToolReplies)
    _first: dict[int, float] = field(default_factory=dict, init=False)   # prompt p -> its first token's arrival
    _last: dict[int, float] = field(default_factory=dict, init=False)    # choice -> its newest token's arrival
    _ended: dict[int, float] = field(default_factory=dict, init=False)   # prompt p -> its output's arrival
    _reasons: dict[int, str] = field(default_factory=dict, init=False)   # choice -> finish reason, as events said
    _finished: bool = field(default=False, init=False)

    def attach(self, request: Request) -> None:
        """Take the request's id and access-log record (labkit.serve.access)."""
        self.record = record_of(request)
        if self.record is not None:
            self.record.call_open = True
            for stream in self.streams:
                stream.client_request_id = self.record.request_id

    def server_timing(self) -> str:
        """The request's stages as a Server-Timing header (ms). A span the clocks make slightly
        negative (a stamp's own cost) is written as 0; `timing_stages` keeps them raw."""
        return ", ".join(f"{name};dur={max(0.0, end - begin) * 1e3:.3f}"
                         for name, begin, end in self.timing_stages())

    def timing_stages(self) -> list[tuple[str, float, float]]:
        """The request's stages as (name, begin, end), unclamped. Engine times come from its own
        clock: time.perf_counter is one system-wide monotonic clock on Linux, so the worker's
        and the front end's readings compare."""
        out = self.streams[0].output
        m = self.marks
        stages = [("read", m["arrival"], m["read"]), ("parse", m["read"], m["parsed"]),
                  ("tokenize", m["parsed"], m["tokenized"]), ("submit", m["tokenized"], m["submitted"]),
                  ("to-engine", m["submitted"], out.arrival_time)]
        if out.first_scheduled_time is not None and out.first_token_time is not None:
            stages += [("queue", out.arrival_time, out.first_scheduled_time),
                       ("prefill", out.first_scheduled_time, out.first_token_time)]
        if out.first_token_time is not None and out.finish_time is not None:
            stages += [("decode", out.first_token_time, out.finish_time),
                       ("to-front-end", out.finish_time, m["collected"])]
        stages.append(("serialize", m["collected"], m["serialized"]))
        return stages

    def finish(self, outcome: str, error: BaseException | None = None) -> None:
        """Count the request once (labkit.serve.metrics): its outcome; per prompt, its prompt
        tokens once computed (once whatever n) and the tokens that reached the front end;
        per choice, its finish reason; per prompt whose output arrived, its histograms."""
        if self._finished:
            return
        self._finished = True
        self.metrics.count(self.route, outcome)
        cut = cut_reason(error) if outcome != "ok" else None
        reasons, generated_total = [], 0
        for p, stream in enumerate(self.streams):
            out = stream.output
            if out is not None:
                prompt, generated = len(out.prompt_token_ids), sum(len(s.token_ids) for s in out.samples)
            else:  # cut off: its prompt counts once it ran (a token came back)
                generated = stream.tokens_received
                prompt = len(stream.request.prompt_token_ids) if generated else 0
            generated_total += generated
            self.metrics.tokens(prompt, generated)
            given = {s.index: s.finish_reason for s in out.samples} if out is not None else {}
            for i in range(self.n):
                reason = given.get(i) or self._reasons.get(p * self.n + i) or cut
                if reason is not None:
                    self.metrics.ended(reason)
                    reasons.append(reason)
            if out is not None:
                self.metrics.finished(FinishedRequest(
                    prompt, generated, max((len(s.token_ids) for s in out.samples), default=0), self.n,
                    stream.request.params.max_tokens, self._ended.get(p, time.perf_counter()) - self.arrival,
                    _between(out.arrival_time, out.first_scheduled_time),
                    _between(out.first_scheduled_time, out.first_token_time),
                    _between(out.first_token_time, out.finish_time)))
        request_id = self.record.request_id if self.record is not None else None
        log.info("%s %s request_id=%s outcome=%s user=%s metadata=%s prompt_tokens=%s seconds=%.3f", self.route,
                 self.response_id, request_id, outcome, self.user, self.metadata,
                 [len(s.request.prompt_token_ids) for s in self.streams],
                 time.perf_counter() - self.arrival)
        if self.record is not None:
            r = self.record
            r.outcome, r.response_id, r.finish_reasons = outcome, self.response_id, reasons
            r.prompt_tokens = sum(len(s.request.prompt_token_ids) for s in self.streams)
            r.output_tokens = generated_total
            r.ttft = min(self._first.values()) - self.arrival if self._first else None
            if r.log_prompts:
                decode = self.tokens.tokenizer.decode
                r.prompts = [decode(s.request.prompt_token_ids) for s in self.streams]
                r.outputs = [sample.text for s in self.streams if s.output is not None for sample in s.output.samples]
            r.call_done()

    def abort_all(self) -> None:
        for stream in self.streams:
            stream.abort()
            if self.on_closed is not None:
                self.on_closed(stream)

    async def _events(self, keepalive_s: float | None = None):
        """(choice index, event) from every stream, in the order they arrive; with
        `keepalive_s`, None after each such stretch in which nothing came."""
        pending = {asyncio.ensure_future(s.next()): p for p, s in enumerate(self.streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED, timeout=keepalive_s)
                if not done:
                    yield None
                for task in done:
                    p = pending.pop(task)
                    event = task.result()
                    now = time.perf_counter()
                    if event is None:
                        self._ended[p] = now
                        if self.on_closed is not None:
                            self.on_closed(self.streams[p])
                    else:
                        choice = p * self.n + event.index
                        if event.token_id is not None:
                            if p not in self._first:
                                self._first[p] = now
                                self.metrics.ttft.observe(now - self.arrival)
                            if choice in self._last:
                                self.metrics.inter_token.observe(now - self._last[choice])
                            self._last[choice] = now
                            if self.on_token is not None:
                                self.on_token(self.streams[p].request_id)
                        if event.finished and event.finish_reason:
                            self._reasons[choice] = event.finish_reason
                        yield p * self.n + event.index, event
                        pending[asyncio.ensure_future(self.streams[p].next())] = p
        finally:
            for task in pending:
                task.cancel()

    def events(self, keepalive_s: float | None = None):
        """(choice index, event) as they arrive, None after each silent `keepalive_s` stretch:
        for an adapter that writes its own protocol's stream (labkit.serve.anthropic_wire)."""
        return self._events(keepalive_s)

    async def _collect(self) -> None:
        async for _ in self._events():
            pass

    async def answer(self, request: Request, *, chat: bool = False, render=None,
                     shape: ErrorShape | None = None) -> JSONResponse:
        """The whole answer: OpenAI's chat or completion body, or `render(outputs)` for
        another protocol, whose errors are then in `shape` (labkit.serve.errors)."""
        self.attach(request)
        work = asyncio.ensure_future(self._collect())
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            self.abort_all()
            self.finish("cancelled")
            return JSONResponse({}, status_code=499)  # nobody is listening; nothing is sent
        try:
            work.result()
        except (EngineFailure, ValueError) as error:
            self.abort_all()
            self.finish(outcome_of(error), error)
            return failure_error(error).response(shape)
        self.marks["collected"] = time.perf_counter()
        outputs = [s.output for s in self.streams]
        tokens = self.tokens if self.logprobs else None
        if render is not None:
            body = render(outputs)
        elif chat:
            body = responses.chat_body(self.response_id, self.created, self.model, outputs[0], tokens,
                                       self.replies)
        else:
            body = responses.completion_body(self.response_id, self.created, self.model, outputs, self.n,
                                             tokens, self.echo)
        answer = JSONResponse(body)  # X-Request-Id: labkit.serve.access
        self.marks["serialized"] = time.perf_counter()
        answer.headers["Server-Timing"] = self.server_timing()
        self.finish("ok")
        return answer

    def stream(self, request: Request, *, chat: bool, include_usage: bool) -> StreamingResponse:
        self.attach(request)
        return StreamingResponse(self._sse(chat, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # X-Request-Id: labkit.serve.access

    def stream_as(self, request: Request, writer: StreamWriter) -> StreamingResponse:
        """The answer as Server-Sent Events in `writer`'s frames."""
        self.attach(request)
        return StreamingResponse(self._frames(writer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # X-Request-Id: labkit.serve.access

    async def _frames(self, writer: StreamWriter):
        outcome, failure = "cancelled", None
        try:
            for frame in writer.opening():
                yield frame
            async for item in self._events(self.keepalive_s):
                if item is None:
                    yield KEEPALIVE
                    continue
                for frame in writer.event(*item):
                    yield frame
            for frame in writer.closing([s.output for s in self.streams]):
                yield frame
            outcome = "ok"
        except (EngineFailure, ValueError) as error:
            outcome, failure = outcome_of(error), error
            for frame in writer.failure(failure_error(error)):
                yield frame
        finally:
            self.abort_all()
            self.finish(outcome, failure)
        for frame in writer.ending():
            yield frame

    def _chunks(self, chat: bool, index: int, event, offset: int) -> list[dict]:
        """The chunks that carry `event`: one at most (`_chunk`), or, where tool calls are read,
        a chunk per delta the reader gives (logprobs on the first, the finish reason on the last)."""
        if not (chat and self.replies is not None):
            chunk = self._chunk(chat, index, event, offset)
            return [] if chunk is None else [chunk]
        logprobs = None
        if self.logprobs and event.token_id is not None:
            logprobs = responses.chat_logprobs(self.tokens, [event.token_id], [event.logprob],
                                               [event.top_logprobs or ()])
        deltas = self.replies.deltas(index, event.text, event.finished)
        if (logprobs is not None and not deltas) or (event.finished and not deltas):
            deltas = [{"content": ""} if logprobs is not None else {}]
        reason = self.replies.finish_reason(index, event.finish_reason) if event.finished else None
        return [responses.chat_chunk(self.response_id, self.created, self.model, index, delta,
                                     reason if i == len(deltas) - 1 else None, logprobs if i == 0 else None)
                for i, delta in enumerate(deltas)]

    def _chunk(self, chat: bool, index: int, event, offset: int) -> dict | None:
        """The chunk that carries `event` (None if it carries nothing); `event.text` is what the
        choice's text grows by, `offset` where the event's token begins in it (completions'
        `text_offset`: the tokens' texts before it, as in a whole answer, whatever text a stop
        string still holds back)."""
        logprobs = None
        if self.logprobs and event.token_id is not None:
            top = [event.top_logprobs or ()]
            logprobs = (responses.chat_logprobs(self.tokens, [event.token_id], [event.logprob], top) if chat else
                        responses.completion_logprobs(self.tokens, [event.token_id], [event.logprob], top,
                                                      offset))
        if not event.text and not event.finished and logprobs is None:
            return None
        reason = event.finish_reason if event.finished else None
        if chat:
            delta = {"content": event.text} if event.text or logprobs else {}
            return responses.chat_chunk(self.response_id, self.created, self.model, index, delta, reason, logprobs)
        return responses.completion_chunk(self.response_id, self.created, self.model, index, event.text,
                                          reason, logprobs)

    async def _sse(self, chat: bool, include_usage: bool):
        outcome, failure = "cancelled", None
        opened: set[int] = set()       # choices that sent an event
        offsets: dict[int, int] = {}   # choice -> characters of its tokens' texts so far
        # with include_usage, every chunk but the last carries "usage": null (OpenAI's shape)
        usage = {"usage": None} if include_usage else {}
        try:
            if chat:
                for index in range(self.n):
                    role = {"role": "assistant", "content": ""}
                    yield sse(responses.chat_chunk(self.response_id, self.created, self.model, index, role, None)
                              | usage)
            async for item in self._events(self.keepalive_s):
                if item is None:
                    yield KEEPALIVE
                    continue
                index, event = item
                if self.echo is not None and index not in opened:  # the prompt opens the choice's text
                    event = replace(event, text=self.echo[index // self.n] + event.text)
                opened.add(index)
                chunks = self._chunks(chat, index, event, offsets.get(index, 0))
                if self.logprobs and event.token_id is not None:
                    offsets[index] = offsets.get(index, 0) + len(self.tokens.text(event.token_id))
                for chunk in chunks:
                    yield sse(chunk | usage)
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                outputs = [s.output for s in self.streams]
                yield sse(responses.usage_chunk(self.response_id, self.created, self.model, obj, outputs))
            outcome = "ok"
        except (EngineFailure, ValueError) as error:
            outcome, failure = outcome_of(error), error
            yield sse(failure_error(error).body())
        finally:
            self.abort_all()
            self.finish(outcome, failure)
        yield "data: [DONE]\n\n"


# An SSE comment: clients skip it; a proxy or load balancer sees bytes, so a request that
# waits in the queue (or in a long prefill) is not cut off as idle.
KEEPALIVE = ": keep-alive\n\n"



def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
