"""Where a float32 product should leave labkit's C matrix-vector kernel for oneDNN's packed
GEMM (chapter 17): the cost of every matrix product of a pass of n rows on each path, the
row count where the two cross, and whether the engine's cost then rises with the rows.

labkit's engine (`labkit.kernels.packed.PackedLinear`) multiplies a product of at most
`native.gemv_max_rows()` rows by the C kernel, which reads each weight once but does each
row's multiply-adds on its own, and a wider one by oneDNN's blocked GEMM, which costs more
for one row and grows slowly. Set the cutoff past the crossover and a pass of k rows costs
more than one of k + 1 (what chapter 17 once measured at 4 and 5 tokens). The crossover
depends on the machine, so the chapter measures it where it runs and says whether the
setting matches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from statistics import median as median_of
from typing import Any

import torch

from labkit.kernels import native
from labkit.kernels.packed import PackedLinear, is_packed, pack_model
from labkit.models.llama import MATRICES
from labkit.util.compare import Comparison, compare
from labkit.util.timing import measure_interleaved

C_PATH = "labkit C gemv"
GEMM_PATH = "oneDNN packed GEMM"


def pass_products(model) -> list[PackedLinear]:
    """The products a pass of the model multiplies, packed as the engine packs them: every
    layer's four matrices and the LM head. ValueError where the weights cannot be packed."""
    packed = model if is_packed(model) else pack_model(model)
    if not is_packed(packed):
        raise ValueError("the model's weights cannot be packed for oneDNN here")
    return [getattr(layer, name) for layer in packed.layers for name in MATRICES] + [packed.lm_head]


def path_runners(model, rows: Sequence[int], seed: int = 0) -> dict[tuple[str, int], Callable[[], Any]]:
    """(path, n) -> a call that multiplies n random rows by every product of a pass on that
    path: `C_PATH` (`native.gemv` on the plain weight, what a step of few rows runs; only
    where the C kernels build) and `GEMM_PATH` (`PackedLinear.gemm`, what a wider step runs)."""
    products = pass_products(model)
    generator = torch.Generator().manual_seed(seed)
    inputs = {n: [torch.randn(n, p.weight.shape[1], generator=generator) for p in products] for n in rows}
    paths: dict[str, Callable[[PackedLinear, torch.Tensor], torch.Tensor]] = {
        GEMM_PATH: lambda p, x: p.gemm(x)}
    if native.load() is not None:
        paths[C_PATH] = lambda p, x: native.gemv(x, p.weight)

    def runner(multiply, xs):
        def run():
            for product, x in zip(products, xs):
                multiply(product, x)
        return run

    return {(path, n): runner(multiply, inputs[n]) for n in rows for path, multiply in paths.items()}


@torch.inference_mode()
def path_costs(model, rows: Sequence[int], rounds: int, warmup: int = 1) -> list[dict[str, Any]]:
    """Time the products of a pass of n rows on each path (`path_runners`) for every n in
    `rows`, all in turns: each of `rounds` rounds times every (path, n) once, so a slow spell
    of the machine falls on every row count and both paths alike. Records: path, rows,
    median_s, p25_s, p75_s, spread, samples (seconds)."""
    runners = path_runners(model, sorted(set(rows)))
    named = {f"{path}, {n} rows": fn for (path, n), fn in runners.items()}
    timings = measure_interleaved(named, rounds=rounds, warmup=warmup)
    out = []
    for (path, n), name in zip(runners, named):
        t = timings[name]
        out.append({"path": path, "rows": n, "median_s": t.median, "p25_s": t.quantile(0.25),
                    "p75_s": t.quantile(0.75), "spread": t.spread, "samples": list(t.samples)})
    return out


def _by_path(records: Sequence[Mapping[str, Any]], path: str) -> dict[int, Mapping[str, Any]]:
    return {int(r["rows"]): r for r in records if r["path"] == path}


def crossover_rows(records: Sequence[Mapping[str, Any]]) -> int:
    """The most rows up to which the C kernel's median cost was at most oneDNN's at every row
    count measured from 1 (0 where it lost already at one row, or was not measured): the
    cutoff these costs call for. A cutoff there keeps the engine on the cheaper path below
    it, and past it oneDNN's cost grows slowly, so a pass of k rows costs no more than one of
    k + 1."""
    c, gemm = _by_path(records, C_PATH), _by_path(records, GEMM_PATH)
    cutoff = 0
    for n in sorted(set(c) & set(gemm)):
        if n != cutoff + 1 or c[n]["median_s"] > gemm[n]["median_s"]:
            break
        cutoff = n
    return cutoff


def engine_samples(records: Sequence[Mapping[str, Any]], cutoff: int) -> dict[int, list[float]]:
    """rows -> the samples of the path the engine takes at that many rows with this `cutoff`
    (the C kernel up to it, oneDNN beyond); row counts whose path was not measured are left
    out."""
    c, gemm = _by_path(records, C_PATH), _by_path(records, GEMM_PATH)
    out = {}
    for n in sorted(set(c) | set(gemm)):
        chosen = c.get(n) if n <= cutoff else gemm.get(n)
        if chosen is not None:
            out[n] = list(chosen["samples"])
    return out


def order_breaks(samples: Mapping[int, Sequence[float]]) -> list[tuple[int, Comparison]]:
    """Each n (with n + 1 also measured) where n rows cost more than n + 1 beyond the noise:
    `compare(samples[n + 1], samples[n])` calls n + 1 faster. Empty where cost never falls
    as the rows grow."""
    out = []
    for n in sorted(samples):
        if n + 1 in samples:
            c = compare(samples[n + 1], samples[n], name_a=f"{n + 1} rows", name_b=f"{n} rows")
            if c.verdict == "faster":
                out.append((n, c))
    return out


def cutoff_reading(cutoff: int, crossover: int, measured_up_to: int) -> str:
    """A sentence: the engine's cutoff (`native.gemv_max_rows()` when the model was packed)
    against the crossover measured here (`crossover_rows`, over 1..`measured_up_to` rows)."""
    head = f"The engine multiplies a step of up to {cutoff} rows by the C kernel and a wider one by oneDNN"
    if crossover >= measured_up_to:
        where = f"here the C kernel was the cheaper path at every row count measured, up to {measured_up_to}"
    elif crossover == 0:
        where = "here oneDNN was the cheaper path already at one row"
    else:
        where = (f"here the C kernel was the cheaper path up to {crossover} rows "
                 f"and oneDNN from {crossover + 1}")
    if crossover == cutoff or (crossover >= measured_up_to and cutoff >= measured_up_to):
        return f"{head}; {where}, so the setting is this machine's crossover."
    return (f"{head}; {where}, so on this machine the setting is not the crossover: "
            f"`{native.GEMV_ROWS_ENV}={crossover}` would make it so.")


def order_reading(samples: Mapping[int, Sequence[float]], what: str) -> str:
    """Whether the cost of `what` (e.g. "the engine's products") ever fell from n to n + 1
    rows beyond the noise (`order_breaks`), as a clause for a glued sentence."""
    breaks = order_breaks(samples)
    if not breaks:
        return (f"{what} never cost more at a row count than at the next beyond the noise, "
                f"from {min(samples)} to {max(samples)} rows")
    each = "; ".join(f"{n} rows cost {c.ratio:.2f} times {n + 1} ({c.confidence:.0%} interval "
                     f"{c.low:.2f}-{c.high:.2f})" for n, c in breaks)
    return f"{what} cost more at some row counts than at the next beyond the noise: {each}"


def pass_pair_reading(samples: Mapping[int, Sequence[float]], k: int) -> str:
    """Whether a whole pass of k tokens cost more than one of k + 1 (`samples`: tokens ->
    pass times), by `compare`, in a sentence for the prose."""
    c = compare(samples[k], samples[k + 1], name_a=f"{k} tokens", name_b=f"{k + 1} tokens")
    versus = f"a {k + 1}-token one"
    # c.ratio is the (k + 1)-token time over the k-token time: its inverse is "k over k + 1"
    median = f"medians {1e3 * median_of(samples[k]):.1f} and {1e3 * median_of(samples[k + 1]):.1f} ms"
    interval = f"ratio {1 / c.ratio:.2f}, {c.confidence:.0%} interval {1 / c.high:.2f}-{1 / c.low:.2f}"
    if c.verdict == "slower":
        return f"A {k}-token pass cost more than {versus} beyond the noise ({median}; {interval})."
    if c.verdict == "faster":
        return f"A {k}-token pass cost less than {versus} beyond the noise ({median}; {interval})."
    return f"A {k}-token pass cost no more than {versus} beyond the noise ({median}; {interval})."


__all__ = ["C_PATH", "GEMM_PATH", "crossover_rows", "cutoff_reading", "engine_samples", "order_breaks",
           "order_reading", "pass_pair_reading", "pass_products", "path_costs", "path_runners"]
