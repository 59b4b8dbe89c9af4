"""EngineCore: an `LLMEngine` driven by commands, the way a server drives it.

    front end (any thread)                    the core's one step loop (one thread)
    add(prompt, params) --AddRequest-->  ]    apply commands -> engine.step() -> route events
    stream.close()      --AbortRequest-> ]--> to each request's own queue; a finished request
                                               is released and its stream gets the output

A request's events go to its `Sink`: a `RequestStream` (a blocking queue, for threads) from
`add`, or any object with `put` given to `submit` (the HTTP service's worker forwards them
to another process; its in-process mode hands them to an asyncio loop).

Only the loop touches the engine: `add` and `abort` are messages it applies at the start of
its next iteration, so a client never waits on a step and a step never waits on a client.
A prompt is checked in the caller's thread (`LLMEngine.check_request`), so bad input is a
ValueError at `add`, before anything is queued. Every request's events go to its own
`RequestStream`; any number may be read at once, each sees exactly its own tokens. State is
bounded: a request is forgotten when it finishes (its output handed to its stream), and the
engine keeps only its newest state changes.

Run the loop on a thread with `start()` (and `shutdown()`), or step it by hand with
`run_once()` / `run_until_idle()` (tests, notebooks).
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence as Seq

from labkit.engine.llm_engine import EngineStats, LLMEngine, RequestOutput, TokenEvent
from labkit.sampling import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1
    cache_salt: str | None = None
    # When the request reached the engine's process, on the engine's clock. None: when the
    # loop applies the command. A worker that receives commands on a thread of its own sets
    # it, so that waiting for the step in progress counts as queueing, not as the way there.
    arrival_time: float | None = None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class StreamEnd:
    """The last item of a stream: the request's output, or why it failed."""

    output: RequestOutput | None
    error: BaseException | None = None


class Sink(Protocol):
    """Where one request's items go, in order: its `TokenEvent`s, then one `StreamEnd`.
    Called on the core's loop thread, so it must not block."""

    def put(self, item: TokenEvent | StreamEnd) -> None: ...


class RequestStream:
    """One request's events in order, then its `RequestOutput` (`output` once finished).
    Iterate it (blocking) or `get()` one item; `close()` aborts the request if unfinished."""

    def __init__(self, request_id: str, core: "EngineCore"):
        self.request_id, self._core = request_id, core
        self._items: queue.SimpleQueue[TokenEvent | StreamEnd] = queue.SimpleQueue()
        self.output: RequestOutput | None = None
        self.finished = False

    def get(self, timeout: float | None = None) -> TokenEvent | StreamEnd:
        """The next event, or the `StreamEnd`; raises queue.Empty after `timeout` seconds."""
        item = self._items.get(timeout=timeout)
        if isinstance(item, StreamEnd):
            self.finished, self.output = True, item.output
        return item

    def __iter__(self) -> Iterator[TokenEvent]:
        while not self.finished:
            item = self.get()
            if isinstance(item, StreamEnd):
                if item.error is not None:
                    raise RuntimeError(f"request {self.request_id} failed: {item.error}") from item.error
                return
            yield item

    def close(self) -> None:
        if not self.finished:
            self._core.abort(self.request_id)

    def put(self, item: TokenEvent | StreamEnd) -> None:
        self._items.put(item)


class EngineCore:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[AddRequest | AbortRequest] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()          # guards _sinks between callers and the loop
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats: EngineStats = engine.stats()  # a snapshot, replaced after every step

    # -- commands (any thread) ----------------------------------------------------------------
    def add(self, prompt: str | Seq[int], params: SamplingParams | None = None, *,
            request_id: str | None = None, n: int = 1, cache_salt: str | None = None) -> RequestStream:
        """Queue a request and return its stream. ValueError for input the engine refuses
        (nothing is queued then)."""
        params = params or SamplingParams(temperature=0.0)
        ids = self.engine.check_request(prompt, params, n=n)
        request_id = f"core-{next(self._ids)}" if request_id is None else str(request_id)
        stream = RequestStream(request_id, self)
        self.submit(AddRequest(request_id, ids, params, n, cache_salt), stream)
        return stream

    def submit(self, command: AddRequest, sink: Sink) -> None:
        """Queue an already checked request whose items go to `sink`. ValueError if its id
        is in use (nothing is queued then)."""
        with self._lock:
            if command.request_id in self._sinks:
                raise ValueError(f"request id {command.request_id!r} is already in use")
            self._sinks[command.request_id] = sink
        self._commands.put(command)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))
        self._wake.set()

    @property
    def open_requests(self) -> int:
        with self._lock:
            return len(self._sinks)

    # -- the loop (one thread) ----------------------------------------------------------------
    def run_once(self) -> bool:
        """Apply the queued commands, run one engine step, route its events. True while any
        request is still unfinished."""
        self._apply_commands()
        try:
            events = self.engine.step()
        except Exception as error:  # a failed step must not strand its requests' blocks
            self._fail_all(error)
            return False
        self.stats = self.engine.stats()
        self._route(events)
        return self.engine.has_unfinished()

    def run_until_idle(self) -> None:
        while self.run_once():
            pass

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the core's loop is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="labkit-engine-core", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still open are aborted and their streams ended."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._lock:
            open_ids = list(self._sinks)
        for request_id in open_ids:
            self.abort(request_id)
        self._apply_commands()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.run_once() and self._commands.empty():
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddRequest):
                try:
                    self.engine.add_request(command.prompt_token_ids, command.params, request_id=command.request_id,
                                            n=command.n, cache_salt=command.cache_salt,
                                            arrival_time=command.arrival_time)
                except ValueError as error:
                    self._end(command.request_id, StreamEnd(None, error))
            elif command.request_id in self.engine.requests:
                self.engine.abort(command.request_id)
                self._release(command.request_id)
            # an abort for a request that has already ended (or never started) changes nothing

    def _route(self, events: list[TokenEvent]) -> None:
        with self._lock:
            sinks = dict(self._sinks)
        finished = set()
        for event in events:
            sink = sinks.get(event.request_id)
            if sink is not None:
                sink.put(event)
            if event.finished:
                finished.add(event.request_id)
        for request_id in finished:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        request = self.engine.requests.get(request_id)
        if request is not None and request.done:
            self._end(request_id, StreamEnd(self.engine.release(request_id)))

    def _end(self, request_id: str, end: StreamEnd) -> None:
        with self._lock:
            sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.put(end)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self.engine.release(request_id)
            self._end(request_id, StreamEnd(None, error))
