"""Distributed inference, measured: tensor and pipeline parallel SmolLM2 under torchrun.

The processes are real: every run is `python -m torch.distributed.run --standalone
--nproc_per_node N -m labkit.experiments.distributed_worker ...` in a subprocess (gloo on
the CPU, NCCL where CUDA is present), and each writes its record to a temporary folder
that this module reads back.

* :func:`run_generation`: one greedy run of the split model (`labkit.models.parallel`):
  tokens, the logits that chose them, per-token decode times, bytes communicated per rank.
* :func:`reference_greedy` and :func:`exactness`: the same prompt through the library's
  single-process model (`labkit.engine.loop.greedy_decode`) and how far the split run is
  from it (identical tokens? largest logit difference?).
* :func:`run_comm_bench`: all-reduce and send/recv (a ring, the pipeline's pattern) over a
  range of message sizes at one process count.
* :func:`fit_linear_cost`: latency + bytes / bandwidth fitted to those timings.
* :class:`MeasuredCost` (:func:`measured_comm`): the benchmark's medians themselves, read
  at any size between two measured ones; :class:`RingAllReduce`: an all-reduce priced as
  2(N - 1) hops of a ring; :func:`band_verdict`: whether two costs count as the same.
* :func:`measure_compute`, :func:`tensor_parallel_cost`, :func:`pipeline_cost`: a cost
  model of the time per token, calibrated from single-process compute timings and the
  measured communication costs, for ranks that share the machine's cores or have their own.

Threads: every rank gets `threads_per_rank(N)` = max(1, cores // N) threads, so N ranks
together never ask for more cores than there are, except where N > cores (one thread each,
time-sliced).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from labkit.engine.loop import greedy_decode
from labkit.models.llama import linear, rms_norm
from labkit.util.timing import Timing, measure

WORKER = "labkit.experiments.distributed_worker"
HIDDEN_DTYPE_BYTES = 4  # fp32 activations
TOKEN_BYTES = 8         # one int64 token id, sent back from the last stage to the first


def threads_per_rank(procs: int, cores: int = 2) -> int:
    return max(1, cores // procs)


def gpus_for(procs: int) -> bool:
    """Whether NCCL can run `procs` ranks here: it needs a GPU of its own for each."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= procs


def torchrun(procs: int, worker_args: Sequence[str], *, timeout: float = 900) -> float:
    """Run the worker module on `procs` processes; return the wall seconds. Raises
    RuntimeError with the tail of the output when the run fails."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(procs), "-m", WORKER, *worker_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # each rank sets its own torch threads
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"torchrun with {procs} processes failed ({done.returncode}):\n{tail}")
    return time.perf_counter() - start


# -- generation runs ----------------------------------------------------------------------

@dataclass
class RunResult:
    """One torchrun generation, as rank 0 and the last rank recorded it."""

    mode: str
    procs: int
    backend: str
    threads_per_rank: int
    tokens: list[int]
    ranks_agree: bool
    logits: torch.Tensor        # [new_tokens, vocab], the logits that chose each token
    prefill_seconds: float
    step_seconds: list[float]   # rank 0's decode steps (pipeline: until the token is back)
    ranks: list[dict]           # every rank's record: comm counts, weight bytes, load time
    wall_seconds: float
    repeat: int = 0             # which repetition of a sweep

    def step_timing(self) -> Timing:
        return Timing(f"{self.mode} x{self.procs}", list(self.step_seconds), warmup=1,
                      threads=self.threads_per_rank, meta={"procs": self.procs})

    def comm_totals(self, rank: int = 0) -> dict:
        """Calls, payload bytes and seconds of each kind of communication on `rank` over the
        whole run (prefill and decode; every step makes the same number of calls)."""
        return self.ranks[rank]["comm"]


def run_generation(mode: str, procs: int, prompt_ids: Sequence[int], new_tokens: int, *,
                   model: str = "smollm2-135m", cores: int = 2, backend: str = "gloo",
                   workdir: str | os.PathLike | None = None, timeout: float = 900) -> RunResult:
    """Greedy-generate `new_tokens` tokens after `prompt_ids` with the model split `procs`
    ways (`mode` "tensor" or "pipeline") in `procs` processes under torchrun, on `backend`
    ("gloo": the CPU; "nccl": one GPU per rank). The ranks write their records to
    `workdir` (default: a temporary folder, removed once read back)."""
    if workdir is None:  # a folder of its own, removed once read back
        with tempfile.TemporaryDirectory(prefix=f"labkit-dist-{mode}{procs}-") as folder:
            return run_generation(mode, procs, prompt_ids, new_tokens, model=model, cores=cores,
                                  backend=backend, workdir=folder, timeout=timeout)
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    prompt_file = out / "prompt.json"
    prompt_file.write_text(json.dumps([int(t) for t in prompt_ids]))
    threads = threads_per_rank(procs, cores)
    wall = torchrun(procs, ["generate", "--mode", mode, "--model", model,
                            "--prompt-file", str(prompt_file), "--new-tokens", str(new_tokens),
                            "--threads", str(threads), "--backend", backend, "--out", str(out)],
                   timeout=timeout)
    return read_run(out, wall)


def read_run(folder: str | os.PathLike, wall_seconds: float = float("nan")) -> RunResult:
    folder = Path(folder)
    record = json.loads((folder / "run.json").read_text())
    rank0 = record["ranks"][0]
    return RunResult(record["mode"], record["procs"], record["backend"], record["threads_per_rank"],
                     record["tokens"], record["ranks_agree"], torch.load(folder / "logits.pt"),
                     rank0["prefill_s"], rank0["step_s"], record["ranks"], wall_seconds)


@dataclass
class Reference:
    tokens: list[int]
    logits: torch.Tensor  # [new_tokens, vocab]


def reference_greedy(model, prompt_ids: Sequence[int], new_tokens: int,
                     threads: int | None = None) -> Reference:
    """The library's own single-process greedy run (the loop the other chapters share), on
    `threads` threads (default: the current setting). The thread count matters to the last
    bits: a matrix product split over more threads adds its partial sums in another order."""
    from labkit.util.timing import num_threads

    with num_threads(threads):
        run = greedy_decode(model, list(prompt_ids), new_tokens, keep_logits=True)
    return Reference(run.token_ids, torch.stack(run.logits))


@dataclass(frozen=True)
class Exactness:
    identical: bool
    first_difference: int | None  # index of the first token that differs
    prompt_logit_diff: float      # largest |difference| of the prompt's last-position logits
    max_logit_diff: float         # ... over every step up to the first differing token


def exactness(tokens: Sequence[int], logits: torch.Tensor, ref: Reference) -> Exactness:
    """Compare a run's tokens and logits with the reference's. Logits are compared only up
    to the first differing token (after it the two runs see different inputs)."""
    n = min(len(tokens), len(ref.tokens))
    first = next((i for i in range(n) if tokens[i] != ref.tokens[i]), None)
    if first is None and len(tokens) != len(ref.tokens):
        first = n
    upto = n if first is None else min(first + 1, n)
    diff = (logits[:upto].float() - ref.logits[:upto].float()).abs()
    return Exactness(first is None, first, float(diff[0].max()), float(diff.max()))


def agreement(runs: Sequence[RunResult], ref: Reference, logit_error: float | None = None):
    """Every run's greedy tokens held to the library's under the near-tie rule
    (:mod:`labkit.util.near_tie`, through :mod:`labkit.experiments.path_agreement`): a run
    that parts from the reference where the reference's gap between its token and the run's
    is within twice `logit_error` (default: the book's stated float32 error,
    ``path_agreement.LOGIT_ERROR``) is excused, and counted. Scores are the logits both paths
    chose each token from, so the summary also reports the error measured between them.
    Returns an :class:`~labkit.util.near_tie.AgreementSummary`, one sequence per run."""
    from labkit.experiments import path_agreement as pa

    error = pa.LOGIT_ERROR if logit_error is None else logit_error
    return pa.compare([ref.tokens] * len(runs), [run.tokens for run in runs],
                      [ref.logits] * len(runs), [run.logits for run in runs], logit_error=error)


def agreement_sentence(summary, new_tokens: int) -> str:
    """The tokens' verdict in words, true for any outcome: "the split model produced the
    library model's 6 greedy tokens exactly in all 4 runs" or "... exactly in 3 of 4 runs;
    1 parted from them at a near-tie (...) and was excused"."""
    total = len(summary.sequences)
    exact = summary.exact
    head = (f"the split model produced the library model's {new_tokens} greedy tokens exactly in "
            + (("the one run" if total == 1 else f"all {total} runs") if exact == total
               else f"{exact} of {total} runs"))
    excused = [a for a in summary.sequences if a.excused]
    if excused:
        widest = max(a.margin for a in excused)
        head += (f"; {len(excused)} parted from them at a near-tie (the library's gap between the "
                 f"two tokens at most {widest:.1e} logits, within the {excused[0].tolerance:.1e} that "
                 f"rounding can close) and {'was' if len(excused) == 1 else 'were'} excused")
    if summary.failed:
        head += f"; {summary.failed} diverged beyond the near-tie tolerance"
    return head


# -- communication micro-benchmarks --------------------------------------------------------

@dataclass(frozen=True)
class CommSample:
    op: str          # "all_reduce" or "ring_hop" (one send/recv hop of a ring)
    procs: int
    nbytes: int
    seconds: list[float]

    @property
    def median(self) -> float:
        return float(torch.tensor(self.seconds).median())


def run_comm_bench(procs: int, sizes: Sequence[int], *, repeats: int = 10, inner: int = 10,
                   warmup: int = 3, workdir=None, timeout: float = 900) -> list[CommSample]:
    """Time all-reduce and one ring hop for each message size (bytes) on `procs` processes
    (gloo on the CPU): each sample is the mean of `inner` back-to-back calls."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix=f"labkit-dist-bench{procs}-") as folder:
            return run_comm_bench(procs, sizes, repeats=repeats, inner=inner, warmup=warmup,
                                  workdir=folder, timeout=timeout)
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    torchrun(procs, ["bench", "--sizes", ",".join(str(int(s)) for s in sizes), "--repeats",
                     str(repeats), "--inner", str(inner), "--warmup", str(warmup), "--out", str(out)],
             timeout=timeout)
    record = json.loads((out / "bench.json").read_text())
    return [CommSample(s["op"], record["procs"], s["bytes"], s["seconds"]) for s in record["samples"]]


@dataclass(frozen=True)
class LinearCost:
    """time(bytes) = latency + bytes / bandwidth."""

    latency_s: float
    bytes_per_s: float

    def __call__(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


def fit_linear_cost(nbytes: Sequence[float], seconds: Sequence[float]) -> LinearCost:
    """Least-squares fit of latency + bytes / bandwidth, in relative error (each point
    weighted by 1 / its time), so the small messages that fix the latency count as much as
    the large ones that fix the bandwidth."""
    x = torch.tensor(list(nbytes), dtype=torch.float64)
    y = torch.tensor(list(seconds), dtype=torch.float64)
    if len(x) < 2 or len(set(x.tolist())) < 2:
        raise ValueError("need at least two different message sizes")
    w = 1.0 / y
    a = torch.stack([torch.ones_like(x), x], dim=1) * w[:, None]
    latency, per_byte = torch.linalg.lstsq(a, y * w).solution.tolist()
    return LinearCost(latency, 1.0 / per_byte if per_byte > 0 else float("inf"))


@dataclass(frozen=True)
class MeasuredCost:
    """time(bytes) read off a benchmark's medians: the median at a measured size, a straight
    line between the two measured sizes around any other, and no extrapolation beyond the
    smallest or the largest. Unlike a latency + bandwidth fit it cannot miss its own points:
    where the medians do not follow a line (gloo's all-reduce on shared cores scatters from
    one size to the next), the fit can sit several times below or above them."""

    nbytes: tuple[float, ...]   # increasing
    seconds: tuple[float, ...]

    def __call__(self, nbytes: float) -> float:
        xs, ys = self.nbytes, self.seconds
        if not xs[0] <= nbytes <= xs[-1]:
            raise ValueError(f"{nbytes} bytes is outside the measured sizes {xs[0]}..{xs[-1]}")
        i = bisect_left(xs, nbytes)
        if xs[i] == nbytes:
            return ys[i]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)

    def bytes_share(self, nbytes: float) -> float:
        """The share of time(nbytes) that its bytes account for, priced at the medians' rise
        per byte from `nbytes` to the largest measured size (0 where they do not rise)."""
        top = self.nbytes[-1]
        if not nbytes < top:
            raise ValueError("bytes_share needs a size below the largest measured one")
        slope = max(0.0, (self.seconds[-1] - self(nbytes)) / (top - nbytes))
        return min(1.0, nbytes * slope / self(nbytes))


def measured_cost(nbytes: Sequence[float], seconds: Sequence[float]) -> MeasuredCost:
    """A :class:`MeasuredCost` from (size, median) pairs in any order."""
    pairs = sorted(zip(nbytes, seconds))
    if len(pairs) < 2 or len({x for x, _ in pairs}) != len(pairs):
        raise ValueError("need at least two different message sizes, each once")
    return MeasuredCost(tuple(float(x) for x, _ in pairs), tuple(float(y) for _, y in pairs))


def _by_op_and_procs(samples: Sequence[CommSample]) -> dict[tuple[str, int], list[CommSample]]:
    """The samples grouped by (op, procs), in the order first seen."""
    groups: dict[tuple[str, int], list[CommSample]] = {}
    for s in samples:
        groups.setdefault((s.op, s.procs), []).append(s)
    return groups


def measured_comm(samples: Sequence[CommSample]) -> dict[tuple[str, int], MeasuredCost]:
    """The medians of each (op, procs) as a :class:`MeasuredCost`."""
    return {key: measured_cost([s.nbytes for s in group], [s.median for s in group])
            for key, group in _by_op_and_procs(samples).items()}


@dataclass(frozen=True)
class RingAllReduce:
    """An all-reduce of N ranks priced as the textbook ring (a reduce-scatter, then an
    all-gather): 2(N - 1) hops one after another, each carrying 1/N of the message. `hop`
    prices one send/recv hop by its bytes."""

    hop: Callable[[float], float]
    procs: int

    def __call__(self, nbytes: float) -> float:
        if self.procs < 2:
            return 0.0
        return 2 * (self.procs - 1) * self.hop(nbytes / self.procs)


SAME_COST_FACTOR = 1.5
"""Two per-call communication costs within this factor of each other count as the same
(a stated band, not derived from the run it judges). Gloo's isolated all-reduce medians at
message sizes whose bytes cost next to nothing scatter by tens of percent from one size to
the next, so a tighter band would call that scatter a finding."""


def band_verdict(ratio: float, factor: float = SAME_COST_FACTOR) -> str:
    """Where `ratio` (one cost over another) lies against the band [1/factor, factor]:
    "above", "within" or "below"."""
    if not factor > 1.0:
        raise ValueError("the band's factor must exceed 1")
    if ratio > factor:
        return "above"
    return "below" if ratio < 1.0 / factor else "within"


# -- the cost model ------------------------------------------------------------------------

@dataclass(frozen=True)
class ComputeProfile:
    """Single-process decode costs by thread count: a whole decode step, and the part of it
    that a tensor-parallel split does not divide (final norm + LM head)."""

    step_s: dict[int, float]
    head_s: dict[int, float]
    step_samples: dict[int, list[float]] = field(default_factory=dict)

    @property
    def threads_alone(self) -> int:
        """The thread count of the one-process run: the largest one measured."""
        return max(self.step_s)


def measure_compute(model, prompt_ids: Sequence[int], threads: Sequence[int], *,
                    new_tokens: int = 16, repeats: int = 20) -> ComputeProfile:
    """Median decode-step and head times of the single-process model at each thread count."""
    from labkit.util.timing import num_threads

    step, head, samples = {}, {}, {}
    x = torch.randn(1, 1, model.config.hidden_size, dtype=model.dtype)
    for t in threads:
        with num_threads(t):
            greedy_decode(model, list(prompt_ids), 2)  # warm-up at this thread count
            samples[t] = greedy_decode(model, list(prompt_ids), new_tokens).step_seconds
            step[t] = float(torch.tensor(samples[t]).median())
            head[t] = measure(lambda: linear(rms_norm(x, model.final_norm, model.config.rms_norm_eps),
                                             model.lm_head), repeats=repeats).median
    return ComputeProfile(step, head, samples)


@dataclass(frozen=True)
class CostBreakdown:
    procs: int
    compute_s: float
    comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


def tensor_parallel_cost(procs: int, compute: ComputeProfile, all_reduce: LinearCost,
                         layers: int, hidden: int, *, cores: int | None = 2) -> CostBreakdown:
    """Time per token of N-way tensor parallelism:

        compute = [(step(t) - head(t)) / N + head(t)] * max(1, N t / cores)
        comm    = layers * 2 * all_reduce(hidden bytes)

    t = threads_per_rank(N): the layers' work splits N ways, the head is computed on every
    rank, and when N ranks of t threads ask for more than `cores` cores the ranks take turns.
    `cores=None`: every rank has a machine of its own (t = the one-process thread count,
    no turns): the textbook compute / N."""
    t = compute.threads_alone if cores is None else threads_per_rank(procs, cores)
    oversubscribed = 1.0 if cores is None else max(1.0, procs * t / cores)
    split = compute.step_s[t] - compute.head_s[t]
    work = (split / procs + compute.head_s[t]) * oversubscribed
    comm = 0.0 if procs == 1 else layers * 2 * all_reduce(hidden * HIDDEN_DTYPE_BYTES)
    return CostBreakdown(procs, work, comm)


def pipeline_cost(procs: int, compute: ComputeProfile, hop: LinearCost, hidden: int, *,
                  cores: int | None = 2) -> CostBreakdown:
    """Time per token of an N-stage pipeline running one sequence:

        compute = step(t)        (the stages run one after another, each on t threads)
        comm    = (N - 1) * hop(hidden bytes) + hop(token bytes)     (N > 1)

    `cores=None`: every stage has a machine of its own (t = the one-process thread count)."""
    t = compute.threads_alone if cores is None else threads_per_rank(procs, cores)
    comm = 0.0 if procs == 1 else ((procs - 1) * hop(hidden * HIDDEN_DTYPE_BYTES) + hop(TOKEN_BYTES))
    return CostBreakdown(procs, compute.step_s[t], comm)


# -- what the chapter tabulates ------------------------------------------------------------

def run_sweep(configs: Sequence[tuple[str, int]], prompt_ids: Sequence[int], new_tokens: int,
              repeats: int = 1, **kw) -> list[RunResult]:
    """Every (mode, procs) in `configs`, `repeats` times, in turns (all configs once, then
    again), so that a slow spell of a shared machine falls on all of them alike."""
    runs = []
    for repeat in range(repeats):
        for mode, procs in configs:
            run = run_generation(mode, procs, prompt_ids, new_tokens, **kw)
            runs.append(replace(run, repeat=repeat))
    return runs


def exactness_rows(runs: Sequence[RunResult], ref: Reference,
                   by_threads: dict[int, Reference] | None = None) -> list[dict]:
    """One row per run: tokens and logits against `ref`, and (if `by_threads` holds a
    reference at the run's threads per rank) the logits against the library run on as
    many threads as each rank had."""
    rows = []
    for run in runs:
        e = exactness(run.tokens, run.logits, ref)
        row = {"mode": run.mode, "processes": run.procs, "run": run.repeat + 1,
               "threads_per_rank": run.threads_per_rank,
               "tokens_identical": e.identical, "ranks_agree": run.ranks_agree,
               "prompt_logit_max_diff": e.prompt_logit_diff,
               "all_steps_logit_max_diff": e.max_logit_diff}
        same = (by_threads or {}).get(run.threads_per_rank)
        if same is not None:
            row["same_threads_logit_max_diff"] = exactness(run.tokens, run.logits, same).max_logit_diff
        rows.append(row)
    return rows


EXACTNESS_HEADERS = {
    "threads_per_rank": "threads per rank", "tokens_identical": "runs with the library's tokens",
    "ranks_agree": "ranks agree", "prompt_logit_max_diff": "largest logit diff., prompt",
    "all_steps_logit_max_diff": "largest logit diff., all steps",
    "same_threads_logit_max_diff": "vs. library on as many threads",
    "excused": "runs excused at a near-tie"}
"""Headers in words for :func:`exactness_rows`' columns as the chapter shows them (one row
per configuration: counts of runs, largest differences over them)."""


def timing_rows(runs: Sequence[RunResult]) -> list[dict]:
    """Per (mode, procs): the median decode step over every step of every repeat, its 95%
    bootstrap interval, and rank 0's communication calls per step and seconds per decode
    step (median over the repeats of `comm_seconds`)."""
    from labkit.util.compare import median_interval

    groups: dict[tuple[str, int], list[RunResult]] = {}
    for run in runs:
        groups.setdefault((run.mode, run.procs), []).append(run)
    rows = []
    for (mode, procs), group in groups.items():
        steps = [s for run in group for s in run.step_seconds]
        low, high = median_interval(steps)
        calls = sum(c["calls"] for c in group[0].comm_totals(0).values()) / len(group[0].tokens)
        seconds = [comm_seconds(run) for run in group]
        rows.append({"mode": mode, "processes": procs, "threads_per_rank": group[0].threads_per_rank,
                     "median_ms": 1e3 * float(torch.tensor(steps).median()),
                     "low_ms": 1e3 * low, "high_ms": 1e3 * high, "steps": len(steps),
                     "comm_calls_per_token": calls,
                     "comm_ms_per_token": 1e3 * float(torch.tensor(seconds).median()),
                     "samples_s": steps})
    return rows


def comm_seconds(run: RunResult) -> float:
    """Rank 0's median seconds inside communication calls per decode step."""
    return float(torch.tensor(run.ranks[0]["step_comm_s"]).median())


def fit_comm(samples: Sequence[CommSample]) -> dict[tuple[str, int], LinearCost]:
    """A latency + bandwidth fit per (op, procs), on the median of each message size."""
    return {key: fit_linear_cost([s.nbytes for s in group], [s.median for s in group])
            for key, group in _by_op_and_procs(samples).items()}


def _not_priced(nbytes: float) -> float:
    return float("nan")


def cost_rows(timing: Sequence[dict], compute: ComputeProfile,
              fits: dict[tuple[str, int], Callable[[float], float]], layers: int, hidden: int,
              cores: int = 2, own_hop: Callable[[float], float] | None = None) -> list[dict]:
    """The cost model beside each measured (mode, procs): shared cores (this machine) and
    a machine per rank, each split into compute and communication. `fits` prices each
    (op, procs) call on this machine's shared cores (a :class:`LinearCost` fit or the
    :class:`MeasuredCost` medians). A machine per rank must not pay a cost measured with
    ranks sharing cores: it prices communication by `own_hop`, one send/recv hop measured
    between processes that had a core each (an all-reduce as a :class:`RingAllReduce` of
    it); without `own_hop` its split configurations are NaN (not priced)."""
    rows = []
    for row in timing:
        mode, procs = row["mode"], row["processes"]
        hop = own_hop or _not_priced
        if mode == "tensor":
            fit = fits.get(("all_reduce", procs), LinearCost(0.0, float("inf")))
            shared = tensor_parallel_cost(procs, compute, fit, layers, hidden, cores=cores)
            own = tensor_parallel_cost(procs, compute, RingAllReduce(hop, procs), layers,
                                       hidden, cores=None)
        else:
            fit = fits.get(("ring_hop", procs), LinearCost(0.0, float("inf")))
            shared = pipeline_cost(procs, compute, fit, hidden, cores=cores)
            own = pipeline_cost(procs, compute, hop, hidden, cores=None)
        rows.append({"mode": mode, "processes": procs,
                     "model_compute_ms": 1e3 * shared.compute_s, "model_comm_ms": 1e3 * shared.comm_s,
                     "model_shared_cores_ms": 1e3 * shared.total_s,
                     "model_own_cores_ms": 1e3 * own.total_s,
                     "model_own_comm_ms": 1e3 * own.comm_s,
                     "measured_ms": row["median_ms"], "measured_comm_ms": row["comm_ms_per_token"],
                     "measured_over_model": row["median_ms"] / (1e3 * shared.total_s)})
    return rows
