"""Chapter 13's study of block-wise attention: peak memory (exact, from the profiler's
allocation events) and time of each attention method on causal prefills of growing
length, the time ratios between methods, and the chapter's figures. The algorithm itself
is in :mod:`labkit.kernels.blockwise`."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch

from labkit.util.figures import plain_log_ticks, plain_ticks, ticks_at

MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc's largest heap block on 64-bit Linux (DEFAULT_MMAP_THRESHOLD_MAX): an allocation
of this size or more is always mapped from the kernel and unmapped when freed, so every
call that makes one takes fresh pages, which the kernel zeroes on their first touch."""


@dataclass
class AllocationPeak:
    """What the CPU allocator handed out during one call, from torch's profiler.

    ``peak_bytes``: the highest total of live allocations made during the call (above what
    was live before it; the inputs are not counted, the returned tensor is, until it is
    dropped); ``allocated_bytes``: the sum of all allocations; ``allocations``: how many;
    ``result_bytes``: bytes of the returned tensor; ``fresh_sizes``: the allocations of
    :data:`MMAP_THRESHOLD_MAX` or more, in order (fresh pages on every call)."""

    peak_bytes: int
    allocated_bytes: int
    allocations: int
    result_bytes: int
    fresh_sizes: tuple[int, ...] = ()

    @property
    def fresh_bytes(self) -> int:
        """Bytes the call takes as fresh pages from the kernel (see ``fresh_sizes``)."""
        return sum(self.fresh_sizes)

    @property
    def extra_bytes(self) -> int:
        """Peak minus the result itself: the memory the method needs beyond its output."""
        return self.peak_bytes - self.result_bytes


@contextmanager
def _quiet_native_stderr():
    """Send what native code writes to file descriptor 2 to /dev/null for a moment (Python's
    own ``sys.stderr`` is flushed first and is otherwise untouched)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def allocation_peak(fn: Callable[[], Any]) -> AllocationPeak:
    """Run ``fn()`` once under ``torch.profiler`` with ``profile_memory=True`` and return the
    peak of its live allocations, exact to the byte (every allocation and free the CPU
    allocator reports, summed in time order), unlike sampling the resident set size, which
    misses small and short-lived tensors. The result of ``fn`` is dropped inside the
    profiled region. The profiler slows the call down: use it for memory, never for time.
    """
    from torch.profiler import ProfilerActivity, profile

    result_bytes = 0
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():  # the profiler logs its start and stop to file descriptor 2
        prof.__enter__()
    try:
        result = fn()
        if isinstance(result, torch.Tensor):
            result_bytes = result.untyped_storage().nbytes()
        del result
    finally:
        with _quiet_native_stderr():
            prof.__exit__(None, None, None)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = allocated = count = 0
    fresh = []
    for e in events:
        size = e.nbytes()
        live += size
        peak = max(peak, live)
        if size > 0:
            allocated += size
            count += 1
            if size >= MMAP_THRESHOLD_MAX:
                fresh.append(size)
    return AllocationPeak(peak_bytes=peak, allocated_bytes=allocated, allocations=count,
                          result_bytes=result_bytes, fresh_sizes=tuple(fresh))


def first_touch(sizes, *, repeats: int = 3, warmup: int = 1, threads: int | None = None):
    """Time what fresh pages cost, apart from any arithmetic: one call allocates each of
    ``sizes`` (bytes) in turn, writes one byte in every 4 KiB page (the kernel maps and
    zeroes each page on that first write) and frees it before the next, as a call of
    naive attention takes and returns its large tensors. Returns the
    :class:`labkit.util.timing.Timing` of ``repeats`` such calls. With sizes of at least
    :data:`MMAP_THRESHOLD_MAX` every call pays the whole cost again."""
    from labkit.util.timing import measure

    sizes = [int(n) for n in sizes]

    def call() -> None:
        for size in sizes:
            block = torch.empty(size, dtype=torch.uint8)
            block[::4096].fill_(1)
            del block

    return measure(call, name=f"first touch of {sum(sizes) / 2**30:.2f} GiB", repeats=repeats,
                   warmup=warmup, threads=threads)


def compare_less_touch(a, b, touch, *, name_a: str = "a", name_b: str = "b",
                       confidence: float = 0.95, resamples: int = 2000, seed: int = 0):
    """:func:`labkit.util.compare.compare` of ``a`` against ``b`` with a cost measured apart
    taken out of ``b``: ``touch`` holds the timed calls of that cost alone (the
    :func:`first_touch` of ``b``'s fresh allocations). The ratio is
    (median(b) - median(touch)) / median(a), and its interval resamples all three sets of
    calls, so the uncertainty of what is subtracted is in it, not only that of ``b``.
    ValueError with fewer than three calls in any set, or when the cost is not less than
    every call of ``b`` (then the two measurements do not add up)."""
    from labkit.util.compare import MIN_SAMPLES, Comparison

    sets = [torch.tensor([float(x) for x in s], dtype=torch.float64) for s in (a, b, touch)]
    if min(len(s) for s in sets) < MIN_SAMPLES:
        raise ValueError(f"compare_less_touch needs at least {MIN_SAMPLES} calls in each set")
    if not float(sets[2].median()) < float(sets[1].min()):
        raise ValueError("the cost measured apart is not less than every call it is taken from")
    generator = torch.Generator().manual_seed(seed)

    def medians(values):
        picks = torch.randint(0, len(values), (resamples, len(values)), generator=generator)
        ordered = values[picks].sort(dim=1).values
        n = len(values)
        return (ordered[:, (n - 1) // 2] + ordered[:, n // 2]) / 2

    def median(values):
        ordered, n = values.sort().values, len(values)
        return float((ordered[(n - 1) // 2] + ordered[n // 2]) / 2)

    ratios = (medians(sets[1]) - medians(sets[2])) / medians(sets[0])
    tail = (1.0 - confidence) / 2
    low, high = torch.quantile(ratios, torch.tensor([tail, 1.0 - tail], dtype=torch.float64))
    ratio = (median(sets[1]) - median(sets[2])) / median(sets[0])
    return Comparison(name_a, name_b, ratio, float(low), float(high), confidence,
                      len(sets[0]), len(sets[1]))


def interval_words(comparison) -> str:
    """:meth:`labkit.util.compare.Comparison.phrase` (its verdict words unchanged) with the
    interval named for what it is with few calls: "6.10 times faster (bootstrap range
    6.01-6.17 over 7 calls each)". A percentile bootstrap of a handful of calls cannot
    reach beyond the ratios of the extreme calls, so its nominal 95% is not a coverage."""
    label = f"{comparison.confidence:.0%} interval "
    phrase = comparison.phrase()
    if label not in phrase or not phrase.endswith(")"):
        raise ValueError(f"no {label!r} in {phrase!r}")
    calls = (f"{comparison.samples_a} calls each" if comparison.samples_a == comparison.samples_b
             else f"{comparison.samples_a} and {comparison.samples_b} calls")
    return phrase.replace(label, "bootstrap range ")[:-1] + f" over {calls})"


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def compare_methods(methods: dict[str, Callable[..., torch.Tensor]], lengths, *, batch: int = 1,
                    heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    repeats: int = 3, warmup: int = 1, threads: int | None = None,
                    seed: int = 0, memory_fraction: float = 0.7) -> list[dict]:
    """Peak memory, then time, of each attention method on a causal prefill of each length.

    For every length, seeded inputs are built once (``attention_inputs`` of
    :mod:`labkit.experiments.attention_cost`; not counted). Each method is called once for memory
    (CPU: :func:`allocation_peak`, exact allocator bytes; CUDA: the allocator's peak above
    what was allocated before), which is also the first warm-up call; then ``warmup - 1``
    more untimed and ``repeats`` timed calls through :func:`labkit.util.timing.measure`.
    A method named ``"naive"`` is skipped (``skipped`` says why) when its predicted peak
    (``naive_peak_model``) exceeds ``memory_fraction`` of the free memory. Returns one flat
    record per (length, method): method, length, dtype, device, median_s, p25_s, p75_s,
    repeats, threads, samples_s (every timed call, seconds, for
    :func:`labkit.util.compare.compare`), peak_bytes, result_bytes, extra_bytes (peak minus
    the output), fresh_sizes and fresh_bytes (CPU: allocations mapped fresh on every call,
    see :class:`AllocationPeak`; None on CUDA), score_bytes (one score tensor, the
    formula), naive_model_bytes, skipped."""
    from labkit.experiments.attention_cost import AttentionShape, attention_inputs, naive_peak_model
    from labkit.util.timing import measure, num_threads, synchronize
    from labkit.kernels.attention import score_tensor_bytes

    device = torch.device(device)
    on_cuda = device.type == "cuda"
    shape = AttentionShape("compare", batch=batch, heads=heads, kv_heads=kv_heads,
                           head_dim=head_dim)
    records = []
    for length in lengths:
        q, k, v = attention_inputs(batch, heads, kv_heads, length, length, head_dim, dtype,
                                   seed, device)
        naive_model = naive_peak_model(shape, length, length, dtype)
        for name, fn in methods.items():
            record = {"method": name, "length": length, "dtype": str(dtype).replace("torch.", ""),
                      "device": str(device), "median_s": None, "p25_s": None, "p75_s": None,
                      "repeats": 0, "threads": None, "samples_s": [], "peak_bytes": None,
                      "result_bytes": None, "fresh_sizes": [], "fresh_bytes": None,
                      "extra_bytes": None,
                      "score_bytes": score_tensor_bytes(batch, heads, length, length, dtype),
                      "naive_model_bytes": naive_model, "skipped": None}
            records.append(record)
            if name == "naive" and naive_model > memory_fraction * _free_bytes(device):
                record["skipped"] = (f"needs about {naive_model / 2**30:.1f} GiB; "
                                     f"{_free_bytes(device) / 2**30:.1f} GiB free")
                continue

            def call(fn=fn):
                return fn(q, k, v)

            with num_threads(threads):
                if on_cuda:
                    synchronize(device)
                    start = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    out = call()
                    synchronize(device)
                    peak = torch.cuda.max_memory_allocated(device) - start
                    result = out.untyped_storage().nbytes()
                    del out
                    fresh = []
                else:
                    alloc = allocation_peak(call)
                    peak, result = alloc.peak_bytes, alloc.result_bytes
                    fresh = list(alloc.fresh_sizes)
            timing = measure(call, name=f"{name} {length}", repeats=repeats,
                             warmup=max(warmup - 1, 0), threads=threads,
                             device=device if on_cuda else None)
            record.update(median_s=timing.median, p25_s=timing.quantile(0.25),
                          p75_s=timing.quantile(0.75), repeats=len(timing.samples),
                          samples_s=list(timing.samples),
                          threads=timing.threads, peak_bytes=peak, result_bytes=result,
                          extra_bytes=peak - result, fresh_sizes=fresh,
                          fresh_bytes=sum(fresh) if not on_cuda else None)
        del q, k, v
        if on_cuda:
            torch.cuda.empty_cache()
    return records


def records_frame(records):
    """A DataFrame of :func:`compare_methods` records with ``median_ms``, ``peak_mib``,
    ``extra_mib``, ``result_mib`` and ``score_mib`` added."""
    import pandas as pd

    df = pd.DataFrame(list(records))
    df["median_ms"] = df["median_s"].astype(float) * 1e3
    for col in ("peak", "extra", "result", "score"):
        df[f"{col}_mib"] = df[f"{col}_bytes"].astype(float) / 2**20
    return df


def compare_at(df, a: str, b: str, length: int):
    """:func:`labkit.util.compare.compare` of method ``a`` against method ``b`` at one
    ``length``, from the ``samples_s`` of :func:`compare_methods` records in ``df``: the
    ratio is median(b) / median(a), so above 1 means ``a`` took less time."""
    from labkit.util.compare import compare

    def samples(method):
        row = df[(df["method"] == method) & (df["length"] == length)]
        return list(row["samples_s"].iloc[0])

    return compare(samples(a), samples(b), name_a=a, name_b=b)


def speed_owner(loop_vs_naive, fused_vs_loop, baseline: str = "naive attention") -> str:
    """One sentence saying who owns the fused kernel's speed over naive attention, read
    from two :class:`labkit.util.compare.Comparison` results (ratio = median(b) / median(a)):
    ``loop_vs_naive``, the block-wise loop (``a``) against naive attention (``b``), is what
    the algorithm alone buys; ``fused_vs_loop``, the fused kernel against the loop, is what
    compiling it into one kernel adds on top. The two multiply to the fused kernel's lead
    over naive attention, so both are needed: judging from the second alone credits the
    kernel with a speed-up the algorithm made. A step is credited only when its verdict is
    "faster"; one share is called the larger only when the two intervals do not overlap.
    ``baseline`` names what the loop was measured against (naive attention by default).
    Every branch reads true for its outcome."""
    algo, kernel = loop_vs_naive, fused_vs_loop
    head = "The memory saving belongs to the algorithm"

    def step(c, who, against):
        if c.verdict == "faster":
            return f"{who} was {c.ratio:.2f} times as fast as {against}"
        if c.verdict == "slower":
            return f"{who} was slower than {against} ({c.ratio:.2f} times its speed)"
        return f"{who} was not faster than {against} beyond the noise (ratio {c.ratio:.2f})"

    loop = step(algo, "the loop alone", baseline)
    fused = step(kernel, "the fused kernel", "the loop")
    if algo.verdict == "faster" and kernel.verdict == "faster":
        if algo.low > kernel.high:
            share = "more of the fused kernel's lead came with the algorithm than with the kernel"
        elif kernel.low > algo.high:
            share = "more of the fused kernel's lead came with the kernel than with the algorithm"
        else:
            share = "neither share is clearly the larger"
        return (f"{head}, and here both own part of the speed: {loop}, and the fused kernel "
                f"{kernel.ratio:.2f} times as fast again as the loop, so {share}.")
    if algo.verdict == "faster":
        return f"{head}, and here so does the speed: {loop}, and {fused}."
    if kernel.verdict == "faster":
        return f"{head}; the speed belongs to the kernel: {loop}, while {fused}."
    return f"{head}; here neither owns a speed-up beyond the noise: {loop}, and {fused}."


def time_ratios(df, pairs):
    """For each length, ``median_s`` of one method divided by another's (both from the same
    run): ``pairs`` is a list of ``(numerator, denominator)`` method names. Columns: length,
    pair (``"a / b"``), ratio."""
    import pandas as pd

    times = df.pivot_table(index="length", columns="method", values="median_s")
    rows = [{"length": int(n), "pair": f"{a} / {b}", "ratio": times.loc[n, a] / times.loc[n, b]}
            for a, b in pairs for n in times.index
            if a in times and b in times and times.loc[n, a] == times.loc[n, a]
            and times.loc[n, b] == times.loc[n, b]]
    return pd.DataFrame(rows, columns=["length", "pair", "ratio"])


def plot_block_sizes(ax_time, ax_memory, df) -> None:
    """Block-size sweep (``df`` from :func:`records_frame` with a ``block`` column): median
    time (ms, with the interquartile range of the timed calls) and extra allocation (MiB)
    against the block size, log-log, plain tick labels."""
    df = df.sort_values("block")
    if {"p25_s", "p75_s"} <= set(df):  # the interquartile range of the timed calls
        mid = df["median_ms"].to_numpy(float)
        ax_time.errorbar(df["block"], mid, yerr=[mid - 1e3 * df["p25_s"].to_numpy(float),
                                                 1e3 * df["p75_s"].to_numpy(float) - mid],
                         fmt="none", ecolor="black", lw=1, capsize=3)
    for ax, col, label in ((ax_time, "median_ms", "time per call (ms)"),
                           (ax_memory, "extra_mib", "extra allocated (MiB)")):
        ax.plot(df["block"], df[col], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks_at(ax.xaxis, df["block"], "{:g}")
        plain_log_ticks(ax.yaxis)
        ax.set_xlabel("block size Br = Bc (tokens)")
        ax.set_ylabel(label)


def plot_peaks(ax, df, formulas=None) -> None:
    """Measured peak allocation (MiB) against length, one series per method (log-log);
    ``formulas``: optional ``{label: (lengths, mib)}`` drawn as grey dashed/dotted lines."""
    from labkit.util.palette import LINESTYLES, MARKERS

    for i, (label, (xs, ys)) in enumerate((formulas or {}).items()):
        ax.plot(xs, ys, color="0.55", linewidth=1, linestyle=LINESTYLES[(i + 1) % len(LINESTYLES)],
                label=label)
    for i, (method, group) in enumerate(df.groupby("method", sort=False)):
        group = group.sort_values("length")
        ax.plot(group["length"], group["peak_mib"], marker=MARKERS[i % len(MARKERS)],
                label=f"{method} (measured)")
    _length_axis(ax)
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.set_ylabel("peak allocated (MiB)")


def _length_axis(ax) -> None:
    """A log-2 x axis of sequence lengths, labelled with the lengths themselves."""
    from matplotlib.ticker import LogLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=2))
    ax.xaxis.set_minor_locator(NullLocator())
    plain_ticks(ax.xaxis, "{:,.0f}")
    ax.set_xlabel("sequence length (tokens)")


def _plot_series(ax, df, by: str, y: str, ylabel: str) -> None:
    """One line per group of `by`, `y` against length, log-log."""
    from labkit.util.palette import MARKERS

    for i, (name, group) in enumerate(df.groupby(by, sort=False)):
        group = group.sort_values("length")
        ax.plot(group["length"], group[y], marker=MARKERS[i % len(MARKERS)], label=name)
    _length_axis(ax)
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.set_ylabel(ylabel)


def plot_times(ax, df) -> None:
    """Median time per call (ms) against length, one series per method (log-log), with
    the interquartile range of the timed calls as error bars where there is one."""
    _plot_series(ax, df, "method", "median_ms", "time per call (ms)")
    colours = [line.get_color() for line in ax.get_lines()]
    for colour, (_, group) in zip(colours, df.groupby("method", sort=False)):
        group = group.sort_values("length")
        if {"p25_s", "p75_s"} <= set(group):
            mid = group["median_ms"].to_numpy(float)
            err = [mid - 1e3 * group["p25_s"].to_numpy(float),
                   1e3 * group["p75_s"].to_numpy(float) - mid]
            ax.errorbar(group["length"], mid, yerr=err, fmt="none", ecolor=colour, lw=1,
                        capsize=2)


def plot_ratios(ax, ratios) -> None:
    """Time ratios against length, one series per pair, with a line at 1 (log y)."""
    _plot_series(ax, ratios, "pair", "ratio", "time ratio")
    ax.axhline(1.0, color="0.5", linewidth=1, linestyle=":")
    plain_log_ticks(ax.yaxis)


__all__ = ["MMAP_THRESHOLD_MAX", "AllocationPeak", "allocation_peak", "first_touch",
           "compare_less_touch", "interval_words", "compare_methods", "compare_at",
           "records_frame", "speed_owner", "time_ratios",
           "plot_peaks", "plot_times", "plot_ratios", "plot_block_sizes"]
