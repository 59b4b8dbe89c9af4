"""The engine in its own process, and the front end's handle on it.

    front end (uvicorn's event loop)                     engine worker (its own process)
    WorkerEngine.submit --AddRequest/AbortRequest--> PULL  a receiving thread stamps each
                                                           command's arrival -> inbox
                                                           the loop: inbox -> EngineCore.run_once()
    ResultStream.put   <--Batch(items, stats)------- PUSH  every step's events and ends

The two talk over a pair of pyzmq sockets on a private IPC path; messages are pickled
dataclasses. The worker owns the model and the step loop and never waits for a client: it
sends each step's events and goes on. Its loop reads commands between steps; a thread that
does nothing but receive them notes when each one arrived, so that a request's arrival time
is when it reached the worker, and the wait for the step in progress is counted as queueing
(Server-Timing's `queue`), not as the way to the engine (`to-engine`). The front end owns sockets, validation and the
streams' buffers.

If the worker dies, or hangs (it has work and has sent nothing for `hang_timeout` seconds:
it is killed), the front end notices at its next look (it looks every `poll_interval`
seconds, when its event loop gets to it; a busy loop looks later), ends the streams
that had already received tokens with an error (those tokens cannot be taken back, so they
are never retried), keeps the requests that had received nothing, starts a new worker, and
submits those once more, except those whose client cancelled meanwhile (their abort had no
worker to reach). A request whose second attempt also dies fails. While the worker starts,
new requests are refused with 503 and `Retry-After`, and the engine's gauges are absent
from /metrics rather than the dead worker's last values. Starts that fail back off, and
after `max_failed_starts` failed generations in a row the engine reports itself failed
instead of starting workers forever (`labkit.serve.supervision`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace

import zmq
import zmq.asyncio

from labkit.engine.core import AbortRequest, AddRequest, EngineCore, StreamEnd
from labkit.engine.llm_engine import EngineConfig, EngineStats, LLMEngine, TokenEvent
from labkit.engine.limits import EngineLimits
from labkit.serve.engine_client import EngineFailure, EngineRequest, EngineUnavailable, ResultStream
from labkit.serve.fault_injection import FaultFile
from labkit.serve.supervision import Supervision

log = logging.getLogger("labkit.serve")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its engine (sent to a fresh process)."""

    model: str = "smollm2-135m"
    threads: int | None = None
    engine: dict = field(default_factory=dict)  # EngineConfig fields (scheduler: a dict of its own)
    fault_file: str | None = None               # tests and chapters inject faults through it

    def build_engine(self) -> LLMEngine:
        import torch

        from labkit.models import load_model

        faults = FaultFile(self.fault_file) if self.fault_file else None
        if faults is not None:
            faults.check_start()
        if self.threads:
            torch.set_num_threads(self.threads)
        from labkit.engine.scheduler import SchedulerConfig

        options = dict(self.engine)
        if isinstance(options.get("scheduler"), dict):
            options["scheduler"] = SchedulerConfig(**options["scheduler"])
        engine = LLMEngine(load_model(self.model), EngineConfig(**options))
        if faults is not None:
            engine.step = faults.wrap_step(engine.step, engine.has_unfinished)
        return engine


@dataclass(frozen=True)
class Ready:
    limits: EngineLimits
    pid: int
    weights: str                  # the mode the engine runs (backends.WEIGHTS)
    weights_fallback: str | None  # why the preferred mode could not run, if it could not
    context_note: str | None = None  # the context was capped to the KV pool (EngineConfig)


@dataclass(frozen=True)
class StartFailed:
    reason: str                   # why the worker could not build its engine (then it exits)


@dataclass(frozen=True)
class Batch:
    items: list[tuple[str, TokenEvent | StreamEnd]]
    stats: EngineStats


@dataclass(frozen=True)
class Shutdown:
    pass


# -- the worker's side ---------------------------------------------------------------------

class _Outbox:
    """The core's sink for one request: its items wait here until the step's batch is sent."""

    def __init__(self, items: list, request_id: str):
        self.items, self.request_id = items, request_id

    def put(self, item: TokenEvent | StreamEnd) -> None:
        if isinstance(item, StreamEnd) and item.error is not None:
            # Exceptions cross the process boundary as one of two picklable kinds.
            kind = ValueError if isinstance(item.error, ValueError) else RuntimeError
            item = StreamEnd(None, kind(str(item.error)))
        self.items.append((self.request_id, item))


def _receive(commands, inbox: queue.SimpleQueue, stop: threading.Event, clock) -> None:
    """The worker's receiving thread: every command goes into `inbox` with the time it
    arrived. It touches nothing else (the engine core stays with the loop's thread); it
    ends with a Shutdown, or when the loop sets `stop`."""
    try:
        while not stop.is_set():
            if commands.poll(100):
                message = commands.recv_pyobj()
                inbox.put((clock(), message))
                if isinstance(message, Shutdown):
                    return
    except Exception:  # a worker that cannot hear commands must end, so the front end restarts it
        log.exception("the engine worker's receiving thread failed")
        inbox.put((clock(), Shutdown()))


def worker_main(spec: WorkerSpec, command_address: str, event_address: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when the worker stops
    parent = os.getppid()
    context = zmq.Context()
    events = context.socket(zmq.PUSH)
    events.connect(event_address)
    try:
        core = EngineCore(spec.build_engine())
    except Exception as error:  # the front end logs the reason and decides whether to try again
        events.send_pyobj(StartFailed(f"{type(error).__name__}: {error}"))
        events.close(linger=2000)
        context.term()
        raise
    commands = context.socket(zmq.PULL)
    commands.connect(command_address)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    receiver = threading.Thread(target=_receive, args=(commands, inbox, stop, core.engine.clock),
                                name="labkit-worker-receive", daemon=True)
    receiver.start()
    engine = core.engine
    events.send_pyobj(Ready(engine.limits, os.getpid(), engine.weights, engine.weights_fallback,
                            engine.context_note))
    outbox: list[tuple[str, TokenEvent | StreamEnd]] = []
    sent_stats = None
    try:
        while True:
            busy = core.engine.has_unfinished()
            try:
                item = inbox.get_nowait() if busy else inbox.get(timeout=0.1)
            except queue.Empty:
                item = None
                if not busy and os.getppid() != parent:
                    return  # the front end is gone; nobody will read our events
            while item is not None:
                arrived, message = item
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, AddRequest):
                    try:
                        core.submit(replace(message, arrival_time=arrived), _Outbox(outbox, message.request_id))
                    except ValueError as error:
                        outbox.append((message.request_id, StreamEnd(None, ValueError(str(error)))))
                elif isinstance(message, AbortRequest):
                    core.abort(message.request_id)
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    item = None
            core.run_once()
            if outbox or core.stats != sent_stats:
                events.send_pyobj(Batch(list(outbox), core.stats))
                outbox.clear()
                sent_stats = core.stats
    finally:
        stop.set()
        receiver.join(5)
        commands.close(linger=0)
        events.close(linger=0)
        context.term()


# -- the front end's side ------------------------------------------------------------------

class WorkerEngine:
    """An `EngineClient` whose engine runs in a separate process (restarted if it dies)."""

    def __init__(self, spec: WorkerSpec, *, start_timeout: float = 600.0,
                 supervision: Supervision | None = None):
        self.spec, self.start_timeout = spec, start_timeout
        self.supervision = supervision or Supervision()
        self.limits: EngineLimits | None = None
        self.weights: str | None = None
        self.context_note: str | None = None
        self.restarts = 0             # workers started after the first
        self.hangs = 0                # workers killed because they had work and did not advance
        self.replays = 0              # requests submitted again to a new worker (they had no token yet)
        self.failed_starts = 0        # failed generations in a row (supervision)
        self.last_failure: str | None = None
        self.state = "starting"       # supervision.STATES
        self.worker_pid: int | None = None
        self._last_batch = time.monotonic()
        self._served = False          # the current generation has sent an event for a request
        self._started_at = time.monotonic()
        self._ready = False
        self._stopping = False
        self._streams: dict[str, ResultStream] = {}
        self._stats: EngineStats | None = None
        self._context = zmq.asyncio.Context()
        self._directory = tempfile.mkdtemp(prefix="labkit-serve-")
        self._generation = 0
        self._process = None
        self._commands = self._events = None
        self._watch_task: asyncio.Task | None = None
        self._read_task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self._ready

    def stats(self) -> EngineStats | None:
        return self._stats

    def health(self) -> dict:
        return {"engine": "worker", "state": self.state, "ready": self._ready, "worker_pid": self.worker_pid,
                "restarts": self.restarts, "hangs": self.hangs, "replays": self.replays,
                "failed_starts": self.failed_starts,
                "last_failure": self.last_failure, "open_requests": len(self._streams)}

    async def start(self) -> None:
        await self._launch()  # a first start that fails stops the server, with the reason
        self._watch_task = asyncio.create_task(self._watch(), name="labkit-worker-watch")

    async def _launch(self) -> None:
        self._generation += 1
        base = os.path.join(self._directory, f"g{self._generation}")
        commands, events = f"ipc://{base}-commands", f"ipc://{base}-events"
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.bind(commands)
        self._events = self._context.socket(zmq.PULL)
        self._events.bind(events)
        process = multiprocessing.get_context("spawn").Process(
            target=worker_main, args=(self.spec, commands, events), name="labkit-engine-worker", daemon=True)
        process.start()
        self._process = process
        deadline = time.monotonic() + self.start_timeout
        try:
            while True:
                if not process.is_alive():
                    raise RuntimeError(f"the engine worker exited with code {process.exitcode} while starting")
                if time.monotonic() > deadline:
                    process.kill()
                    raise RuntimeError(f"the engine worker did not start within {self.start_timeout:.0f} s")
                if await self._events.poll(timeout=200):
                    ready = await self._events.recv_pyobj()
                    if isinstance(ready, StartFailed):
                        await asyncio.to_thread(process.join, 10)
                        raise RuntimeError(f"the engine worker failed to start: {ready.reason}")
                    break
        except BaseException:
            # a failed start's sockets are closed here: left open, they would block the
            # context's term() in stop(), and a failed server would never exit
            self._close_sockets()
            raise
        self.limits, self.worker_pid, self.weights = ready.limits, ready.pid, ready.weights
        self.context_note = ready.context_note
        if ready.weights_fallback and self._generation == 1:
            log.warning("%s; the engine runs f32 weights", ready.weights_fallback)
        self._read_task = asyncio.create_task(self._read(self._events), name="labkit-worker-read")
        self._last_batch, self._served = time.monotonic(), False
        self._started_at = self._last_batch
        self._ready, self.state = True, "ready"
        log.info("engine worker %d ready (generation %d)", ready.pid, self._generation)

    async def _read(self, events) -> None:
        while True:
            batch: Batch = await events.recv_pyobj()
            self._last_batch = time.monotonic()
            # An idle worker sends its counters once after Ready; only an event for a request
            # shows that this generation can run a step with work.
            if batch.items and not self._served:
                self._served, self.failed_starts = True, 0
            self._stats = batch.stats
            for request_id, item in batch.items:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                stream.put(item)
                if isinstance(item, StreamEnd):
                    del self._streams[request_id]

    async def _watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.supervision.poll_interval)
            if self._stopping or self._process is None or not self._ready:
                continue
            if not self._process.is_alive():
                await self._recover(f"died (exit code {self._process.exitcode})")
            elif self.supervision.hung(bool(self._streams), time.monotonic() - self._last_batch):
                silent = time.monotonic() - self._last_batch
                self.hangs += 1
                self._process.kill()  # SIGKILL ends a stopped process too
                await asyncio.to_thread(self._process.join, 10)
                await self._recover(f"hung (it had work and sent nothing for {silent:.1f} s; killed)")

    async def _recover(self, what: str) -> None:
        log.warning("engine worker %s %s; restarting", self.worker_pid, what)
        self._ready, self.state = False, "restarting"
        self._stats = None  # the dead worker's gauges no longer describe anything
        self._close_sockets()
        if self.supervision.generation_failed(self._served, time.monotonic() - self._started_at):
            self.failed_starts += 1
        self.last_failure = f"worker {self.worker_pid} {what}"
        retry = []
        for stream in self._streams.values():
            if stream.tokens_received == 0 and stream.attempts == 1:
                retry.append(stream)
                log.info("request %s (X-Request-Id %s) had no token yet: it is submitted again",
                         stream.request_id, stream.client_request_id)
            else:
                log.warning("request %s (X-Request-Id %s) fails: the engine worker %s while it ran",
                            stream.request_id, stream.client_request_id, what)
                stream.put(EngineFailure(f"the engine worker {what} while this request ran", code="engine_died"))
        self._streams.clear()
        while True:
            if self.supervision.gives_up(self.failed_starts):
                self._give_up(retry)
                return
            await asyncio.sleep(self.supervision.backoff(self.failed_starts))
            if self._stopping:
                return
            self.restarts += 1
            try:
                await self._launch()
                break
            except RuntimeError as error:
                log.error("engine worker restart failed: %s", error)
                self.failed_starts += 1
                self.last_failure = str(error)
        for stream in retry:
            if stream.cancelled:  # its abort went nowhere (no worker); submitting it again would run it for nobody
                stream.put(EngineFailure("the request was cancelled while the engine worker restarted",
                                         code="cancelled", client_error=True))
                continue
            stream.attempts += 1
            self.replays += 1
            self._streams[stream.request_id] = stream
            self._send(stream.request.command())

    def _give_up(self, waiting: list[ResultStream]) -> None:
        self.state = "failed"
        log.error("engine worker failed %d times in a row; no more restarts (last: %s)",
                  self.failed_starts, self.last_failure)
        for stream in waiting:
            stream.put(EngineFailure(f"the engine worker failed and is not restarted: {self.last_failure}",
                                     code="engine_died"))

    def _close_sockets(self) -> None:
        if self._read_task is not None:
            self._read_task.cancel()
            self._read_task = None
        for socket in (self._commands, self._events):
            if socket is not None:
                socket.close(linger=0)
        self._commands = self._events = None

    def _send(self, message) -> None:
        self._commands.send_pyobj(message)

    def submit(self, request: EngineRequest, *, max_buffered: int = 1024, policy: str = "abort") -> ResultStream:
        if not self._ready:
            raise EngineUnavailable("the engine worker has failed and is not restarted" if self.state == "failed"
                                    else "the engine worker is starting")
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        stream = ResultStream(request, self.abort, max_buffered=max_buffered, policy=policy)
        if not self._streams:
            self._last_batch = time.monotonic()  # silence while idle says nothing about a hang
        self._streams[request.request_id] = stream
        self._send(request.command())
        return stream

    def abort(self, request_id: str) -> None:
        if self._ready and request_id in self._streams:
            self._send(AbortRequest(request_id))

    async def stop(self) -> None:
        self._stopping = True
        self._ready, self.state = False, "stopped"
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self._process is not None and self._process.is_alive():
            try:
                await self._commands.send_pyobj(Shutdown())
            except zmq.ZMQError:
                pass
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
        for stream in self._streams.values():
            stream.put(EngineFailure("the server is shutting down", code="shutting_down"))
        self._streams.clear()
        self._close_sockets()
        self._context.term()
        shutil.rmtree(self._directory, ignore_errors=True)
