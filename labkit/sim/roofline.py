"""The roofline with three ceilings, measured on this machine, and a predictor for an op.

An operation that does F floating-point operations and moves B bytes cannot finish faster
than F / peak_flops (the compute ceiling) nor faster than B / bandwidth (the memory
ceiling), and every call pays a fixed overhead (the launch/dispatch ceiling):

    predicted time = overhead + max(F / peak_flops, B / bandwidth)

`measure_machine()` measures the three numbers with labkit.util.timing; `Op` describes an
operation by its FLOPs and bytes; `predict` applies the model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from labkit.util.timing import measure, num_threads


@dataclass(frozen=True)
class Machine:
    peak_flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    overhead: float  # seconds per call
    threads: int
    dtype: str = "float32"

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


def measure_peak_flops(size: int = 2048, dtype: torch.dtype = torch.float32,
                       repeats: int = 5) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    timing = measure(lambda: torch.mm(a, b), name="gemm", repeats=repeats, warmup=2)
    return 2.0 * size**3 / timing.median


def measure_bandwidth(mbytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a streaming copy (read + write) far larger than the caches."""
    n = mbytes * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    timing = measure(lambda: dst.copy_(src), name="copy", repeats=repeats, warmup=2)
    return 2.0 * n * 4 / timing.median


def measure_overhead(repeats: int = 200) -> float:
    """Seconds of a call that does almost nothing: the fixed cost of any op."""
    a, b = torch.ones(1, 1), torch.ones(1, 1)
    return measure(lambda: torch.mm(a, b), name="tiny", repeats=repeats, warmup=20).median


def measure_machine(threads: int | None = None, gemm_size: int = 2048,
                    stream_mbytes: int = 512) -> Machine:
    with num_threads(threads):
        return Machine(
            peak_flops=measure_peak_flops(gemm_size),
            bandwidth=measure_bandwidth(stream_mbytes),
            overhead=measure_overhead(),
            threads=torch.get_num_threads(),
        )
