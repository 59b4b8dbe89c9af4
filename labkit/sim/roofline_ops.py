"""A catalogue of real operations for testing the roofline, and a decode step as a list of ops.

Each entry pairs a `labkit.sim.roofline.Op` (closed-form FLOPs and bytes) with a `make()`
that allocates the inputs and returns a zero-argument callable running the operation on
this machine (float32, CPU or `device`). Inputs are built lazily, so a catalogue of many
ops holds only the tensors of the op being measured.

Byte counts are the minimum traffic: every input read once and the output written once
(what an ideal kernel with perfect caching would move). Each entry also has a `footprint`:
the bytes its repeated calls touch in all. An op called again and again on the same small
inputs finds them in the cache, so it is not timed against memory; `gemv_from_memory`
rotates through enough copies of a weight matrix that each call's copy has been pushed out
by the others, as a decode step does with its 540 MB of distinct weights. `residence` is the
one definition of where an op's operands live (cache, partly cached, memory). FLOP counts follow the usual
conventions: a multiply-add is 2 FLOPs, elementwise ops count a few FLOPs per element.

`measure_step_products` times a decode step's weight products alone at each batch size, and
`largest_step_jump` / `jump_reading` say how much of the step's largest jump they carry.

`decode_step_ops(config, batch, position)` writes one batched decode step of a Llama model
(the forward pass in labkit/models/llama.py with a KV cache) as the list of ops it runs, so
that the roofline can predict a step as a sum of per-op predictions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from labkit.util.machine import memory_read_buffer_bytes
from labkit.util.timing import measure
from labkit.sim.roofline import Machine, Op, bound, last_level_cache_bytes, matmul_op, predict

F32 = 4  # bytes per float32 element


@dataclass(frozen=True)
class CatalogueOp:
    """An Op with a kind, the shape of its output, and a factory for a runnable callable.

    `footprint` is the bytes that repeated calls touch in all (by default the op's own
    bytes: every call reuses the same inputs)."""

    op: Op
    kind: str
    out_shape: tuple[int, ...]
    make: Callable[[], Callable[[], torch.Tensor]]
    footprint: float | None = None

    @property
    def footprint_bytes(self) -> float:
        return self.op.bytes if self.footprint is None else self.footprint

    @property
    def name(self) -> str:
        return self.op.name


def _rand(*shape: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, device=device)


# -- single-op constructors -----------------------------------------------------------------
def gemm(m: int, n: int, k: int, name: str = "", kind: str = "gemm",
         device: str = "cpu") -> CatalogueOp:
    """x [m, k] @ W^T with W [n, k] (F.linear, the layout of a model's weights)."""
    def make():
        x, w = _rand(m, k, device=device), _rand(n, k, device=device)
        return lambda: F.linear(x, w)
    return CatalogueOp(matmul_op(m, n, k, name=name or f"{kind} {m}x{k}x{n}"), kind, (m, n), make)


def residence(footprint: float, llc_bytes: int, memory_bytes: int | None = None) -> str:
    """Where repeated calls of an op find their operands, by the book's one definition:
    "cache" when the bytes they touch in all fit in the last-level cache, "memory" when they
    are at least `memory_bytes` (default `labkit.util.machine.memory_read_buffer_bytes`, the
    rule the bandwidth ceiling is measured by: four times the cache, within fixed limits),
    and "partly cached" between the two, where a cache may still hold part of them."""
    memory = memory_read_buffer_bytes(llc_bytes) if memory_bytes is None else memory_bytes
    if footprint <= llc_bytes:
        return "cache"
    return "memory" if footprint >= memory else "partly cached"


def gemv_from_memory(n: int, k: int, name: str, llc_bytes: int, device: str = "cpu",
                     memory_bytes: int | None = None) -> CatalogueOp:
    """x [1, k] @ W^T, each call with the next of enough copies of W [n, k] that together
    they are at least `memory_bytes` (default: the book's rule for a read from memory,
    `memory_read_buffer_bytes(llc_bytes)`; see `residence`): the copies are read in the order
    they were written, so each call finds its weights evicted, as in a decode step."""
    op = matmul_op(1, n, k, name=name)
    memory = memory_read_buffer_bytes(llc_bytes) if memory_bytes is None else memory_bytes
    copies = max(1, -(-memory // (F32 * n * k)))

    def make():
        x = _rand(1, k, device=device)
        weights = [_rand(n, k, device=device) for _ in range(copies)]
        turn = [0]

        def call():
            w = weights[turn[0]]
            turn[0] = (turn[0] + 1) % copies
            return F.linear(x, w)
        return call
    return CatalogueOp(op, "gemv from memory", (1, n), make, footprint=float(copies * op.bytes))


def bmm(b: int, m: int, n: int, k: int, name: str = "", device: str = "cpu") -> CatalogueOp:
    """b independent [m, k] @ [k, n] products (torch.bmm)."""
    def make():
        x, y = _rand(b, m, k, device=device), _rand(b, k, n, device=device)
        return lambda: torch.bmm(x, y)
    op = Op(name or f"bmm {b}x({m}x{k}x{n})", 2.0 * b * m * n * k,
            float(F32 * b * (m * k + k * n + m * n)))
    return CatalogueOp(op, "bmm", (b, m, n), make)


_ELEMENTWISE = {
    # name: (inputs read, FLOPs per element, function of the inputs)
    "add": (2, 1.0, lambda a, b: a + b),
    "mul": (2, 1.0, lambda a, b: a * b),
    "silu": (1, 4.0, lambda a: F.silu(a)),
    "silu*mul": (2, 5.0, lambda a, b: F.silu(a) * b),
}


def elementwise(fn: str, n: int, device: str = "cpu") -> CatalogueOp:
    """An elementwise op over n float32 elements: add, mul, silu or silu*mul (SwiGLU)."""
    reads, flops, f = _ELEMENTWISE[fn]

    def make():
        args = [_rand(n, device=device) for _ in range(reads)]
        return lambda: f(*args)
    op = Op(f"{fn} {n:,}", flops * n, float(F32 * n * (reads + 1)))
    return CatalogueOp(op, "elementwise", (n,), make)


def softmax(rows: int, cols: int, device: str = "cpu") -> CatalogueOp:
    """Softmax over the last dim: max, subtract, exp, sum, divide ~ 5 FLOPs per element."""
    def make():
        x = _rand(rows, cols, device=device)
        return lambda: torch.softmax(x, dim=-1)
    op = Op(f"softmax {rows}x{cols}", 5.0 * rows * cols, float(F32 * 2 * rows * cols))
    return CatalogueOp(op, "softmax", (rows, cols), make)


def rmsnorm(rows: int, hidden: int, eps: float = 1e-5, device: str = "cpu") -> CatalogueOp:
    """RMSNorm as the model computes it: square, mean, rsqrt, scale, weight ~ 4 FLOPs/element."""
    from labkit.models.llama import rms_norm

    def make():
        x, w = _rand(rows, hidden, device=device), _rand(hidden, device=device)
        return lambda: rms_norm(x, w, eps)
    op = Op(f"rmsnorm {rows}x{hidden}", 4.0 * rows * hidden,
            float(F32 * (2 * rows * hidden + hidden)))
    return CatalogueOp(op, "rmsnorm", (rows, hidden), make)


def gather(tokens: int, vocab: int, hidden: int, device: str = "cpu") -> CatalogueOp:
    """Embedding lookup of `tokens` rows from a [vocab, hidden] table: no FLOPs, only bytes."""
    def make():
        table = _rand(vocab, hidden, device=device)
        ids = torch.randint(0, vocab, (tokens,), device=device)
        return lambda: F.embedding(ids, table)
    op = Op(f"gather {tokens} of {vocab}x{hidden}", 0.0,
            float(F32 * 2 * tokens * hidden + 8 * tokens))
    return CatalogueOp(op, "gather", (tokens, hidden), make)


def copy(n: int, device: str = "cpu") -> CatalogueOp:
    """dst.copy_(src) of n float32 elements: read n, write n."""
    def make():
        src, dst = _rand(n, device=device), torch.empty(n, device=device)
        return lambda: dst.copy_(src)
    return CatalogueOp(Op(f"copy {n:,}", 0.0, float(F32 * 2 * n)), "copy", (n,), make)


# -- the catalogue ----------------------------------------------------------------------------
def smollm2_weight_shapes(hidden: int = 576, intermediate: int = 1536, heads: int = 9,
                          kv_heads: int = 3, head_dim: int = 64,
                          vocab: int = 49152) -> dict[str, tuple[int, int]]:
    """(out, in) of SmolLM2-135M's matrices as labkit fuses them."""
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o_proj": (heads * head_dim, hidden),
        "gate_up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
        "lm_head": (vocab, hidden),
    }


def catalogue(size: str = "full", device: str = "cpu",
              llc_bytes: int | None = None) -> list[CatalogueOp]:
    """The ops the chapter measures: `size="full"` (>= 50 ops) or `"tiny"` (for tests).

    The model's five weight matrices appear twice as one-row products: reusing one copy
    (kind "gemv", weights in the cache when they fit) and rotating through copies that
    together reach the book's rule for a read from memory (kind "gemv from memory"; see
    `residence`; `llc_bytes` defaults to this machine's cache)."""
    llc = llc_bytes if llc_bytes is not None else last_level_cache_bytes()
    if size == "tiny":
        return [gemm(8, 12, 16, device=device), gemm(1, 24, 16, kind="gemv", device=device),
                bmm(2, 4, 5, 6, device=device), elementwise("add", 32, device=device),
                elementwise("silu*mul", 32, device=device), softmax(3, 7, device=device),
                rmsnorm(3, 16, device=device), gather(5, 50, 8, device=device),
                copy(64, device=device),
                gemv_from_memory(24, 16, "gemv 24x16 from memory", 4096, device=device,
                                 memory_bytes=4 * 4096)]
    if size != "full":
        raise ValueError(f"size must be 'full' or 'tiny', not {size!r}")
    ops: list[CatalogueOp] = []
    for s in (64, 128, 256, 512, 768, 1024):
        ops.append(gemm(s, s, s, device=device))
    shapes = smollm2_weight_shapes()
    for m in (32, 128):  # prefill-shaped GEMMs of the model's weights
        for name in ("qkv", "o_proj", "gate_up", "down"):
            n, k = shapes[name]
            ops.append(gemm(m, n, k, name=f"{name} prefill {m}", device=device))
    for m in (1, 8):  # decode-shaped: one or a few rows against each weight
        for name, (n, k) in shapes.items():
            ops.append(gemm(m, n, k, name=f"{name} decode b{m}",
                            kind="gemv" if m == 1 else "gemm", device=device))
    for name, (n, k) in shapes.items():
        ops.append(gemv_from_memory(n, k, f"{name} decode b1, from memory", llc, device=device))
    ops += [bmm(9, 1, 64, 64, name="attn q.K^T b1 s64", device=device),
            bmm(9 * 16, 1, 512, 64, name="attn q.K^T b16 s512", device=device),
            bmm(9, 128, 128, 64, name="attn Q.K^T prefill 128", device=device),
            bmm(9, 512, 512, 64, name="attn Q.K^T prefill 512", device=device),
            bmm(9, 512, 64, 512, name="attn P.V prefill 512", device=device),
            bmm(64, 64, 64, 64, device=device)]
    for n in (1_000, 100_000, 1_000_000, 4_000_000):
        for fn in ("add", "mul", "silu"):
            ops.append(elementwise(fn, n, device=device))
    ops += [elementwise("silu*mul", n, device=device) for n in (1536, 196_608, 1_572_864)]
    ops += [softmax(9, 64, device=device), softmax(9 * 128, 128, device=device),
            softmax(9 * 512, 512, device=device)]
    ops += [rmsnorm(1, 576, device=device), rmsnorm(128, 576, device=device),
            rmsnorm(2048, 576, device=device)]
    ops += [gather(1, 49152, 576, device=device), gather(128, 49152, 576, device=device),
            gather(2048, 49152, 576, device=device)]
    ops += [copy(n, device=device) for n in (1_000, 100_000, 1_000_000, 8_000_000)]
    return ops


def measure_catalogue(ops: list[CatalogueOp], machine: Machine, *, repeats: int = 5,
                      warmup: int = 1, max_bytes: float | None = None,
                      max_flops: float | None = None, llc_bytes: int | None = None,
                      memory_bytes: int | None = None, device: str | None = None) -> list[dict]:
    """Measure each op (skipping those above `max_bytes` / `max_flops`) and predict it.

    Returns one row per op: name, kind, flops, bytes, intensity, predicted_s, measured_s
    (median), best_s (fastest run), spread, ratio (measured / predicted), the bound the model
    names, footprint_bytes, in_cache (footprint within `llc_bytes`; default: this
    machine's last-level cache) and residence ("cache", "partly cached" or "memory", by
    `residence` with `memory_bytes`). `device` synchronises GPU work around every timed call.
    """
    llc = llc_bytes if llc_bytes is not None else last_level_cache_bytes()
    rows = []
    for entry in ops:
        op = entry.op
        if (max_bytes is not None and op.bytes > max_bytes) or (
                max_flops is not None and op.flops > max_flops):
            continue
        fn = entry.make()
        timing = measure(fn, name=op.name, repeats=repeats, warmup=warmup, device=device)
        del fn
        predicted = predict(op, machine)
        rows.append({"name": op.name, "kind": entry.kind, "flops": op.flops, "bytes": op.bytes,
                     "intensity": op.intensity, "predicted_s": predicted,
                     "measured_s": timing.median, "best_s": timing.min,
                     "spread": timing.spread, "ratio": timing.median / predicted,
                     "bound": bound(op, machine), "footprint_bytes": entry.footprint_bytes,
                     "in_cache": entry.footprint_bytes <= llc,
                     "residence": residence(entry.footprint_bytes, llc, memory_bytes)})
    return rows


# -- a batched decode step as ops ---------------------------------------------------------------
def decode_step_ops(config, batch: int, position: int) -> list[Op]:
    """The ops of one decode step for `batch` sequences at cache position `position`.

    Follows labkit.models.llama.Llama.forward with a KV cache and last_only=True: embedding
    gather, then per layer RMSNorm, fused QKV linear, RoPE on q and k, the cache write,
    scores q.K^T over position+1 keys, softmax, P.V, output projection, residual add,
    RMSNorm, fused gate/up linear, SiLU*up, down projection, residual add; then final norm
    and the LM head. Weights are read once per step whatever the batch.
    """
    c = config
    B, S, D = batch, position + 1, c.head_dim
    H, KV, hidden = c.num_heads, c.num_kv_heads, c.hidden_size
    inter = c.intermediate_size
    qkv_out = (H + 2 * KV) * D
    ops = [Op("embedding", 0.0, float(F32 * 2 * B * hidden + 8 * B))]
    for i in range(c.num_layers):
        ops += [
            Op(f"L{i} rmsnorm", 4.0 * B * hidden, float(F32 * (2 * B * hidden + hidden))),
            matmul_op(B, qkv_out, hidden, name=f"L{i} qkv"),
            Op(f"L{i} rope", 6.0 * B * (H + KV) * D, float(F32 * 2 * B * (H + KV) * D)),
            Op(f"L{i} cache write", 0.0, float(F32 * 2 * 2 * B * KV * D)),
            Op(f"L{i} q.K^T", 2.0 * B * H * S * D, float(F32 * (B * H * D + B * KV * S * D + B * H * S))),
            Op(f"L{i} softmax", 5.0 * B * H * S, float(F32 * 2 * B * H * S)),
            Op(f"L{i} P.V", 2.0 * B * H * S * D, float(F32 * (B * H * S + B * KV * S * D + B * H * D))),
            matmul_op(B, hidden, H * D, name=f"L{i} o_proj"),
            Op(f"L{i} residual", 1.0 * B * hidden, float(F32 * 3 * B * hidden)),
            Op(f"L{i} rmsnorm 2", 4.0 * B * hidden, float(F32 * (2 * B * hidden + hidden))),
            matmul_op(B, 2 * inter, hidden, name=f"L{i} gate_up"),
            Op(f"L{i} silu*up", 5.0 * B * inter, float(F32 * 3 * B * inter)),
            matmul_op(B, hidden, inter, name=f"L{i} down"),
            Op(f"L{i} residual 2", 1.0 * B * hidden, float(F32 * 3 * B * hidden)),
        ]
    ops += [Op("final rmsnorm", 4.0 * B * hidden, float(F32 * (2 * B * hidden + hidden))),
            matmul_op(B, c.vocab_size, hidden, name="lm_head")]
    return ops


def predict_decode_step(config, batch: int, position: int, machine: Machine) -> dict:
    """Roofline predictions of one decode step, three ways.

    - ``per_op_s``: the sum of per-op predictions (each op pays the overhead);
    - ``whole_step_s``: the step as one op (all FLOPs, all bytes, one overhead);
    - ``compute_s`` / ``memory_s`` / ``overhead_s``: the parts, for explanation.
    """
    ops = decode_step_ops(config, batch, position)
    flops, nbytes = sum(o.flops for o in ops), sum(o.bytes for o in ops)
    return {"batch": batch, "ops": len(ops), "flops": flops, "bytes": nbytes,
            "per_op_s": sum(predict(o, machine) for o in ops),
            "whole_step_s": predict(Op("decode step", flops, nbytes), machine),
            "compute_s": flops / machine.peak_flops, "memory_s": nbytes / machine.bandwidth,
            "overhead_s": len(ops) * machine.overhead,
            "bound": bound(Op("decode step", flops, nbytes), machine)}


def decode_step_timer(model, batch: int, prompt_ids: list[int]) -> Callable[[], torch.Tensor]:
    """A callable that runs one decode step for `batch` sequences at a fixed position.

    Prefills `prompt_ids` once (batch 1), copies that cache into every row of a batch-B
    cache, and returns a function that rewinds the cache to the prompt length and runs
    model(ids[B, 1], cache, last_only=True): each call is the same step at the same position.
    """
    P = len(prompt_ids)
    single = model.new_cache(1, P + 1)
    model(torch.tensor([prompt_ids]), cache=single, last_only=True)
    cache = model.new_cache(batch, P + 1)
    cache.keys[:, :, :, :P] = single.keys[:, :, :, :P]
    cache.values[:, :, :, :P] = single.values[:, :, :, :P]
    ids = torch.full((batch, 1), prompt_ids[-1], dtype=torch.long)

    def step() -> torch.Tensor:
        cache.length = P
        return model(ids, cache=cache, last_only=True)
    return step


def measure_decode_steps(model, batches: list[int], prompt_ids: list[int], machine: Machine,
                         *, rounds: int = 7, threads: int | None = None) -> list[dict]:
    """Time one decode step at every batch size, interleaved, and predict each.

    The batch sizes take turns (1, 2, 4, ..., 1, 2, 4, ...) for `rounds` rounds after one
    warm-up each, so a slow spell of a shared machine falls on all of them alike instead of
    deciding one batch's number. Each row has the predictions of `predict_decode_step`,
    the median step time with its bootstrap 95% interval (low_s, high_s), p75_s, max_s,
    and the ratios of the median to the whole-step and per-op predictions.
    """
    from labkit.util.compare import median_interval
    from labkit.util.timing import measure_interleaved

    runners = {b: decode_step_timer(model, b, prompt_ids) for b in batches}
    timings = measure_interleaved(runners, rounds=rounds, warmup=1, threads=threads)
    rows = []
    for b in batches:
        t = timings[b]
        low, high = median_interval(t.samples)
        p = predict_decode_step(model.config, b, len(prompt_ids), machine)
        rows.append({**p, "measured_s": t.median, "low_s": low, "high_s": high,
                     "p75_s": t.quantile(0.75), "max_s": t.max, "rounds": len(t.samples),
                     "ratio_whole": t.median / p["whole_step_s"],
                     "ratio_per_op": t.median / p["per_op_s"]})
    return rows


def from_memory_reading(rows: list[dict], bandwidth: float, llc_bytes: int) -> str:
    """What the catalogue's ops that read from memory (residence "memory") say about the
    memory ceiling, in a sentence for the prose: whether any ran faster than their
    prediction (ratio under 1), the one that came closest, and, where some beat it, why a
    footprint past the book's rule can still do so (part of it stays in the cache).
    `bandwidth` is the ceiling in bytes/s; `llc_bytes` the last-level cache."""
    memory = [r for r in rows if r["residence"] == "memory"]
    if not memory:
        return "No op of this run read its operands from memory."
    best = min(memory, key=lambda r: r["ratio"])
    rate = best["bytes"] / best["measured_s"] / 1e9
    fast = [r for r in memory if r["ratio"] < 1]
    if not fast:
        return (f"None of the {len(memory)} ops that read from memory ran faster than its "
                f"prediction; the closest, {best['name']}, took {best['ratio']:.2f}× it "
                f"({rate:.1f} GB/s against the ceiling's {bandwidth / 1e9:.1f}).")
    times = best["footprint_bytes"] / llc_bytes
    return (f"{len(fast)} of the {len(memory)} ops that read from memory ran faster than their "
            f"prediction; the fastest, {best['name']}, took {best['ratio']:.2f}× it, reading at "
            f"{rate:.1f} GB/s against the ceiling's {bandwidth / 1e9:.1f}. Its copies touch "
            f"{times:.1f} times the cache, yet a last-level cache does not evict strictly the "
            "oldest line first, so part of the rotation is still there when its turn comes: "
            "these ops are partly cache-resident, and the memory ceiling is not a bound for "
            "them.")


def step_products_timer(model, batch: int) -> Callable[[], torch.Tensor]:
    """A callable that runs only the weight products of one decode step for `batch`
    sequences: x [batch, 1, k] times every layer matrix of `model` (labkit's fused qkv,
    o_proj, gate_up, down) and the LM head, through the same call the forward pass makes
    (`F.linear` on a weight tensor, or the weight's own module). Everything else in the step
    (norms, RoPE, attention, elementwise work) is left out, so the step's time minus this
    one is what the rest costs."""
    weights = [getattr(layer, name) for layer in model.layers
               for name in ("qkv", "o_proj", "gate_up", "down")] + [model.lm_head]
    inputs = {}
    for w in weights:
        k = int(w.shape[-1])
        inputs.setdefault(k, torch.randn(batch, 1, k))

    def products() -> torch.Tensor:
        out = None
        for w in weights:
            x = inputs[int(w.shape[-1])]
            out = F.linear(x, w) if isinstance(w, torch.Tensor) else w(x)
        return out
    return products


def measure_step_products(model, batches: list[int], *, rounds: int = 7,
                          threads: int | None = None) -> list[dict]:
    """Time the weight products of one decode step (`step_products_timer`) at every batch
    size, interleaved as `measure_decode_steps` times the steps. Each row: batch,
    products_s (median) with its bootstrap 95% interval (low_s, high_s), the weight bytes
    the products read (float32, once per call), and weight_gbs, the rate they read them."""
    from labkit.util.compare import median_interval
    from labkit.util.timing import measure_interleaved

    runners = {b: step_products_timer(model, b) for b in batches}
    timings = measure_interleaved(runners, rounds=rounds, warmup=1, threads=threads)
    weight_bytes = float(sum(F32 * getattr(layer, n).shape[0] * getattr(layer, n).shape[1]
                             for layer in model.layers
                             for n in ("qkv", "o_proj", "gate_up", "down"))
                         + F32 * model.lm_head.shape[0] * model.lm_head.shape[1])
    rows = []
    for b in batches:
        t = timings[b]
        low, high = median_interval(t.samples)
        rows.append({"batch": b, "products_s": t.median, "low_s": low, "high_s": high,
                     "weight_bytes": weight_bytes, "weight_gbs": weight_bytes / t.median / 1e9})
    return rows


def largest_step_jump(steps: list[dict], products: list[dict]) -> dict:
    """Where the decode step's time jumps most between neighbouring batch sizes, and how
    much of that jump the weight products alone carry.

    `steps` are rows of `measure_decode_steps` (batch, measured_s), `products` rows of
    `measure_step_products` (batch, products_s), both in increasing batch order over the
    same batch sizes. The jump is the largest ratio of a step's median time to the one
    before it (a step reads every weight once whatever its batch, so while it is bound by
    memory a larger batch should cost little more). Returns the two batch sizes, the step's and the
    products' times at both, and `products_share`: the products' growth over the step's
    (under 0 or over 1 where the rest of the step shrank or grew more)."""
    by_batch = {r["batch"]: r["products_s"] for r in products}
    order = [r for r in steps if r["batch"] in by_batch]
    if len(order) < 2:
        raise ValueError("need the step and the products at two batch sizes at least")
    pairs = list(zip(order, order[1:]))
    before, after = max(pairs, key=lambda p: p[1]["measured_s"] / p[0]["measured_s"])
    a, b = before["batch"], after["batch"]
    step_growth = after["measured_s"] - before["measured_s"]
    products_growth = by_batch[b] - by_batch[a]
    return {"from_batch": a, "to_batch": b, "step_from_s": before["measured_s"],
            "step_to_s": after["measured_s"], "products_from_s": by_batch[a],
            "products_to_s": by_batch[b],
            "step_ratio": after["measured_s"] / before["measured_s"],
            "products_ratio": by_batch[b] / by_batch[a],
            "products_share": products_growth / step_growth if step_growth > 0 else float("nan")}


def jump_reading(jump: dict) -> str:
    """The sentence for `largest_step_jump`: whether the weight products carry the step's
    largest jump (at least half of its growth), the rest of the step does, or there was no
    growth to explain."""
    a, b = jump["from_batch"], jump["to_batch"]
    head = (f"The step's largest jump is from batch {a} to batch {b}: "
            f"{jump['step_from_s'] * 1e3:.1f} to {jump['step_to_s'] * 1e3:.1f} ms "
            f"({jump['step_ratio']:.2f}×). The weight products alone, timed on their own, went "
            f"from {jump['products_from_s'] * 1e3:.1f} to {jump['products_to_s'] * 1e3:.1f} ms "
            f"({jump['products_ratio']:.2f}×)")
    share = jump["products_share"]
    if share != share:  # NaN: the step did not grow
        return head + "; the step did not grow, so there is no jump to explain."
    if share >= 0.5:
        return (head + f", {share:.0%} of the step's growth: the jump is the products'. They "
                f"read the same weights at both sizes, so at {b} rows the library's kernel "
                f"streamed them {jump['products_ratio']:.2f} times more slowly than at {a}.")
    return (head + f", only {max(share, 0.0):.0%} of the step's growth: the jump is in the rest "
            "of the step (norms, attention, elementwise work), not in the weight products.")


def products_vs_step(measured_s: float, predicted_s: float, products_s: float) -> str:
    """What the one-row products, timed on their own (from memory), say about a decode step
    the roofline under-predicts, in a sentence for the prose. `measured_s` is the step,
    `predicted_s` its roofline prediction, `products_s` the products' sum.

    A share of the gap (measured - predicted) makes sense only between 0 and 100%: products
    that take longer than the whole step over-predict it (the step read its weights faster
    than the benchmark did), and a step no slower than its prediction has no gap."""
    gap = measured_s - predicted_s
    if gap <= 0:
        return ("Here the step took no longer than the prediction, so there is no gap for "
                "them to explain.")
    if products_s > measured_s:
        return ("The products timed from memory alone took longer than the whole step, so that "
                "benchmark over-predicts the step: the step read its weights faster than the "
                "products from memory did. "
                "This run does not show where the step's bytes came from (part of them may "
                "stay in the cache between steps); neither the cached nor the from-memory "
                "benchmark predicts the step here.")
    share = max(0.0, (products_s - predicted_s) / gap)
    return f"That accounts for {share:.0%} of the gap between the prediction and the measurement."
