"""Exact block-wise attention with an online softmax: the algorithm inside FlashAttention,
written as plain PyTorch loops so that every step can be read.

Naive attention (:func:`labkit.kernels.attention.naive_attention`) builds the whole
``[q_len, kv_len]`` score matrix per head, takes its softmax row by row, and multiplies by
the values. Block-wise attention visits the keys and values ``block_k`` at a time (and the
queries ``block_q`` at a time) and never holds more than one ``block_q x block_k`` tile of
scores. What makes that exact is the *online softmax*: for each query row it keeps

- ``m``, the largest score seen so far (the running max),
- ``l``, the sum of ``exp(score - m)`` over the keys seen so far (the running sum),
- ``O``, the sum of ``exp(score - m) * value`` over the keys seen so far (the running
  output, not yet divided by ``l``),

and, for each new block of scores ``S`` (one row shown; ``V_j`` the block's values)::

    m_new = max(m, max_j S_j)
    alpha = exp(m - m_new)                 # rescales what was summed under the old max
    P_j   = exp(S_j - m_new)
    l     = alpha * l + sum_j P_j
    O     = alpha * O + sum_j P_j V_j
    m     = m_new

After the last block ``O / l`` equals ``softmax(S) V`` over all keys: every term in ``l``
and ``O`` carries the same factor ``exp(-m)``, and ``alpha`` moves the earlier terms to the
current ``m`` whenever the max grows. Subtracting the running max keeps every ``exp`` at
most 1, so nothing overflows. Without ``alpha`` (``rescale=False``, a deliberate bug for
the tests and the chapter) terms summed under different maxima are mixed, and the result
is wrong as soon as a later block raises the max.

Causal attention skips work: a key block that lies entirely after the last query of a
query block (above the diagonal) is never computed; only blocks that cross the diagonal
build a mask. Shapes and conventions follow :mod:`labkit.kernels.attention`: q ``[B, H, T,
D]``, k and v ``[B, KV, S, D]`` with ``H`` a multiple of ``KV`` (grouped-query attention:
the ``H // KV`` query heads of a group are stacked against their one KV head, no KV copy),
causal masks aligned to the end of the keys.

This is a teaching kernel. FlashAttention's speed comes from doing all of the above inside
one GPU kernel, with each tile in on-chip memory; a Python loop issues several separate
PyTorch operations per tile, each of which writes its result to memory, so it keeps the
memory saving and loses the speed.
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch

from labkit.kernels.attention import _group, _ungroup


def _tile_mask(q_start: int, q_stop: int, k_start: int, k_stop: int, group: int,
               offset: int, device) -> torch.Tensor:
    """Boolean ``[group * (q_stop - q_start), k_stop - k_start]`` causal mask of one tile,
    True where allowed. Rows are ordered (group member, query) as :func:`_group` stacks
    them; query ``i`` sits at position ``offset + i`` (end-aligned)."""
    q_pos = torch.arange(offset + q_start, offset + q_stop, device=device).repeat(group)
    k_pos = torch.arange(k_start, k_stop, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        *, block_q: int = 128, block_k: int = 128, rescale: bool = True,
                        stats: dict | None = None) -> torch.Tensor:
    """Exact attention, ``softmax(q k^T / sqrt(d) + mask) v``, computed tile by tile with an
    online softmax (see the module docstring for the recurrences).

    q ``[B, H, T, D]``; k, v ``[B, KV, S, D]`` (``S >= T`` when causal: the mask is
    end-aligned, query ``i`` at position ``S - T + i``). For each block of ``block_q``
    queries (all ``H // KV`` heads of a group at once) it loops over blocks of ``block_k``
    keys, keeping the running max ``m``, sum ``l`` and output ``O`` of every query row; when
    ``causal``, key blocks wholly after the block's last query are skipped, and only tiles
    that cross the diagonal are masked. The largest score tile is
    ``[B, KV, (H // KV) * block_q, block_k]``. ``rescale=False`` omits the correction
    ``alpha = exp(m_old - m_new)`` (a deliberate bug). ``stats``, if given, is filled with
    ``tiles`` (computed), ``skipped`` (above the diagonal), ``masked`` (tiles that crossed
    the diagonal) and ``tile_bytes`` (one score tile). The output is in ``q.dtype``; the
    running statistics are kept in float32 (float64 for float64 inputs).
    """
    batch, heads, steps, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    if causal and kv_len < steps:
        raise ValueError(f"causal attention needs kv_len >= q_len, got {kv_len} < {steps}")
    if block_q < 1 or block_k < 1:
        raise ValueError("block sizes must be positive")
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(dim)
    offset = kv_len - steps
    out = torch.empty_like(q)
    tiles = skipped = masked = 0
    for q0 in range(0, steps, block_q):
        q1 = min(q0 + block_q, steps)
        qb = _group(q[:, :, q0:q1], kv_heads).to(acc_dtype)  # [B, KV, G*Br, D]
        rows = qb.shape[2]
        m = torch.full((batch, kv_heads, rows, 1), float("-inf"), dtype=acc_dtype, device=q.device)
        l = torch.zeros((batch, kv_heads, rows, 1), dtype=acc_dtype, device=q.device)
        acc = torch.zeros((batch, kv_heads, rows, dim), dtype=acc_dtype, device=q.device)
        # Causal: the last query of this block sits at offset + q1 - 1, so no key at or
        # beyond offset + q1 is ever visible to it: those blocks are skipped.
        k_stop = offset + q1 if causal else kv_len
        for k0 in range(0, kv_len, block_k):
            if k0 >= k_stop:
                skipped += 1
                continue
            k1 = min(k0 + block_k, kv_len)
            kb = k[:, :, k0:k1].to(acc_dtype)
            vb = v[:, :, k0:k1].to(acc_dtype)
            s = (qb @ kb.transpose(-1, -2)) * scale  # [B, KV, G*Br, Bc]: one tile of scores
            if causal and k1 - 1 > offset + q0:  # the tile crosses the diagonal
                s.masked_fill_(~_tile_mask(q0, q1, k0, k1, group, offset, q.device),
                               float("-inf"))
                masked += 1
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s - m_new)
            if rescale:
                alpha = torch.exp(m - m_new)  # exp(-inf) = 0 on the first block
                l = alpha * l + p.sum(dim=-1, keepdim=True)
                acc = alpha * acc + p @ vb
            else:  # the bug: earlier terms keep their old max
                l = l + p.sum(dim=-1, keepdim=True)
                acc = acc + p @ vb
            m = m_new
            tiles += 1
        out[:, :, q0:q1] = _ungroup((acc / l).to(q.dtype), heads, q1 - q0)
    if stats is not None:
        stats.update(tiles=tiles, skipped=skipped, masked=masked,
                     tile_bytes=batch * kv_heads * group * min(block_q, steps)
                     * min(block_k, kv_len) * torch.finfo(acc_dtype).bits // 8)
    return out


def blockwise_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               lengths: torch.Tensor | list[int] | None = None, *,
                               block_k: int = 256, rescale: bool = True) -> torch.Tensor:
    """One new query per sequence against a long cache, visiting the cache ``block_k``
    positions at a time with the online softmax (same recurrences as
    :func:`blockwise_attention`; the decode counterpart of
    :func:`labkit.kernels.attention.decode_attention`).

    q ``[B, H, 1, D]``; k_cache, v_cache ``[B, KV, max_len, D]``; ``lengths``: valid cache
    length per sequence (default all of ``max_len``; each must be >= 1). Blocks past the
    longest length are skipped; positions past a sequence's own length are masked. The score
    tile is ``[B, KV, H // KV, block_k]``: the memory saving is small here (decode scores are
    one row per head), the point is that the same loop serves both shapes, and that its
    partial results per block could be computed in parallel and merged the same way
    (split-KV, "flash decoding")."""
    batch, heads, steps, dim = q.shape
    if steps != 1:
        raise ValueError("blockwise_decode_attention takes exactly one query per sequence")
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qb = _group(q, kv_heads).to(acc_dtype)  # [B, KV, G, D]
    rows = qb.shape[2]
    if lengths is None:
        limit, valid_len = max_len, None
    else:
        valid_len = torch.as_tensor(lengths, device=q.device)
        if int(valid_len.min()) < 1:
            raise ValueError("every sequence needs at least one cached position")
        limit = int(valid_len.max())
    m = torch.full((batch, kv_heads, rows, 1), float("-inf"), dtype=acc_dtype, device=q.device)
    l = torch.zeros((batch, kv_heads, rows, 1), dtype=acc_dtype, device=q.device)
    acc = torch.zeros((batch, kv_heads, rows, dim), dtype=acc_dtype, device=q.device)
    for k0 in range(0, limit, block_k):
        k1 = min(k0 + block_k, limit)
        s = (qb @ k_cache[:, :, k0:k1].to(acc_dtype).transpose(-1, -2)) / math.sqrt(dim)
        if valid_len is not None:
            pos = torch.arange(k0, k1, device=q.device)
            s.masked_fill_(~(pos[None, :] < valid_len[:, None])[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new) if rescale else torch.ones_like(m)
        l = alpha * l + p.sum(dim=-1, keepdim=True)
        acc = alpha * acc + p @ v_cache[:, :, k0:k1].to(acc_dtype)
        m = m_new
    return _ungroup((acc / l).to(q.dtype), heads, 1)


def working_set_bytes(batch: int, heads: int, kv_heads: int, q_len: int, head_dim: int,
                      block_q: int, block_k: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Closed-form bytes :func:`blockwise_attention` holds beyond its inputs, for float32
    statistics (the default for float32/16-bit inputs):

    - ``tile``: one score tile ``[B, KV, G*Br, Bc]`` (the exponentials ``P`` are a second);
    - ``stats``: running max and sum, ``2 x [B, KV, G*Br, 1]``;
    - ``running_output``: ``O``, ``[B, KV, G*Br, D]``;
    - ``working``: 2 tiles + stats + 2 running outputs (old and new ``O`` alive together) +
      the query block: what a step holds at its peak;
    - ``output``: the ``[B, H, T, D]`` result in ``dtype``, which every implementation
      returns and is not "extra".

    Br and Bc are capped at the lengths. None of it depends on the sequence length except
    the output."""
    acc = 4
    rows = heads * min(block_q, q_len)  # G*Br per KV head, times KV heads
    tile = batch * rows * block_k * acc
    stats = 2 * batch * rows * acc
    running = batch * rows * head_dim * acc
    return {"tile": tile, "stats": stats, "running_output": running,
            "working": 2 * tile + stats + 3 * running,
            "output": batch * heads * q_len * head_dim * torch.finfo(dtype).bits // 8}


@dataclass
class AllocationPeak:
    """What the CPU allocator handed out during one call, from torch's profiler.

    ``peak_bytes``: the highest total of live allocations made during the call (above what
    was live before it; the inputs are not counted, the returned tensor is, until it is
    dropped); ``allocated_bytes``: the sum of all allocations; ``allocations``: how many;
    ``result_bytes``: bytes of the returned tensor."""

    peak_bytes: int
    allocated_bytes: int
    allocations: int
    result_bytes: int

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
    for e in events:
        size = e.nbytes()
        live += size
        peak = max(peak, live)
        if size > 0:
            allocated += size
            count += 1
    return AllocationPeak(peak_bytes=peak, allocated_bytes=allocated, allocations=count,
                          result_bytes=result_bytes)


def sdpa_backend(backend: str) -> Callable[..., torch.Tensor]:
    """An attention function that calls ``F.scaled_dot_product_attention`` (causal, square,
    ``enable_gqa`` when KV heads are fewer) restricted to one of PyTorch's SDPA backends:
    ``"flash"`` (FlashAttention-2, CUDA only), ``"efficient"`` (memory-efficient, CUDA),
    ``"math"`` (the unfused reference) or ``"any"`` (PyTorch chooses)."""
    import torch.nn.functional as F

    def call(q, k, v, causal: bool = True):
        kwargs = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        causal_square = causal and q.shape[2] == k.shape[2]
        if causal and not causal_square and q.shape[2] > 1:
            raise ValueError("sdpa_backend calls handle square causal or unmasked problems only")
        if backend == "any":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal_square, **kwargs)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH,
                  "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal_square, **kwargs)

    call.__name__ = f"sdpa_{backend}"
    return call


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
    :mod:`labkit.bench.attention_cost`; not counted). Each method is called once for memory
    (CPU: :func:`allocation_peak`, exact allocator bytes; CUDA: the allocator's peak above
    what was allocated before), which is also the first warm-up call; then ``warmup - 1``
    more untimed and ``repeats`` timed calls through :func:`labkit.bench.timing.measure`.
    A method named ``"naive"`` is skipped (``skipped`` says why) when its predicted peak
    (``naive_peak_model``) exceeds ``memory_fraction`` of the free memory. Returns one flat
    record per (length, method): method, length, dtype, device, median_s, p25_s, p75_s,
    repeats, threads, peak_bytes, result_bytes, extra_bytes (peak minus the output),
    score_bytes (one score tensor, the formula), naive_model_bytes, skipped."""
    from labkit.bench.attention_cost import AttentionShape, attention_inputs, naive_peak_model
    from labkit.bench.timing import measure, num_threads, synchronize
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
                      "repeats": 0, "threads": None, "peak_bytes": None, "result_bytes": None,
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
                else:
                    alloc = allocation_peak(call)
                    peak, result = alloc.peak_bytes, alloc.result_bytes
            timing = measure(call, name=f"{name} {length}", repeats=repeats,
                             warmup=max(warmup - 1, 0), threads=threads,
                             device=device if on_cuda else None)
            record.update(median_s=timing.median, p25_s=timing.quantile(0.25),
                          p75_s=timing.quantile(0.75), repeats=len(timing.samples),
                          threads=timing.threads, peak_bytes=peak, result_bytes=result,
                          extra_bytes=peak - result)
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


def plain_log_ticks(axis) -> None:
    """Label a log-scaled matplotlib axis (``ax.xaxis`` or ``ax.yaxis``) with plain numbers
    (``0.5``, ``2``, ``300``) instead of powers, labelling only the 1s, 2s, 3s and 5s."""
    from matplotlib.ticker import FuncFormatter

    def label(value, _):
        if value <= 0:
            return ""
        lead = round(value / 10 ** math.floor(math.log10(value)))
        return f"{value:g}" if lead in (1, 2, 3, 5) else ""

    axis.set_major_formatter(FuncFormatter(label))
    axis.set_minor_formatter(FuncFormatter(label))


def plot_block_sizes(ax_time, ax_memory, df) -> None:
    """Block-size sweep (``df`` from :func:`records_frame` with a ``block`` column): median
    time (ms) and extra allocation (MiB) against the block size, log-log, plain tick labels."""
    from matplotlib.ticker import NullLocator

    df = df.sort_values("block")
    for ax, col, label in ((ax_time, "median_ms", "time per call (ms)"),
                           (ax_memory, "extra_mib", "extra allocated (MiB)")):
        ax.plot(df["block"], df[col], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(list(df["block"]), [str(b) for b in df["block"]])
        ax.xaxis.set_minor_locator(NullLocator())
        plain_log_ticks(ax.yaxis)
        ax.set_xlabel("block size Br = Bc")
        ax.set_ylabel(label)


def plot_peaks(ax, df, formulas=None) -> None:
    """Measured peak allocation (MiB) against length, one series per method (log-log);
    ``formulas``: optional ``{label: (lengths, mib)}`` drawn as grey dashed/dotted lines."""
    from labkit.book.style import LINESTYLES, MARKERS

    for i, (label, (xs, ys)) in enumerate((formulas or {}).items()):
        ax.plot(xs, ys, color="0.55", linewidth=1, linestyle=LINESTYLES[(i + 1) % len(LINESTYLES)],
                label=label)
    for i, (method, group) in enumerate(df.groupby("method", sort=False)):
        group = group.sort_values("length")
        ax.plot(group["length"], group["peak_mib"], marker=MARKERS[i % len(MARKERS)],
                label=f"{method} (measured)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak allocated (MiB)")


def _plot_series(ax, df, by: str, y: str, ylabel: str) -> None:
    """One line per group of `by`, `y` against length, log-log."""
    from labkit.book.style import MARKERS

    for i, (name, group) in enumerate(df.groupby(by, sort=False)):
        group = group.sort_values("length")
        ax.plot(group["length"], group[y], marker=MARKERS[i % len(MARKERS)], label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(ylabel)


def plot_times(ax, df) -> None:
    """Median time per call (ms) against length, one series per method (log-log)."""
    _plot_series(ax, df, "method", "median_ms", "time per call (ms)")


def plot_ratios(ax, ratios) -> None:
    """Time ratios against length, one series per pair, with a line at 1 (log y)."""
    _plot_series(ax, ratios, "pair", "ratio", "time ratio")
    ax.axhline(1.0, color="0.5", linewidth=1, linestyle=":")
    plain_log_ticks(ax.yaxis)


__all__ = ["blockwise_attention", "blockwise_decode_attention", "working_set_bytes",
           "AllocationPeak", "allocation_peak", "sdpa_backend", "compare_methods", "records_frame", "time_ratios",
           "plot_peaks", "plot_times", "plot_ratios", "plain_log_ticks", "plot_block_sizes"]
