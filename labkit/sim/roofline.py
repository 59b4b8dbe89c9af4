"""The roofline with three ceilings, measured on this machine, and a predictor for an op.

An operation that does F floating-point operations and moves B bytes cannot finish faster
than F / peak_flops (the compute ceiling) nor faster than B / bandwidth (the memory
ceiling), and every call pays a fixed overhead (the launch/dispatch ceiling):

    predicted time = overhead + max(F / peak_flops, B / bandwidth)

`measure_machine()` measures the three numbers with labkit.util.timing, each as the best of
repeated runs (a ceiling is what the machine can do, so the fastest run is the estimate and
slower runs are the machine doing other work); `Op` describes an operation by its FLOPs and
bytes; `predict` applies the model. `last_level_cache_bytes()` says how large an operand
may be and still stay in the cache between calls: the model's memory ceiling is DRAM's, so
an op whose operands stay in the cache can beat it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from labkit.util import machine
from labkit.util.timing import Timing, measure, num_threads


@dataclass(frozen=True)
class Machine:
    peak_flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    overhead: float  # seconds per call
    threads: int
    dtype: str = "float32"
    device: str = "cpu"

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which an op is compute-bound."""
        return self.peak_flops / self.bandwidth

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Op:
    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


def matmul_op(m: int, n: int, k: int, dtype: torch.dtype = torch.float32, name: str = "") -> Op:
    """[m, k] @ [k, n]: 2mnk FLOPs; reads both inputs and writes the output once."""
    size = torch.finfo(dtype).bits // 8
    return Op(name or f"matmul {m}x{k}x{n}", 2.0 * m * n * k, float(size * (m * k + k * n + m * n)))


def elementwise_op(n: int, reads: int = 2, writes: int = 1, flops_per_element: float = 1.0,
                   dtype: torch.dtype = torch.float32, name: str = "") -> Op:
    size = torch.finfo(dtype).bits // 8
    return Op(name or f"elementwise {n}", flops_per_element * n, float(size * n * (reads + writes)))


def predict(op: Op, machine: Machine) -> float:
    """Roofline time of `op` on `machine`, in seconds."""
    return machine.overhead + max(op.flops / machine.peak_flops, op.bytes / machine.bandwidth)


def bound(op: Op, machine: Machine) -> str:
    """Which ceiling the model says limits `op`."""
    compute, memory = op.flops / machine.peak_flops, op.bytes / machine.bandwidth
    if machine.overhead > max(compute, memory):
        return "overhead"
    return "compute" if compute >= memory else "memory"


def last_level_cache_bytes(default: int = 64 * 2**20) -> int:
    """Size of this machine's largest CPU cache, in bytes (`labkit.util.machine`: Linux
    sysfs, or ``$LABKIT_CACHE_SIZES``); `default` where none can be read.

    An operand smaller than this can stay in the cache between calls, so an op that reuses
    it is not timed against memory.
    """
    return machine.last_level_cache_bytes(default)


parse_cache_size = machine.parse_size


def _timed(fn: Callable[[], object], name: str, repeats: int, warmup: int, device: str) -> Timing:
    return measure(fn, name=name, repeats=repeats, warmup=warmup, device=device)


def measure_peak_flops(size: int = 2048, dtype: torch.dtype = torch.float32,
                       repeats: int = 5, device: str = "cpu") -> float:
    """FLOP/s of the fastest of `repeats` runs of a square GEMM (a ceiling, so the best run)."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    timing = _timed(lambda: torch.mm(a, b), "gemm", repeats, 2, device)
    return 2.0 * size**3 / timing.min


def measure_bandwidth(mbytes: int = 512, repeats: int = 5, device: str = "cpu",
                      kind: str = "copy") -> float:
    """Bytes per second of the fastest of `repeats` passes over an `mbytes` MB buffer.

    `kind="copy"` copies it into a second buffer and counts the read and the write;
    `kind="read"` sums it, reading every byte once (what a matrix-vector product does with
    its weights). Make the buffer much larger than the last-level cache to measure memory;
    a buffer that fits measures the cache.
    """
    n = max(1, mbytes * 2**20 // 4)
    src = torch.ones(n, device=device)
    if kind == "copy":
        dst = torch.empty(n, device=device)
        timing = _timed(lambda: dst.copy_(src), "copy", repeats, 2, device)
        return 2.0 * n * 4 / timing.min
    if kind == "read":
        timing = _timed(lambda: src.sum(), "read", repeats, 2, device)
        return n * 4 / timing.min
    raise ValueError(f"kind must be 'copy' or 'read', not {kind!r}")


def measure_overhead(repeats: int = 200, device: str = "cpu") -> float:
    """Seconds of the fastest call that does almost nothing: the fixed cost of any op."""
    a, b = torch.ones(1, 1, device=device), torch.ones(1, 1, device=device)
    return _timed(lambda: torch.mm(a, b), "tiny", repeats, 20, device).min


def measure_ceilings(threads: int | None = None, gemm_size: int = 2048,
                     stream_mbytes: int = 512, repeats: int = 5,
                     device: str = "cpu") -> tuple[Machine, list[dict]]:
    """Measure the three ceilings on `threads` threads, each as the best of `repeats` runs.

    - peak: the faster of two large square GEMMs (`gemm_size` and half of it);
    - bandwidth: the faster of a copy and a read of `stream_mbytes` MB (choose it far
      above the last-level cache);
    - overhead: the fastest 1x1 matrix product.

    Returns the Machine and one row per experiment (ceiling, experiment, value, unit).
    """
    with num_threads(threads):
        peaks = {s: measure_peak_flops(s, repeats=repeats, device=device)
                 for s in (gemm_size // 2, gemm_size)}
        streams = {k: measure_bandwidth(stream_mbytes, repeats, device, k)
                   for k in ("copy", "read")}
        overhead = measure_overhead(device=device)
        used = torch.get_num_threads()
    machine = Machine(peak_flops=max(peaks.values()), bandwidth=max(streams.values()),
                      overhead=overhead, threads=used, device=device)
    rows = [{"ceiling": "peak", "experiment": f"GEMM {s}x{s}x{s}", "value": f / 1e9,
             "unit": "GFLOP/s", "used": f == machine.peak_flops} for s, f in peaks.items()]
    rows += [{"ceiling": "bandwidth", "experiment": f"{k} of {stream_mbytes} MB",
              "value": b / 1e9, "unit": "GB/s", "used": b == machine.bandwidth}
             for k, b in streams.items()]
    rows.append({"ceiling": "overhead", "experiment": "1x1 matrix product",
                 "value": overhead * 1e6, "unit": "µs", "used": True})
    for row in rows:
        row["threads"] = used
    return machine, rows


def measure_machine(threads: int | None = None, gemm_size: int = 2048,
                    stream_mbytes: int = 512, repeats: int = 5,
                    device: str = "cpu") -> Machine:
    """The Machine of `measure_ceilings` (best-of-`repeats` ceilings on `threads` threads)."""
    return measure_ceilings(threads, gemm_size, stream_mbytes, repeats, device)[0]


def relation_word(ratio: float, tolerance: float = 0.1) -> str:
    """How a rate compares with a reference, for prose: `ratio` = rate / reference.

    "less than" below 1 - tolerance, "more than" above 1 + tolerance, "about the same as"
    between: a sentence glued from it claims a difference only when there is one."""
    if ratio < 1 - tolerance:
        return "less than"
    if ratio > 1 + tolerance:
        return "more than"
    return "about the same as"
