"""Honest timing: warm up, repeat, report a distribution, control threads, watch memory.

Every timing in the book goes through `measure`. A single number from a single call is an
anecdote: the first call pays one-time costs, the machine does other work, and a GPU call
returns before the GPU has finished. So we warm up, synchronise, repeat, and keep every
sample; the median is the headline and the spread travels with it.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch


def quantile(values: Iterable[float], q: float) -> float:
    """Quantile q in [0, 1] of `values`, interpolating linearly between order statistics
    (numpy's default rule); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = q * (len(ordered) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class Timing:
    """Samples (seconds) of repeated calls, with the conditions they were taken under."""

    name: str
    samples: list[float]
    warmup: int
    threads: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def quantile(self, q: float) -> float:
        """Linear-interpolated quantile of the samples, q in [0, 1]."""
        return quantile(self.samples, q)

    @property
    def spread(self) -> float:
        """Interquartile range divided by the median: a unit-free measure of noise."""
        return (self.quantile(0.75) - self.quantile(0.25)) / self.median if self.median else 0.0

    def to_dict(self) -> dict:
        return {
            "name": self.name, "median_s": self.median, "min_s": self.min, "max_s": self.max,
            "p25_s": self.quantile(0.25), "p75_s": self.quantile(0.75), "spread": self.spread,
            "repeats": len(self.samples), "warmup": self.warmup, "threads": self.threads,
            "samples_s": list(self.samples), **self.meta,
        }

    def __str__(self) -> str:
        return (f"{self.name}: median {self.median * 1e3:.3f} ms "
                f"[p25 {self.quantile(0.25) * 1e3:.3f}, p75 {self.quantile(0.75) * 1e3:.3f}] "
                f"over {len(self.samples)} runs, {self.threads} thread(s)")


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait for queued GPU work; a no-op on the CPU (whose calls are synchronous)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def num_threads(n: int | None):
    """Run a block with `n` intra-op threads, then restore the previous setting."""
    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def measure(fn: Callable[[], Any], *, name: str = "call", repeats: int = 7, warmup: int = 2,
            min_seconds: float = 0.0, max_repeats: int = 1000, threads: int | None = None,
            device: str | torch.device | None = None, **meta: Any) -> Timing:
    """Time `fn()`: `warmup` untimed calls, then at least `repeats` timed calls (more while the
    total is under `min_seconds`, up to `max_repeats`). GPU work is synchronised around every
    timed call so that the time covers the work, not just its launch."""
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    with num_threads(threads):
        for _ in range(warmup):
            fn()
        synchronize(device)
        samples: list[float] = []
        started = time.perf_counter()
        while len(samples) < repeats or (time.perf_counter() - started < min_seconds
                                         and len(samples) < max_repeats):
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            samples.append(time.perf_counter() - t0)
        used = torch.get_num_threads()
    return Timing(name=name, samples=samples, warmup=warmup, threads=used, meta=dict(meta))


def measure_interleaved(runners: dict, rounds: int, warmup: int = 1, threads: int | None = None,
                        **meta) -> dict:
    """Time several systems in turns (A, B, C, A, B, C, ...) on `threads` threads, so that a
    slow spell of a shared machine falls on all of them alike. Every sample is one
    `measure` call; returns a `Timing` per system with all its samples."""
    with num_threads(threads):
        for fn in runners.values():
            for _ in range(warmup):
                fn()
        samples = {name: [] for name in runners}
        for _ in range(rounds):
            for name, fn in runners.items():
                samples[name] += measure(fn, name=name, repeats=1, warmup=0).samples
        used = torch.get_num_threads()
    return {name: Timing(name, s, warmup, used, dict(meta)) for name, s in samples.items()}


def rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    import psutil

    return psutil.Process().memory_info().rss


class PeakMemory:
    """Peak resident memory above the starting level while a block runs.

    A background thread samples the process RSS every `interval` seconds, so allocations that
    live shorter than that can be missed: good for large tensors (the subject here), not for
    counting bytes exactly. On CUDA the allocator's own peak is reported too.

        with PeakMemory() as peak:
            attention(q, k, v)
        peak.rss_delta_bytes
    """

    def __init__(self, interval: float = 0.001, device: str | torch.device | None = None):
        self.interval = interval
        self.device = device
        self.start_rss = self.peak_rss = 0
        self.cuda_peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        import gc

        gc.collect()
        self.start_rss = self.peak_rss = rss_bytes()
        if self.device is not None and torch.device(self.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.peak_rss = max(self.peak_rss, rss_bytes())
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.device is not None and torch.device(self.device).type == "cuda":
            synchronize(self.device)
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.device)

    @property
    def rss_delta_bytes(self) -> int:
        return self.peak_rss - self.start_rss
