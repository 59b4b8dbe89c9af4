"""What a MoE layer's time is made of past one token (chapter 19).

At one token a MoE layer reads its ``k`` experts, and its time is the time of reading
them. Past one token two things change at once: the batch's union of experts grows (more
weight bytes to read), and each expert multiplies a few rows instead of one, which a CPU's
matrix products do less efficiently per byte than one row or many (a dense layer whose
bytes never change still takes longer with more rows). The layer's time ratio from 1 to
T tokens mixes the two, so it cannot say by itself that a batch "pays for its union".

:func:`expert_row_times` measures the second thing alone: the time of one expert on
``n`` rows, for several ``n``, each timed as a call that runs every expert of the layer
on its own ``n`` rows (so the weights stream from memory as they do in the layer, not
from a cache that one expert called again would fill) and divided by ``E``.
:func:`predicted_layer_ms` then prices a batch from its routing alone: the sum, over the
experts its tokens chose, of one expert's time at the rows it got. Where that prediction
meets the measured layer (:func:`explains`), the layer's time is its union priced at the
small-product rate; where it does not, something else (routing, gather and scatter, a
cache) matters.

:func:`cpu_used_elsewhere` measures how busy the rest of the machine was while a sweep
ran: CPU seconds of every other process (``/proc/stat``'s busy ticks less this process's
own), as a share of the cores' time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from labkit.experiments.moe_layer import MoEWeights, swiglu
from labkit.util.timing import measure_interleaved


def expert_row_times(weights: MoEWeights, rows: list[int], rounds: int, *, warmup: int = 1,
                     seed: int = 0, threads: int | None = None) -> dict[int, list[float]]:
    """Milliseconds per expert at each row count: every sample is one call that runs all
    ``E`` experts, each on its own ``n`` random rows, divided by ``E``; the row counts are
    timed in turns (:func:`labkit.util.timing.measure_interleaved`)."""
    g = torch.Generator().manual_seed(seed)
    experts = weights.experts
    xs = {n: torch.randn(experts, n, weights.hidden, generator=g) for n in rows}

    def every_expert(x: torch.Tensor) -> None:
        for e in range(experts):
            swiglu(x[e], weights.w1[e], weights.w3[e], weights.w2[e])

    runners = {n: (lambda n=n: every_expert(xs[n])) for n in rows}
    with torch.no_grad():
        timings = measure_interleaved(runners, rounds=rounds, warmup=warmup, threads=threads)
    return {n: [1e3 * s / experts for s in t.samples] for n, t in timings.items()}


def per_expert_ms(row_times: dict[int, float], n: int) -> float:
    """One expert's time on ``n`` rows, linear between the measured row counts (and along
    the last two beyond them)."""
    known = sorted(row_times)
    if n in row_times:
        return row_times[n]
    low = max([r for r in known if r < n], default=known[0])
    high = min([r for r in known if r > n], default=known[-1])
    if low == high:  # outside the measured range: extend the nearest segment
        low, high = (known[0], known[1]) if n < known[0] else (known[-2], known[-1])
    slope = (row_times[high] - row_times[low]) / (high - low)
    return row_times[low] + slope * (n - low)


def predicted_layer_ms(load: torch.Tensor, row_times: dict[int, float]) -> float:
    """The experts' part of one layer call: for each expert some token chose (``load[e]``
    rows), one expert's time on that many rows, summed. Unchosen experts cost nothing."""
    return sum(per_expert_ms(row_times, int(n)) for n in load.tolist() if n > 0)


def explains(measured_ms: float, predicted_ms: float, factor: float = 1.25) -> bool:
    """True where the prediction is within ``factor`` of the measured time, either way."""
    if measured_ms <= 0 or predicted_ms <= 0:
        raise ValueError("times must be positive")
    return 1 / factor <= measured_ms / predicted_ms <= factor


def busy_ticks(proc_stat: str) -> int:
    """Clock ticks the CPUs spent working, from the ``cpu`` line of ``/proc/stat``: user,
    nice, system, irq, softirq and steal (not idle, not iowait; guest time is already in
    user)."""
    fields = proc_stat.splitlines()[0].split()
    if fields[0] != "cpu":
        raise ValueError("expected /proc/stat's aggregate 'cpu' line first")
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return user + nice + system + irq + softirq + steal


@dataclass
class CpuElsewhere:
    """CPU time the rest of the machine used during a block: ``others_cpu_s`` over
    ``wall_s`` on ``cores`` (None where ``/proc/stat`` cannot be read)."""

    wall_s: float = 0.0
    others_cpu_s: float | None = None
    cores: int = 1

    @property
    def share(self) -> float | None:
        """Other processes' CPU time as a share of all the cores' time (0: idle)."""
        if self.others_cpu_s is None or self.wall_s <= 0:
            return None
        return max(0.0, self.others_cpu_s) / (self.wall_s * self.cores)


def others_cpu_seconds(busy_before: int, busy_after: int, ticks_per_s: float,
                       own_before: float, own_after: float) -> float:
    """The machine's busy CPU seconds between two readings, less this process's own."""
    return (busy_after - busy_before) / ticks_per_s - (own_after - own_before)


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@contextmanager
def cpu_used_elsewhere() -> Iterator[CpuElsewhere]:
    """Measure, around a block, how much CPU time every other process took."""
    result = CpuElsewhere(cores=os.cpu_count() or 1)
    try:
        with open("/proc/stat") as f:
            before = busy_ticks(f.read())
    except (OSError, ValueError):
        before = None
    own, start = _own_cpu_s(), time.perf_counter()
    try:
        yield result
    finally:
        result.wall_s = time.perf_counter() - start
        if before is not None:
            with open("/proc/stat") as f:
                after = busy_ticks(f.read())
            result.others_cpu_s = others_cpu_seconds(before, after, os.sysconf("SC_CLK_TCK"),
                                                     own, _own_cpu_s())
