"""The streaming experiments of chapter 27: the raw-socket client and its parsers, the kernel
and transport probes, the slow-reader accounting, the blocking foil and departing clients."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

import pytest

from labkit.bench.http_load import HttpRecord
from labkit.experiments import slow_readers as sr
from labkit.experiments import streaming as st

MODEL = "smollm2-135m"


def sse(payload) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def chunked(events: list[bytes]) -> tuple[bytes, list[int]]:
    """An HTTP/1.1 response carrying `events` as chunks, and the byte offset after each."""
    raw = bytearray(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n")
    ends = []
    for event in events:
        raw += f"{len(event):x}\r\n".encode() + event + b"\r\n"
        ends.append(len(raw))
    return bytes(raw + b"0\r\n\r\n"), ends


def text_event(text, reason=None):
    return sse({"choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]})


# -- parsing -------------------------------------------------------------------------------------

def test_dechunk_recovers_the_body_and_every_chunk_end():
    events = [text_event(" one"), text_event(" two"), text_event("", "length"),
              sse({"choices": [], "usage": {"completion_tokens": 2}}), sse("[DONE]")]
    raw, ends = chunked(events)
    status, header, body, got = st.dechunk(raw)
    assert status == 200 and body == b"".join(events) and got == ends
    assert header == raw.index(b"\r\n\r\n") + 4
    # a truncated stream: the last whole chunk is the last one kept
    status, _, body, got = st.dechunk(raw[:ends[1] + 3])
    assert body == b"".join(events[:2]) and got == ends[:2]


def test_sse_outcome_tells_completed_from_cut_off():
    done = [text_event(" one"), text_event(" two", "length"),
            sse({"choices": [], "usage": {"completion_tokens": 2}}), sse("[DONE]")]
    out = st.sse_outcome(200, b"".join(done))
    assert (out.text, out.chunks, out.completion_tokens, out.kind) == (" one two", 2, 2, "completed")
    cut = [text_event(" one"), sse({"error": {"code": "slow_reader", "message": "x"}}), sse("[DONE]")]
    out = st.sse_outcome(200, b"".join(cut))
    assert out.kind == "cut off (slow_reader)" and out.text == " one"
    assert st.sse_outcome(200, text_event(" one")).kind == "incomplete"


def test_text_chunks_counts_only_chunks_with_text():
    stream = st.SocketStream("http://127.0.0.1:1", {})
    stream.raw += chunked([text_event(" a \\\" b"), text_event(""), text_event("c", "length")])[0]
    assert stream.text_chunks() == 2
    stream.sock.close()


# -- the buffers below the front end -------------------------------------------------------------

def proc_net_tcp_queues(local_port: int, remote_port: int) -> tuple[int, int] | None:
    """The independent reference: (tx_queue, rx_queue) of a socket as /proc/net/tcp prints them."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.split(":")[1], 16) == local_port and int(remote.split(":")[1], 16) == remote_port:
            tx, rx = fields[4].split(":")
            return int(tx, 16), int(rx, 16)
    return None


def test_socket_queues_agree_with_proc_net_tcp_and_see_unread_bytes():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        peer.sendall(b"x" * 3000)
        time.sleep(0.1)
        port, peer_port = client.getsockname()[1], peer.getsockname()[1]
        assert st.socket_queues(client)[1] == 3000 == proc_net_tcp_queues(port, peer_port)[1]  # unread
        assert st.socket_queues(peer)[0] == 0 == proc_net_tcp_queues(peer_port, port)[0]  # acknowledged
        client.recv(1000)
        time.sleep(0.05)
        assert st.socket_queues(client.fileno())[1] == 2000 == proc_net_tcp_queues(port, peer_port)[1]
    finally:
        for s in (client, peer, server):
            s.close()


def test_kernel_absorption_adds_up_and_shrinks_with_a_small_socket():
    small = st.kernel_absorption(st.SocketOptions(1024, 536))
    default = st.kernel_absorption(st.SocketOptions(None, None))
    # bytes received but not yet acknowledged count in both queues: at most a segment or two
    assert 0 <= small.server_send_queue + small.client_receive_queue - small.written <= 2 * 536
    assert 0 <= default.server_send_queue + default.client_receive_queue - default.written <= 1 << 16
    assert 0 < small.written < default.written / 10


def test_transport_pauses_at_asyncios_documented_default():
    # asyncio's write-buffer limits: high 64 KiB, low a quarter of it
    assert st.transport_high_water() == (16 * 1024, 64 * 1024)


def test_stream_length_covers_absorption_buffer_and_margin():
    assert sr.stream_length_for(100 * 224, 224, 16, 0) == 128        # 100 + 16 -> 128
    assert sr.stream_length_for(100 * 224 + 1, 224, 16, 11) == 128   # 101 + 16 + 11 = 128
    assert sr.stream_length_for(100 * 224 + 1, 224, 16, 12) == 144


def test_framed_chunk_is_the_event_in_chunked_framing():
    event = ('data: {"id": "cmpl-' + "0" * 32 + '-0", "object": "text_completion", "created": '
             + str(int(time.time())) + ', "model": "smollm2-135m", "choices": [{"index": 0, '
             '"text": " the", "logprobs": null, "finish_reason": null}]}\n\n')
    assert sr.framed_chunk_bytes(" the", include_usage=False) == len(f"{len(event):x}\r\n") + len(event) + 2
    with_usage = event.replace("]}\n\n", '], "usage": null}\n\n')  # include_usage: usage null until the end
    assert sr.framed_chunk_bytes(" the") == len(f"{len(with_usage):x}\r\n") + len(with_usage) + 2


# -- accounting --------------------------------------------------------------------------------------

def run_of(records):
    return st.LoadRun(1, 0, 1.0, records)


def test_count_identical_pairs_each_stream_with_its_own_prompt():
    records = [HttpRecord(i, 3, 0.0, text=t) for i, t in enumerate(["a", "b", "c"])]
    assert st.count_identical([run_of(records)], ["a", "b", "c"]) == (3, 3)
    assert st.count_identical([run_of(records), run_of(records[::-1])], ["a", "b", "x"]) == (4, 6)


def test_onset_splits_the_bytes_between_reader_kernel_and_transport():
    ends = [100 + 200 * (i + 1) for i in range(50)]         # 100 header bytes, 200 per chunk
    samples = [sr.BufferSample(0.1, 0, 10, 0, 300, 500, 200),
               sr.BufferSample(0.2, 5, 45, 0, 700, 3000, 400)]
    run = sr.PolicyRun("abort", st.sse_outcome(200, b""), [], samples, ends, 100, 64, 16, 1.0, 0)
    onset = run.onset(threshold=4)
    assert onset["events_handed_on"] == 40 and onset["bytes_handed_on"] == 100 + 40 * 200
    assert onset["kernel_bytes"] == 3400
    assert onset["transport_bytes"] == 8100 - 700 - 3400
    assert onset["events_past_client"] == 40 - 3              # the client had 3 whole chunks
    assert run.onset(threshold=6) is None and run.peak_buffered == 5


def test_against_says_within_the_noise_only_when_it_is():
    base = [0.030 + 0.001 * (i % 7) for i in range(60)]
    assert sr.against(base, base[::-1]).startswith("within the noise of the control's")
    slower = sr.against(base, [2 * x for x in base])
    assert slower.startswith("2.00 times the control's, longer beyond the noise")
    assert "shorter" in sr.against(base, [x / 2 for x in base], "the idle server's")


class _Inner:
    limits, restarts, ready = "limits", 3, True

    def __init__(self):
        self.aborted = []

    def submit(self, request, *, max_buffered, policy):
        return type("S", (), {"request": request, "policy": policy, "max_buffered": max_buffered})()

    def abort(self, request_id):
        self.aborted.append(request_id)

    def stats(self):
        return "stats"

    def health(self):
        return {"engine": "fake"}


def test_recording_client_passes_everything_on_and_keeps_the_streams():
    from labkit.sampling import SamplingParams
    from labkit.serve.engine_client import EngineRequest

    inner = _Inner()
    client = sr.RecordingClient(inner)
    a = client.submit(EngineRequest("a", [1, 2], SamplingParams()), max_buffered=4, policy="coalesce")
    client.submit(EngineRequest("b", [3], SamplingParams()), max_buffered=4, policy="coalesce")
    client.abort("a")
    assert (client.limits, client.restarts, client.ready, client.stats()) == ("limits", 3, True, "stats")
    assert a.policy == "coalesce" and a.max_buffered == 4 and inner.aborted == ["a"]
    assert client.stream_of([1, 2]) is a and client.stream_of([9]) is None
    assert client.health() == {"engine": "fake"}


def test_a_blocking_sink_holds_its_caller_until_the_reader_takes_an_item():
    sink = sr.BlockingSink(1)
    sink.put("first")
    done = threading.Event()
    threading.Thread(target=lambda: (sink.put("second"), done.set()), daemon=True).start()
    assert not done.wait(0.2)                                 # full: the caller waits
    assert sink.items.get() == "first"
    assert done.wait(2) and sink.waited_s >= 0.2 and sink.peak == 1
    free = sr.BlockingSink(0)
    for i in range(100):
        free.put(i)
    assert free.peak == 100  # every put returned with no reader: an unbounded sink never waits


def test_streamer_tokenizer_survives_transformers_streamer_at_a_newline():
    from transformers import TextIteratorStreamer

    from labkit.models.loader import load_tokenizer

    import torch

    tok = load_tokenizer(MODEL)
    ids = tok.encode("one two\nthree four\n five")

    def stream_with(tokenizer) -> str:
        streamer = TextIteratorStreamer(tokenizer)
        for i in ids:
            streamer.put(torch.tensor([i]))
        streamer.end()
        return "".join(streamer)

    class Direct:  # what the naive foil hands the streamer: labkit's decode as it is
        def decode(self, ids, skip_special_tokens=False, **_):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    assert stream_with(st.StreamerTokenizer(tok)) == tok.decode(ids)
    with pytest.raises(TypeError):
        stream_with(Direct())


# -- against a live service (engine in process) ------------------------------------------------------

@pytest.fixture(scope="module")
def engine(model):
    from labkit.engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(model, EngineConfig(kv_cache_tokens=4096))


@pytest.fixture
def served(engine, model):
    from labkit.serve.app import ServeSettings, build_app
    from labkit.serve.engine_client import InProcessEngine
    from labkit.serve.server import BackgroundServer

    with BackgroundServer(build_app(InProcessEngine(engine), model.tokenizer, ServeSettings(MODEL))) as server:
        yield server


@pytest.mark.slow
def test_concurrent_streams_over_sockets_equal_the_simple_loop(served, model, engine):
    prompts = st.stream_prompts(model.tokenizer, 3, 8, 24)
    runs = st.load_runs(served.url, prompts, 8, concurrencies=(1, 3), repeats=1)
    assert [r.concurrency for r in runs] == [1, 3]
    assert all(r.summary["ok"] == 3 and r.summary["output_tokens"] == 24 for r in runs)
    assert st.count_identical(runs, st.solo_texts(model, prompts, 8)) == (6, 6)
    assert st.count_identical(runs, st.solo_texts(model, prompts, 7))[0] == 0
    assert engine.stats().blocks_used == 0


@pytest.mark.slow
def test_a_departed_client_is_let_go_within_a_few_steps(served, model, engine):
    prompt, other = st.stream_prompts(model.tokenizer, 2, 8, 24)
    trials = st.disconnect_trials(served.url, prompt, other, max_tokens=200, after_chunks=3, trials=2)
    for t in trials:
        # let go within a few engine steps (a count, not a time: how long they take is the machine's)
        assert t.chunks_read >= 3 and t.freed_s is not None and t.freed_after_s <= t.freed_s
        assert 0 <= t.steps_after <= 5 and t.next_wait_s > 0
    time.sleep(0.2)
    assert not engine.requests and engine.stats().blocks_used == 0
    engine.check_invariants()


@pytest.mark.slow
def test_abort_cuts_the_slow_stream_once_every_buffer_below_is_full(engine, model):
    prompts = st.stream_prompts(model.tokenizer, 2, 8, 24)
    low, high = 2048, 8192  # smaller marks than asyncio's 16 and 64 KiB: a shorter stream fills them
    chunk = sr.framed_chunk_bytes()
    absorbed = st.kernel_absorption(piece=chunk).written + high
    tokens = sr.stream_length_for(absorbed, chunk, 4, 48)
    after = high // chunk  # the others start before the policy acts, with the kernel's share to go
    run = sr.policy_run(engine, model.tokenizer, "abort", prompts[0], prompts[1:], tokens, max_buffered=4,
                        others_after=after, transport_limits=(low, high))
    assert run.slow.errors == ["slow_reader"] and run.slow.chunks < tokens
    # the others waited until the slow stream had been handed `after` tokens
    at_start = next(x for x in run.samples if x.t_s >= run.others_started_s)
    assert at_start.reached_front_end >= after and run.others_after == after
    onset = run.onset(threshold=2)
    # paused, the transport holds between its marks (it resumes the writer below the low one)
    assert low - 4 * chunk <= onset["transport_bytes"] <= high + 4 * chunk
    assert onset["kernel_bytes"] > 20_000
    sizes = [b - a for a, b in zip(run.chunk_ends, run.chunk_ends[1:-2])]
    assert abs(statistics.median(sizes) - chunk) <= 4
    assert all(r.ok and r.output_tokens == tokens - after for r in run.others)
    assert run.blocks_left == 0 and run.peak_buffered <= 5
    # the harness let the slow client read the rest only after the others had started
    assert run.others_started_s < run.drained_s <= run.wall_s


@pytest.mark.slow
def test_a_blocking_sink_sets_every_streams_pace(engine, model):
    prompts = st.stream_prompts(model.tokenizer, 2, 8, 24)
    # the engine's own step here: a reader that takes every event at once
    step = statistics.median(sr.blocking_foil(engine, prompts[0], prompts[1:], 12, queue_size=0,
                                              every_s=0.0).gaps_s)
    # the sink's pace is set well above this machine's step, so the reader, not the engine,
    # is the slower on any machine and under any load
    pace = max(0.15, 4 * step)
    free = sr.blocking_foil(engine, prompts[0], prompts[1:], 12, queue_size=0, every_s=pace)
    blocked = sr.blocking_foil(engine, prompts[0], prompts[1:], 12, queue_size=2, every_s=pace)
    # once its queue is full, the blocked run's gaps are at least the sink's pace (a lower
    # bound no load can break); the free run never waited on the sink and ran ahead of it
    # (a peak queue above the blocked one's bound)
    assert statistics.median(blocked.gaps_s) > 0.8 * pace
    assert blocked.waited_s > pace > free.waited_s
    assert blocked.slow_tokens == free.slow_tokens == 12 and blocked.peak_queued == 2
    assert free.peak_queued > 2 and not engine.requests


def test_policy_sentences_are_true_whether_or_not_the_reader_fell_behind():
    from types import SimpleNamespace

    def run(kind, chunks, peak, text="abc", errors=()):
        slow = SimpleNamespace(kind=kind, chunks=chunks, text=text, errors=list(errors))
        return SimpleNamespace(slow=slow, peak_buffered=peak)

    behind = {"none": run("completed", 288, 1),
              "abort": run("cut off (slow_reader)", 193, 17, text="ab", errors=["slow_reader"]),
              "coalesce": run("completed", 120, 17), "unbounded": run("completed", 288, 120)}
    got = sr.policy_sentences(behind, 16, 288)
    assert all(holds for holds, _, _ in got.values())
    assert "the 177 that had left the buffer" in got["abort"][1]
    assert "in 120 chunks instead of 288" in got["coalesce"][1]
    kept_up = {"none": run("completed", 288, 1), "abort": run("completed", 288, 9),
               "coalesce": run("completed", 288, 9), "unbounded": run("completed", 288, 9)}
    got = sr.policy_sentences(kept_up, 16, 288)
    assert not any(holds for holds, _, _ in got.values())
    assert "never acted" in got["abort"][2] and "none folded" in got["coalesce"][2]
    assert "within the 16" in got["unbounded"][2]


# -- the other streams' gaps, judged against the control's drift --------------------------------

def _gaps(scale: float = 1.0, tail: float = 1.0) -> list[float]:
    """1,000 gaps around 52 ms; the top 2% (what sets the p99) multiplied by `tail`."""
    base = sorted(0.050 + 0.0001 * (i % 50) for i in range(1000))
    return [scale * (x * tail if i >= 980 else x) for i, x in enumerate(base)]


def test_gap_verdicts_count_a_difference_only_beyond_the_control_runs_drift():
    control, again = _gaps(), _gaps(1.08)                  # two control runs, 8% apart
    runs = {"a": _gaps(1.06), "b": _gaps(0.8), "c": _gaps(tail=1.3)}
    got = sr.gap_verdicts(control, runs, again)
    assert sr.gap_drift(control, again) == pytest.approx((1.08, 1.08))
    # 6% longer, and a bootstrap of one run separates it, but two control runs drift 8%
    assert got["a"].median_word == "within the threshold" and got["a"].median_separated
    assert got["b"].median_word == "shorter" and got["b"].p99_word == "shorter"
    assert got["c"].median_word == "within the threshold" and got["c"].p99_word == "longer"
    assert got["c"].p99_ratio == pytest.approx(1.3, rel=0.02)
    assert "(longer beyond the threshold)" in got["c"].text()
    # no repeat of the control: the stated floor alone, which 6% passes
    alone = sr.gap_verdicts(control, runs)
    assert alone["a"].median_threshold == sr.GAP_FLOOR and alone["a"].median_word == "longer"


def test_gap_sentences_name_what_counted_for_each_outcome():
    control, again = _gaps(), _gaps(1.01)
    quiet = sr.gap_verdicts(control, {"abort": _gaps(0.99), "unbounded": _gaps(1.02)}, again)
    text = sr.drift_sentence(control, again, quiet)
    assert "1.01 times" in text and "no policy moved" in text
    assert "did not lengthen" in sr.lede_sentence(quiet)
    assert sr.gap_notes(quiet).startswith("No policy moved")
    mixed = sr.gap_verdicts(control, {"abort": _gaps(0.8), "coalesce": _gaps(1.01),
                                      "unbounded": _gaps(tail=1.3)}, again)
    assert "`abort` and `unbounded` moved" in sr.drift_sentence(control, again, mixed)
    assert "no other policy did" in sr.drift_sentence(control, again, mixed)
    assert "though under `unbounded`" in sr.lede_sentence(mixed)
    notes = sr.gap_notes(mixed)
    assert "A shorter gap" in notes and "A longer gap" in notes
    assert "`abort` median shorter" in sr.gap_summary(mixed, True)
    stretched = sr.gap_verdicts(control, {"abort": _gaps(2.0), "unbounded": control}, again)
    assert "stretched" in sr.lede_sentence(stretched) and "`abort`" in sr.lede_sentence(stretched)
    assert "every policy" not in sr.drift_sentence(control, again, stretched)
    once = sr.drift_sentence(control, None, sr.gap_verdicts(control, {"abort": _gaps(0.8)}))
    assert once.startswith("This profile runs the control once")
    assert "does not measure the drift" in sr.gap_summary(quiet, False)


def test_tcp_buffer_sysctls_reads_three_sizes_and_skips_the_rest(tmp_path):
    (tmp_path / "tcp_wmem").write_text("4096\t16384\t4194304\n")
    (tmp_path / "tcp_rmem").write_text("not numbers\n")
    assert st.tcp_buffer_sysctls(tmp_path) == {"tcp_wmem": (4096, 16384, 4194304)}
    assert st.tcp_buffer_sysctls(tmp_path / "absent") == {}


def test_buffer_limits_sentence_says_whether_the_queues_ended_at_the_limits():
    limits = {"tcp_wmem": (4096, 16384, 4194304), "tcp_rmem": (4096, 131072, 6291456)}
    at = st.KernelAbsorption(4146176 + 128384, 4146176, 128384)
    holds, if_true, _ = st.buffer_limits_sentence(at, limits)
    assert holds and "99% of the send buffer's maximum, 4,194,304 bytes" in if_true
    short = st.KernelAbsorption(1_000_000 + 128384, 1_000_000, 128384)
    holds, _, if_false = st.buffer_limits_sentence(short, limits)
    assert not holds and "24% of the send buffer's maximum" in if_false
    holds, _, if_false = st.buffer_limits_sentence(at, {})
    assert not holds and "does not report" in if_false


def test_socket_probes_run_only_on_linux():
    assert st.socket_probes_unsupported("linux") is None
    assert "this system is darwin" in st.socket_probes_unsupported("darwin")
