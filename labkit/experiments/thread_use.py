"""Does a matrix product use the second thread? Chapters 6 and 7 ask it of each path a
token's matmuls can take.

A second core can only shorten a product whose library splits the work between threads.
Whether it does depends on the path (PyTorch hands `F.linear(x, W)` and `x @ W_t` to
different BLAS routines), on the number of rows (one token's row, or a prompt's many), and
on the library's own choices for the CPU it finds, so it is measured, never assumed. Two
measurements answer it, each independent of the other:

- **the time** on one and on two threads, interleaved in rounds
  (:func:`labkit.experiments.matmul_sweeps.compare_threads`), with the bootstrap interval of
  the ratio (:func:`labkit.util.compare.compare`);
- **the work the other threads did**: the CPU time of every thread of this process is read
  from the kernel (``/proc/self/task/<tid>/stat``) before and after a run of calls on two
  threads. A path that never splits its work leaves the second thread idle whatever the
  machine's load, which a timing on a shared machine cannot show on its own.

The second is a yes-or-no test for one operation repeated: an OpenMP worker that took part
in a parallel region keeps spinning for a while after it (so its CPU time says it was used,
not how much of the work it did), and a worker that was never handed work stays asleep.
Before each run the function sleeps long enough for a worker left spinning by earlier work
to go to sleep (`SETTLE_S`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from labkit.kernels import native
from labkit.kernels.packed import PackedLinear, available as can_pack
from labkit.util.compare import Comparison
from labkit.util.timing import num_threads

IDLE_SHARE = 0.1   # helper CPU time under this share of the busier thread's: it stayed idle
BUSY_SHARE = 0.5   # at or above it: the work was handed to the second thread
CONFIDENCE = 0.95  # compare_threads' intervals (labkit.util.compare's default)
SETTLE_S = 0.3     # longer than libgomp's spin (well under 1 ms) and Intel OpenMP's 200 ms


def thread_cpu_seconds() -> dict[int, float] | None:
    """CPU seconds (user + system) of every thread of this process, by thread id, from
    ``/proc/self/task``; None where the system has no such files (not Linux)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    seconds = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended between the listing and the read
            continue
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return seconds


@dataclass(frozen=True)
class ThreadUse:
    """CPU time of the calling thread and of the busiest other thread over `calls` calls
    that took `wall_s` seconds on `threads` threads."""

    name: str
    threads: int
    calls: int
    wall_s: float
    caller_cpu_s: float
    helper_cpu_s: float

    @property
    def helper_share(self) -> float:
        """The busiest other thread's CPU time over the larger of its own and the calling
        thread's: near 1 when the two worked (or spun) side by side, or the other did the
        work while the caller waited; near 0 when the caller worked alone. A ratio of CPU
        times, not of wall time, so that other processes taking turns on the cores lower
        both alike. NaN where neither used a measurable tick."""
        larger = max(self.caller_cpu_s, self.helper_cpu_s)
        return self.helper_cpu_s / larger if larger > 0 else float("nan")


def measure_thread_use(fn: Callable[[], Any], *, name: str = "call", threads: int = 2,
                       min_seconds: float = 0.5, warmup: int = 2,
                       settle_s: float = SETTLE_S) -> ThreadUse | None:
    """Run `fn` on `threads` threads (after `warmup` calls and `settle_s` of sleep) until
    `min_seconds` have passed, and read how much CPU time the caller and the other threads
    of the process used meanwhile. None where per-thread CPU times cannot be read. The
    kernel counts CPU time in ticks (10 ms on most systems), so `min_seconds` should be
    several tenths of a second."""
    if threads < 2:
        raise ValueError(f"a second thread needs threads >= 2, got {threads}")
    if thread_cpu_seconds() is None:
        return None
    caller = threading.get_native_id()
    with num_threads(threads):
        for _ in range(warmup):
            fn()
        time.sleep(settle_s)
        before, calls, started = thread_cpu_seconds(), 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - started < min_seconds:
            fn()
            calls += 1
        wall, after = time.perf_counter() - started, thread_cpu_seconds()
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    helpers = [cpu for tid, cpu in used.items() if tid != caller]
    return ThreadUse(name, threads, calls, wall, used.get(caller, 0.0), max(helpers, default=0.0))


def helper_words(share: float) -> str:
    """What the second thread did, in words, from :attr:`ThreadUse.helper_share`."""
    if share != share:  # NaN: neither thread's CPU time was measurable
        return "the threads' CPU time was too short to read"
    if share < 0:
        raise ValueError(f"a share of CPU time cannot be negative, got {share}")
    if share < IDLE_SHARE:
        return f"the second thread stayed idle (its CPU time {share:.0%} of the busier thread's)"
    if share >= BUSY_SHARE:
        return f"the second thread worked alongside (its CPU time {share:.0%} of the busier thread's)"
    return f"the second thread worked part of the time (its CPU time {share:.0%} of the busier thread's)"


def engine_kernel_name(rows: int) -> str:
    """Which kernel labkit's engine (`labkit.kernels.packed.PackedLinear`) uses for a
    float32 product of `rows` rows on this machine."""
    if rows <= native.gemv_max_rows() and native.load() is not None:
        return "labkit's C gemv"
    return "oneDNN with packed weights"


def product_paths(in_features: int, out_features: int, *, many_rows: int = 64,
                  copies: int = 1, seed: int = 0) -> dict[str, Callable[[], torch.Tensor]]:
    """One product of an [in, out] weight by each path a token's matmul can take, keyed by
    a name that says the path and its rows: `F.linear(x, W)` on one row (PyTorch's path,
    the model's layout), `x @ W_t` on one row (the transposed layout), `F.linear` on
    `many_rows` rows (a prompt's matmul), and labkit's engine kernel (`PackedLinear`) on one
    row and on `many_rows`. Each call takes the next of `copies` copies of the weight, so
    that with enough of them the weight comes from main memory, as in a decode step."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(out_features, in_features, generator=generator) for _ in range(copies)]
    transposed = [w.t().contiguous() for w in weights]
    one = torch.randn(1, in_features, generator=generator)
    many = torch.randn(many_rows, in_features, generator=generator)
    turn = [0]

    def cycling(product: Callable[[int], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            turn[0] = (turn[0] + 1) % copies
            return product(turn[0])
        return call

    paths = {
        "F.linear(x, W) on 1 row": cycling(lambda i: F.linear(one, weights[i])),
        "x @ W_t on 1 row": cycling(lambda i: one @ transposed[i]),
        f"F.linear(x, W) on {many_rows} rows": cycling(lambda i: F.linear(many, weights[i])),
    }
    if can_pack(weights[0]):
        packed = [PackedLinear(w) for w in weights]
        for rows, x in ((1, one), (many_rows, many)):
            label = f"{engine_kernel_name(rows)} on {rows} row{'s' * (rows > 1)}"
            paths[label] = cycling(lambda i, x=x: packed[i](x))
    return paths


def path_records(timings: Sequence[Mapping[str, Any]], uses: Mapping[str, ThreadUse | None],
                 bytes_read: int) -> list[dict[str, Any]]:
    """One row per path from :func:`~labkit.experiments.matmul_sweeps.compare_threads`
    records (one and two threads) and the paths' :func:`measure_thread_use` results: the two
    median times, the weight GB/s on each, the speedup with its interval, and the second
    thread's CPU time as a share of the busier thread's (NaN where it could not be read)."""
    by_path: dict[str, dict[int, Mapping[str, Any]]] = {}
    for record in timings:
        by_path.setdefault(record["name"], {})[record["threads"]] = record
    rows = []
    for name, pair in by_path.items():
        one, two = pair[min(pair)], pair[max(pair)]
        use = uses.get(name)
        gain = Comparison("two threads", "one thread", two["speedup"], two["speedup_low"],
                          two["speedup_high"], CONFIDENCE, two["repeats"], one["repeats"])
        rows.append({"path": name, "one_thread_ms": one["median_s"] * 1e3,
                     "two_threads_ms": two["median_s"] * 1e3,
                     "one_thread_gb_s": bytes_read / one["median_s"] / 1e9,
                     "two_threads_gb_s": bytes_read / two["median_s"] / 1e9,
                     "speedup": two["speedup"], "speedup_low": two["speedup_low"],
                     "speedup_high": two["speedup_high"],
                     "verdict": gain.verdict, "phrase": gain.phrase(),
                     "second_thread_cpu_share": float("nan") if use is None else use.helper_share})
    return rows


def split_words(records: Sequence[Mapping[str, Any]]) -> str:
    """Which paths of :func:`path_records` left the second thread idle and which handed it
    work, with each path's two-thread speedup, as a clause for a glued sentence."""
    def listed(group: list[Mapping[str, Any]]) -> str:
        items = [f"{r['path']} ({r['speedup']:.2f}x)" for r in group]
        return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]

    idle = [r for r in records if r["second_thread_cpu_share"] < IDLE_SHARE]
    working = [r for r in records if r["second_thread_cpu_share"] >= IDLE_SHARE]
    unread = [r for r in records if r["second_thread_cpu_share"] != r["second_thread_cpu_share"]]
    if unread:
        return ("the threads' CPU times could not be read here, so only the timings say "
                "which paths used the second thread")
    if not idle:
        return f"every path handed the second thread work: {listed(working)}"
    if not working:
        return f"no path handed the second thread any work: {listed(idle)}"
    return (f"{listed(idle)} left the second thread idle, so a second core could not shorten "
            f"them; {listed(working)} handed it work")


@dataclass(frozen=True)
class Shortfall:
    """How far a time on two threads missed half the time on one, split between the weight
    matmuls and the rest of the step (step minus matmuls), all in seconds (medians)."""

    total_s: float
    matmuls_s: float
    rest_s: float
    measurable: bool = True  # False where the step timed no longer than its matmuls alone

    @property
    def where(self) -> str:
        """Which part most of the shortfall lay in: a part holds "most" of it only with two
        thirds or more; otherwise it was shared."""
        if self.total_s <= 0:
            return "the step took no more than half its one-thread time"
        if self.rest_s >= 2 / 3 * self.total_s:
            return "most of it lay outside the weight matmuls"
        if self.matmuls_s >= 2 / 3 * self.total_s:
            return "most of it lay in the weight matmuls"
        return "it was shared between the weight matmuls and the rest of the step"


def shortfall(step_s: Mapping[int, float], matmuls_s: Mapping[int, float]) -> Shortfall:
    """:class:`Shortfall` of a step timed on 1 and 2 threads (`step_s[1]`, `step_s[2]`) whose
    weight matmuls alone took `matmuls_s[1]` and `matmuls_s[2]`. A step that timed no longer
    than its own matmuls (a rest of zero or less: the two timings were disturbed) is not
    `measurable`, and its split must not be read."""
    rest = {t: step_s[t] - matmuls_s[t] for t in (1, 2)}
    return Shortfall(step_s[2] - step_s[1] / 2, matmuls_s[2] - matmuls_s[1] / 2,
                     rest[2] - rest[1] / 2, measurable=min(rest.values()) > 0)


def gain_order_words(one_row: Mapping[str, Any], many_rows: Mapping[str, Any]) -> str:
    """Whether the second thread sped up the one-row products less than the many-row ones,
    from two :func:`path_records` rows' speedup intervals (``speedup_low``,
    ``speedup_high``): a side is taken only when the intervals do not overlap."""
    if one_row["speedup_high"] < many_rows["speedup_low"]:
        return "the one-row products gained less from the second thread than the many-row ones"
    if one_row["speedup_low"] > many_rows["speedup_high"]:
        return "the one-row products gained more from the second thread than the many-row ones"
    return ("the intervals of the two gains overlap, so these runs do not tell the one-row and "
            "the many-row products apart")


__all__ = ["IDLE_SHARE", "BUSY_SHARE", "SETTLE_S", "thread_cpu_seconds", "ThreadUse",
           "measure_thread_use", "helper_words", "engine_kernel_name", "product_paths",
           "path_records", "split_words", "Shortfall", "shortfall", "gain_order_words"]
