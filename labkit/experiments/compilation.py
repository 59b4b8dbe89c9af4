"""Chapter 18's experiments: the decode step under `torch.compile` (Inductor on a CPU, which
writes C++ and builds it with the system compiler), what makes Dynamo recompile, and what
happens when the compiler is not on PATH.

Two details make the step compile at all on torch 2.13 (CPU). `Llama.forward` runs under
`torch.inference_mode()`, and compiling a step that writes into views of the cache under
inference mode fails inside AOT functionalization ("Cannot set version_counter for
inference tensor", pytorch/pytorch#180823): the step calls the undecorated forward
(`Llama.forward.__wrapped__`) under `torch.no_grad()`, with caches of ordinary tensors.
And `StaticCache` keeps its position in a tensor only: a Python int that changes every
step (as the contiguous cache's `length`) is a value Dynamo guards on, so it recompiles.

The compiled function takes the model as an argument (`forward_step(model, ids, cache)`), so
one compiled function can meet a model of another dtype, and a guard on dtype shows up.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from labkit.engine.loop import GreedyRun, greedy_continue
from labkit.models.llama import KVCache, Llama, shallow_copy
from labkit.util.compare import compare
from labkit.util.timing import Timing

@dataclasses.dataclass
class CompileCounter:
    """An Inductor backend that records each graph it compiles (and how long it took)."""
    graphs: list[int] = dataclasses.field(default_factory=list)      # nodes per compiled graph
    seconds: list[float] = dataclasses.field(default_factory=list)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        compiled = compile_fx(gm, example_inputs)
        self.graphs.append(len(gm.graph.nodes))
        self.seconds.append(time.perf_counter() - start)
        return compiled


FORWARD = Llama.forward.__wrapped__  # the forward pass without its inference_mode decorator


class StaticCache(KVCache):
    """A KV cache of fixed shape whose write position is a tensor: every decode step has the
    same shapes and the same Python values, so one compiled graph serves every position.
    Attention covers all `max_len` slots under a mask. Decode steps only (one new token)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position: int = 0):
        super().__init__(keys, values, position)
        self.position = torch.tensor(position, dtype=torch.long)

    @classmethod
    def for_model(cls, model: Llama, batch: int, max_len: int) -> "StaticCache":
        empty = KVCache.empty(model.config, batch, max_len, model.dtype)
        return cls(empty.keys, empty.values)

    def positions(self, steps: int, limit: int) -> torch.Tensor:
        # The bound is checked by the caller (`greedy_decode`): comparing a tensor with a
        # Python int would need its value, which a graph cannot have at trace time.
        return self.position + torch.arange(steps)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, kv_heads, group, steps, dim = q.shape
        if steps != 1:
            raise ValueError("StaticCache serves decode steps (one token per sequence)")
        keys, values = self.keys[layer, :batch], self.values[layer, :batch]
        keys.index_copy_(2, self.position.view(1), k)
        values.index_copy_(2, self.position.view(1), v)
        visible = (torch.arange(self.max_len) <= self.position).view(1, -1)
        out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, group, dim), keys, values,
                                             attn_mask=visible)
        return out.view(batch, kv_heads, group, 1, dim)

    def advance(self, steps: int) -> None:
        self.position += steps  # a tensor update: no Python value for Dynamo to guard on


def forward_step(model: Llama, token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One decode step: logits [batch, vocab] of the last position (the function we compile)."""
    return FORWARD(model, token_ids, cache=cache)[:, -1]


def inductor_cache_for_this_cpu() -> str:
    """Give Inductor's on-disk cache a folder of its own for this process's CPU capability
    (PyTorch's `get_cpu_capability()` and oneDNN's ISA cap), unless the environment already
    chose one, and return it. A cache filled under one capability and read under another
    gave wrong tokens here (an AVX-512 machine told `ATEN_CPU_CAPABILITY=avx2`, as the test
    matrix emulates an AVX2 laptop: token 0 from the second step on, a reference gap of 12.5
    logits); a fresh cache under either gives the eager tokens."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return chosen
    capability = torch.backends.cpu.get_cpu_capability()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "all")
    path = os.path.join(default_cache_dir(), re.sub(r"[^a-z0-9_.-]", "_", f"labkit-{capability}-{onednn}".lower()))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    from torch._inductor.utils import clear_caches

    clear_caches()
    return path


def no_compiler_reason(error: BaseException) -> str | None:
    """Why a compiled call could not run, where `error` (what it raised) comes from Inductor
    finding no working C++ compiler (`InvalidCxxCompiler`, however Dynamo wrapped it: as the
    `inner_exception` of an `InductorError`, a cause or a context, or only by name in the
    message of an error from a compile worker); None for any other error, which is a bug to
    show, not a fact about the machine."""
    from torch._inductor.exc import InvalidCxxCompiler

    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, InvalidCxxCompiler) or "InvalidCxxCompiler" in str(e):
            return "Inductor found no working C++ compiler in this process's environment"
        todo += [getattr(e, "inner_exception", None), e.__cause__, e.__context__]
    return None


def first_call(call) -> tuple[float, str | None]:
    """Run and time the first call of a compiled function: (seconds, None), or (NaN, why)
    where Inductor found no working C++ compiler (`no_compiler_reason`), so that a chapter
    records its compiled measurements as NOT_RUN with the reason instead of stopping on a
    machine without one. Any other error propagates."""
    start = time.perf_counter()
    try:
        call()
    except Exception as error:
        why = no_compiler_reason(error)
        if why is None:
            raise
        return math.nan, why
    return time.perf_counter() - start, None


def trial_call(call) -> tuple[float, str | None]:
    """:func:`first_call` for an optional variant (the frozen compile): (seconds, None), or
    (NaN, why) where it raised anything, the missing compiler's reason or the error's type
    and first line, so the chapter records that variant as NOT_RUN with the reason and
    goes on with the rest."""
    try:
        return first_call(call)
    except Exception as error:  # a failure of the variant here is a finding, not a crash
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        return math.nan, f"it raised {type(error).__name__}: {first_line}"


def compile_step(counter: CompileCounter | None = None, **options):
    """`torch.compile(forward_step)`, with `counter` as the backend if given. Dynamo's caches
    are reset first, so graphs from earlier experiments cannot serve this one."""
    torch._dynamo.reset()
    return torch.compile(forward_step, backend=counter if counter is not None else "inductor",
                         **options)


def compile_frozen_step(counter: CompileCounter):
    """`torch.compile(forward_step)` with Inductor's freezing (`torch._inductor.config.freezing`):
    the model's parameters become constants of the graph, so Inductor can fold them and pack
    each matrix product's weight once for the CPU's GEMM library, as labkit's engine packs
    its weights for oneDNN (`labkit.kernels.packed`). Dynamo reads the setting while it
    traces and Inductor while it compiles, and freezing applies only without autograd, so
    the returned step sets both (`freezing=True`, `no_grad`) around every call, recompiles
    included. `counter` must be a backend of its own: Dynamo keeps graphs per backend, so a
    frozen graph never serves an unfrozen step. Dynamo's caches are not reset, so a step
    compiled before keeps its graphs. A frozen graph holds the weights it was traced with:
    it must be compiled again after they change in place."""
    compiled = torch.compile(forward_step, backend=counter)

    def frozen_step(model: Llama, token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return compiled(model, token_ids, cache)
    return frozen_step


@torch.no_grad()
def prefill(model: Llama, prompt_ids: list[int], static: bool, max_len: int,
            batch: int = 1) -> tuple[KVCache, torch.Tensor]:
    """Prefill `prompt_ids` (eagerly, every row the same) into a fresh cache of `max_len`
    slots; returns the cache (a StaticCache if `static`) and the last position's logits."""
    if len(prompt_ids) >= min(max_len, model.rope_cos.shape[0]):
        raise ValueError("the prompt fills the cache")
    contiguous = model.new_cache(batch, max_len)
    logits = FORWARD(model, torch.tensor([prompt_ids] * batch), cache=contiguous, last_only=True)
    if not static:
        return contiguous, logits[:, -1]
    cache = StaticCache(contiguous.keys, contiguous.values)
    cache.position.fill_(len(prompt_ids))
    return cache, logits[:, -1]


@torch.no_grad()
def greedy_decode(model: Llama, step, prompt_ids: list[int], new_tokens: int, static: bool,
                  max_len: int | None = None, batch: int = 1) -> tuple[list[int], list[float]]:
    """Greedy tokens after `prompt_ids` with `step(model, ids, cache)` (eager `forward_step`
    or a compiled one) doing every decode step; returns the first row's tokens and each
    decode step's seconds."""
    run = greedy_run(model, step, prompt_ids, new_tokens, static, max_len, batch, keep_logits=False)
    return run.token_ids, run.step_seconds


@torch.no_grad()
def greedy_run(model: Llama, step, prompt_ids: list[int], new_tokens: int, static: bool,
               max_len: int | None = None, batch: int = 1, keep_logits: bool = True) -> GreedyRun:
    """:func:`greedy_decode`, keeping (unless told not to) the logits that chose each token of
    the first row, for the near-tie rule (`labkit.experiments.path_agreement`)."""
    max_len = max_len or len(prompt_ids) + new_tokens
    if len(prompt_ids) + new_tokens > min(max_len, model.rope_cos.shape[0]):
        raise ValueError("prompt + new tokens exceed the cache or the model's context")
    cache, logits = prefill(model, prompt_ids, static, max_len, batch)
    return greedy_continue(model, cache, logits, new_tokens, step=step, keep_logits=keep_logits)


def agreement(reference: GreedyRun, candidate: GreedyRun, logit_error: float | None = None):
    """The candidate run's tokens against the reference run's under the near-tie rule, with
    the logit error measured between them (`labkit.experiments.path_agreement.compare`; not
    checked). `logit_error` defaults to the stated float32 error."""
    from labkit.experiments import path_agreement as pa

    return pa.compare([reference.token_ids], [candidate.token_ids], [reference.logits],
                      [candidate.logits], pa.LOGIT_ERROR if logit_error is None else logit_error)


def step_at(model: Llama, step, cache: KVCache, position: int, token: int = 0):
    """A zero-argument call of one decode step at `position` (rewinding the cache each time),
    for `labkit.util.timing.measure`."""
    ids = torch.full((cache.keys.shape[1], 1), token, dtype=torch.long)

    @torch.no_grad()
    def call():
        if isinstance(cache, StaticCache):
            cache.position.fill_(position)
        else:
            cache.length = position
        return step(model, ids, cache)
    return call


def slice_model(model: Llama, layers: int | None = None, dtype: torch.dtype | None = None,
                device: str | torch.device | None = None) -> Llama:
    """A shallow copy of `model` with only its first `layers` layers and/or its tensors cast
    to `dtype` and/or moved to `device` (for cheap compile experiments, and the GPU). The
    original is not modified."""
    out = shallow_copy(model, layers)
    if (dtype is not None and dtype != model.dtype) or device is not None:
        out.to(device=device, dtype=dtype)  # new tensors for the copy; a tied head stays tied
    return out


@contextmanager
def recompile_reasons():
    """Collect Dynamo's recompilation messages (which guard failed) into a list, quietly."""
    reasons: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            reasons.append(record.getMessage())

    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    handler = Catch()
    torch._logging.set_logs(recompiles=True)  # Dynamo formats the message only when enabled
    logger.propagate = False                   # ... but we keep it off stderr
    logger.addHandler(handler)
    try:
        yield reasons
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


_GUARD = re.compile(r"^-\s*\d+/\d+:\s*(.*?)(\s+#.*)?$")


def failed_guards(reason: str) -> list[str]:
    """The failed guards named in one recompilation message (without their comments), one per
    graph Dynamo held for the function, leaving out graphs that failed only because another
    backend built them (BACKEND_MATCH: a second compiled step of the same function, as the
    frozen step beside the default one, whose graphs this call could never use)."""
    out = []
    for line in reason.splitlines():
        match = _GUARD.match(line.strip())
        if match and not match.group(1).startswith("BACKEND_MATCH"):
            out.append(match.group(1).strip())
    return out


def first_guard(reason: str) -> str:
    """The first failed guard named in one recompilation message (without its comment),
    graphs of other backends left out (`failed_guards`)."""
    guards = failed_guards(reason)
    if guards:
        return guards[0]
    return reason.strip().splitlines()[-1] if reason.strip() else ""


def recompile_case(runs: list[tuple], prompt_ids: list[int], new_tokens: int, max_len: int,
                   **options) -> dict:
    """Compile `forward_step` once (with `options`) and decode with it for each run
    (model, static cache?, batch, max_len or 0 for `max_len`[, threads]); count the graphs.
    Returns graphs, Inductor seconds, the first failed guard of each recompile, whether
    every run gave the eager tokens (`identical`), and the near-tie rule's verdict on them
    (`agree`, `excused`, `agreement`; compiled and eager code are two numerical paths, so a
    divergence is excused only at a near-tie, and a wider one or a logit error beyond the
    stated one (bfloat16's for a bfloat16 model) raises AssertionError)."""
    from labkit.util.timing import num_threads

    from labkit.experiments import path_agreement as pa

    counter = CompileCounter()
    step = compile_step(counter, **options)
    same, agreements = True, []
    with recompile_reasons() as reasons:
        for model, static, batch, length, *threads in runs:
            with num_threads(threads[0] if threads else None):
                got = greedy_run(model, step, prompt_ids, new_tokens, static, length or max_len, batch)
                want = greedy_run(model, forward_step, prompt_ids, new_tokens, False,
                                  length or max_len, batch)
            same = same and got.token_ids == want.token_ids
            error = pa.BF16_LOGIT_ERROR if model.dtype == torch.bfloat16 else pa.LOGIT_ERROR
            agreements.append(pa.check(agreement(want, got, error), error).sequences[0])
    together = pa.summary(agreements)
    return {"graphs": len(counter.graphs), "inductor_s": sum(counter.seconds),
            "guards": [first_guard(r) for r in reasons], "identical": same,
            "agree": together.ok, "excused": together.excused, "agreement": together}


def break_even_steps(compile_s: float, eager_step_s: float, compiled_step_s: float) -> float:
    """Decode steps after which the compile time is paid back (inf if compiling saves
    nothing per step)."""
    saved = eager_step_s - compiled_step_s
    return compile_s / saved if saved > 0 else math.inf


def compile_verdict(eager: Timing, compiled: Timing, compile_s: float) -> dict:
    """What the timings of the eager and the compiled step support, in words for the prose:
    the speed-up eager / compiled with its 95% bootstrap interval (`labkit.util.compare`),
    and a break-even (compile time over time saved per step) only where the compiled step
    is faster beyond the noise, given as the range the interval allows, to two significant
    figures. A difference inside the noise gets no break-even: dividing by a saving that may
    be zero gives a number that means nothing."""
    c = compare(compiled.samples, eager.samples, name_a="compiled", name_b="eager")
    interval = f"95% interval {c.low:.2f}-{c.high:.2f}"
    if c.verdict == "faster":
        fewest, most = (compile_s / (compiled.median * (r - 1.0)) for r in (c.high, c.low))
        speed = f"{c.ratio:.2f} times the speed of the eager step ({interval})"
        break_even = (f"about {_two_figures(break_even_steps(compile_s, eager.median, compiled.median))} "
                      f"decode steps (between {_two_figures(fewest)} and {_two_figures(most)} over the interval)")
    elif c.verdict == "slower":
        speed = f"only {c.ratio:.2f} times the speed of the eager step ({interval}), that is, slower"
        break_even = "never reached, because the compiled step was slower"
    else:
        speed = f"the speed of the eager step within the noise (ratio {c.ratio:.2f}, {interval})"
        break_even = "not defined, because the compiled step saved no time beyond the noise"
    return {"comparison": c, "speed_phrase": speed, "break_even_phrase": break_even}


def frozen_sentence(frozen: Timing, frozen_1t: Timing, eager: Timing, eager_1t: Timing,
                    compiled: Timing, threads: int, agreement_phrase: str) -> str:
    """The frozen compile's step in words for the prose: its median against the eager step's
    and the default compile's (timed in the same rounds, with `threads` threads), and with
    one thread against eager, each verdict by `labkit.util.compare`; then its greedy tokens
    against eager (`agreement_phrase`, from `path_agreement.phrase`)."""
    against_eager = compare(frozen.samples, eager.samples).phrase_than("the eager step")
    against_default = compare(frozen.samples, compiled.samples).phrase_than("the default compile")
    one = compare(frozen_1t.samples, eager_1t.samples).phrase_than("the eager step")
    return (f"With freezing a step took {1e3 * frozen.median:.1f} ms with {threads} threads: "
            f"{against_eager}, and {against_default}. With one thread it took "
            f"{1e3 * frozen_1t.median:.1f} ms, {one}. Its greedy tokens against the eager ones, "
            f"under the near-tie rule: {agreement_phrase}.")


def _two_figures(x: float) -> str:
    return f"{float(f'{x:.2g}'):,.0f}"


# -- the environment lesson -----------------------------------------------------------------
COMPILER_NAMES = ("g++", "c++", "gcc", "cc", "clang++", "clang")

_PROBE = """
import torch
f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
x = torch.arange(8.0)
assert torch.allclose(f(x), torch.sin(x) * 2 + 1)
print("compiled and ran")
"""


def path_without_compiler(path: str | None = None) -> str:
    """PATH with every directory that holds a C/C++ compiler removed (the Python
    interpreter is called by its full path, so it is not needed on PATH)."""
    keep = []
    for d in (path if path is not None else os.environ.get("PATH", "")).split(os.pathsep):
        if d and not any(os.path.exists(os.path.join(d, n)) for n in COMPILER_NAMES):
            keep.append(d)
    return os.pathsep.join(keep)


def _probe_env(strip_compiler: bool, cache: str) -> dict:
    env = dict(os.environ)
    env.pop("CXX", None)
    env.pop("CC", None)
    if strip_compiler:
        env["PATH"] = path_without_compiler(env.get("PATH", ""))
    env["TORCHINDUCTOR_CACHE_DIR"] = cache
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    return env


def compile_in_subprocess(*strip_compiler: bool, timeout: float = 300.0) -> list[dict]:
    """Compile and run a tiny function with Inductor in fresh Python processes (one per
    argument, run side by side), each with an empty Inductor cache and CXX unset, with the
    C++ compiler's directories removed from PATH where the argument is True.
    Returns, per process: ok, the last error line (if it failed), the PATH, seconds."""
    with tempfile.TemporaryDirectory(prefix="inductor-probe-") as root:
        start = time.perf_counter()
        procs = []
        for i, strip in enumerate(strip_compiler):
            env = _probe_env(strip, os.path.join(root, str(i)))
            procs.append((env, subprocess.Popen([sys.executable, "-c", _PROBE], env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                text=True)))
        results = []
        for env, proc in procs:
            out, err = proc.communicate(timeout=timeout)
            errors = [ln for ln in err.splitlines() if "Error" in ln or "error" in ln]
            failed = proc.returncode != 0 or "compiled and ran" not in out
            results.append({"ok": not failed, "error": errors[-1].strip() if failed and errors else "",
                            "path": env["PATH"], "seconds": time.perf_counter() - start})
    return results


# -- CUDA graphs (runs only where CUDA is present) --------------------------------------------
@torch.no_grad()
def cuda_graph_decode(model: Llama, prompt_ids: list[int], new_tokens: int,
                      max_len: int | None = None) -> dict:
    """Greedy decode on the GPU twice: eagerly, and by replaying one captured CUDA graph of
    the decode step (the StaticCache keeps every step's shapes and addresses the same).
    `model` must already be on the GPU's default device (`torch.set_default_device`).
    Returns both token lists and the median step milliseconds of each."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    max_len = max_len or len(prompt_ids) + new_tokens
    eager_tokens, eager_times = greedy_decode(model, forward_step, prompt_ids, new_tokens, True,
                                              max_len)
    cache, logits = prefill(model, prompt_ids, True, max_len)
    ids = logits.argmax(-1, keepdim=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (allocations, kernels)
        for _ in range(2):
            cache.position.fill_(len(prompt_ids))
            forward_step(model, ids, cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    cache.position.fill_(len(prompt_ids))
    with torch.cuda.graph(graph):
        out = forward_step(model, ids, cache)  # `ids` and `out` are the graph's fixed buffers
    cache.position.fill_(len(prompt_ids))  # capture ran nothing; state is as after prefill
    tokens, times = [int(ids[0, 0])], []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        graph.replay()
        ids.copy_(out.argmax(-1, keepdim=True))
        tokens.append(int(ids[0, 0]))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    median = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    return {"eager_tokens": eager_tokens, "graph_tokens": tokens,
            "eager_ms": median(eager_times), "graph_ms": median(times)}
