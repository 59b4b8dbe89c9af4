"""labkit.experiments.gemv_rows: the crossover of the C kernel's and oneDNN's costs, the path
the engine takes at each row count, and readings whose direction is checked on costs made
up to point one way or the other; the timing plumbing on a tiny packed model."""

import pytest
import torch

from conftest import make_tiny_llama
from labkit.experiments import gemv_rows as gr
from labkit.kernels import native
from labkit.kernels.packed import PackedLinear, available

needs_onednn = pytest.mark.skipif(not available(torch.zeros(1)), reason="no oneDNN in this torch")


def records(c_ms: dict[int, float], gemm_ms: dict[int, float], jitter: float = 0.01) -> list[dict]:
    """Cost records as `path_costs` makes them, five samples around each median."""
    out = []
    for path, costs in ((gr.C_PATH, c_ms), (gr.GEMM_PATH, gemm_ms)):
        for n, ms in costs.items():
            samples = [ms * 1e-3 * (1 + jitter * d) for d in (-2, -1, 0, 1, 2)]
            out.append({"path": path, "rows": n, "median_s": ms * 1e-3, "samples": samples})
    return out


# the shape measured on the book's machine: the C kernel grows by a good part of a one-row
# product per row, oneDNN starts higher and grows slowly
C_MS = {n: 20.0 + 8.0 * (n - 1) for n in range(1, 9)}
GEMM_MS = {n: 30.0 + 1.0 * (n - 1) for n in range(1, 9)}


def test_the_crossover_is_the_last_row_count_where_the_c_kernel_is_cheaper():
    assert gr.crossover_rows(records(C_MS, GEMM_MS)) == 2               # 28 <= 31, then 36 > 32
    assert gr.crossover_rows(records({1: 40.0, 2: 41.0}, {1: 30.0, 2: 30.0})) == 0
    assert gr.crossover_rows(records({1: 10.0, 2: 11.0}, {1: 30.0, 2: 30.0})) == 2  # all measured
    # a later row count where the C kernel wins again (noise) does not extend the cutoff
    assert gr.crossover_rows(records({1: 10.0, 2: 40.0, 3: 10.0}, {1: 30.0, 2: 30.0, 3: 30.0})) == 1
    assert gr.crossover_rows(records({}, GEMM_MS)) == 0                  # no C kernel measured


def test_the_engine_takes_the_c_kernel_up_to_the_cutoff():
    taken = gr.engine_samples(records(C_MS, GEMM_MS), cutoff=4)
    medians = {n: sorted(s)[2] * 1e3 for n, s in taken.items()}
    assert medians == pytest.approx({n: C_MS[n] if n <= 4 else GEMM_MS[n] for n in C_MS})


def test_a_cutoff_past_the_crossover_breaks_the_order_and_the_crossover_does_not():
    costs = records(C_MS, GEMM_MS)
    mistuned = gr.order_breaks(gr.engine_samples(costs, cutoff=4))
    assert [n for n, _ in mistuned] == [4]                    # 4 rows (44 ms) cost more than 5 (34)
    assert mistuned[0][1].ratio == pytest.approx(44.0 / 34.0)
    assert gr.order_breaks(gr.engine_samples(costs, cutoff=gr.crossover_rows(costs))) == []
    assert "never cost more" in gr.order_reading(gr.engine_samples(costs, 2), "the products")
    reading = gr.order_reading(gr.engine_samples(costs, 4), "the products")
    assert "4 rows cost 1.29 times 5" in reading


def test_noise_alone_is_no_break():
    noisy = {1: [1.0, 1.3, 0.8, 1.1, 0.9], 2: [1.05, 0.85, 1.2, 0.95, 1.0]}
    assert gr.order_breaks(noisy) == []


def test_the_pass_pair_reading_points_the_right_way():
    dear_4 = {4: [0.048, 0.047, 0.049, 0.048], 5: [0.041, 0.042, 0.040, 0.041]}
    assert gr.pass_pair_reading(dear_4, 4).startswith("A 4-token pass cost more than a 5-token one")
    assert "ratio 1.17" in gr.pass_pair_reading(dear_4, 4)
    cheap_4 = {4: dear_4[5], 5: dear_4[4]}
    assert gr.pass_pair_reading(cheap_4, 4).startswith("A 4-token pass cost less than")
    even = {4: [0.040, 0.046, 0.042, 0.044], 5: [0.045, 0.041, 0.043, 0.042]}
    assert gr.pass_pair_reading(even, 4).startswith("A 4-token pass cost no more than")


def test_the_cutoff_reading_says_whether_the_setting_is_the_crossover():
    assert gr.cutoff_reading(2, 2, 16).endswith("so the setting is this machine's crossover.")
    off = gr.cutoff_reading(4, 2, 16)
    assert "not the crossover" in off and f"{native.GEMV_ROWS_ENV}=2" in off
    assert "oneDNN from 3" in off
    assert "already at one row" in gr.cutoff_reading(2, 0, 16)
    assert "every row count measured" in gr.cutoff_reading(16, 16, 16)


@needs_onednn
def test_the_runners_multiply_every_product_of_a_pass_on_their_path(monkeypatch):
    model = make_tiny_llama(seed=11)
    products = gr.pass_products(model)
    assert len(products) == 4 * len(model.layers) + 1 and all(isinstance(p, PackedLinear) for p in products)
    calls = []
    monkeypatch.setitem(native._state, "lib", object())  # a (fake) C library is loaded
    monkeypatch.setattr(native, "gemv", lambda x, w: calls.append(("gemv", x.shape[0], w.shape)))
    monkeypatch.setattr(PackedLinear, "gemm", lambda self, x: calls.append(("gemm", x.shape[0], self.weight.shape)))
    runners = gr.path_runners(model, [1, 3])
    assert set(runners) == {(p, n) for p in (gr.C_PATH, gr.GEMM_PATH) for n in (1, 3)}
    for (path, n), run in runners.items():
        calls.clear()
        run()
        kind = "gemv" if path == gr.C_PATH else "gemm"
        assert calls == [(kind, n, p.weight.shape) for p in products], (path, n)
    monkeypatch.setitem(native._state, "lib", None)  # no C kernels: oneDNN's path alone
    assert {p for p, _ in gr.path_runners(model, [1])} == {gr.GEMM_PATH}


@needs_onednn
def test_path_costs_records_every_path_and_row_count_per_round():
    model = make_tiny_llama(seed=12)
    out = gr.path_costs(model, [2, 1], rounds=3, warmup=0)
    paths = [gr.GEMM_PATH] + ([gr.C_PATH] if native.load() is not None else [])
    assert sorted((r["path"], r["rows"]) for r in out) == sorted((p, n) for p in paths for n in (1, 2))
    assert all(len(r["samples"]) == 3 and r["median_s"] > 0 for r in out)
