"""Which path a product of a few rows takes, and what each row count costs (chapter 11).

A batched decode step multiplies B rows, one per sequence, by every weight matrix. Between
one row and a few, the time of those products need not grow smoothly: PyTorch hands
`F.linear` to its BLAS library for every row count, and inside it the library picks a
kernel and a thread split of its own per shape. Three readings per (matrix, row count),
each independent of the others:

- **the time** of one product with the weight read from main memory (each call takes the
  next of several copies, as :func:`labkit.experiments.matmul_sweeps.cold_copies` sizes
  them), every (matrix, row count) interleaved in rounds
  (:func:`labkit.util.timing.measure_interleaved`), on the threads asked for;
- **the second thread's CPU time** over a run of calls on two threads
  (:func:`labkit.experiments.thread_use.measure_thread_use`): whether the library split
  the product at all;
- **the BLAS routine PyTorch called**, as Intel MKL's verbose mode prints it
  (:func:`blas_calls`; empty where the build's BLAS is not MKL, so the reading is then
  missing, never guessed).

:func:`step_samples` adds a decode step's products per round (each matrix times the calls a
step makes of it), so that two row counts can be compared with
:func:`labkit.util.compare.compare` on the step's whole weight-product time.
"""

from __future__ import annotations

import ctypes
import os
import re
import statistics
import sys
import tempfile
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from labkit.experiments.matmul_sweeps import cold_copies
from labkit.experiments.thread_use import measure_thread_use
from labkit.util.timing import measure_interleaved

F32 = 4
_VERBOSE = re.compile(r"MKL_VERBOSE\s+([A-Z_0-9]+)\(([^)]*)\)")


def parse_mkl_verbose(text: str) -> list[str]:
    """The calls in MKL verbose output, each as its routine and the arguments before the
    first pointer: 'MKL_VERBOSE SGEMM(T,N,3072,2,576,0x7ff...,...) 16.8ms ...' gives
    'SGEMM(T,N,3072,2,576)' (transposes and sizes; the pointers change every run)."""
    calls = []
    for routine, args in _VERBOSE.findall(text):
        kept = []
        for arg in args.split(","):
            if arg.strip().lower().startswith("0x"):
                break
            kept.append(arg.strip())
        calls.append(f"{routine}({','.join(kept)})")
    return calls


def blas_calls(fn: Callable[[], Any]) -> list[str]:
    """Run `fn` once with MKL's verbose mode on and return the BLAS calls it made
    (:func:`parse_mkl_verbose`). MKL prints them to the process's standard output (file
    descriptor 1, not Python's `sys.stdout`), which is redirected to a file meanwhile. An
    empty list where this torch has no MKL, or MKL printed nothing."""
    if not torch.backends.mkl.is_available():
        return []
    sys.stdout.flush()
    saved = os.dup(1)
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        try:
            with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
                fn()
            libc.fflush(None)  # MKL writes through C's buffered stdout
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        return parse_mkl_verbose(captured.read().decode(errors="replace"))


def _cycling_products(weights: list[torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    """One call: x through every copy once (so a copy is reused only after all the others)."""
    def call() -> None:
        for w in weights:
            F.linear(x, w)
    return call


def row_costs(shapes: Mapping[str, tuple[int, int]], rows: Sequence[int], *,
              cold_bytes: int, rounds: int = 5, threads: int | None = None,
              use_seconds: float = 0.3, seed: int = 0) -> list[dict[str, Any]]:
    """Time `F.linear` of `rows` rows by each weight of `shapes` ({name: (in, out)}, the
    model's [out, in] layout), reading the weight from memory (copies cycled until
    `cold_bytes` are touched between two uses of one copy). All (matrix, rows) pairs take
    turns for `rounds` rounds on `threads` threads. One record per pair: name, rows,
    threads, copies, `samples_s` (seconds per product, one per round), median_s,
    weight_gb_s, `second_thread_share` (the second thread's CPU time over the busier
    thread's on two threads; NaN where not readable) and `blas` (the BLAS calls of one
    product, :func:`blas_calls`)."""
    if not rows or min(rows) < 1:
        raise ValueError(f"rows must be positive counts, got {list(rows)}")
    if rounds < 3:
        raise ValueError("rounds must be at least 3 (compare needs three samples a side)")
    generator = torch.Generator().manual_seed(seed)
    runners, meta = {}, {}
    for name, (k, n) in shapes.items():
        copies = cold_copies(F32 * k * n, cold_bytes)
        weights = [torch.randn(n, k, generator=generator) for _ in range(copies)]
        for r in rows:
            x = torch.randn(r, k, generator=generator)
            runners[(name, r)] = _cycling_products(weights, x)
            meta[(name, r)] = (copies, F32 * k * n, weights[0], x)
    timings = measure_interleaved(runners, rounds=rounds, warmup=1, threads=threads)
    records = []
    for key, timing in timings.items():
        name, r = key
        copies, nbytes, weight, x = meta[key]
        per_product = [s / copies for s in timing.samples]
        median = statistics.median(per_product)
        use = measure_thread_use(runners[key], name=f"{name}, {r} rows",
                                 min_seconds=use_seconds) if threads != 1 else None
        records.append({"name": name, "rows": r, "threads": timing.threads, "copies": copies,
                        "samples_s": per_product, "median_s": median,
                        "weight_gb_s": nbytes / median / 1e9,
                        "second_thread_share": float("nan") if use is None else use.helper_share,
                        "blas": blas_calls(lambda: F.linear(x, weight))})
    return records


def step_samples(records: Sequence[Mapping[str, Any]],
                 calls_per_step: Mapping[str, int]) -> dict[int, list[float]]:
    """The weight products of one decode step, per round, for each row count: the sum over
    the matrices of (seconds per product in that round) x (calls a step makes of it). Rounds
    were interleaved, so round i of every matrix ran in the same stretch of time. Raises
    ValueError where a matrix of `calls_per_step` has no record at some row count."""
    by_rows: dict[int, dict[str, Sequence[float]]] = {}
    for record in records:
        by_rows.setdefault(record["rows"], {})[record["name"]] = record["samples_s"]
    sums = {}
    for r, by_name in sorted(by_rows.items()):
        missing = set(calls_per_step) - set(by_name)
        if missing:
            raise ValueError(f"no record of {sorted(missing)} at {r} rows")
        rounds = min(len(by_name[name]) for name in calls_per_step)
        sums[r] = [sum(by_name[name][i] * calls for name, calls in calls_per_step.items())
                   for i in range(rounds)]
    return sums


def routine_words(records: Sequence[Mapping[str, Any]]) -> str | None:
    """Which BLAS routines the products called, by row count, as a clause: 'SGEMM for every
    row count (1, 2, 4 rows)' or 'SGEMV at 1 row; SGEMM at 2, 4 rows'. None where no record
    read a call (no MKL)."""
    by_rows: dict[int, set[str]] = {}
    for record in records:
        for call in record["blas"]:
            by_rows.setdefault(record["rows"], set()).add(call.split("(")[0])
    if not by_rows:
        return None
    groups: dict[str, list[int]] = {}
    for r in sorted(by_rows):
        groups.setdefault(" and ".join(sorted(by_rows[r])), []).append(r)
    if len(groups) == 1:
        (routine, counts), = groups.items()
        return f"{routine} for every row count ({', '.join(map(str, counts))} rows)"
    return "; ".join(f"{routine} at {', '.join(map(str, counts))} row{'s' * (counts != [1])}"
                     for routine, counts in groups.items())


__all__ = ["blas_calls", "parse_mkl_verbose", "routine_words", "row_costs", "step_samples"]
