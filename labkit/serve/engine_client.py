"""The front end's view of the engine: submit a checked request, read its events, abort.

    HTTP route --submit(EngineRequest)--> EngineClient --> the engine's step loop
               <-- ResultStream: TokenEvents, then the RequestOutput (or an EngineFailure)

Two clients keep this contract: `InProcessEngine` (an `EngineCore` on a thread of this
process: notebooks and quick tests) and `labkit.serve.worker.WorkerEngine` (the engine in its
own process, restarted if it dies: what `labkit serve` runs). Routes cannot tell them apart.

A `ResultStream` lives on the event loop. The engine pushes into it and never waits for the
reader: if a reader falls more than `max_buffered` events behind, the policy decides. `abort`
(the default) cancels the request, frees its KV blocks and ends the stream with an error;
`coalesce` folds new text into the newest buffered event of its sample, so the buffer stops
growing and nothing is lost (the reader gets fewer, longer chunks; a stream with logprobs,
which cannot be folded, is cancelled as under `abort`); `unbounded` keeps everything.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from labkit.engine.core import AbortRequest, AddRequest, EngineCore, StreamEnd
from labkit.engine.limits import EngineLimits
from labkit.engine.llm_engine import EngineStats, LLMEngine, RequestOutput, TokenEvent
from labkit.sampling import SamplingParams

SLOW_READER_POLICIES = ("abort", "coalesce", "unbounded")


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1
    cache_salt: str | None = None

    def command(self) -> AddRequest:
        return AddRequest(self.request_id, self.prompt_token_ids, self.params, self.n, self.cache_salt)


class EngineFailure(Exception):
    """The engine could not finish a request (it died, or the request was cut off)."""

    def __init__(self, message: str, *, code: str = "engine_failure", client_error: bool = False):
        super().__init__(message)
        self.code, self.client_error = code, client_error


class EngineUnavailable(Exception):
    """The engine cannot take requests now (starting, restarting, or shut down)."""


class ResultStream:
    """One request's events on the event loop: `async for event in stream`, then `.output`.
    Raises `EngineFailure` if the engine failed the request, ValueError if it refused it."""

    def __init__(self, request: EngineRequest, on_abort, *, max_buffered: int = 1024, policy: str = "abort"):
        if policy not in SLOW_READER_POLICIES:
            raise ValueError(f"slow-reader policy must be one of {SLOW_READER_POLICIES}, got {policy!r}")
        self.request, self._on_abort = request, on_abort
        self.max_buffered, self.policy = max_buffered, policy
        self._items: deque[TokenEvent | StreamEnd | BaseException] = deque()
        self._ready = asyncio.Event()
        self.output: RequestOutput | None = None
        self.tokens_received = 0      # token events that reached the front end
        self.coalesced = 0            # events folded into a buffered one (policy "coalesce")
        self.finished = False
        self.cancelled = False        # the reader asked to stop (it may not have reached the engine)
        self.attempts = 1
        self.client_request_id: str | None = None  # the client's X-Request-Id, for log lines

    @property
    def request_id(self) -> str:
        return self.request.request_id

    # -- the engine's side (event loop thread) ----------------------------------------------
    def put(self, item: TokenEvent | StreamEnd | BaseException) -> None:
        if self.finished:
            return
        if isinstance(item, TokenEvent):
            full = self.policy != "unbounded" and len(self._items) >= self.max_buffered
            if full and self.policy == "coalesce" and item.logprob is None and self._coalesce(item):
                return
            if full:
                # The reader keeps what was produced, then learns why it stopped.
                self._on_abort(self.request_id)
                item = EngineFailure(f"the client fell {self.max_buffered} events behind; the request "
                                     "was cancelled", code="slow_reader", client_error=True)
            elif item.token_id is not None:
                self.tokens_received += 1
        self.finished = not isinstance(item, TokenEvent)
        self._items.append(item)
        self._ready.set()

    def _coalesce(self, item: TokenEvent) -> bool:
        """Fold `item` into the newest buffered event of its sample: one chunk with the text of
        both, so the buffer stops growing while no token is lost. False if there is none."""
        for at in range(len(self._items) - 1, -1, -1):
            last = self._items[at]
            if isinstance(last, TokenEvent) and last.index == item.index:
                self._items[at] = TokenEvent(
                    item.request_id, item.index, item.token_id if item.token_id is not None else last.token_id,
                    last.text + item.text, item.finished, item.finish_reason, item.time)
                self.tokens_received += item.token_id is not None
                self.coalesced += 1
                self._ready.set()
                return True
        return False

    # -- the reader's side ---------------------------------------------------------------------
    @property
    def buffered(self) -> int:
        return len(self._items)

    async def next(self) -> TokenEvent | None:
        """The next event; None once the stream ended with an output."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items[0]
        if isinstance(item, BaseException):
            raise item  # it stays: every later call sees it too
        if isinstance(item, StreamEnd):
            if item.error is not None:
                raise item.error if isinstance(item.error, ValueError) else EngineFailure(str(item.error))
            self.output = item.output
            return None
        return self._items.popleft()

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        event = await self.next()
        if event is None:
            raise StopAsyncIteration
        return event

    def abort(self) -> None:
        if not self.finished:
            self.cancelled = True
            self._on_abort(self.request_id)


class EngineClient(Protocol):
    limits: EngineLimits
    restarts: int
    weights: str | None  # the engine's weights mode (backends.WEIGHTS); None until it is ready
    context_note: str | None  # why the context is shorter than the model's (capped to the KV pool)

    @property
    def ready(self) -> bool: ...

    def stats(self) -> EngineStats | None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def submit(self, request: EngineRequest, *, max_buffered: int, policy: str) -> ResultStream:
        """Raises EngineUnavailable when the engine cannot take requests now."""
        ...

    def abort(self, request_id: str) -> None: ...

    def health(self) -> dict: ...


class _LoopSink:
    """Hands items from the core's thread to a stream on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: ResultStream):
        self.loop, self.stream = loop, stream

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.stream.put, item)
        except RuntimeError:  # the loop has closed: nobody is reading any more
            pass


class InProcessEngine:
    """An `EngineCore` on a thread of this process."""

    def __init__(self, engine: LLMEngine):
        self.core = EngineCore(engine)
        self.limits, self.weights = engine.limits, engine.weights
        self.context_note = engine.context_note
        self.restarts = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def ready(self) -> bool:
        return self._loop is not None

    def stats(self) -> EngineStats:
        return self.core.stats

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.core.start()

    async def stop(self) -> None:
        self._loop = None
        await asyncio.to_thread(self.core.shutdown)

    def submit(self, request: EngineRequest, *, max_buffered: int = 1024, policy: str = "abort") -> ResultStream:
        if self._loop is None:
            raise EngineUnavailable("the engine is not running")
        stream = ResultStream(request, self.abort, max_buffered=max_buffered, policy=policy)
        self.core.submit(request.command(), _LoopSink(self._loop, stream))
        return stream

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def health(self) -> dict:
        return {"engine": "in-process", "ready": self.ready, "restarts": 0}


__all__ = ["AbortRequest", "EngineClient", "EngineFailure", "EngineLimits", "EngineRequest",
           "EngineUnavailable", "InProcessEngine", "ResultStream", "SLOW_READER_POLICIES"]
