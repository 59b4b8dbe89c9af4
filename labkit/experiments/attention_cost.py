"""What attention costs: peak memory and time of naive attention vs PyTorch's SDPA.

Chapter 8 measures the attention implementations of :mod:`labkit.kernels.attention` over
sequence length, beside the closed-form size of the score tensor that naive attention
materialises::

    from labkit.experiments.attention_cost import SMOLLM2, sweep
    records = sweep([256, 1024], ["naive", "sdpa"], SMOLLM2, mode="prefill")
    records[0]["peak_bytes"], records[0]["formula_bytes"], records[0]["median_s"]

Two shapes of problem:

- ``prefill``: ``q_len == kv_len == length``, causal (a prompt attends to itself);
- ``decode``: ``q_len == 1`` against ``kv_len == length`` cached keys and values (one new
  token), where the score tensor is tiny and the time is spent reading K and V.

Memory is measured with :class:`ResidentPeak` around one call: on the CPU, the growth of
the process's resident set size (RSS) at its peak, read from the kernel's high-water mark
(exact to the page, not sampled) after glibc has returned the free pages of its heap to
the kernel. That release matters: memory an earlier run freed but the C heap kept can
serve a tensor without any growth of the resident set, and every fused-kernel peak of
this chapter once read zero that way. A peak below the call's own output is still a
failed measurement (``peak_seen`` is False) and the chapter reports it as NOT_RUN. On
CUDA the allocator's peak above what was allocated before is used (exact).
"""

from __future__ import annotations

import ctypes
import gc
import math
import re
import resource
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from labkit.util.machine import last_level_cache_bytes  # noqa: F401 - the chapter's ac.last_level_cache_bytes()
from labkit.util.machine import isa_flags
from labkit.util.compare import Comparison, compare
from labkit.util.timing import PeakMemory, measure, measure_interleaved, num_threads, synchronize
from labkit.kernels.attention import causal_mask, naive_attention, score_tensor_bytes, sdpa_attention

GiB = 2**30
MiB = 2**20


_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_bytes(field: str) -> int:
    with open(_STATUS) as status:
        return int(re.search(rf"{field}:\s+(\d+) kB", status.read()).group(1)) * 1024


def release_free_heap() -> bool:
    """Ask glibc to return the free pages of every malloc arena to the kernel
    (``malloc_trim(0)``); False where there is no glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)  # its result says whether anything was released, not whether it could be
    return True


def minor_faults() -> int:
    """Minor page faults of this process so far (``getrusage``): pages the kernel had to
    map in on first touch, without reading anything from disk."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class ResidentPeak:
    """Growth of the resident set while a block runs, at its peak, exact to the page.

    On Linux: collect garbage, return the heap's free pages to the kernel (unless
    ``release_free=False``), reset the kernel's high-water mark to the current RSS (write
    ``5`` to ``/proc/self/clear_refs``), run the block, read ``VmHWM``. Nothing is sampled,
    so a short-lived tensor is not missed; and since freed heap memory no longer sits in
    the resident set, a tensor that reuses it shows. Elsewhere it falls back to
    :class:`labkit.util.timing.PeakMemory` (sampled every millisecond). ``method`` says
    which ran; ``delta_bytes`` is the result.

        with ResidentPeak() as peak:
            attention(q, k, v)
        peak.delta_bytes
    """

    def __init__(self, release_free: bool = True):
        self.release_free = release_free
        self.delta_bytes = 0
        self.method = ""
        self._start = 0
        self._sampler: PeakMemory | None = None

    def __enter__(self) -> "ResidentPeak":
        gc.collect()
        released = self.release_free and release_free_heap()
        try:
            with open(_CLEAR_REFS, "w") as refs:
                refs.write("5")
            self._start = _status_bytes("VmRSS")
            self.method = "high-water mark" + (", free heap released" if released else "")
        except OSError:
            self._sampler = PeakMemory().__enter__()
            self.method = "sampled every ms" + (", free heap released" if released else "")
        return self

    def __exit__(self, *exc) -> None:
        if self._sampler is not None:
            self._sampler.__exit__(*exc)
            self.delta_bytes = self._sampler.rss_delta_bytes
        else:
            self.delta_bytes = max(_status_bytes("VmHWM") - self._start, 0)


@dataclass(frozen=True)
class AttentionShape:
    """The model side of an attention problem: batch, query heads, KV heads, head size.

    ``kv_heads < heads`` is grouped-query attention (each KV head serves
    ``heads // kv_heads`` query heads); ``kv_heads == heads`` is multi-head attention.
    """

    name: str
    batch: int = 1
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


SMOLLM2 = AttentionShape("SmolLM2 9q/3kv", batch=1, heads=9, kv_heads=3, head_dim=64)
"""One layer of SmolLM2-135M's attention: 9 query heads share 3 KV heads, head_dim 64."""

MHA12 = AttentionShape("MHA 12 heads", batch=1, heads=12, kv_heads=12, head_dim=64)
"""GPT-2's attention (the source's shape): 12 heads, each with its own K and V, head_dim 64."""


def sdpa_enable_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    causal: bool = True) -> torch.Tensor:
    """SDPA told about the grouping (``enable_gqa=True``) and the causal mask
    (``is_causal=True``) instead of being given a materialised boolean mask.

    ``is_causal`` in SDPA is aligned to the top-left corner, which equals labkit's
    end-aligned mask only when ``q_len == kv_len``; a single query (decode) needs no mask;
    any other causal shape falls back to an explicit ``[q_len, kv_len]`` mask.
    """
    steps, kv_len = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    kwargs = {"enable_gqa": True} if gqa else {}
    if not causal or steps == 1:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    if steps == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    mask = causal_mask(steps, kv_len, 1, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "sdpa_gqa": sdpa_enable_gqa,
}
"""The implementations a sweep can name: labkit's naive and SDPA paths, and SDPA with
``enable_gqa``/``is_causal`` (no materialised mask)."""


def attention_inputs(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
                     head_dim: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                     device: str | torch.device = "cpu"):
    """Seeded standard-normal ``(q, k, v)``: q ``[batch, heads, q_len, head_dim]``, k and v
    ``[batch, kv_heads, kv_len, head_dim]``, drawn in float32 on the CPU (so every dtype and
    device sees the same values, rounded) and then cast and moved."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def element_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def formula_bytes(shape: AttentionShape, q_len: int, kv_len: int,
                  dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Closed-form sizes for one attention call.

    - ``score``: one ``[batch, heads, q_len, kv_len]`` score tensor,
      ``batch * heads * q_len * kv_len * bytes per element``;
    - ``score_softmax``: the score tensor and the softmax output alive together (2x);
    - ``output``: the ``[batch, heads, q_len, head_dim]`` result;
    - ``kv``: the keys and values read, ``2 * batch * kv_heads * kv_len * head_dim * bytes``.
    """
    score = score_tensor_bytes(shape.batch, shape.heads, q_len, kv_len, dtype)
    size = element_bytes(dtype)
    return {
        "score": score,
        "score_softmax": 2 * score,
        "output": shape.batch * shape.heads * q_len * shape.head_dim * size,
        "kv": 2 * shape.batch * shape.kv_heads * kv_len * shape.head_dim * size,
    }


def naive_peak_model(shape: AttentionShape, q_len: int, kv_len: int,
                     dtype: torch.dtype = torch.float32) -> int:
    """Bytes that :func:`~labkit.kernels.attention.naive_attention` holds at its peak, read
    off its code. Two moments compete:

    - masking: the scores and their masked copy (``dtype`` each), with the boolean causal
      mask ``[group * q_len, kv_len]`` and its negation ``~mask``;
    - softmax: the masked scores (``dtype``), their float32 copy (none when ``dtype`` is
      float32) and the float32 softmax output, with the mask.

    In float32 the first wins: 2 score tensors and 2 masks. In a 2-byte dtype the second:
    2 + 4 + 4 = 10 bytes per score (5 score tensors) and 1 mask. In decode (``q_len == 1``)
    the mask is all-True and tiny; it is counted all the same."""
    elements = shape.batch * shape.heads * q_len * kv_len
    size = element_bytes(dtype)
    mask = shape.group * q_len * kv_len
    masking = 2 * size * elements + 2 * mask
    softmax = (2 * size if size == 4 else size + 4 + 4) * elements + mask
    return max(masking, softmax)


def default_schedule(length: int) -> tuple[int, int]:
    """``(warmup, repeats)`` for a problem of ``length`` tokens: long runs are slow and
    large, so they are repeated less (from 4,096 tokens the only untimed call is the one that
    measures memory), but never fewer than three timed calls, the fewest from which
    :func:`labkit.util.compare.compare` draws an interval."""
    if length <= 1024:
        return 1, 5
    if length <= 2048:
        return 1, 3
    return 0, 3


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def _release(device: torch.device) -> None:
    """Collect garbage (``gc.freeze()`` in the caller keeps this cheap) and, on CUDA, return
    the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_attention(impl_name: str, shape: AttentionShape, q_len: int, kv_len: int | None = None,
                      *, dtype: torch.dtype = torch.float32, repeats: int | None = None,
                      warmup: int | None = None, causal: bool = True,
                      device: str | torch.device = "cpu", seed: int = 0,
                      threads: int | None = None, memory_fraction: float = 0.7,
                      release_free: bool = True) -> dict:
    """Measure one attention implementation's peak memory, then time it.

    The inputs are built first (they are not counted). The first call runs alone inside
    :class:`ResidentPeak` (``release_free`` as there; False reproduces the failed
    measurement of a heap that kept freed memory) and is the first warm-up call; then
    ``warmup - 1`` more untimed and ``repeats`` timed calls go through :func:`~labkit.util.timing.measure` (at least one
    untimed call always happens: ``warmup=0`` means only the memory call). Returns a
    flat record: the problem (impl, shape fields, mode, dtype, device, q_len, kv_len), the
    timing (``median_s``, ``p25_s``, ``p75_s``, ``spread``, ``repeats``, ``warmup``,
    ``threads``), the memory (``peak_rss_bytes`` and ``memory_method``; ``peak_cuda_bytes``
    on CUDA, else None; ``peak_bytes``, the one of them that is exact for the device;
    ``peak_seen``, whether it is at least the call's own output, without which it is a
    failed measurement), the formulas
    (``formula_bytes`` = one score tensor, ``formula_softmax_bytes``, ``output_bytes``,
    ``kv_bytes``, ``naive_model_bytes``) and ``kv_gb_per_s`` (K/V bytes over the median
    time), ``samples_s`` (the timed calls) and ``faults_per_call`` (minor page faults of the
    process per call after the first, :func:`minor_faults`: a call whose tensors are mapped
    fresh from the kernel faults on every page it touches). When the naive path's predicted
    peak exceeds ``memory_fraction`` of the free memory, nothing runs and ``skipped`` gives
    the reason (timing and memory are None).
    Inputs and outputs are freed before returning.
    """
    if impl_name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {impl_name!r}; known: {sorted(IMPLEMENTATIONS)}")
    kv_len = q_len if kv_len is None else kv_len
    device = torch.device(device)
    if warmup is None or repeats is None:
        default_warmup, default_repeats = default_schedule(max(q_len, kv_len))
        warmup = default_warmup if warmup is None else warmup
        repeats = default_repeats if repeats is None else repeats
    sizes = formula_bytes(shape, q_len, kv_len, dtype)
    record = {
        "impl": impl_name, **{f"shape_{k}": v for k, v in asdict(shape).items()},
        "mode": "decode" if q_len == 1 else "prefill", "dtype": str(dtype).replace("torch.", ""),
        "device": str(device), "q_len": q_len, "kv_len": kv_len, "causal": causal,
        "formula_bytes": sizes["score"], "formula_softmax_bytes": sizes["score_softmax"],
        "output_bytes": sizes["output"], "kv_bytes": sizes["kv"],
        "naive_model_bytes": naive_peak_model(shape, q_len, kv_len, dtype),
        "median_s": None, "p25_s": None, "p75_s": None, "spread": None, "repeats": 0,
        "warmup": warmup, "threads": None, "peak_rss_bytes": None, "peak_cuda_bytes": None,
        "peak_bytes": None, "memory_method": None, "peak_seen": None, "kv_gb_per_s": None,
        "samples_s": None, "faults_per_call": None, "skipped": None,
    }
    needed = record["naive_model_bytes"] if impl_name == "naive" else 4 * sizes["output"]
    available = _available_bytes(device)
    if needed > memory_fraction * available:
        record["skipped"] = (f"needs about {needed / GiB:.1f} GiB; "
                             f"{available / GiB:.1f} GiB free on {device}")
        return record

    impl = IMPLEMENTATIONS[impl_name]
    q, k, v = attention_inputs(shape.batch, shape.heads, shape.kv_heads, q_len, kv_len,
                               shape.head_dim, dtype, seed, device)

    def call() -> None:
        impl(q, k, v, causal=causal)  # the result is dropped at once

    on_cuda = device.type == "cuda"
    cuda_start = torch.cuda.memory_allocated(device) if on_cuda else 0
    with num_threads(threads):  # the first call: memory measured, and a warm-up for timing
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with ResidentPeak(release_free=release_free) as peak:
            call()
            synchronize(device if on_cuda else None)
    faults_before = minor_faults()
    timing = measure(call, name=f"{impl_name} {shape.name} {q_len}x{kv_len}",
                     repeats=repeats, warmup=max(warmup - 1, 0), threads=threads,
                     device=device if on_cuda else None)
    calls = len(timing.samples) + max(warmup - 1, 0)
    faults_per_call = (minor_faults() - faults_before) / calls
    del q, k, v
    _release(device)
    record.update({
        "median_s": timing.median, "p25_s": timing.quantile(0.25),
        "p75_s": timing.quantile(0.75), "spread": timing.spread, "repeats": len(timing.samples),
        "warmup": max(warmup, 1),
        "threads": timing.threads, "peak_rss_bytes": peak.delta_bytes,
        "memory_method": "CUDA allocator peak" if on_cuda else peak.method,
        "kv_gb_per_s": sizes["kv"] / timing.median / 1e9, "samples_s": list(timing.samples),
        "faults_per_call": faults_per_call,
    })
    if on_cuda:
        record["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(device) - cuda_start
    record["peak_bytes"] = record["peak_cuda_bytes"] if on_cuda else record["peak_rss_bytes"]
    record["peak_seen"] = record["peak_bytes"] >= sizes["output"]
    return record


def sweep(lengths: Iterable[int], impls: Sequence[str], shape: AttentionShape,
          mode: str = "prefill", *, dtype: torch.dtype = torch.float32,
          device: str | torch.device = "cpu", repeats: int | None = None,
          warmup: int | None = None, seed: int = 0, threads: int | None = None,
          release_free: bool = True) -> list[dict]:
    """:func:`measure_attention` for every length and implementation, one at a time
    (each run deletes its tensors and collects garbage before the next).

    ``mode="prefill"``: ``q_len = kv_len = length``, causal. ``mode="decode"``:
    ``q_len = 1`` against ``kv_len = length`` cached keys (the mask is then all-True and
    is skipped). ``repeats``/``warmup`` default to :func:`default_schedule` by length.
    """
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    records = []
    for length in lengths:
        q_len = length if mode == "prefill" else 1
        for name in impls:
            records.append(measure_attention(name, shape, q_len, length, dtype=dtype,
                                             repeats=repeats, warmup=warmup, device=device,
                                             seed=seed, threads=threads,
                                             release_free=release_free))
    return records


def interleaved_attention(calls: Sequence[tuple[str, AttentionShape]], q_len: int, kv_len: int,
                          *, rounds: int, warmup: int = 2, threads: int | None = None,
                          dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, list[float]]:
    """Time attention calls in turns (A, B, C, A, B, C, ...; :func:`labkit.util.timing.
    measure_interleaved`), so that a slow spell of a shared machine falls on all of them: the
    samples that :func:`time_ratio_words` compares. ``calls`` are (implementation name, shape)
    pairs, each with its own seeded inputs, built once; returns "impl, shape name" -> the
    ``rounds`` samples in seconds. The causal flag is on, as in :func:`sweep`."""
    runners = {}
    for impl_name, shape in calls:
        if impl_name not in IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {impl_name!r}; known: {sorted(IMPLEMENTATIONS)}")
        q, k, v = attention_inputs(shape.batch, shape.heads, shape.kv_heads, q_len, kv_len,
                                   shape.head_dim, dtype, seed)
        impl = IMPLEMENTATIONS[impl_name]
        runners[f"{impl_name}, {shape.name}"] = lambda impl=impl, q=q, k=k, v=v: impl(q, k, v)
    timings = measure_interleaved(runners, rounds=rounds, warmup=warmup, threads=threads)
    return {name: list(t.samples) for name, t in timings.items()}


def time_ratio_words(slow: Sequence[float], fast: Sequence[float], slow_name: str = "naive attention",
                     fast_name: str = "SDPA") -> tuple[Comparison, str]:
    """How long `slow_name` took against `fast_name`, in words the samples support
    (:func:`labkit.util.compare.compare`, median(slow) / median(fast) with its bootstrap
    interval): "naive attention took 1.58 times as long as SDPA (95% interval 1.50-1.66): SDPA
    was faster", "... : naive attention was faster", or "...: a tie within the noise". The
    names only say which sample is which: the data decide who was faster."""
    c = compare(fast, slow, name_a=fast_name, name_b=slow_name)
    head = (f"{slow_name} took {c.ratio:.2f} times as long as {fast_name} "
            f"({c.confidence:.0%} interval {c.low:.2f}-{c.high:.2f})")
    if c.verdict == "faster":
        return c, f"{head}: {fast_name} was faster"
    if c.verdict == "slower":
        return c, f"{head}: {slow_name} was faster"
    return c, f"{head}: a tie within the noise"


SIXTEEN_BIT_ARITHMETIC = {
    "bfloat16": (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")),
    "float16": (("avx512_fp16", "AVX512-FP16"), ("amx_fp16", "AMX-FP16")),
}
"""The CPU flags (as /proc/cpuinfo spells them) of instructions that multiply and add in
each 16-bit format. F16C only converts float16 to and from float32, so it is not one."""


def sixteen_bit_arithmetic(flags: Iterable[str] | None = None) -> dict[str, list[str]]:
    """For bfloat16 and float16, the instruction sets among ``flags`` (default: this CPU's,
    :func:`labkit.util.machine.isa_flags`) that compute in that format."""
    have = set(isa_flags() if flags is None else flags)
    return {fmt: [name for flag, name in sets if flag in have]
            for fmt, sets in SIXTEEN_BIT_ARITHMETIC.items()}


def bf16_instruction_phrase(flags: Iterable[str] | None = None) -> tuple[bool, str]:
    """Whether this CPU has bfloat16 arithmetic instructions, and a clause that says so
    from its flags (it follows "bfloat16, "): "for which this CPU has arithmetic
    instructions (AVX512-BF16, AMX-BF16), as it has for float16 (AVX512-FP16)", or "for
    which this CPU has no arithmetic instructions (...)"."""
    formats = sixteen_bit_arithmetic(flags)
    bf16, fp16 = formats["bfloat16"], formats["float16"]
    fp16_text = f"float16 ({', '.join(fp16)})" if fp16 else ""
    if bf16:
        text = f"for which this CPU has arithmetic instructions ({', '.join(bf16)})"
        return True, text + (f", as it has for {fp16_text}" if fp16 else "")
    text = ("for which this CPU has no arithmetic instructions (neither AVX512-BF16 nor "
            "AMX-BF16: its products are computed in float32 or emulated)")
    return False, text + (f"; it has them for {fp16_text}" if fp16 else "")


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s numbers at ``value`` (unit in the last place)."""
    if value == 0:
        return torch.finfo(dtype).tiny
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(value)))


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        causal: bool = True) -> torch.Tensor:
    """Float64 attention with the KV heads repeated explicitly and an end-aligned mask."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], 1, q.device), float("-inf"))
    return scores.softmax(-1) @ v


def agreement(shape: AttentionShape, lengths: Iterable[int], dtypes: Sequence[torch.dtype],
              impls: Sequence[str] = ("naive", "sdpa"), *, ulps: float = 8.0, seed: int = 0,
              device: str | torch.device = "cpu") -> list[dict]:
    """Do two implementations give the same answer, within the rounding of the dtype?

    For each length (prefill-shaped, causal) and dtype: ``max_abs_diff`` = max |a - b|
    between the first two ``impls``, each one's max error against a float64 reference on
    the same (rounded) inputs, and ``tolerance`` = ``ulps`` units in the last place of
    ``dtype`` at the largest output magnitude. ``passed`` is ``max_abs_diff <= tolerance``.
    """
    first, second = IMPLEMENTATIONS[impls[0]], IMPLEMENTATIONS[impls[1]]
    rows = []
    for length in lengths:
        for dtype in dtypes:
            q, k, v = attention_inputs(shape.batch, shape.heads, shape.kv_heads, length, length,
                                       shape.head_dim, dtype, seed, device)
            a, b = first(q, k, v).double(), second(q, k, v).double()
            ref = reference_attention(q, k, v)
            tolerance = ulps * ulp(ref.abs().max().item(), dtype)
            diff = (a - b).abs().max().item()
            rows.append({
                "shape": shape.name, "length": length, "dtype": str(dtype).replace("torch.", ""),
                "max_abs_diff": diff, f"{impls[0]}_vs_fp64": (a - ref).abs().max().item(),
                f"{impls[1]}_vs_fp64": (b - ref).abs().max().item(), "tolerance": tolerance,
                "passed": diff <= tolerance,
            })
            del q, k, v, a, b, ref
    return rows


# ------------------------------------------------------------------------------------------
# Tables and figures for the chapter
# ------------------------------------------------------------------------------------------

def records_frame(records: Sequence[dict]):
    """A pandas DataFrame of sweep records with readable columns added: ``length``
    (kv_len), ``median_ms``, ``peak_mib`` (NaN, like ``peak_bytes``, where the peak was
    not seen: below the call's output), ``formula_mib`` (one score tensor),
    ``peak_over_formula``, ``peak_over_model`` (measured / :func:`naive_peak_model`, which
    describes the naive path only) and ``kv_mib``."""
    import pandas as pd

    df = pd.DataFrame(list(records))
    df["length"] = df["kv_len"]
    df["median_ms"] = df["median_s"].astype(float) * 1e3
    # a peak below the call's own output is a failed measurement: no number, never zero
    seen = df["peak_seen"].fillna(False).astype(bool) if "peak_seen" in df else True
    df["peak_bytes"] = df["peak_bytes"].astype(float).where(seen)
    df["peak_mib"] = df["peak_bytes"] / MiB
    df["formula_mib"] = df["formula_bytes"] / MiB
    df["peak_over_formula"] = df["peak_bytes"].astype(float) / df["formula_bytes"]
    df["peak_over_model"] = df["peak_bytes"].astype(float) / df["naive_model_bytes"]
    df["kv_mib"] = df["kv_bytes"] / MiB
    return df


def peak_cells(df) -> "pd.Series":
    """The measured peak of each row of a :func:`records_frame` as table text: MiB to one
    decimal, "not run: <reason>" where the run was skipped by design (its memory would not
    fit), and "not seen (failed measurement)" where the peak was below the call's own output.
    The two must not share a label: one is a choice, the other an instrument that failed."""
    def cell(row) -> str:
        if isinstance(row["skipped"], str):
            return "not run (would not fit in memory)"
        if row["peak_mib"] != row["peak_mib"]:
            return "not seen (failed measurement)"
        return f"{row['peak_mib']:.1f}"
    return df.apply(cell, axis=1)


def formula_table(shapes: Sequence[AttentionShape], lengths: Iterable[int],
                  dtypes: Sequence[torch.dtype]):
    """GiB of one prefill score tensor (``q_len = kv_len = length``) for each shape, length
    and dtype: a DataFrame with columns shape, length, and one per dtype."""
    import pandas as pd

    rows = []
    for shape in shapes:
        for length in lengths:
            row = {"shape": shape.name, "length": length}
            for dtype in dtypes:
                row[str(dtype).replace("torch.", "")] = formula_bytes(shape, length, length, dtype)["score"] / GiB
            rows.append(row)
    return pd.DataFrame(rows)


def speedups(df, baseline: str = "naive"):
    """Per shape, dtype and length: ``median_s`` of ``baseline`` divided by that of each other
    implementation (a ratio of two timings from the same run). Columns: shape_name, dtype,
    length, impl, ratio."""
    import pandas as pd

    rows = []
    for (shape, dtype, length), group in df.groupby(["shape_name", "dtype", "length"], sort=False):
        times = dict(zip(group["impl"], group["median_s"]))
        base = times.get(baseline)
        for impl, t in times.items():
            # a skipped baseline (NaN: naive at a length that did not fit) gives no ratio
            if impl != baseline and base is not None and base == base and t is not None and t == t:
                rows.append({"shape_name": shape, "dtype": dtype, "length": length,
                             "impl": impl, "ratio": base / t})
    return pd.DataFrame(rows, columns=["shape_name", "dtype", "length", "impl", "ratio"])


def largest_complete_length(df) -> int:
    """The largest length at which no run of a sweep frame was skipped (every
    implementation and shape measured): where a machine with less free memory skipped the
    naive run at the longest length, the chapter reads its headline figures here instead
    of at a NaN. Raises ValueError where every length had a skipped run."""
    ran = df["skipped"].isna().groupby(df["length"]).all()
    if not ran.any():
        raise ValueError("every length of this sweep has a skipped run")
    return int(ran[ran].index.max())


def rate_fall(sizes: Sequence[float], rates: Sequence[float], within: float = 0.15) -> float:
    """Where a read rate reached its level at the largest size: the smallest size from which
    on every rate lies within `within` (a fraction) of the rate at the largest size. The
    decode sweep's rates fall from cache rates to the memory rate; this says where, from the
    measurement, rather than from the cache size the machine reports."""
    pairs = sorted(zip(sizes, rates))
    if not pairs:
        raise ValueError("no sizes")
    level = pairs[-1][1]
    fall = pairs[-1][0]
    for size, rate in reversed(pairs):
        if abs(rate / level - 1) > within:
            break
        fall = size
    return fall


def closer_phrase(ratios: Sequence[float], a: str = "naive attention", b: str = "SDPA",
                  margin: float = 1.2) -> str:
    """Which of two implementations came closer to a reference, from the ratios of their
    errors (`a`'s error / `b`'s, one per row): "SDPA was closer in every row, by 1.5 to 1.8
    times", the same for `a`, or "neither was closer in every row by more than 1.2 times
    (...)". A ratio within `margin` of 1 counts for neither."""
    values = [float(r) for r in ratios]
    if not values:
        raise ValueError("no ratios")
    low, high = min(values), max(values)
    if low > margin:
        return f"{b} was closer in every row, by {low:.1f} to {high:.1f} times"
    if high < 1 / margin:
        return f"{a} was closer in every row, by {1 / high:.1f} to {1 / low:.1f} times"
    return (f"neither was closer in every row by more than {margin:g} times ({a}'s error "
            f"over {b}'s from {low:.2f} to {high:.2f})")


SERIES_ORDER = [(SMOLLM2.name, "naive"), (SMOLLM2.name, "sdpa"), (SMOLLM2.name, "sdpa_gqa"),
                (MHA12.name, "naive"), (MHA12.name, "sdpa")]
"""The chapter's series in a fixed order: a series keeps its colour and marker in every
figure, whichever other series a figure draws."""


def series_index(shape_name: str, impl: str) -> int:
    """The position of a (shape, implementation) series in :data:`SERIES_ORDER` (an unknown
    one goes after them, by a stable hash of its name), which picks its colour and marker."""
    key = (shape_name, impl)
    if key in SERIES_ORDER:
        return SERIES_ORDER.index(key)
    return len(SERIES_ORDER) + sum(map(ord, f"{shape_name}{impl}")) % 3


def series_styles(df):
    """(style index, label, rows by length, marker, colour) for each shape and implementation."""
    from labkit.util.palette import MARKERS, OKABE_ITO

    for (shape, impl), group in df.groupby(["shape_name", "impl"], sort=False):
        i = series_index(shape, impl)
        yield (i, f"{impl}, {shape}", group.sort_values("length"), MARKERS[i % len(MARKERS)],
               OKABE_ITO[i % len(OKABE_ITO)])


def plot_memory(ax, df, floor_mib: float = 1.0) -> None:
    """Measured peak (MiB) against one score tensor's formula size (MiB), log-log, one series
    per shape and implementation, with the lines 'peak = 1 score tensor' and '= 2'.

    RSS moves in pages and misses what the process already held, so peaks below
    ``floor_mib`` say only "small": they are drawn as hollow markers on the floor line
    instead of at their (meaningless) values."""
    lo, hi = df["formula_mib"].min(), df["formula_mib"].max()
    for factor, style in ((1, ":"), (2, "--")):
        ax.plot([lo, hi], [factor * lo, factor * hi], color="0.5", linestyle=style, linewidth=1,
                label=f"{factor} score tensor{'s' if factor > 1 else ''} (formula)")
    ax.axhline(floor_mib, color="0.75", linewidth=1)
    for i, label, group, marker, color in series_styles(df):
        above = group[group["peak_mib"] >= floor_mib]
        below = group[group["peak_mib"] < floor_mib]
        ax.plot(above["formula_mib"], above["peak_mib"], marker=marker, color=color, label=label)
        ax.plot(below["formula_mib"], [floor_mib] * len(below), linestyle="none", marker=marker,
                markerfacecolor="white", markeredgecolor=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("one score tensor, formula (MiB)")
    ax.set_ylabel("measured peak (MiB)")


def plot_times(ax, df) -> None:
    """Median time per call (ms) against sequence length, log-log, one series per shape and
    implementation."""
    for i, label, group, marker, color in series_styles(df):
        ax.plot(group["length"], group["median_ms"], marker=marker, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("time per call (ms)")


def plot_ratios(ax, ratios) -> None:
    """Time of naive attention divided by each other implementation's, against length; one
    line style per dtype when there are several."""
    from labkit.util.palette import MARKERS

    from labkit.util.palette import LINESTYLES

    keys = ["shape_name", "impl", "dtype"]
    dtypes = list(dict.fromkeys(ratios["dtype"]))
    for i, ((shape, impl, dtype), group) in enumerate(ratios.groupby(keys, sort=False)):
        group = group.sort_values("length")
        label = f"naive / {impl}, {shape}" + (f", {dtype}" if len(dtypes) > 1 else "")
        ax.plot(group["length"], group["ratio"], marker=MARKERS[i % len(MARKERS)],
                linestyle=LINESTYLES[dtypes.index(dtype) % len(LINESTYLES)], label=label)
    ax.axhline(1.0, color="0.5", linewidth=1, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("time ratio (naive / other)")


def plot_decode_bandwidth(ax, df, cache_bytes: int | None = None) -> None:
    """Decode-shaped calls: K/V bytes read per second (GB/s) against the K/V bytes (MiB),
    log x; a vertical line at the last-level cache size when it is known."""
    for i, label, group, marker, color in series_styles(df):
        ax.plot(group["kv_mib"], group["kv_gb_per_s"], marker=marker, color=color, label=label)
    if cache_bytes:
        ax.axvline(cache_bytes / MiB, color="0.5", linewidth=1, linestyle="--",
                   label="last-level cache")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("keys and values read per call (MiB)")
    ax.set_ylabel("K/V read rate (GB/s)")


__all__ = [
    "AttentionShape", "SMOLLM2", "MHA12", "IMPLEMENTATIONS", "sdpa_enable_gqa",
    "ResidentPeak", "release_free_heap", "SIXTEEN_BIT_ARITHMETIC", "sixteen_bit_arithmetic",
    "bf16_instruction_phrase", "attention_inputs", "element_bytes", "formula_bytes", "naive_peak_model",
    "default_schedule", "measure_attention", "sweep", "minor_faults", "interleaved_attention",
    "time_ratio_words", "peak_cells", "SERIES_ORDER", "series_index", "series_styles", "ulp", "reference_attention", "agreement",
    "GiB", "MiB", "last_level_cache_bytes", "records_frame", "formula_table", "speedups",
    "largest_complete_length", "rate_fall", "closer_phrase", "plot_memory",
    "plot_times", "plot_ratios", "plot_decode_bandwidth",
]
