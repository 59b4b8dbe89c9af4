"""One slow reader among normal streams: the service's three policies and a blocking foil.

Chapter 27 makes a reader slow over a real socket (`labkit.experiments.streaming.SocketStream`:
a small receive buffer and segment size, a few bytes read every so often) and watches where
the stream's bytes wait:

    engine --events--> front end's per-stream buffer --SSE chunks--> uvicorn's transport
           --> kernel: the server's send queue --> the client's receive queue --> the reader

* :class:`RecordingClient` wraps the service's `EngineClient` and keeps every stream it
  opens, so a sampler can read a stream's buffer (`ResultStream.buffered`) while it runs;
  :func:`policy_run` runs one slow reader beside normal streams under `--slow-reader abort`,
  `coalesce` or `unbounded` (or a fast reader: the control) and :meth:`PolicyRun.onset`
  says how many bytes each layer held when the per-stream buffer began to fill.
* :func:`stream_length_for` and :func:`framed_chunk_bytes` size a stream long enough for
  the policy to act.
* :func:`blocking_foil` is what the service avoids: an `EngineCore` whose slow request's sink
  blocks (:class:`BlockingSink`), so the core's one step loop waits for the slow reader and
  every other request waits with it.
* :func:`gap_verdicts` judges the other streams' token gaps under each policy against the
  control's, median and 99th percentile, beyond the drift between two runs of the control
  (:data:`GAP_FLOOR` at least); :func:`drift_sentence`, :func:`gap_notes`,
  :func:`gap_summary` and :func:`lede_sentence` put those verdicts in words.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field

from labkit.bench.http_load import HttpRecord, percentiles, run_closed_loop
from labkit.engine.core import AddRequest, EngineCore, StreamEnd
from labkit.engine.llm_engine import TokenEvent
from labkit.experiments.streaming import (MODEL, SocketOptions, SocketStream, StreamOutcome, accepted_socket,
                                          completion_body, dechunk, limit_transport, read_slowly, sse_outcome,
                                          socket_queues)
from labkit.sampling import SamplingParams
from labkit.util.threads import run_in_thread

ONSET_THRESHOLD = 4
"""Events in the per-stream buffer at which :meth:`PolicyRun.onset` says it began to fill
(a few, not one: one event waits there briefly even for a reader that keeps up)."""

SAMPLE_S = 0.005
"""How often :func:`policy_run` samples the slow stream's buffer and the kernel's queues (s)."""

GAP_FLOOR = 0.05
"""The smallest relative change of the other streams' median or 99th-percentile token gap
that :func:`gap_verdicts` counts as a policy's effect, whatever drift two runs of the control
show: one repeat measures that drift once, and a lucky pair of runs would otherwise let a
difference of 1% count."""


# -- one slow reader, the service's policies ----------------------------------------------------

class RecordingClient:
    """An `EngineClient` that hands everything to `inner` and keeps every stream it opened,
    so an experiment can watch a stream's buffer (`ResultStream.buffered`) as it is read."""

    def __init__(self, inner):
        self.inner = inner
        self.streams: list = []

    @property
    def limits(self):
        return self.inner.limits

    @property
    def restarts(self) -> int:
        return self.inner.restarts

    @property
    def weights(self) -> str | None:
        return self.inner.weights

    @property
    def ready(self) -> bool:
        return self.inner.ready

    def stats(self):
        return self.inner.stats()

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    def submit(self, request, *, max_buffered: int, policy: str):
        stream = self.inner.submit(request, max_buffered=max_buffered, policy=policy)
        self.streams.append(stream)
        return stream

    def abort(self, request_id: str) -> None:
        self.inner.abort(request_id)

    def health(self) -> dict:
        return self.inner.health()

    def stream_of(self, prompt: list[int]):
        return next((s for s in self.streams if s.request.prompt_token_ids == list(prompt)), None)


@dataclass(frozen=True)
class BufferSample:
    t_s: float                      # from the start of the run
    buffered: int                   # events waiting in the front end's buffer for the stream
    reached_front_end: int          # token events the engine has handed to the stream
    coalesced: int                  # events folded into a buffered one
    client_bytes: int               # bytes the slow client has read
    server_send_queue: int          # kernel: the server socket's unacknowledged bytes
    client_receive_queue: int       # kernel: bytes the client's socket holds unread


@dataclass
class PolicyRun:
    policy: str                     # abort / coalesce / unbounded, or "none": a fast reader
    slow: StreamOutcome
    others: list[HttpRecord] = field(repr=False)
    samples: list[BufferSample] = field(repr=False)
    chunk_ends: list[int] = field(repr=False)   # byte offset after each chunk of the slow stream
    header_bytes: int
    max_tokens: int
    max_buffered: int
    wall_s: float
    blocks_left: int                # KV blocks in use once the run is over (0: none leaked)
    others_after: int = 0           # slow-stream tokens handed on before the others started
    others_started_s: float = 0.0   # when they started, from the start of the run
    drained_s: float | None = None  # when the harness let the slow client read the rest at
                                    # once (after the others and the slow request were done)

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for r in self.others if r.ok for a, b in zip(r.token_s, r.token_s[1:])]

    @property
    def peak_buffered(self) -> int:
        return max((s.buffered for s in self.samples), default=0)

    def onset(self, threshold: int = ONSET_THRESHOLD) -> dict | None:
        """Where the bytes were when the per-stream buffer first held `threshold` events:
        events past the buffer (handed to uvicorn), the bytes those make, what the client had
        read, what the kernel held (server send queue + client receive queue) and, the rest,
        what uvicorn's transport held."""
        sample = next((s for s in self.samples if s.buffered >= threshold), None)
        if sample is None:
            return None
        handed = sample.reached_front_end - sample.buffered
        if not 0 < handed <= len(self.chunk_ends):
            return None
        sent = self.chunk_ends[handed - 1]
        kernel = sample.server_send_queue + sample.client_receive_queue
        return {"t_s": sample.t_s, "events_handed_on": handed, "bytes_handed_on": sent,
                "client_read_bytes": sample.client_bytes, "server_send_queue_bytes": sample.server_send_queue,
                "client_receive_queue_bytes": sample.client_receive_queue, "kernel_bytes": kernel,
                "transport_bytes": sent - sample.client_bytes - kernel,
                "events_past_client": handed - sum(e <= sample.client_bytes for e in self.chunk_ends)}

    def row(self) -> dict:
        gaps = percentiles(self.gaps_s, (0.5, 0.99))
        return {"policy": self.policy, "slow_stream": self.slow.kind, "slow_chunks": self.slow.chunks,
                "slow_text_chars": len(self.slow.text), "peak_buffered_events": self.peak_buffered,
                "others_itl_p50_ms": 1e3 * gaps["p50"], "others_itl_p99_ms": 1e3 * gaps["p99"],
                "blocks_left": self.blocks_left, "wall_s": self.wall_s}


def _sample_buffers(client: RecordingClient, prompt, stream: SocketStream, server, start: float,
                    stop: threading.Event, out: list, interval: float) -> None:
    accepted = None
    while not stop.is_set():
        target = client.stream_of(prompt)
        port = getattr(stream, "local_port", None)
        if accepted is None and port is not None:
            accepted = accepted_socket(server, port)
        if target is not None and accepted is not None and not stream.closed:
            try:
                sent, held = socket_queues(accepted)[0], socket_queues(stream.sock)[1]
            except OSError:  # a socket closed under us: the run is ending
                break
            out.append(BufferSample(time.perf_counter() - start, target.buffered, target.tokens_received,
                                    target.coalesced, len(stream.raw), sent, held))
        stop.wait(interval)


def policy_run(engine, tokenizer, policy: str, slow_prompt: list[int], other_prompts: list[list[int]],
               max_tokens: int, *, others_after: int = 0, max_buffered: int = 16, read_bytes: int = 32,
               every_s: float = 1.0, options: SocketOptions = SocketOptions(), interval: float = SAMPLE_S,
               transport_limits: tuple[int, int] | None = None, model: str = MODEL,
               timeout_s: float = 900.0) -> PolicyRun:
    """One run of the service (engine in this process, `BackgroundServer`) with `--slow-reader
    policy` and `--max-buffered-events max_buffered`: a raw-socket client asks for
    `max_tokens` tokens and reads `read_bytes` every `every_s` seconds. Once the engine has
    handed the slow stream `others_after` tokens (fewer than the buffers below the front end
    absorb, so that the policy has yet to act), one normal streaming client per prompt
    in `other_prompts` asks for the rest, `max_tokens - others_after` tokens each: their
    gaps are measured while the policy acts. Once the others are done and the engine has
    finished with (or cut off) the slow request, the slow client reads the rest at once, so
    its whole outcome is known. Policy "none" is the control: the same requests, the slow
    client reading at full speed. `transport_limits` (low, high) replaces the write-buffer
    marks of the slow stream's connection (`limit_transport`): smaller marks make the
    per-stream buffer fill after fewer tokens (a short run), the defaults are what uvicorn
    does."""
    if not 0 <= others_after < max_tokens:
        raise ValueError("others_after must be at least 0 and less than max_tokens")
    from labkit.serve.app import ServeSettings, build_app
    from labkit.serve.engine_client import InProcessEngine
    from labkit.serve.server import BackgroundServer

    client = RecordingClient(InProcessEngine(engine))
    settings = ServeSettings(model, slow_reader="abort" if policy == "none" else policy,
                             max_buffered_events=max_buffered)
    samples: list[BufferSample] = []
    with BackgroundServer(build_app(client, tokenizer, settings)) as server:
        stream = SocketStream(server.url, completion_body(slow_prompt, max_tokens, model), options)
        drain, stop = threading.Event(), threading.Event()
        if policy == "none":
            drain.set()
        start = time.perf_counter()
        sampler = threading.Thread(target=_sample_buffers, daemon=True,
                                   args=(client, slow_prompt, stream, server, start, stop, samples, interval))
        reader = threading.Thread(target=read_slowly, args=(stream, read_bytes, every_s, drain, timeout_s))
        stream.open()
        if transport_limits is not None and not limit_transport(server, stream.local_port, *transport_limits):
            raise RuntimeError("the slow stream's connection did not appear on the server")
        sampler.start()
        reader.start()
        while client.stream_of(slow_prompt) is None and time.perf_counter() - start < 60:
            time.sleep(0.005)
        target = client.stream_of(slow_prompt)
        while (target.tokens_received < others_after and not target.finished
               and time.perf_counter() - start < timeout_s):
            time.sleep(0.005)
        others_started = time.perf_counter() - start
        records, _ = run_in_thread(run_closed_loop, server.url, model, other_prompts,
                                   [max_tokens - others_after] * len(other_prompts), len(other_prompts),
                                   extra={"ignore_eos": True})
        while not target.finished and time.perf_counter() - start < timeout_s:
            time.sleep(0.01)
        drained = 0.0 if policy == "none" else time.perf_counter() - start
        drain.set()
        reader.join(timeout_s)
        wall = time.perf_counter() - start
        stop.set()
        sampler.join()
        while engine.has_unfinished() and time.perf_counter() - start < timeout_s:
            time.sleep(0.01)
    status, header, body, ends = dechunk(bytes(stream.raw))
    return PolicyRun(policy, sse_outcome(status, body), records, samples, ends, header, max_tokens, max_buffered,
                     wall, engine.stats().blocks_used, others_after, others_started, drained)


def stream_length_for(absorbed_bytes: int, chunk_bytes: int, max_buffered: int, margin: int) -> int:
    """Tokens a slow stream needs before its per-stream buffer overflows: the chunks the
    buffers below the front end absorb, the per-stream buffer, and a margin (for what the
    slow reader reads meanwhile), rounded up to a multiple of 16."""
    tokens = -(-absorbed_bytes // chunk_bytes) + max_buffered + margin
    return -(-tokens // 16) * 16


def framed_chunk_bytes(text: str = " the", model: str = MODEL, include_usage: bool = True) -> int:
    """Bytes on the wire of one streamed completions chunk carrying `text`: the SSE event
    as the service writes it, in HTTP/1.1 chunked framing. With `include_usage` (as
    `streaming.completion_body` asks) every chunk but the last carries `"usage": null`."""
    from labkit.serve.responses import completion_chunk

    rid = "cmpl-" + "0" * 32 + "-0"
    chunk = completion_chunk(rid, int(time.time()), model, 0, text, None) | ({"usage": None} if include_usage else {})
    event = f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    size = len(event.encode())
    return len(f"{size:x}\r\n") + size + 2


# -- the foil: a sink that blocks -----------------------------------------------------------------

class BlockingSink:
    """A sink whose `put` waits for room in a bounded queue (`size` 0: unbounded, never
    waits). `EngineCore` calls `put` on its one step loop, so while a slow reader leaves
    the queue full, no request in the engine advances."""

    def __init__(self, size: int):
        self.items: queue.Queue = queue.Queue(maxsize=size)
        self.waited_s = 0.0
        self.peak = 0

    def put(self, item) -> None:
        began = time.perf_counter()
        self.items.put(item)
        self.waited_s += time.perf_counter() - began
        self.peak = max(self.peak, self.items.qsize())


@dataclass
class FoilRun:
    queue_size: int                 # 0: the sink never blocks (what the service does)
    gaps_s: list[float] = field(repr=False)  # every gap between the other streams' tokens
    slow_tokens: int
    waited_s: float                 # time the core's loop spent inside the slow sink's put
    peak_queued: int                # most events waiting for the slow reader
    wall_s: float

    def row(self) -> dict:
        gaps = percentiles(self.gaps_s, (0.5, 0.99))
        return {"sink": f"blocks at {self.queue_size} events" if self.queue_size else "never blocks",
                "peak_queued_events": self.peak_queued, "loop_blocked_s": self.waited_s,
                "others_itl_p50_ms": 1e3 * gaps["p50"], "others_itl_p99_ms": 1e3 * gaps["p99"],
                "slow_tokens": self.slow_tokens, "wall_s": self.wall_s}


def blocking_foil(engine, slow_prompt: list[int], other_prompts: list[list[int]], max_tokens: int, *,
                  queue_size: int = 16, every_s: float = 0.2) -> FoilRun:
    """The engine waits for the client: an `EngineCore` (its loop on a thread) whose slow
    request's sink is a :class:`BlockingSink` of `queue_size` events, taken one every
    `every_s` seconds while the other requests (normal streams, read at once) run; then
    the rest is taken at once. Returns the others' token gaps and the time the loop spent
    blocked."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core = EngineCore(engine)
    sink = BlockingSink(queue_size)
    arrivals: list[list[float]] = [[] for _ in other_prompts]
    core.start()
    start = time.perf_counter()
    try:
        core.submit(AddRequest("foil-slow", list(slow_prompt), params), sink)
        streams = [core.add(list(p), params) for p in other_prompts]

        def read(i: int) -> None:
            for event in streams[i]:
                if event.token_id is not None:
                    arrivals[i].append(time.perf_counter())
        readers = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
        for r in readers:
            r.start()
        slow_tokens, ended = 0, False
        while not ended:
            item = sink.items.get(timeout=600)
            ended = isinstance(item, StreamEnd)
            slow_tokens += isinstance(item, TokenEvent) and item.token_id is not None
            if any(r.is_alive() for r in readers):
                time.sleep(every_s)
        for r in readers:
            r.join()
        wall = time.perf_counter() - start
    finally:
        core.shutdown()
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    return FoilRun(queue_size, gaps, slow_tokens, sink.waited_s, sink.peak, wall)


def policy_sentences(policies: dict, max_buffered: int, slow_tokens: int) -> dict[str, tuple[bool, str, str]]:
    """Per slow-reader policy, (whether it acted, the sentence if it did, the sentence if not).

    A policy acts only once the reader is `max_buffered` events behind, after the kernel and
    the transport have taken what they hold. How soon that comes, if it comes before the
    stream ends, depends on the machine: how fast its engine makes tokens against the reader's
    pace, and how far its kernel lets a socket's buffers grow meanwhile. So whether each
    policy acted is a fact of the run, written as the sentence for the outcome it had.
    `policies` maps "abort", "coalesce", "unbounded" and "none" (the control) to
    :class:`PolicyRun`."""
    control = policies["none"].slow.text

    def same(run) -> str:
        return "the same" if run.slow.text == control else "not the same"

    abort, coalesce, unbounded = (policies[p] for p in ("abort", "coalesce", "unbounded"))
    out = {}
    a = abort.slow
    out["abort"] = (
        a.errors == ["slow_reader"],
        f"the slow stream was {a.kind} after {a.chunks:,} chunks: the {a.chunks - max_buffered:,} "
        f"that had left the buffer and the {max_buffered} in it. The request was cancelled; none "
        "of its KV blocks was in use at the end of the run.",
        f"the slow stream {a.kind} with {a.chunks:,} chunks: its reader never fell "
        f"{max_buffered} events behind before the stream ended, so the policy never acted.")
    c = coalesce.slow
    out["coalesce"] = (
        c.chunks < slow_tokens,
        f"the stream {c.kind}, in {c.chunks:,} chunks instead of {slow_tokens:,}; the buffer never "
        f"held more than {coalesce.peak_buffered} items (the {max_buffered} events, folded ever "
        f"longer, and at the end the stream's end), and the text was {same(coalesce)} as the "
        "control's.",
        f"the stream {c.kind} in all {c.chunks:,} chunks, none folded: its buffer peaked at "
        f"{coalesce.peak_buffered} items before the stream ended, so the policy never had to "
        f"fold; the text was {same(coalesce)} as the control's.")
    u = unbounded.slow
    out["unbounded"] = (
        unbounded.peak_buffered > max_buffered,
        f"the stream {u.kind} with every chunk ({u.chunks:,}, text {same(unbounded)} as the "
        f"control's), and the buffer grew to {unbounded.peak_buffered:,} events: everything "
        "produced after the onset. A longer stream or a slower reader would have made it longer "
        "without limit.",
        f"the stream {u.kind} with every chunk ({u.chunks:,}, text {same(unbounded)} as the "
        f"control's); its buffer peaked at {unbounded.peak_buffered:,} events, within the "
        f"{max_buffered} a bounded buffer allows, because the stream ended first.")
    return out


def against(base: list[float], values: list[float], base_name: str = "the control's") -> str:
    """Timings `values` against `base` (token gaps against the control's, latencies against
    an idle server's), in words that claim no more than a bootstrap interval of the ratio of
    their medians (`labkit.util.compare`)."""
    from labkit.util.compare import compare

    c = compare(base, values, name_a="base", name_b="values")
    interval = f"95% interval {c.low:.2f}-{c.high:.2f}"
    if not c.separated:
        return f"within the noise of {base_name} (median ratio {c.ratio:.2f}, {interval})"
    word = "longer" if c.verdict == "faster" else "shorter"
    return f"{c.ratio:.2f} times {base_name}, {word} beyond the noise ({interval})"


# -- the other streams' gaps under each policy, judged against the control's drift ----------------

@dataclass(frozen=True)
class GapVerdict:
    """The other streams' token gaps under one policy against the control's: the ratios
    (policy / control) of their medians and 99th percentiles, and the thresholds a ratio must
    pass, as |ratio - 1|, to count as the policy's effect (:func:`gap_verdicts`)."""

    median_ratio: float
    p99_ratio: float
    median_threshold: float
    p99_threshold: float
    median_separated: bool          # the bootstrap interval of the median ratio excludes 1

    @property
    def median_word(self) -> str:
        """"longer", "shorter", "within the threshold" or "within the noise" (beyond the
        threshold, but a bootstrap of the gaps cannot tell the medians apart)."""
        return _gap_word(self.median_ratio, self.median_threshold, self.median_separated)

    @property
    def p99_word(self) -> str:
        return _gap_word(self.p99_ratio, self.p99_threshold, True)

    def text(self) -> str:
        def said(word: str) -> str:
            return word if word.startswith("within") else f"{word} beyond the threshold"
        return (f"a median gap {self.median_ratio:.2f} times the control's ({said(self.median_word)}) "
                f"and a 99th percentile {self.p99_ratio:.2f} times ({said(self.p99_word)})")


def _gap_word(ratio: float, threshold: float, separated: bool) -> str:
    if abs(ratio - 1.0) <= threshold:
        return "within the threshold"
    if not separated:
        return "within the noise"
    return "longer" if ratio > 1.0 else "shorter"


def _median_p99(gaps: list[float]) -> tuple[float, float]:
    got = percentiles(gaps, (0.5, 0.99))
    return got["p50"], got["p99"]


def gap_drift(control: list[float], again: list[float]) -> tuple[float, float]:
    """(median, 99th percentile) of the gaps of a second run of the control over the first's:
    how far two runs of the same thing drift apart on this machine."""
    (m0, p0), (m1, p1) = _median_p99(control), _median_p99(again)
    return m1 / m0, p1 / p0


def gap_verdicts(control: list[float], runs: dict[str, list[float]], again: list[float] | None = None,
                 floor: float = GAP_FLOOR) -> dict[str, GapVerdict]:
    """Each policy's gaps (`runs`: name -> the other streams' token gaps) against the
    control's. A ratio counts as the policy's effect only where |ratio - 1| exceeds the
    threshold: the drift between the control and its repeat `again` (:func:`gap_drift`), or
    `floor` where that is larger or there is no repeat. A bootstrap of one run's gaps cannot
    stand in for that: thousands of correlated gaps from one run give an interval far
    narrower than the difference between two identical runs. The median must also be
    separated by that bootstrap (`labkit.util.compare`)."""
    from labkit.util.compare import compare

    m_thr = p_thr = floor
    if again is not None:
        dm, dp = gap_drift(control, again)
        m_thr, p_thr = max(floor, abs(dm - 1.0)), max(floor, abs(dp - 1.0))
    m0, p0 = _median_p99(control)
    out = {}
    for name, gaps in runs.items():
        m, p = _median_p99(gaps)
        out[name] = GapVerdict(m / m0, p / p0, m_thr, p_thr, compare(control, gaps).separated)
    return out


def _threshold_words(drift_measured: bool, floor: float) -> str:
    if drift_measured:
        return f"the larger of two control runs' drift and {floor:.0%}"
    return f"{floor:.0%}, as this profile does not measure the drift between runs"


def drift_sentence(control: list[float], again: list[float] | None, verdicts: dict[str, GapVerdict],
                   floor: float = GAP_FLOOR) -> str:
    """The threshold the verdicts used, in words: the control's drift between two runs (or
    that it was not measured), and each policy measured against it."""
    if again is None:
        head = (f"This profile runs the control once, so the drift between two runs is not "
                f"measured; a policy's difference counts only where it exceeds {floor:.0%}.")
    else:
        from labkit.util.compare import compare

        dm, dp = gap_drift(control, again)
        v = next(iter(verdicts.values()))
        boot = compare(control, again)
        aside = (f" A bootstrap of one run's gaps would call even that difference real (95% "
                 f"interval {boot.low:.2f}-{boot.high:.2f}), because it cannot see how runs "
                 "differ; it decides nothing alone here." if boot.separated else "")
        head = (f"Run again after the three policies, the control's other streams had a median "
                f"gap {dm:.2f} times and a 99th percentile {dp:.2f} times the first run's: two "
                "runs of the same thing differ by that much on this machine, so a policy's "
                f"difference counts only where it exceeds the larger of that drift and "
                f"{floor:.0%} ({v.median_threshold:.1%} for the median, {v.p99_threshold:.1%} "
                f"for the 99th percentile).{aside}")
    counted = [f"`{p}`" for p, v in verdicts.items()
               if v.median_word in ("longer", "shorter") or v.p99_word in ("longer", "shorter")]
    if not counted:
        tail = " By that test, no policy moved the other streams' gaps."
    elif len(counted) == len(verdicts):
        tail = " By that test, every policy moved the other streams' gaps."
    else:
        tail = f" By that test, {_join(counted)} moved the other streams' gaps, and no other policy did."
    return head + tail


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def gap_notes(verdicts: dict[str, GapVerdict]) -> str:
    """What a gap beyond the threshold may mean, for the directions that occurred."""
    words = [w for v in verdicts.values() for w in (v.median_word, v.p99_word)]
    notes = []
    if "shorter" in words:
        notes.append("A shorter gap costs the other streams nothing; possible causes, not "
                     "measured here: under `abort` the batch runs one sequence fewer once the "
                     "slow stream is cut, and while a stream's writes are paused the front end "
                     "has less to send, in a process where the event loop, the engine's thread "
                     "and the clients share one interpreter.")
    if "longer" in words:
        notes.append("A longer gap beyond the threshold is a cost the other streams paid while "
                     "that policy ran; this chapter does not measure its cause.")
    return " ".join(notes) or "No policy moved a median or a 99th percentile beyond the threshold."


def gap_summary(verdicts: dict[str, GapVerdict], drift_measured: bool, floor: float = GAP_FLOOR) -> str:
    """One line for "What we measured": each policy's median and p99 verdict."""
    def word(w: str) -> str:
        return w if w in ("longer", "shorter") else "within"
    parts = [f"`{p}` median {word(v.median_word)}, 99th percentile {word(v.p99_word)}"
             for p, v in verdicts.items()]
    return (f"the other streams' gaps against the control's: {'; '.join(parts)} (threshold: "
            f"{_threshold_words(drift_measured, floor)})")


def lede_sentence(verdicts: dict[str, GapVerdict], limit: float = 1.5) -> str:
    """The opening's sentence on what a slow reader cost the other streams, for the outcome
    this run had: nothing beyond the threshold (:func:`gap_verdicts`), a cost short of `limit`
    times the control's gaps, or `limit` times or more under some policy."""
    longer = [f"`{p}`" for p, v in verdicts.items() if "longer" in (v.median_word, v.p99_word)]
    stretched = [f"`{p}`" for p, v in verdicts.items() if max(v.median_ratio, v.p99_ratio) >= limit]
    if stretched:
        return (f"A reader that falls behind stretched the other streams' token gaps to {limit} "
                f"times the control's or more under {_join(stretched)} in this run, though the "
                "engine never waits for a client.")
    if longer:
        return ("A reader that falls behind did not set the other streams' pace here, because "
                f"the engine never waits for a client, though under {_join(longer)} their token "
                "gaps grew beyond the threshold set out below.")
    return ("A reader that falls behind did not lengthen the other streams' token gaps here "
            "beyond the threshold set out below: the engine never waits for a client.")
