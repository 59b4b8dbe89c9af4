"""The client side of chapter 30's fault injection: what a test harness needs to talk to a
live `labkit serve`, read its state and break it on purpose.

* :class:`LiveService`: `labkit serve` in worker mode as a child process, stopped at exit
  even when a notebook cell fails (`atexit`), so no server outlives the kernel.
* :func:`parse_metrics`, :func:`metrics`, :func:`health`, :func:`kill_worker`: the
  service's own view of itself (Prometheus text and `/health`) and a SIGKILL for its worker.
* :class:`Outcome` and the request helpers :func:`stream`, :func:`whole`, :func:`raw`:
  one request each, recording what its client saw (status, text, error code, timings).
* :func:`should_retry`: the two retry rules the chapter compares, as a pure function.

The scenarios themselves are in :mod:`labkit.experiments.faults`.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field

import httpx

from labkit.serve.server import ServerProcess
from labkit.util.threads import run_in_thread

MODEL = "smollm2-135m"
ERROR_FIELDS = {"message", "type", "param", "code"}
# Codes that say "the service could not do it now", not "this request is wrong": worth a retry.
TRANSIENT_CODES = {"engine_died", "engine_unavailable", "queue_full"}
NOT_WORTH_RETRYING = {"deadline_expired", "deadline_unreachable"}  # its time is up already


class LiveService:
    """`labkit serve --port 0 ARGS` in worker mode (a real engine process), for a notebook
    whose cells share one server: ``service = LiveService(...).start()``, later
    ``service.stop()``. The stop is also registered with `atexit`, so a kernel that shuts
    down after a failed cell still stops the server and its worker. A context manager too."""

    def __init__(self, *args: str, start_timeout: float = 240.0):
        self.args, self.start_timeout = tuple(str(a) for a in args), start_timeout
        self.process: ServerProcess | None = None
        self.start_s: float | None = None

    @property
    def url(self) -> str:
        if self.process is None or self.process.url is None:
            raise RuntimeError("the service is not running")
        return self.process.url

    def start(self) -> "LiveService":
        began = time.perf_counter()
        self.process = ServerProcess(*self.args, start_timeout=self.start_timeout).__enter__()
        atexit.register(self.stop)
        wait_until(lambda: ready(self.url), timeout=self.start_timeout)
        self.start_s = time.perf_counter() - began
        return self

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            process.__exit__(None, None, None)
        atexit.unregister(self.stop)

    def __enter__(self) -> "LiveService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- the service's view of itself ------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series: value}, read with prometheus_client's own parser; a series
    is its sample's name with its labels sorted as Prometheus prints them, less `model_name`
    (one server serves one model): ``labkit:requests_total{outcome="ok",route="chat"}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def health(url: str) -> tuple[int, dict]:
    """(status, body) of `/health`; (0, {}) when nothing answers."""
    try:
        answer = httpx.get(url + "/health", timeout=10)
    except httpx.HTTPError:
        return 0, {}
    return answer.status_code, answer.json()


def ready(url: str) -> bool:
    return health(url)[0] == 200


def idle(m: dict[str, float]) -> bool:
    """Nothing runs, nothing waits, no KV block is held (False while the gauges are absent:
    a fresh worker has not sent its first snapshot yet)."""
    return all(m.get(name) == 0 for name in ("labkit:num_requests_running", "labkit:num_requests_waiting",
                                               "labkit:kv_blocks_used"))


def wait_until(condition, timeout: float = 60.0, interval: float = 0.02) -> float:
    """Seconds until `condition()` held; TimeoutError after `timeout`."""
    start = time.perf_counter()
    while not condition():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.perf_counter() - start


async def await_until(condition, timeout: float = 60.0, interval: float = 0.005) -> float:
    """:func:`wait_until` for an async `condition()`."""
    start = time.perf_counter()
    while not await condition():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)
    return time.perf_counter() - start


class Poller:
    """GET `/metrics` and `/health` over one kept-alive connection that acknowledges every
    segment at once (`TCP_QUICKACK`, Linux).

    Where a server's socket leaves Nagle's algorithm on, a response written in two pieces
    (headers, then body) waits for the client's acknowledgement of the first, and a client
    that delays its acknowledgements (Linux: 40 ms at the least) makes every kept-alive poll
    take that long. The service now turns Nagle off (`TCP_NODELAY`,
    tests/test_serve_socket.py), so against it `quickack=False` and `True` should time the
    same; acknowledging at once keeps a measurement that polls
    (:func:`labkit.experiments.faults.disconnects`) clear of that stall on any server."""

    QUICKACK = getattr(socket, "TCP_QUICKACK", None)

    def __init__(self, url: str, *, quickack: bool = True):
        self.host, _, port = url.removeprefix("http://").partition(":")
        self.port, self.quickack = int(port), quickack and self.QUICKACK is not None
        self.reader = self.writer = None

    def _ack_now(self) -> None:
        if self.quickack:
            self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, self.QUICKACK, 1)

    async def get(self, path: str) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self._ack_now()
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        self._ack_now()
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                      if k.lower() == "content-length")
        payload = await self.reader.readexactly(length)
        self._ack_now()
        return int(lines[0].split()[1]), payload

    async def metrics(self) -> dict[str, float]:
        return parse_metrics((await self.get("/metrics"))[1].decode())

    async def health(self) -> tuple[int, dict]:
        status, payload = await self.get("/health")
        return status, json.loads(payload)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def __aenter__(self) -> "Poller":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def alternating_poll_round_trips(url: str, polls: int = 20) -> tuple[list[float], list[float]]:
    """Seconds per `/metrics` poll on two kept-alive connections, one that acknowledges at
    once (`TCP_QUICKACK`) and one that does not, polled in turn (the one that goes first
    switches each round), so whatever drifts over the run (the machine's load, the
    service's state) falls on both alike: (quick, slow), `polls` of each."""
    quick, slow = [], []
    async with Poller(url) as acking, Poller(url, quickack=False) as delaying:
        for poller in (acking, delaying):
            await poller.get("/health")
        for round_ in range(polls):
            pairs = [(acking, quick), (delaying, slow)]
            for poller, out in pairs if round_ % 2 == 0 else pairs[::-1]:
                start = time.perf_counter()
                await poller.get("/metrics")
                out.append(time.perf_counter() - start)
    return quick, slow


def kill_worker(url: str) -> tuple[int, float]:
    """SIGKILL the engine worker named by `/health`: (its pid, perf_counter time of the kill)."""
    pid = health(url)[1]["worker_pid"]
    os.kill(pid, signal.SIGKILL)
    return pid, time.perf_counter()


def run_async(make):
    """Run the coroutine `make()` to its end on a fresh event loop in its own thread, so it
    works where a loop already runs (a notebook's kernel) and where none does."""
    return run_in_thread(lambda: asyncio.run(make()))


# -- one request, as its client saw it -------------------------------------------------------

@dataclass
class Outcome:
    """What one request's client got. `ended`: "answer" (a whole answer, or a stream that
    reached [DONE] without an error), "error" (an error in the service's shape, as a status or
    as a stream's error event), "left" (the client went away on purpose), "lost" (neither: a
    transport failure, or nothing yet)."""

    label: str
    kind: str
    status: int | None = None
    text: str = ""
    chunks: int = 0                 # stream chunks that carried text
    code: str | None = None         # the service's error code, or the client's exception
    ended: str = "lost"
    seconds: float | None = None    # send to the end, as the client saw it
    expected: str | None = None     # its solo run's text, where it has one
    shape_ok: bool | None = None    # an error body in exactly OpenAI's shape
    attempts: int = 1
    done: bool = False              # a stream's [DONE] arrived (after an error event, too)
    parts: list[str] = field(default_factory=list)       # the text of each attempt
    chunk_s: list[float] = field(default_factory=list, repr=False)  # chunk arrivals, from send
    sent_at: float | None = None    # perf_counter
    ended_at: float | None = None   # perf_counter

    def mark_ended(self) -> None:
        """The client's view of the end: now, and the seconds since it sent."""
        self.ended_at = time.perf_counter()
        self.seconds = self.ended_at - self.sent_at

    @property
    def matches(self) -> bool | None:
        return None if self.expected is None else self.text == self.expected

    def row(self) -> dict:
        return {"request": self.label, "kind": self.kind, "status": self.status, "ended": self.ended,
                "code": self.code, "chunks": self.chunks, "attempts": self.attempts,
                "seconds": None if self.seconds is None else round(self.seconds, 3),
                "equals_solo": self.matches, "text": self.text}


def body(prompt, max_tokens: int, **extra) -> dict:
    """A completions body: greedy, past EOS to `max_tokens` (lengths the scenarios control)."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True} | extra


def error_code(payload) -> tuple[str | None, bool]:
    """(the error's code, whether `payload` is exactly the one error shape)."""
    error = payload.get("error") if isinstance(payload, dict) else None
    shape = isinstance(error, dict) and set(error) == ERROR_FIELDS and set(payload) == {"error"} \
        and isinstance(error.get("message"), str) and bool(error["message"])
    return (error.get("code") if isinstance(error, dict) else None), shape


async def stream(client: httpx.AsyncClient, url: str, request: dict, out: Outcome, *,
                 leave_after: int | None = None, stop: asyncio.Event | None = None,
                 on_chunk=None) -> Outcome:
    """Stream `request`, filling `out`. Leave (close the connection) after `leave_after` text
    chunks, or at the first chunk after `stop` is set; `on_chunk(out)` after each chunk."""
    out.sent_at = time.perf_counter()
    finished = False
    try:
        async with client.stream("POST", url + "/v1/completions", json=request | {"stream": True}) as answer:
            out.status = answer.status_code
            if answer.status_code != 200:
                out.code, out.shape_ok = error_code(json.loads(await answer.aread()))
                out.ended = "error"
                return out
            async for line in answer.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = out.done = True
                    break
                payload = json.loads(line[6:])
                if "error" in payload:
                    out.code, out.shape_ok = error_code(payload)
                    out.ended = "error"
                    continue
                for choice in payload.get("choices", ()):
                    if choice.get("text"):
                        out.text += choice["text"]
                        out.chunks += 1
                        out.chunk_s.append(time.perf_counter() - out.sent_at)
                if on_chunk is not None:
                    on_chunk(out)
                if (leave_after is not None and out.chunks >= leave_after) or (stop is not None and stop.is_set()):
                    out.ended = "left"
                    break
        if finished and out.ended == "lost":
            out.ended = "answer"
    except httpx.HTTPError as error:
        out.code, out.ended = type(error).__name__, "lost"
    finally:
        out.mark_ended()
        out.parts.append(out.text)
    return out


async def whole(client: httpx.AsyncClient, url: str, request: dict, out: Outcome) -> Outcome:
    """Send `request` for a whole answer, filling `out`."""
    out.sent_at = time.perf_counter()
    try:
        answer = await client.post(url + "/v1/completions", json=request)
        out.status = answer.status_code
        payload = answer.json()
        if answer.status_code == 200:
            out.text, out.ended = payload["choices"][0]["text"], "answer"
        else:
            out.code, out.shape_ok = error_code(payload)
            out.ended = "error"
    except httpx.HTTPError as error:
        out.code, out.ended = type(error).__name__, "lost"
    finally:
        out.mark_ended()
        out.parts.append(out.text)
    return out


async def raw(client: httpx.AsyncClient, url: str, path: str, content: bytes, headers: dict,
              out: Outcome, method: str = "POST") -> Outcome:
    """Send bytes as they are (malformed requests), filling `out`."""
    out.sent_at = time.perf_counter()
    answer = await client.request(method, url + path, content=content,
                                  headers={"Content-Type": "application/json"} | headers)
    out.status = answer.status_code
    try:
        out.code, out.shape_ok = error_code(answer.json())
    except ValueError:
        out.code, out.shape_ok = None, False
    out.ended = "error" if answer.status_code >= 400 else "answer"
    out.mark_ended()
    return out


# -- retries ---------------------------------------------------------------------------------

def is_transient(status: int | None, code: str | None) -> bool:
    """Could the same request succeed later? A transport failure (no status), 429, or a 503
    whose code is not about the request's own deadline; an engine that died under a stream
    (an error event on a 200) too. Client errors (4xx other than 429) never are: retrying
    them masks a persistent error."""
    if code in NOT_WORTH_RETRYING:
        return False
    if code in TRANSIENT_CODES:
        return True
    return status is None or status in (429, 503)


def should_retry(policy: str, *, status: int | None, code: str | None, tokens_received: int,
                 attempt: int, max_attempts: int) -> bool:
    """Whether a client retries after a failed attempt. ``"naive"``: any transient failure.
    ``"safe"`` (the service's own rule for a dead worker): only a transient failure before any
    token reached the client, because tokens already shown cannot be taken back. Both stop at
    `max_attempts`."""
    if policy not in ("naive", "safe"):
        raise ValueError(f"policy must be 'naive' or 'safe', got {policy!r}")
    if attempt >= max_attempts or not is_transient(status, code):
        return False
    return policy == "naive" or tokens_received == 0


def first_difference(a: str, b: str) -> int | None:
    """Index of the first character where `a` and `b` differ (one may be a prefix of the
    other: then the shorter length), or None when they are equal."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
