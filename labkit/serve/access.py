"""X-Request-Id and the access log: one JSON line per request, as operators grep and ship them.

    client --X-Request-Id: abc (optional)--> RequestIds (ASGI middleware, around every route)
           <--X-Request-Id: abc (or a fresh one)-- on every answer: whole, streamed, or an error

A request id the client sends is kept if it is 1 to 128 printable ASCII characters (space
to `~`); anything else is refused with 400 in the one error shape (param "X-Request-Id"),
before any route runs. A request without one gets a fresh id (32 hex digits). The id is
echoed in the response headers and named in every log line about the request: the access
line here, the front end's `labkit.serve` line for a completion (with its response id, the
`cmpl-`/`chatcmpl-` id of the body) and the engine supervisor's `labkit.serve` lines about
it (`WorkerEngine`, when a worker dies under it). The engine's own process logs nothing per
request, so the id goes no further than the front end's `ResultStream`.

The access line (logger `labkit.serve.access`, INFO, the message is JSON) is written once the
request has ended in both senses: the response is sent and, for a completion, its engine
requests are accounted for (`Call.finish` fills in outcome, tokens, times and finish reasons;
a client that disconnected mid-stream can end the two in either order). /health and /metrics
get none (probes and scrapes would drown the rest). Prompt and output text appear only with
`labkit serve --log-prompts`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone

from starlette.datastructures import Headers, MutableHeaders

from labkit.serve.errors import invalid

access_log = logging.getLogger("labkit.serve.access")
MAX_REQUEST_ID = 128
QUIET_PATHS = ("/health", "/metrics")
ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/messages": "messages"}
CALL_GRACE_SECONDS = 10.0  # a response sent whose Call has not finished: log it anyway after this


def request_id_problem(value: str) -> str | None:
    """Why `value` cannot be a request id, or None if it can."""
    if not 1 <= len(value) <= MAX_REQUEST_ID:
        return f"X-Request-Id must be 1 to {MAX_REQUEST_ID} characters, got {len(value)}"
    if any(not " " <= c <= "~" for c in value):
        return "X-Request-Id must be printable ASCII (space to '~')"
    return None


def outcome_of_status(status: int | None) -> str:
    if status is None or status >= 500 and status != 503:
        return "failed"
    if status in (429, 503):
        return "refused"
    return "ok" if status < 400 else "client_error"


@dataclass
class RequestRecord:
    """One request's access line, filled in by the middleware and by its `Call`."""

    request_id: str
    method: str
    path: str
    client: str | None
    log_prompts: bool
    quiet: bool
    arrival: float = field(default_factory=time.perf_counter)
    wall: float = field(default_factory=time.time)
    status: int | None = None
    outcome: str | None = None          # the Call's; else read from the status
    response_id: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft: float | None = None
    finish_reasons: list[str] | None = None
    prompts: list[str] | None = None    # only with --log-prompts
    outputs: list[str] | None = None
    call_open: bool = False             # a Call answers it and has not finished yet
    response_done: bool = False
    logged: bool = False

    def call_done(self) -> None:
        self.call_open = False
        self.emit()

    def _late(self) -> None:
        if not self.logged:
            self.outcome = self.outcome or "unfinished"
            self.call_done()

    def emit(self) -> None:
        if self.logged or self.quiet or self.call_open or not self.response_done:
            return
        self.logged = True
        line = {"time": datetime.fromtimestamp(self.wall, timezone.utc).isoformat(timespec="milliseconds"),
                "request_id": self.request_id, "method": self.method,
                "route": ROUTES.get(self.path, self.path), "status": self.status,
                "outcome": self.outcome or outcome_of_status(self.status), "response_id": self.response_id,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "ttft_s": None if self.ttft is None else round(self.ttft, 6),
                "e2e_s": round(time.perf_counter() - self.arrival, 6), "finish_reasons": self.finish_reasons,
                "client": self.client}
        if self.log_prompts:
            line |= {"prompts": self.prompts, "outputs": self.outputs}
        access_log.info(json.dumps(line, ensure_ascii=False))


def record_of(request) -> RequestRecord | None:
    return request.scope.get("state", {}).get("access")


class RequestIds:
    """ASGI middleware: check or make the request id, echo it, write the access line."""

    def __init__(self, app, log_prompts: bool = False):
        self.app, self.log_prompts = app, log_prompts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id")
        problem = None if given is None else request_id_problem(given)
        peer = scope.get("client")
        record = RequestRecord(given if given is not None and problem is None else uuid.uuid4().hex,
                               scope["method"], scope["path"], f"{peer[0]}:{peer[1]}" if peer else None,
                               self.log_prompts, scope["path"] in QUIET_PATHS)
        state = scope.setdefault("state", {})
        state["access"], state["request_id"] = record, record.request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                MutableHeaders(scope=message)["X-Request-Id"] = record.request_id
            await send(message)

        try:
            if problem is not None:
                await invalid(problem, "X-Request-Id", "invalid_header").response()(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except Exception:
            if record.status is None:
                record.status = 500  # errors.py's handler answers it, outside this middleware
            raise
        finally:
            record.response_done = True
            record.emit()
            if record.call_open:  # a stream whose generator has not run its end yet
                asyncio.get_running_loop().call_later(CALL_GRACE_SECONDS, record._late)


def install_request_ids(app, log_prompts: bool = False) -> None:
    app.add_middleware(RequestIds, log_prompts=log_prompts)
