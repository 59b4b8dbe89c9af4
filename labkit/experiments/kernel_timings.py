"""The engine's kernels measured against the library ones (chapter 18): the decode step
with each way of doing the matrix products, paged attention in C against PyTorch (decode:
gather the blocks and one padded SDPA call; prefill: SDPA's causal kernel per prompt), and
a `labkit bench` record as a table."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from labkit.experiments.compilation import forward_step, greedy_run, prefill, step_at
from labkit.util.timing import Timing, measure_interleaved
from labkit.engine.paged_cache import KVPool, PagedBatch
from labkit.kernels import native
from labkit.kernels.packed import pack_model
from labkit.models.llama import MATRICES, grouped_attention


C_GEMV = "packed + C matrix-vector kernel"

# The largest |difference| allowed between the C kernel's attention outputs and the reference's
# (float32, the timings below): both sum a few hundred terms (up to 320 keys) in different orders.
# Each output is a softmax-weighted mean of unit-normal values (|v| below about 5), and rounding
# errors of about 2^-24 ~ 6e-8 relative per term grow like the square root of the number of
# terms: sqrt(320) * 6e-8 * 5 ~ 5e-6, so 1e-5 holds with a factor of two to spare. A wrong
# block, a missed position or a mis-scaled softmax moves the outputs by 1e-2 or more.
ATTENTION_ERROR = 1e-5


def matrix_kernel_models(model) -> dict:
    """The same weights multiplied three ways: name -> model. The third way, the C
    matrix-vector kernel (`C_GEMV`), only where the kernel builds: without it the packed
    model would fall back to oneDNN and time the second way under the third's name."""
    models = {"F.linear (MKL)": model, "oneDNN, packed weights": pack_model(model, native_gemv=False)}
    if native.load() is not None:
        models[C_GEMV] = pack_model(model, native_gemv=True)
    return models


def matrix_bytes(model) -> int:
    """Bytes of the matrices one decode step reads: each layer's four and the LM head."""
    return sum(getattr(layer, name).nbytes for layer in model.layers for name in MATRICES) + model.lm_head.nbytes


def kernel_steps(model, prompt_ids: list[int], new_tokens: int,
                 repeats: int) -> tuple[dict[str, Timing], dict[str, list[int]]]:
    """For each of `matrix_kernel_models`: the eager decode step at the first generated
    position, the three timed in turns (`measure_interleaved`, `repeats` rounds) so that they
    share the machine's conditions, and `new_tokens` greedy tokens (to check that they agree)."""
    timings, runs = kernel_runs(model, prompt_ids, new_tokens, repeats)
    return timings, {name: run.token_ids for name, run in runs.items()}


def kernel_runs(model, prompt_ids: list[int], new_tokens: int, repeats: int) -> tuple[dict[str, Timing], dict]:
    """:func:`kernel_steps` with each way's greedy run whole (`labkit.engine.loop.GreedyRun`:
    tokens and the logits that chose them), for :func:`kernel_agreement`."""
    steps, runs = {}, {}
    max_len = len(prompt_ids) + new_tokens
    for name, m in matrix_kernel_models(model).items():
        cache, _ = prefill(m, prompt_ids, False, max_len)
        steps[name] = step_at(m, forward_step, cache, len(prompt_ids))
        runs[name] = greedy_run(m, forward_step, prompt_ids, new_tokens, static=False)
    return measure_interleaved(steps, rounds=repeats, warmup=1), runs


def kernel_agreement(runs: dict, reference: str = "F.linear (MKL)", logit_error: float | None = None):
    """Every way's greedy run against the `reference` way's under the near-tie rule
    (`labkit.experiments.path_agreement`): the kernels sum in other orders, so a divergence
    is excused only where the reference's two best tokens were within the tolerance, and the
    logit error between the ways is measured. One sequence per other way, in order; not
    checked (see `path_agreement.check`)."""
    from labkit.experiments import path_agreement as pa

    ref = runs[reference]
    others = [name for name in runs if name != reference]
    return pa.compare([ref.token_ids] * len(others), [runs[n].token_ids for n in others],
                      [ref.logits] * len(others), [runs[n].logits for n in others],
                      pa.LOGIT_ERROR if logit_error is None else logit_error)


def random_pool(config, batch: int, longest: int, block_size: int = 16, seed: int = 0):
    """A one-layer KV pool of random keys and values, `batch` sequences of random lengths in
    [1, longest] with their own blocks, and one query per sequence."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (batch,), generator=g)
    width = -(-longest // block_size)
    pool = KVPool(_one_layer(config), batch * width, block_size)
    pool.keys.normal_(generator=g)
    pool.values.normal_(generator=g)
    tables = torch.randperm(batch * width, generator=g).view(batch, width)
    q = torch.randn(batch, config.num_kv_heads, config.num_heads // config.num_kv_heads,
                    config.head_dim, generator=g)
    return pool, tables, lengths, q


def gathered_attention(pool: KVPool, tables: torch.Tensor, lengths: torch.Tensor,
                       q: torch.Tensor) -> torch.Tensor:
    """The reference: copy every sequence's blocks out, pad to the longest, one SDPA call."""
    keys, values = pool.gather(0, tables)
    mask = torch.arange(keys.shape[2])[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :])


def decode_attention_timings(config, batch: int, longest: int, repeats: int,
                             seed: int = 0) -> dict[str, Timing | float | str]:
    """Time one layer's decode attention both ways, in turns (`measure_interleaved`, `repeats`
    rounds, so that a slow spell of the machine falls on both); `max_abs_diff` compares their
    outputs (see `ATTENTION_ERROR`). Without the C kernel here the C entry is the string
    NOT_RUN: <why>, and nothing is compared."""
    pool, tables, lengths, q = random_pool(config, batch, longest, seed=seed)
    gather = lambda: gathered_attention(pool, tables, lengths, q)  # noqa: E731
    ways = {"gather + SDPA": gather}
    if native.load() is not None:
        ways["C kernel"] = lambda: native.paged_decode_attention(pool.keys[0], pool.values[0],
                                                                 tables, lengths, q)
    out = {"context_tokens": int(lengths.sum()), **measure_interleaved(ways, rounds=repeats, warmup=2)}
    if "C kernel" not in ways:
        out["C kernel"] = f"NOT_RUN: {native.why_unavailable()}"
        return out
    out["max_abs_diff"] = float((ways["C kernel"]() - gather()).abs().max())
    return out


def prefill_attention_timings(config, lengths: list[int], repeats: int,
                              seed: int = 0) -> dict[str, Timing | float | str]:
    """One layer's attention for a prefill step that packs whole prompts of these lengths,
    timed both ways, in turns (`measure_interleaved`, `repeats` rounds): SDPA's causal kernel
    on each prompt's own keys and values (the engine's reference path), and the C kernel
    reading them from a paged pool (one call for the step). `max_abs_diff` compares the
    outputs (see `ATTENTION_ERROR`); without the C kernel its entry is NOT_RUN."""
    g = torch.Generator().manual_seed(seed)
    kv_heads, group, dim = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
    rows = sum(lengths)
    q = torch.randn(1, kv_heads, group, rows, dim, generator=g)
    k, v = torch.randn(1, kv_heads, rows, dim, generator=g), torch.randn(1, kv_heads, rows, dim, generator=g)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]

    def sdpa():
        out = torch.empty_like(q)
        for start, n in zip(starts, lengths):
            span = slice(start, start + n)
            out[:, :, :, span] = grouped_attention(q[:, :, :, span], k[:, :, span], v[:, :, span], 0)
        return out

    if native.load() is None:
        timed = measure_interleaved({"causal SDPA per prompt": sdpa}, rounds=repeats, warmup=2)
        return {"rows": rows, **timed, "C kernel": f"NOT_RUN: {native.why_unavailable()}"}
    # The engine's step over a pool whose blocks are handed out in random order: its first
    # call writes the prompts' keys and values; then the kernel alone is timed.
    block_size = 16
    widths = [-(-n // block_size) for n in lengths]
    pool = KVPool(_one_layer(config), sum(widths), block_size)
    order = torch.randperm(sum(widths), generator=g).tolist()
    tables = [order[sum(widths[:i]):sum(widths[:i + 1])] for i in range(len(lengths))]
    step = PagedBatch(pool, tables, [0] * len(lengths), lengths)
    attended = step.attend(0, q, k, v)
    rows_q = q[0].permute(2, 0, 1, 3).contiguous()
    run = lambda: native.paged_attention(pool.keys[0], pool.values[0], step.tables, step.tiles,  # noqa: E731
                                         rows_q, checked=True)
    out = {"rows": rows, **measure_interleaved({"causal SDPA per prompt": sdpa, "C kernel": run},
                                               rounds=repeats, warmup=2)}
    out["max_abs_diff"] = float((attended - sdpa()).abs().max())
    return out


def _one_layer(config):
    """The config of a one-layer model: a pool for one layer's timing."""
    return type(config)(**{**vars(config), "num_layers": 1})


def bench_table(path: str | Path):
    """A `labkit bench` summary.json as (figures DataFrame, facts about the run)."""
    import pandas as pd

    summary = json.loads(Path(path).read_text())
    rows = [{"figure": f["name"], "what": f["what"], "ours": f["value"], "baseline": f["baseline"],
             "unit": f["unit"], "ratio": f["ratio"], "target": f["target"],
             "met": "yes" if f["passed"] else "NO"} for f in summary["figures"]]
    git = summary.get("environment", {}).get("git", {})
    facts = {"timestamp": summary.get("timestamp"), "threads": summary.get("threads"),
             "quick": summary.get("quick"), "revision": git.get("revision"), "dirty": git.get("dirty")}
    return pd.DataFrame(rows), facts
