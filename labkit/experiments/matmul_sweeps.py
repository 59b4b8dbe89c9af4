"""Matmul sweeps: GEMM and GEMV throughput against size, thread count and weight layout,
and the fixed cost of a call.

Two shapes of matrix multiplication dominate a language model:

- **GEMM** (general matrix-matrix multiply), here square: [n, n] @ [n, n], 2n^3 FLOPs on
  3n^2 numbers. Its arithmetic grows faster than its data, so a large one is limited by
  the arithmetic units (compute-bound).
- **GEMV** (matrix-vector multiply): one token's activation [1, k] through a weight of
  k inputs and n outputs, 2kn FLOPs on kn weights. Every weight is used once, so it is
  limited by how fast the weights arrive (memory-bound); its figure of merit is GB/s of
  weights read.

Every timing goes through :func:`labkit.util.timing.measure` (warm-up, repeats, median
and quartiles, thread count, GPU synchronisation). Each record is a plain dict, so a list
of them becomes a pandas DataFrame in one call. Thread counts are interleaved within a
size (1, 2, 1, 2, ... across sizes), so a ratio of two thread counts comes from the same
run and the same minute of machine load.

A GEMV's weight can be stored two ways, and both appear in practice:

- ``"in_out"``: ``W_t`` of shape [in, out], computed as ``x @ W_t``;
- ``"out_in"``: ``W`` of shape [out, in] (PyTorch's ``nn.Linear`` and labkit's model),
  computed as ``F.linear(x, W)``.

They give the same numbers (up to rounding) and read the same bytes, but walk memory in
different orders and reach different BLAS kernels, so their speed differs.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F

from labkit.models.llama import linear
from labkit.util.compare import MIN_SAMPLES, compare
from labkit.util.machine import cpu_caches  # noqa: F401 - the chapters' sweeps.cpu_caches()
from labkit.util.timing import Timing, measure

LAYOUTS = ("in_out", "out_in")


# -- closed forms ------------------------------------------------------------------------

def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype` (4 for float32, 2 for bfloat16)."""
    return torch.empty((), dtype=dtype).element_size()


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of [m, k] @ [k, n]: one multiply and one add per (row, column, k) triple."""
    return 2 * m * n * k


def matmul_bytes(m: int, n: int, k: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of [m, k] @ [k, n] if each operand is read once and the output written once."""
    return (m * k + k * n + m * n) * dtype_bytes(dtype)


def weight_bytes(in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of a weight matrix with `in_features` inputs and `out_features` outputs."""
    return in_features * out_features * dtype_bytes(dtype)


def _summary(timing: Timing) -> dict[str, Any]:
    return {
        "median_s": timing.median, "mean_s": sum(timing.samples) / len(timing.samples),
        "p25_s": timing.quantile(0.25),
        "p75_s": timing.quantile(0.75), "min_s": timing.min, "max_s": timing.max,
        "spread": timing.spread, "repeats": len(timing.samples), "threads": timing.threads,
    }


def _random(shape: Sequence[int], generator: torch.Generator, dtype: torch.dtype,
            device: str | torch.device) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)


def _cpu_threads(device: str | torch.device, threads: int | None) -> int | None:
    """The thread count to ask `measure` for: none on a GPU (the host threads do not matter)."""
    return threads if torch.device(device).type == "cpu" else None


# -- GEMM ----------------------------------------------------------------------------------

def gemm_sweep(sizes: Iterable[int], threads_list: Sequence[int | None] = (1, 2), *,
               dtype: torch.dtype = torch.float32, repeats: int = 5, warmup: int = 2,
               min_seconds: float = 0.0, device: str | torch.device = "cpu",
               seed: int = 0) -> list[dict[str, Any]]:
    """Time square GEMMs [n, n] @ [n, n] for every n in `sizes` and every thread count.

    Returns one record per (n, threads): n, threads, dtype, device, flops (2n^3), bytes
    (3n^2 elements), median_s, mean_s, p25_s, p75_s, min_s, max_s, spread, repeats, gflops
    (flops / median / 1e9) and gbps (bytes / median / 1e9). On a GPU pass
    ``threads_list=(None,)``; the threads then recorded are the host's.
    """
    generator = torch.Generator().manual_seed(seed)
    records = []
    for n in sizes:
        a = _random((n, n), generator, dtype, device)
        b = _random((n, n), generator, dtype, device)
        flops, nbytes = matmul_flops(n, n, n), matmul_bytes(n, n, n, dtype)
        for threads in threads_list:
            timing = measure(lambda: torch.mm(a, b), name=f"gemm {n}", repeats=repeats,
                             warmup=warmup, min_seconds=min_seconds,
                             threads=_cpu_threads(device, threads), device=device)
            record = {"op": "gemm", "n": n, "dtype": str(dtype).removeprefix("torch."),
                      "device": str(device), "flops": flops, "bytes": nbytes,
                      **_summary(timing)}
            record["gflops"] = flops / record["median_s"] / 1e9
            record["gbps"] = nbytes / record["median_s"] / 1e9
            records.append(record)
        del a, b
    return records


# -- GEMV ----------------------------------------------------------------------------------

def gemv_weight(in_features: int, out_features: int, layout: str, *,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                generator: torch.Generator | None = None) -> torch.Tensor:
    """A random weight stored in `layout`: [in, out] for ``"in_out"``, [out, in] for
    ``"out_in"``. Both layouts drawn from the same generator state hold the same matrix."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    generator = generator or torch.Generator().manual_seed(0)
    w = _random((out_features, in_features), generator, dtype, device)  # [out, in]
    return w.t().contiguous() if layout == "in_out" else w


def gemv(x: torch.Tensor, w: torch.Tensor, layout: str) -> torch.Tensor:
    """x [batch, in] times a weight stored in `layout` -> [batch, out]."""
    if layout == "in_out":
        return x @ w
    if layout == "out_in":
        return F.linear(x, w)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def cold_copies(nbytes: int, cold_bytes: int) -> int:
    """How many copies of an `nbytes` weight to cycle through so that the bytes touched
    between two uses of the same copy reach `cold_bytes` (1 when `cold_bytes` is 0)."""
    if nbytes <= 0:
        raise ValueError("nbytes must be positive")
    return max(1, math.ceil(cold_bytes / nbytes)) if cold_bytes > 0 else 1


def cold_pool_bytes(floor_bytes: int, caches: Mapping[str, int] | None = None,
                    factor: float = 2.0) -> int:
    """Bytes of weight copies for :func:`gemv_sweep` to cycle through so that every call
    reads its weight from main memory: at least `floor_bytes`, and at least `factor` times
    the largest cache of `caches` (default: this machine's, :func:`cpu_caches`). Where no
    cache size can be read, `floor_bytes`."""
    caches = cpu_caches() if caches is None else caches
    largest = max(caches.values(), default=0)
    return max(int(floor_bytes), math.ceil(factor * largest))


def size_words(nbytes: float) -> str:
    """A size for prose, in binary units: '300 MiB', '48 KiB', '1.5 GiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.1f} {unit}" if value < 10 and value != int(value) else f"{value:.0f} {unit}"
    return f"{nbytes:.0f} B"


def cache_words(caches: Mapping[str, int]) -> str:
    """'48 KiB L1, 2 MiB L2, 300 MiB L3', or 'sizes not readable here' for no caches."""
    return ", ".join(f"{size_words(b)} {level}" for level, b in caches.items()) or "sizes not readable here"


def beyond_cache(nbytes: float, caches: Mapping[str, int]) -> bool:
    """Whether `nbytes` exceed the largest cache of `caches`: a fact about the machine, for
    a sentence glued with ``Results.fact``. False where they fit, and where no size is known
    (the sentence for False then has to say so: :func:`llc_words`)."""
    return bool(caches) and nbytes > max(caches.values())


def llc_words(caches: Mapping[str, int]) -> str:
    """The last-level cache for prose: "this machine's 300 MiB last-level cache", or, where
    no size could be read, "the last-level cache (whose size could not be read here)"."""
    if not caches:
        return "the last-level cache (whose size could not be read here)"
    return f"this machine's {size_words(max(caches.values()))} last-level cache"


def gemv_sweep(shapes: Mapping[str, tuple[int, int]], threads_list: Sequence[int | None] = (1, 2),
               layout: str = "in_out", *, batch: int = 1, dtype: torch.dtype = torch.float32,
               repeats: int = 10, warmup: int = 3, min_seconds: float = 0.0,
               cold_bytes: int = 0, device: str | torch.device = "cpu",
               seed: int = 0) -> list[dict[str, Any]]:
    """Time x [batch, in] through each weight of `shapes` (name -> (in, out)) in `layout`.

    With ``cold_bytes > 0`` each call uses the next of several copies of the weight
    (:func:`cold_copies`), so the weight comes from main memory rather than from a cache
    that the previous call filled: the situation of a decode step, which reads every layer's
    weights once. Returns one record per (shape, threads): name, in_features, out_features,
    batch, layout, copies, flops (2 batch in out), weight_bytes (in out elements), bytes
    (weight + input + output), the timing summary, gflops, and gbps (weight bytes per second
    / 1e9).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    generator = torch.Generator().manual_seed(seed)
    records = []
    for name, (k, n) in shapes.items():
        wbytes = weight_bytes(k, n, dtype)
        copies = cold_copies(wbytes, cold_bytes)
        weights = [gemv_weight(k, n, layout, dtype=dtype, device=device, generator=generator)
                   for _ in range(copies)]
        x = _random((batch, k), generator, dtype, device)
        flops = matmul_flops(batch, n, k)
        nbytes = wbytes + (batch * k + batch * n) * dtype_bytes(dtype)
        for threads in threads_list:
            cycle = itertools.cycle(weights)
            timing = measure(lambda: gemv(x, next(cycle), layout), name=f"gemv {name}",
                             repeats=repeats, warmup=max(warmup, copies), min_seconds=min_seconds,
                             threads=_cpu_threads(device, threads), device=device)
            record = {"op": "gemv", "name": name, "in_features": k, "out_features": n,
                      "batch": batch, "layout": layout, "copies": copies,
                      "dtype": str(dtype).removeprefix("torch."), "device": str(device),
                      "flops": flops, "weight_bytes": wbytes, "bytes": nbytes,
                      **_summary(timing)}
            record["gflops"] = flops / record["median_s"] / 1e9
            record["gbps"] = wbytes / record["median_s"] / 1e9
            records.append(record)
        del weights
    return records


# -- the fixed cost of a call ----------------------------------------------------------------

def call_overhead_sweep(sizes: Iterable[int], *, threads: int | None = 1,
                        dtype: torch.dtype = torch.float32, repeats: int = 50, warmup: int = 10,
                        min_seconds: float = 0.02, max_repeats: int = 5000, rounds: int = 3,
                        device: str | torch.device = "cpu",
                        seed: int = 0) -> list[dict[str, Any]]:
    """Time tiny square matmuls [n, n] @ [n, n]: below some n the time no longer depends on
    the work, and what is left is the fixed cost of a call (dispatch, and on a GPU the launch
    and the synchronisation). The sizes are swept `rounds` times and each size's samples
    pooled, so a burst of load on the machine is spread over all sizes instead of landing on
    one. Records: n, flops, the timing summary of the pooled samples, median_us."""
    sizes = list(sizes)
    generator = torch.Generator().manual_seed(seed)
    operands = {n: (_random((n, n), generator, dtype, device), _random((n, n), generator, dtype, device))
                for n in sizes}
    pooled: dict[int, list[float]] = {n: [] for n in sizes}
    used: dict[int, int] = {}
    for _ in range(rounds):
        for n in sizes:
            a, b = operands[n]
            timing = measure(lambda: torch.mm(a, b), name=f"mm {n}", repeats=repeats,
                             warmup=warmup, min_seconds=min_seconds, max_repeats=max_repeats,
                             threads=_cpu_threads(device, threads), device=device)
            pooled[n].extend(timing.samples)
            used[n] = timing.threads
    records = []
    for n in sizes:
        timing = Timing(f"mm {n}", pooled[n], warmup=warmup, threads=used[n])
        record = {"op": "tiny_mm", "n": n, "device": str(device), "flops": matmul_flops(n, n, n),
                  **_summary(timing)}
        record["median_us"] = record["median_s"] * 1e6
        records.append(record)
    return records


def overhead_floor(records: Sequence[Mapping[str, Any]], upto: int = 4) -> float:
    """The per-call floor in seconds: the lowest median among the sizes n <= `upto` (every
    call pays at least the floor; a higher median there is noise, not work)."""
    times = [r["median_s"] for r in records if r["n"] <= upto]
    if not times:
        raise ValueError(f"no record with n <= {upto}")
    return min(times)


def leaves_floor(records: Sequence[Mapping[str, Any]], floor: float,
                 factor: float = 2.0) -> int | None:
    """The smallest n whose median time exceeds `factor` x `floor` (None if none does)."""
    for record in sorted(records, key=lambda r: r["n"]):
        if record["median_s"] > factor * floor:
            return int(record["n"])
    return None


# -- comparing thread counts ------------------------------------------------------------------

def compare_threads(fns: Mapping[str, Callable[[], Any]], threads_list: Sequence[int] = (1, 2), *,
                    rounds: int = 3, repeats: int = 5, warmup: int = 2,
                    min_seconds: float = 0.0) -> list[dict[str, Any]]:
    """Time every function on every thread count, interleaved over `rounds` (op A on 1 and 2
    threads, op B on 1 and 2, ..., then again), pooling each pair's samples, so slow drift of
    the machine's load affects both thread counts alike. Records: name, threads, the summary
    of the pooled samples; speedup (median on the first thread count / this median) and
    its bootstrap interval speedup_low-speedup_high (:func:`labkit.util.compare.compare`
    of the two pooled sets; 1.0-1.0 for the first thread count itself)."""
    pooled: dict[tuple[str, int], list[float]] = {}
    used: dict[tuple[str, int], int] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            for threads in threads_list:
                timing = measure(fn, name=name, repeats=repeats, warmup=warmup,
                                 min_seconds=min_seconds, threads=threads)
                pooled.setdefault((name, threads), []).extend(timing.samples)
                used[(name, threads)] = timing.threads
    records = []
    for name in fns:
        base = pooled[(name, threads_list[0])]
        for threads in threads_list:
            samples = pooled[(name, threads)]
            timing = Timing(name, samples, warmup=warmup, threads=used[(name, threads)])
            record = {"name": name, **_summary(timing)}
            if threads == threads_list[0]:
                record.update(speedup=1.0, speedup_low=1.0, speedup_high=1.0)
            else:
                c = compare(samples, base)
                record.update(speedup=c.ratio, speedup_low=c.low, speedup_high=c.high)
            records.append(record)
    return records


# -- a change of level in a timeline ----------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """The largest change of level in a series of timings, found by :func:`find_step`.

    ``at`` is the 1-based number of the first call of the later level; ``before_s`` and
    ``after_s`` are the medians of the calls before and from it; ``ratio`` = after / before
    with its bootstrap interval ``low``-``high``; ``median_s`` is the median of all the calls
    examined. ``found`` is True only when the whole interval lies beyond ``min_change`` on
    one side (a step up or a step down)."""

    at: int
    median_s: float
    before_s: float
    after_s: float
    ratio: float
    low: float
    high: float
    confidence: float
    min_change: float
    found: bool


def find_step(samples: Sequence[float], *, skip: int = 1, min_fraction: float = 0.1,
              min_change: float = 0.2, confidence: float = 0.95) -> Step:
    """Look for a step in a timeline of calls (the level of the times changes part-way).

    The first `skip` calls are left out (a cold first call is reported on its own). Every
    split that leaves at least `min_fraction` of the rest (and 3 calls) on each side is
    tried, and the one that fits the (log) times best with one level on each side is kept
    (the least total absolute deviation from the two sides' medians); then
    :func:`labkit.util.compare.compare` bootstraps the ratio median(after) / median(before).
    A step is `found` when that whole interval lies above 1 + `min_change` or below
    1 / (1 + `min_change`): beyond the noise *and* large enough to change a reading.

    Comparing the first half with the second half alone would miss a step near either end:
    a step at call 251 of 300 leaves both halves' medians on the first level."""
    rest = [float(s) for s in samples[skip:]]
    n = len(rest)
    edge = max(MIN_SAMPLES, math.ceil(min_fraction * n))
    if n < 2 * edge:
        raise ValueError(f"find_step needs at least {2 * edge + skip} samples, got {len(samples)}")
    logs = [math.log(s) for s in rest]

    def cost(part: list[float]) -> float:
        centre = statistics.median(part)
        return sum(abs(v - centre) for v in part)

    best_k = min(range(edge, n - edge + 1), key=lambda k: cost(logs[:k]) + cost(logs[k:]))
    before, after = rest[:best_k], rest[best_k:]
    c = compare(before, after, name_a="before", name_b="after", confidence=confidence)
    up, down = 1.0 + min_change, 1.0 / (1.0 + min_change)
    return Step(at=skip + best_k + 1, median_s=statistics.median(rest), before_s=statistics.median(before),
                after_s=statistics.median(after), ratio=c.ratio, low=c.low, high=c.high,
                confidence=confidence, min_change=min_change,
                found=c.low > up or c.high < down)


def _times(value: float) -> str:
    """A ratio for prose: 2 decimals from 0.1 to 10, 2 significant digits below, none above."""
    if value >= 10:
        return f"{value:,.0f}x"
    return f"{value:.2f}x" if value >= 0.1 else f"{value:.2g}x"


def step_phrase(step: Step, scale: float = 1e6, unit: str = "µs") -> str:
    """`step` in words for a glued sentence that answers "was there a step?":
    "yes: from call 251 on, the calls took 171 µs instead of 319 µs (0.54x, 95% interval
    0.53-0.54x)" or "no: the largest change of level (at call 40) was 0.98x (95% interval
    0.97-0.99x), inside the factor of 1.2 either way that a step must exceed"."""
    interval = (f"{step.confidence:.0%} interval {_times(step.low)[:-1]}-"
                f"{_times(step.high)}")
    if step.found:
        return (f"yes: from call {step.at} on, the calls took {step.after_s * scale:,.0f} {unit} "
                f"instead of {step.before_s * scale:,.0f} {unit} ({_times(step.ratio)}, "
                f"{interval})")
    return (f"no: the largest change of level (at call {step.at}) was {_times(step.ratio)} "
            f"({interval}), inside the factor of {1 + step.min_change:.2g} either way that a "
            "step must exceed")


def level_phrase(step: Step, reference_s: float, reference: str) -> str:
    """The level(s) of a timeline against a reference time: "0.98x the one-thread median
    before the step and 0.52x after it", or "0.98x the one-thread median throughout" when
    `step` found none (the median of the whole run, not of either side of a split)."""
    if step.found:
        return (f"{_times(step.before_s / reference_s)} {reference} before the step and "
                f"{_times(step.after_s / reference_s)} after it")
    return f"{_times(step.median_s / reference_s)} {reference} throughout"


def slower_phrase(records: Sequence[Mapping[str, Any]]) -> str:
    """Which operations of :func:`compare_threads` records ran slower on more threads beyond
    the noise (the whole speedup interval below 1): "none of the 5 operations", or
    "GEMM 64 (0.95x, 95% interval 0.93-0.97x)" (several joined by "and")."""
    names = list(dict.fromkeys(r["name"] for r in records))
    slower = [r for r in records if r["speedup_high"] < 1.0]
    if not slower:
        return f"none of the {len(names)} operations"
    return " and ".join(f"{r['name']} ({_times(r['speedup'])}, 95% interval "
                        f"{_times(r['speedup_low'])[:-1]}-{_times(r['speedup_high'])})"
                        for r in slower)


# -- one device, all three sweeps ------------------------------------------------------------

def device_sweep(device: str | torch.device, gemm_sizes: Iterable[int],
                 shapes: Mapping[str, tuple[int, int]], tiny_sizes: Iterable[int], *,
                 layout: str = "out_in", repeats: int = 10, min_seconds: float = 0.05,
                 cold_bytes: int = 0, dtype: torch.dtype = torch.float32
                 ) -> dict[str, list[dict[str, Any]]]:
    """The GEMM sweep, the GEMV sweep and the call-overhead sweep on one `device` with its
    default threads (the GPU section of chapter 7; it runs on ``"cpu"`` too). Every timed
    call on a GPU is synchronised, so its time covers the work, not just the launch.
    Returns ``{"gemm": [...], "gemv": [...], "tiny": [...]}``."""
    return {
        "gemm": gemm_sweep(gemm_sizes, (None,), dtype=dtype, repeats=repeats,
                           min_seconds=min_seconds, device=device),
        "gemv": gemv_sweep(shapes, (None,), layout, dtype=dtype, repeats=repeats,
                           min_seconds=min_seconds, cold_bytes=cold_bytes, device=device),
        "tiny": call_overhead_sweep(tiny_sizes, threads=None, dtype=dtype,
                                    min_seconds=min_seconds, device=device),
    }


# -- the model's matmuls ----------------------------------------------------------------------

def model_gemv_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of every weight matrix one token passes through, for a labkit Llama config:
    fused q/k/v, attention output, fused gate/up, down, and the LM head."""
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return {
        "qkv": (hidden, q_width + 2 * kv_width),
        "o": (q_width, hidden),
        "gate_up": (hidden, 2 * inner),
        "down": (inner, hidden),
        "lm_head": (hidden, config.vocab_size),
    }


def gemv_calls_per_token(config) -> dict[str, int]:
    """How many times one decode step multiplies by each shape of :func:`model_gemv_shapes`."""
    return {"qkv": config.num_layers, "o": config.num_layers, "gate_up": config.num_layers,
            "down": config.num_layers, "lm_head": 1}


def decode_matmul_pass(model, rows: int = 1, head_rows: int | None = None) -> Callable[[], torch.Tensor]:
    """A function that performs exactly the weight matmuls of one decode step of `model`
    (a labkit Llama) on its own weights, in its own layout and through its own kernel
    (``F.linear``, or the layer's module where the weights are packed, as
    :func:`labkit.models.llama.linear` does), with fixed random activations of the right
    widths, and nothing else: no norms, attention, RoPE or cache. Timing it gives the matmul
    part of a decode step with the same memory traffic. With `rows` > 1 every product takes
    that many rows, as a prefill of `rows` tokens does. `head_rows` (default `rows`): the
    rows the LM head multiplies; a prefill that keeps only the last position's logits
    (`last_only`, as engine v0's loop asks) runs the head on one row."""
    head_rows = rows if head_rows is None else head_rows
    if rows < 1 or not 1 <= head_rows <= rows:
        raise ValueError(f"need rows >= 1 and 1 <= head_rows <= rows, got {rows} and {head_rows}")
    generator = torch.Generator().manual_seed(0)
    hidden = model.config.hidden_size
    h = _random((rows, hidden), generator, model.dtype, "cpu")
    attn = _random((rows, model.config.num_heads * model.config.head_dim), generator, model.dtype, "cpu")
    act = _random((rows, model.config.intermediate_size), generator, model.dtype, "cpu")

    def run() -> torch.Tensor:
        with torch.inference_mode():
            for layer in model.layers:
                linear(h, layer.qkv)
                linear(attn, layer.o_proj)
                linear(h, layer.gate_up)
                linear(act, layer.down)
            return linear(h[:head_rows], model.lm_head)

    return run


def decode_step_fn(model, prompt_ids: Sequence[int], next_id: int = 0) -> Callable[[], torch.Tensor]:
    """A function that runs one decode step of `model` after `prompt_ids`, again and again at
    the same position: the prompt is prefilled into a KV cache once, and every call rewinds
    the cache to the prompt's length and feeds `next_id`. Returns the step's logits."""
    cache = model.new_cache(1, len(prompt_ids) + 1)
    model(torch.tensor([list(prompt_ids)]), cache=cache, last_only=True)
    position = cache.length
    token = torch.tensor([[next_id]])

    def step() -> torch.Tensor:
        cache.length = position
        return model(token, cache=cache, last_only=True)

    return step


__all__ = [
    "LAYOUTS", "cpu_caches", "dtype_bytes", "matmul_flops", "matmul_bytes", "weight_bytes", "gemm_sweep",
    "gemv_weight", "gemv", "cold_copies", "cold_pool_bytes", "size_words", "cache_words",
    "beyond_cache", "llc_words", "gemv_sweep", "call_overhead_sweep", "overhead_floor",
    "leaves_floor", "compare_threads", "device_sweep", "model_gemv_shapes", "gemv_calls_per_token",
    "decode_matmul_pass", "decode_step_fn", "Step", "find_step", "step_phrase", "level_phrase",
    "slower_phrase",
]
