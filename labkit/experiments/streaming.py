"""Concurrent requests and streaming, measured over real sockets.

Chapter 27 runs these against `labkit serve` (and the slow-reader study in
`labkit.experiments.slow_readers`):

* :func:`load_runs`: the same prompts sent by one client at a time and by many at once
  (`labkit.bench.http_load.run_closed_loop`), repeated; :func:`solo_texts` and
  :func:`count_identical` hold every stream's text to its solo run.
* :class:`SocketStream`: one streamed completion over a raw TCP socket whose receive buffer
  and segment size the caller chooses, read as slowly as the caller likes (:func:`read_slowly`);
  :func:`socket_queues`, :func:`kernel_absorption` and :func:`transport_high_water` measure the
  buffers between the front end and such a reader (:func:`proc_net_tcp_read_s`: why the
  sockets are asked, not /proc/net/tcp); :func:`tcp_buffer_sysctls` reads the system's
  socket-buffer limits, :func:`buffer_limits_sentence` sets the measured queues beside them,
  and :func:`socket_probes_unsupported` says where these Linux-only measurements cannot run.
* :func:`disconnect_trials`: clients that leave after a few chunks; how long the service keeps
  the request, how many engine steps it runs for it, how long the next request waits.
  :func:`naive_app` builds the naive foil for the same trials.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import re
import socket
import struct
import sys
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from labkit.bench.http_load import HttpRecord, run_closed_loop, summarize
from labkit.bench.workloads import text_prompts
from labkit.sampling import SamplingParams
from labkit.util.threads import run_in_thread

MODEL = "smollm2-135m"
NEXT_TOKENS = 4     # the short request that times an idle server, or one a client just left


def completion_body(prompt: list[int], max_tokens: int, model: str = MODEL, **extra) -> dict:
    """A greedy streamed completion that runs to `max_tokens` (`ignore_eos`)."""
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}


def stream_prompts(tokenizer, count: int, shortest: int = 16, longest: int = 48, seed: int = 27) -> list[list[int]]:
    """`count` prompts cut from the book's evaluation text (`text_prompts`)."""
    from labkit.eval import eval_text

    return text_prompts(tokenizer.encode(eval_text()), count, shortest, longest, seed=seed)


# -- one client at a time vs all at once --------------------------------------------------------

@dataclass
class LoadRun:
    concurrency: int
    repeat: int
    wall_s: float
    records: list[HttpRecord] = field(repr=False)

    @property
    def summary(self) -> dict:
        return summarize(self.records, self.wall_s)

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.records]

    def row(self) -> dict:
        s = self.summary
        return {"clients_at_once": self.concurrency, "repeat": self.repeat, "wall_s": self.wall_s,
                "output_tokens_per_s": s["output_tokens_per_s"], "ok": s["ok"],
                "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
                "itl_p50_ms": 1e3 * s["itl_s"]["p50"], "itl_p99_ms": 1e3 * s["itl_s"]["p99"]}


def load_runs(url: str, prompts: list[list[int]], max_tokens: int, *, concurrencies=(1, 32), repeats: int = 1,
              model: str = MODEL, warmup: bool = True) -> list[LoadRun]:
    """Closed-loop runs of all `prompts` x `max_tokens` (greedy, `ignore_eos`) at each
    concurrency, interleaved repeat by repeat so that drift hits both alike. A short untimed
    warm-up request goes first."""
    extra = {"ignore_eos": True}
    if warmup:
        run_in_thread(run_closed_loop, url, model, prompts[:1], [4], 1, extra=extra)
    runs = []
    for repeat in range(repeats):
        for c in concurrencies:
            records, wall = run_in_thread(run_closed_loop, url, model, prompts, [max_tokens] * len(prompts), c,
                                       extra=extra)
            runs.append(LoadRun(c, repeat, wall, records))
    return runs


def solo_texts(model, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Each prompt's greedy text from the simple loop (`labkit.engine.loop.generate`: one
    sequence, a contiguous cache, no batching, no server): the independent reference."""
    from labkit.engine.loop import generate

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [generate(model, list(p), params).text for p in prompts]


def count_identical(runs: list[LoadRun], reference: list[str]) -> tuple[int, int]:
    """(streams whose text equals the reference's for the same prompt, streams compared)."""
    pairs = [(r.text, reference[r.request]) for run in runs for r in run.records]
    return sum(a == b for a, b in pairs), len(pairs)


# -- a raw-socket client ------------------------------------------------------------------------

@dataclass(frozen=True)
class SocketOptions:
    rcvbuf: int | None = 1024   # SO_RCVBUF asked for (Linux doubles it; 2,304 bytes at least)
    mss: int | None = 536       # TCP_MAXSEG: the segment size the client announces in its SYN


def _client_socket(options: SocketOptions) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if options.rcvbuf:  # before connect: the window scale is agreed in the handshake
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, options.rcvbuf)
    if options.mss:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, options.mss)
    return sock


@dataclass
class StreamOutcome:
    status: int | None
    text: str
    chunks: int                  # SSE events with text
    errors: list[str]            # error codes sent in the stream
    finish_reason: str | None
    completion_tokens: int | None
    done: bool                   # the stream ended with data: [DONE]
    body_bytes: int

    @property
    def kind(self) -> str:
        """completed / cut off (<code>) / incomplete."""
        if self.errors:
            return f"cut off ({self.errors[0]})"
        return "completed" if self.done and self.finish_reason else "incomplete"


def dechunk(raw: bytes) -> tuple[int | None, int, bytes, list[int]]:
    """(status, header bytes, body, end offset in `raw` of every whole chunk) of an HTTP/1.1
    response with a chunked body, as far as `raw` goes (a truncated chunk is left out)."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None, 0, b"", []
    status = int(head.split(b" ", 2)[1])
    body, ends, at, offset = bytearray(), [], 0, len(head) + 4
    while True:
        end = rest.find(b"\r\n", at)
        if end < 0:
            break
        size = int(rest[at:end].split(b";")[0], 16)
        if size == 0 or end + 2 + size + 2 > len(rest):
            break
        body += rest[end + 2:end + 2 + size]
        at = end + 2 + size + 2
        ends.append(offset + at)
    return status, offset, bytes(body), ends


def sse_outcome(status: int | None, body: bytes) -> StreamOutcome:
    """What a reader got from a completions stream: its text, chunks, errors, ending."""
    text, chunks, errors, reason, tokens, done = "", 0, [], None, None, False
    for event in body.decode("utf-8", errors="replace").split("\n\n"):
        if not event.startswith("data: "):
            continue
        data = event[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        payload = json.loads(data)
        if "error" in payload:
            errors.append(payload["error"].get("code") or "error")
            continue
        if payload.get("usage"):
            tokens = payload["usage"]["completion_tokens"]
        for choice in payload.get("choices", []):
            if choice.get("text"):
                text += choice["text"]
                chunks += 1
            reason = choice.get("finish_reason") or reason
    return StreamOutcome(status, text, chunks, errors, reason, tokens, done, len(body))


class SocketStream:
    """One streamed completion over a raw TCP socket: the request is written by hand, and
    the caller decides how fast the answer is read (`read`)."""

    def __init__(self, url: str, body: dict, options: SocketOptions = SocketOptions()):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        payload = json.dumps(body).encode()
        self.request = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                        f"Connection: close\r\n\r\n").encode() + payload
        self.sock = _client_socket(options)
        self.raw = bytearray()
        self.closed = False

    def open(self) -> "SocketStream":
        self.sock.connect((self.host, self.port))
        self.local_port = self.sock.getsockname()[1]
        self.sock.sendall(self.request)
        return self

    def read(self, max_bytes: int) -> int:
        """Up to `max_bytes` more bytes (blocking); 0 at the end of the stream."""
        data = self.sock.recv(max_bytes)
        self.raw += data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    def outcome(self) -> StreamOutcome:
        status, _, body, _ = dechunk(bytes(self.raw))
        return sse_outcome(status, body)

    def text_chunks(self) -> int:
        return len(re.findall(rb'"text": "(?:[^"\\]|\\.)+"', bytes(self.raw)))


def read_slowly(stream: SocketStream, read_bytes: int, every_s: float, drain: threading.Event,
                timeout_s: float = 600.0) -> None:
    """`read_bytes` every `every_s` seconds until `drain` is set, then everything at once."""
    stream.sock.settimeout(timeout_s)
    try:
        while not drain.is_set():
            if stream.read(read_bytes) == 0:
                return
            drain.wait(every_s)
        while stream.read(1 << 16):
            pass
    finally:
        stream.close()


def socket_queues(sock) -> tuple[int, int]:
    """(send queue, receive queue) in bytes of a TCP socket (or its file descriptor), from the
    kernel by ioctl (SIOCOUTQ, SIOCINQ): the two numbers /proc/net/tcp prints for it, read in
    microseconds where a read of /proc/net/tcp takes milliseconds of a core. On an
    established socket the send queue is the data written and not yet acknowledged, sent or
    not; the receive queue is what has arrived and not been read."""
    fd = sock if isinstance(sock, int) else sock.fileno()
    out = []
    for request in (termios.TIOCOUTQ, termios.FIONREAD):  # SIOCOUTQ, SIOCINQ on Linux
        out.append(struct.unpack("i", fcntl.ioctl(fd, request, b"\0" * 4))[0])
    return out[0], out[1]


def proc_net_tcp_read_s(repeats: int = 20) -> float:
    """Median seconds one read of /proc/net/tcp takes here: the kernel walks its socket
    tables for it, which is why a sampler asks the sockets themselves (`socket_queues`)."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        with open("/proc/net/tcp") as f:
            f.read()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def socket_probes_unsupported(platform: str | None = None) -> str | None:
    """Why the socket measurements (:func:`socket_queues`' ioctls SIOCOUTQ and SIOCINQ,
    /proc/net/tcp, /proc/sys/net/ipv4) cannot run on `platform` (default: this one), or
    None where they can: they ask the Linux kernel."""
    platform = sys.platform if platform is None else platform
    if platform.startswith("linux"):
        return None
    return (f"they ask the Linux kernel (the socket ioctls SIOCOUTQ and SIOCINQ, /proc/net/tcp, "
            f"/proc/sys/net/ipv4), and this system is {platform}")


def tcp_buffer_sysctls(root: str | Path = "/proc/sys/net/ipv4") -> dict[str, tuple[int, int, int]]:
    """The kernel's TCP socket-buffer sizes in bytes, (min, default, max), of `tcp_wmem` (a
    socket's send buffer) and `tcp_rmem` (its receive buffer), read from `root` (Linux's
    /proc/sys/net/ipv4). A name whose file is absent or unreadable is left out."""
    out = {}
    for name in ("tcp_wmem", "tcp_rmem"):
        try:
            values = tuple(int(x) for x in Path(root, name).read_text().split())
        except (OSError, ValueError):
            continue
        if len(values) == 3:
            out[name] = values
    return out


def buffer_limits_sentence(absorbed: "KernelAbsorption", limits: dict) -> tuple[bool, str, str]:
    """(whether the queues of a never-read loopback connection, `absorbed`, ended at the
    system's limits, the sentence if so, the sentence if not) for :func:`kernel_absorption`
    with a client socket at its defaults. "At the limits": the send queue within 20% below
    `tcp_wmem`'s maximum, up to which Linux grows a sending socket's buffer, and the receive
    queue within 20% below `tcp_rmem`'s default, the size a receive buffer keeps while its
    application reads nothing. `limits` is :func:`tcp_buffer_sysctls`."""
    sent, held = absorbed.server_send_queue, absorbed.client_receive_queue
    if "tcp_wmem" not in limits or "tcp_rmem" not in limits:
        return (False, "", "This system does not report its TCP buffer sizes in "
                "/proc/sys/net/ipv4, so they cannot be set beside the queues here.")
    w, r = limits["tcp_wmem"], limits["tcp_rmem"]
    at_limits = 0.8 * w[2] <= sent <= w[2] and 0.8 * r[1] <= held <= r[1]
    sizes = (f"(`net.ipv4.tcp_wmem` is {w[0]:,} {w[1]:,} {w[2]:,} and `net.ipv4.tcp_rmem` "
             f"{r[0]:,} {r[1]:,} {r[2]:,}: min, default and max bytes)")
    return (at_limits,
            f"Those are the system's socket-buffer sizes at work {sizes}: the send queue ended at "
            f"{sent / w[2]:.0%} of the send buffer's maximum, {w[2]:,} bytes, up to which Linux "
            "grows the buffer of a socket that has data to send, and the receive queue at "
            f"{held / r[1]:.0%} of the receive buffer's default, {r[1]:,} bytes, which Linux "
            "grows only as the application reads.",
            f"Here the send queue ended at {sent / w[2]:.0%} of the send buffer's maximum and the "
            f"receive queue at {held / r[1]:.0%} of the receive buffer's default {sizes}, so "
            "those two sizes alone do not account for where the kernel stopped taking bytes "
            "on this system.")


@dataclass(frozen=True)
class KernelAbsorption:
    written: int                # bytes `send` took before it would block
    server_send_queue: int      # held by the writer's socket (unacknowledged)
    client_receive_queue: int   # held, unread, by the reader's socket (bytes received and not
                                # yet acknowledged count in both queues: a segment or two)


def kernel_absorption(options: SocketOptions = SocketOptions(), piece: int = 224,
                      settle_s: float = 0.2) -> KernelAbsorption:
    """What the kernel takes from a writer on loopback before `send` would block, when the
    reader (a client socket with `options`) reads nothing: `piece`-byte writes (the size of
    one streamed chunk) until none is taken for `settle_s` seconds, and where they wait."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = _client_socket(options)
    client.connect(server.getsockname())
    peer, _ = server.accept()
    peer.setblocking(False)
    total, data, quiet_since = 0, b"x" * piece, None
    try:
        while True:
            try:
                total += peer.send(data)
                quiet_since = None
            except BlockingIOError:
                quiet_since = quiet_since or time.perf_counter()
                if time.perf_counter() - quiet_since > settle_s:
                    break
                time.sleep(0.005)
        return KernelAbsorption(total, socket_queues(peer)[0], socket_queues(client)[1])
    finally:
        for s in (client, peer, server):
            s.close()


def transport_high_water() -> tuple[int, int]:
    """(low, high) write-buffer limits of an asyncio socket transport as uvicorn gets it: the
    bytes uvicorn's transport holds before it pauses the response."""
    async def probe():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        limits = writer.transport.get_write_buffer_limits()
        writer.close()
        server.close()
        return limits
    return run_in_thread(lambda: asyncio.run(probe()))


# -- a client that leaves ---------------------------------------------------------------------------

def read_metrics(client: httpx.Client, url: str) -> dict[str, float]:
    """The samples of `GET /metrics` labelled with nothing but `model_name` (name -> value).
    Pass a client that sends `Connection: close` (:func:`poll_client`) to time with it: see
    :func:`poll_seconds`."""
    from labkit.experiments.fault_client import parse_metrics

    return {name: value for name, value in parse_metrics(client.get(url + "/metrics").text).items()
            if "{" not in name}


def poll_client(keep_alive: bool = False) -> httpx.Client:
    """An HTTP client for polling: with `keep_alive` False, each request on a new connection."""
    return httpx.Client(timeout=30, headers={} if keep_alive else {"Connection": "close"})


def poll_seconds(url: str, polls: int = 6, *, keep_alive: bool) -> list[float]:
    """Seconds of each `GET /metrics` after the first, on one kept-alive connection or on a
    new connection each. (On `labkit serve` a kept-alive request after the first waited
    about 40 ms: its accepted sockets have Nagle's algorithm on, which meets the client's
    delayed acknowledgement.)"""
    out = []
    with poll_client(keep_alive) as client:
        for _ in range(polls + 1):
            began = time.perf_counter()
            read_metrics(client, url)
            out.append(time.perf_counter() - began)
    return out[1:]


def _open_connections(server) -> list:
    """The connections a `BackgroundServer` holds open, read safely from another thread."""
    for _ in range(3):  # the server's thread may change the set while we look
        try:
            return list(server.server.server_state.connections)
        except RuntimeError:
            continue
    return []


def accepted_socket(server, client_port: int) -> int | None:
    """The file descriptor of the connection a `BackgroundServer` accepted from the client
    socket at `client_port` (None while there is none). Safe to call from another thread."""
    for c in _open_connections(server):
        peer = c.transport.get_extra_info("peername")
        if peer and peer[1] == client_port:
            return c.transport.get_extra_info("socket").fileno()
    return None


def limit_transport(server, client_port: int, low: int, high: int, timeout_s: float = 10.0) -> bool:
    """Give the connection a `BackgroundServer` accepted from the client socket at
    `client_port` the write-buffer marks (low, high) instead of asyncio's defaults, so that
    uvicorn pauses that response once `high` bytes wait in its transport. The call runs on
    the server's event loop. False if no such connection appeared within `timeout_s`."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        for c in _open_connections(server):
            peer = c.transport.get_extra_info("peername")
            if peer and peer[1] == client_port:
                loop = server.server.servers[0].get_loop()
                loop.call_soon_threadsafe(c.transport.set_write_buffer_limits, high, low)
                return True
        time.sleep(0.002)
    return False


def accepted_socket_nodelay(server) -> list[int]:
    """TCP_NODELAY of each connection a `BackgroundServer` holds open (0: Nagle on)."""
    return [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            for c in _open_connections(server)]


@dataclass
class DisconnectTrial:
    chunks_read: int                # text chunks the client had when it closed its socket
    max_tokens: int
    freed_s: float | None           # disconnect -> a poll saw no running sequence, no KV block used
    freed_after_s: float | None     # ... and the poll before it, sent at this time, did not:
                                    # the blocks were freed between the two
    steps_after: int | None         # engine steps counted from just before the disconnect
    polls: int
    next_wait_s: float              # a short request sent right at the disconnect: its latency


def _leave_after(url: str, body: dict, chunks: int) -> SocketStream:
    stream = SocketStream(url, body, SocketOptions(None, None)).open()
    while stream.text_chunks() < chunks:
        if stream.read(1 << 16) == 0:
            break
    return stream


def whole_request(url: str, prompt, max_tokens: int, *, temperature: float = 0.0,
                  model: str = MODEL) -> tuple[float, int]:
    """(seconds, completion tokens) of one whole (not streamed) completion."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": temperature}
    began = time.perf_counter()
    answer = httpx.post(url + "/v1/completions", json=body, timeout=600)
    answer.raise_for_status()
    return time.perf_counter() - began, answer.json()["usage"]["completion_tokens"]


def idle_wait(url: str, prompt, *, max_tokens: int = NEXT_TOKENS, temperature: float = 0.0, repeats: int = 3,
              model: str = MODEL) -> list[float]:
    """Latencies of the short request on an idle server (the next request's baseline)."""
    return [whole_request(url, prompt, max_tokens, temperature=temperature, model=model)[0]
            for _ in range(repeats)]


def disconnect_trials(url: str, prompt, next_prompt, *, max_tokens: int, after_chunks: int, trials: int,
                      next_tokens: int = NEXT_TOKENS, temperature: float = 0.0, watch_metrics: bool = True,
                      poll_s: float = 0.005, model: str = MODEL, timeout_s: float = 120.0) -> list[DisconnectTrial]:
    """Clients that stream `prompt` (asking for `max_tokens`) and close their socket after
    `after_chunks` text chunks. With `watch_metrics`, a first client's departure is followed
    by polling `/metrics` every `poll_s` seconds until the engine runs no sequence and uses no
    KV block (and the steps it ran meanwhile are counted); then a second client leaves the
    same way and a short request (`next_prompt`, `next_tokens` tokens) is sent at that
    instant: its latency shows how long the server stayed busy with a client that had gone."""
    body = completion_body(prompt, max_tokens, model, temperature=temperature)
    out = []
    with poll_client() as metrics:
        for _ in range(trials):
            freed = freed_after = steps = None
            polls = 0
            chunks = None
            if watch_metrics:
                stream = _leave_after(url, body, after_chunks)
                before = read_metrics(metrics, url)
                stream.close()
                chunks = stream.text_chunks()
                left = time.perf_counter()
                sent = left
                while time.perf_counter() - left < timeout_s:
                    previous, sent = sent, time.perf_counter()
                    now = read_metrics(metrics, url)
                    polls += 1
                    if now["labkit:num_requests_running"] == 0 and now["labkit:kv_blocks_used"] == 0:
                        freed, freed_after = time.perf_counter() - left, previous - left
                        steps = int(now["labkit:engine_steps_total"] - before["labkit:engine_steps_total"])
                        break
                    time.sleep(poll_s)
            stream = _leave_after(url, body, after_chunks)
            stream.close()
            wait, _ = whole_request(url, next_prompt, next_tokens, temperature=temperature, model=model)
            chunks = stream.text_chunks() if chunks is None else chunks
            out.append(DisconnectTrial(chunks, max_tokens, freed, freed_after, steps, polls, wait))
    return out


class StreamerTokenizer:
    """labkit's tokenizer as `transformers`' `TextIteratorStreamer` calls it: in transformers
    5.x the streamer decodes a single id (an int) after a newline, which labkit's `decode`
    refuses, so the naive foil's stream would die at its first newline."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def naive_app(reference, tokenizer, model: str = MODEL):
    """The naive foil (`labkit.serve.naive.build_naive_app`: transformers `generate`, one
    request at a time) with a tokenizer its streamer can use."""
    from labkit.serve.naive import build_naive_app

    return build_naive_app(model, reference, StreamerTokenizer(tokenizer))
