"""What each configuration of the model and engine costs, and the line that names one.

Chapter 6 measures the table; every chapter that times the engine or the model names its
configuration by `configuration_line`.

A SmolLM2 decode step costs 14 ms in one chapter and 39 ms in another because the two ran
different code: the plain PyTorch model (`F.linear` on the weights as loaded) or the engine,
float32 weights packed for oneDNN with labkit's C matrix-vector kernel, bfloat16 rows or the
model file's Q4_1 blocks read in place, one thread or two. `configuration_line(...)` reads
what runs from the objects themselves (the layer modules the backend put in the model, the
KV pool's dtype and attention path, torch's thread count, the CPU), never from a label
somebody typed, so a chapter's line cannot claim a path it did not run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from labkit.engine.contracts import TransformersAdapter
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.scheduler import SchedulerConfig
from labkit.kernels import native
from labkit.kernels.bf16_weights import OneDNNBF16Linear
from labkit.kernels.gguf_blocks import BlockLinear, BlockLlama
from labkit.kernels.packed import PackedLinear
from labkit.sampling import SamplingParams
from labkit.util.environment import cpu_info
from labkit.util.timing import num_threads

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
BLOCK_NAMES = {"Q4_1": "Q4_1", "Q4_1x8": "Q4_1", "Q8_0": "Q8_0", "BF16": "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def model_name(model) -> str:
    """The registry name labkit's loader gave the model, else its class (a transformers
    model: its class and the folder it came from, if any)."""
    name = getattr(model, "name", None)
    if name:
        return str(name)
    config = getattr(model, "config", None)
    source = getattr(config, "name_or_path", "") or ""
    return f"{type(model).__name__} {source}".strip()


def _first_matrix(model):
    """The first layer's fused attention input matrix: a tensor (the model as loaded) or the
    module a backend put in its place."""
    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no labkit layers to read the matmul path from")
    return layers[0].qkv


def dense_path(module) -> str:
    """The path of a product of many rows (prefill) through `module` or a plain weight."""
    if isinstance(module, torch.Tensor):
        return f"{dtype_name(module.dtype)} PyTorch F.linear"
    if isinstance(module, OneDNNBF16Linear):
        return "oneDNN bfloat16 GEMM"
    if isinstance(module, PackedLinear):
        return f"oneDNN-packed {dtype_name(module.weight.dtype)}"
    raise ValueError(f"no description for a {type(module).__name__} layer")


def matmul_path(model) -> str:
    """The weight format and the matrix products a labkit model runs: what its first layer
    holds, with the LM head's format where it differs."""
    first = _first_matrix(model)
    if isinstance(first, torch.Tensor):
        return f"{dtype_name(first.dtype)}, PyTorch F.linear (model as loaded)"
    if isinstance(first, PackedLinear):
        gemv = first.native_gemv and native.load() is not None
        return f"{dtype_name(first.weight.dtype)}, oneDNN-packed" + (" + labkit C gemv" if gemv else "")
    if isinstance(first, BlockLinear):
        head = model.lm_head
        if first.kind == "BF16":
            words = "bfloat16 rows, labkit C kernel"
        else:
            words = f"{BLOCK_NAMES[first.kind]} blocks in place, labkit C kernel"
            if isinstance(head, BlockLinear) and BLOCK_NAMES[head.kind] != BLOCK_NAMES[first.kind]:
                words += f" (LM head {BLOCK_NAMES[head.kind]})"
        if first.quantize_x:
            words += ", activations rounded to int8 blocks"
        if isinstance(model, BlockLlama):
            words += ", one C call a step"
        if first.max_rows < 1 << 40:  # bigger steps (prefill) go to the dense module
            words += f" of up to {first.max_rows} rows, more rows: {dense_path(first.dense)}"
        return words
    raise ValueError(f"no description for a {type(first).__name__} layer")


def engine_parts(engine: LLMEngine) -> list[str]:
    pool = engine.pool
    attention = ("labkit C paged attention" if pool.native
                 else "gather + SDPA (a whole prompt: SDPA causal)")
    if pool.windows is not None and any(w is not None for w in pool.windows):
        attention = "gather + SDPA with window masks"
    return [f"engine weights {engine.weights}: {matmul_path(engine.model)}",
            f"KV {dtype_name(pool.dtype)} in blocks of {pool.block_size}", attention]


def model_parts(model) -> list[str]:
    """A model called directly (no engine): its own matrices and attention."""
    if hasattr(model, "layers"):  # a labkit model: Llama (or one a backend prepared), Gemma 3
        # a whole prompt runs SDPA's causal kernel; a chunk after cached positions (and a
        # window that hides keys) hands SDPA a mask instead (models/llama.py, window_cache.py)
        attention = ("SDPA, window masks; KV cache rolling per window by default"
                     if hasattr(model.config, "layer_windows")
                     else "SDPA causal for a whole prompt, masked for a later chunk; contiguous KV cache")
        return [matmul_path(model), attention]
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is None:
        raise ValueError(f"{type(model).__name__} is neither a labkit model nor a transformers model")
    weight = next(model.parameters())
    return [f"transformers {dtype_name(weight.dtype)}, nn.Linear", f"attention {implementation}"]


def configuration_line(subject, model=None, *, threads: int | Sequence[int] | None = None) -> str:
    """One line naming what runs: model; weight mode and matmul path; KV dtype and block
    size (paged engine); attention path; torch threads; CPU model.

    `subject` is an `LLMEngine`, an `EngineConfig` (then `model` is the model it serves:
    an engine with a one-block pool is built to read what that config runs, and a weight
    mode that cannot run is the engine's ValueError) or a bare model (labkit's or
    transformers'), called directly. `threads`: the thread count(s) a measurement set
    (default: torch's present setting)."""
    if isinstance(subject, EngineConfig):
        if model is None:
            raise ValueError("an EngineConfig needs the model it serves")
        subject = LLMEngine(model, replace(subject, kv_cache_tokens=subject.block_size,
                                           fit_context_to_pool=False, max_model_len=None))
    elif model is not None:
        raise ValueError("a model goes with an EngineConfig only")
    if isinstance(subject, LLMEngine):
        name, parts = model_name(subject.model), engine_parts(subject)
    else:
        name, parts = model_name(subject), model_parts(subject)
    counts = [torch.get_num_threads()] if threads is None else (
        [threads] if isinstance(threads, int) else list(threads))
    if not counts or any(not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"threads must be positive integers, got {threads!r}")
    words = " and ".join(str(c) for c in counts) + (" torch threads" if counts != [1] else " torch thread")
    cpu = cpu_info()["model"] or "CPU model unknown"
    return "; ".join([name, *parts, words, cpu])



# -- the reference costs -----------------------------------------------------------------------

class PlainModelTimer:
    """A model called directly, as engine v0's loop calls it (a `LogitsModel`: a labkit model
    or a transformers one through `TransformersAdapter`): its own KV cache, the logits of the
    last position only, the greedy token by argmax."""

    def __init__(self, model):
        self.model = model

    def prefill(self, ids: Sequence[int]) -> None:
        cache = self.model.new_cache(batch=1, max_len=len(ids) + 1)
        self.model(torch.tensor([list(ids)]), cache=cache, last_only=True)[0, -1].argmax()

    def decode(self, ids: Sequence[int], steps: int) -> list[float]:
        cache = self.model.new_cache(batch=1, max_len=len(ids) + steps + 1)
        token = self.model(torch.tensor([list(ids)]), cache=cache, last_only=True)[0, -1].argmax()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            token = self.model(token.view(1, 1), cache=cache, last_only=True)[0, -1].argmax()
            times.append(time.perf_counter() - start)
        return times


class EngineTimer:
    """An `LLMEngine`: a prefill is the steps from adding a one-token request until it
    finishes (one step where the scheduler's budget holds the prompt); a decode step is one
    `step()` of a single running request."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def _request(self, ids: Sequence[int], max_tokens: int) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return self.engine.add_request(list(ids), params)

    def prefill(self, ids: Sequence[int]) -> None:
        request = self._request(ids, 1)
        while not self.engine.requests[request].done:
            self.engine.step()
        self.engine.release(request)

    def decode(self, ids: Sequence[int], steps: int) -> list[float]:
        request = self._request(ids, steps + 1)
        while not self.engine.requests[request].seqs[0].output_token_ids:
            self.engine.step()  # the prompt, and the first token
        times = []
        while not self.engine.requests[request].done:
            start = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - start)
        self.engine.release(request)
        return times


def timer_for(subject):
    """The timer of an `LLMEngine`, a labkit model or a transformers model."""
    if isinstance(subject, LLMEngine):
        return EngineTimer(subject)
    if hasattr(subject, "layers"):
        return PlainModelTimer(subject)
    if hasattr(getattr(subject, "config", None), "_attn_implementation"):
        return PlainModelTimer(TransformersAdapter(subject))  # transformers' cache, last logits
    raise ValueError(f"cannot time a {type(subject).__name__}")


def reference_engines(model, longest: int, skipped: dict[str, str] | None = None) -> dict[str, LLMEngine]:
    """The engine in each weight mode, and with fast_kernels=False, serving `model`: a pool
    just large enough for one sequence of `longest` tokens, no prefix caching (a timed
    prompt must be computed every time), a step budget that holds a whole prompt. A mode
    that cannot run here (no C compiler, a model it does not serve) raises its ValueError,
    or, given a `skipped` dict, is left out and its reason put there."""
    pool = -(-(longest + 64) // 16) * 16
    base = EngineConfig(kv_cache_tokens=pool, prefix_caching=False,
                        scheduler=SchedulerConfig(max_batched_tokens=longest, max_num_seqs=1))
    configs = {"engine, fast_kernels=False": replace(base, fast_kernels=False),
               "engine f32": replace(base, weights="f32"), "engine bf16": replace(base, weights="bf16"),
               "engine gguf": replace(base, weights="gguf"),
               "engine gguf-int8": replace(base, weights="gguf-int8")}
    engines = {}
    for label, config in configs.items():
        try:
            engines[label] = LLMEngine(model, config)
        except ValueError as exc:
            if skipped is None:
                raise
            skipped[label] = str(exc)
    return engines


@dataclass(frozen=True)
class CostSample:
    """One round's timing of one configuration on one thread count."""
    label: str
    threads: int
    round: int
    decode_step_s: float                 # median of the round's decode steps
    prefill_s_per_token: dict[int, float]  # by prompt length


def measure_reference_costs(subjects: Mapping[str, Any], threads: Mapping[str, Sequence[int]], *,
                            lengths: Sequence[int] = (128, 1024), context: int = 32, steps: int = 8,
                            rounds: int = 3, seed: int = 0,
                            timer: Callable[[Any], Any] = timer_for) -> list[CostSample]:
    """Time every subject (an `LLMEngine`, a labkit model, a transformers model) on each of
    its thread counts, interleaved round by round (all subjects and thread counts once, then
    again): a decode step after a prompt of `context` tokens (the median of `steps` steps)
    and the prefill of prompts of each of `lengths` tokens, per token. The prompts are
    seeded random token ids. An untimed round (decode and the shortest prompt) warms each
    path first."""
    if rounds < 3:
        raise ValueError(f"a median and its spread need at least 3 rounds, got {rounds}")
    timers = {label: timer(subject) for label, subject in subjects.items()}
    vocab = min(_vocab_size(subject) for subject in subjects.values())
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (max(lengths) + context,), generator=generator).tolist()
    samples = []
    for round_index in range(-1, rounds):  # round -1: the warm-up (shortest prompt), not kept
        for label, run in timers.items():
            for count in threads[label]:
                with num_threads(count):
                    decode = statistics.median(run.decode(ids[:context], steps))
                    prefill = {}
                    for n in lengths if round_index >= 0 else lengths[:1]:
                        start = time.perf_counter()
                        run.prefill(ids[:n])
                        prefill[n] = (time.perf_counter() - start) / n
                if round_index >= 0:
                    samples.append(CostSample(label, count, round_index, decode, prefill))
    return samples


def _vocab_size(subject) -> int:
    model = subject.model if isinstance(subject, LLMEngine) else subject
    return model.config.vocab_size


def summarize_costs(samples: Sequence[CostSample]) -> list[dict[str, Any]]:
    """One row per (configuration, threads): the median over rounds of the decode step (ms)
    and of each prefill length (ms a token), each with the lowest and highest round."""
    groups: dict[tuple[str, int], list[CostSample]] = {}
    for sample in samples:
        groups.setdefault((sample.label, sample.threads), []).append(sample)
    rows = []
    for (label, count), group in groups.items():
        row: dict[str, Any] = {"configuration": label, "threads": count, "rounds": len(group)}
        columns = {"decode_step_ms": [1e3 * s.decode_step_s for s in group]}
        for n in group[0].prefill_s_per_token:
            columns[f"prefill_{n}_ms_per_token"] = [1e3 * s.prefill_s_per_token[n] for s in group]
        for name, values in columns.items():
            row[name] = statistics.median(values)
            row[f"{name}_low"], row[f"{name}_high"] = min(values), max(values)
        rows.append(row)
    return rows


def cost_table_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """`summarize_costs` rows as a table a reader reads: each cost as "median (low-high)"."""
    def cell(row, name, fmt):
        return f"{fmt.format(row[name])} ({fmt.format(row[name + '_low'])}-{fmt.format(row[name + '_high'])})"

    out = []
    for row in rows:
        entry = {"configuration": row["configuration"], "threads": str(row["threads"]),
                 "decode step (ms), median (range)": cell(row, "decode_step_ms", "{:.1f}")}
        for name in row:
            if name.startswith("prefill_") and name.endswith("_ms_per_token"):
                n = int(name.split("_")[1])
                entry[f"prefill of {n:,} tokens (ms a token), median (range)"] = cell(row, name, "{:.2f}")
        out.append(entry)
    return out


__all__ = ["configuration_line", "matmul_path", "model_name", "dense_path", "dtype_name",
           "PlainModelTimer", "EngineTimer", "timer_for", "reference_engines",
           "CostSample", "measure_reference_costs", "summarize_costs", "cost_table_rows"]
