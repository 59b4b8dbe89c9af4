"""Which BLAS routine a product of a few rows calls, its time per row count, and the step's
sum per round (chapter 11)."""

import math
import statistics

import pytest
import torch
import torch.nn.functional as F

from labkit.experiments import row_paths as rp

VERBOSE = (
    "MKL_VERBOSE oneMKL 2024.0 Update 2 Product build 20240605 for Intel(R) 64 architecture\n"
    "MKL_VERBOSE SGEMM(T,N,3072,2,576,0x7ffe99814790,0x7f1c85754040,576,0x55b1,576) 16.82ms "
    "CNR:OFF Dyn:1 FastMM:1 TID:0  NThr:2\n"
    "MKL_VERBOSE SGEMV(N,576,1536,0x7ffe9981,0x7f1c8575,576) 20.1us CNR:OFF NThr:2\n")


def test_parse_keeps_routine_and_sizes_and_drops_pointers():
    assert rp.parse_mkl_verbose(VERBOSE) == ["SGEMM(T,N,3072,2,576)", "SGEMV(N,576,1536)"]
    assert rp.parse_mkl_verbose("no calls here\n") == []


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL")
def test_blas_calls_reads_the_product_that_ran():
    weight, x = torch.randn(48, 16), torch.randn(3, 16)
    calls = rp.blas_calls(lambda: F.linear(x, weight))
    # F.linear(x, W) is x W^T: MKL sees W transposed, 48 outputs, 3 rows, 16 inputs
    assert calls == ["SGEMM(T,N,48,3,16)"]
    assert rp.blas_calls(lambda: x + 1) == []  # no BLAS call, nothing read


def test_step_samples_weights_each_matrix_by_its_calls():
    records = [{"name": "a", "rows": 1, "samples_s": [1.0, 2.0, 3.0]},
               {"name": "b", "rows": 1, "samples_s": [10.0, 20.0, 30.0]},
               {"name": "a", "rows": 2, "samples_s": [4.0, 5.0, 6.0]},
               {"name": "b", "rows": 2, "samples_s": [40.0, 50.0, 60.0]}]
    sums = rp.step_samples(records, {"a": 30, "b": 1})
    assert sums == {1: [40.0, 80.0, 120.0], 2: [160.0, 200.0, 240.0]}
    with pytest.raises(ValueError, match="no record"):
        rp.step_samples(records[:3], {"a": 30, "b": 1})


def test_routine_words_groups_row_counts():
    same = [{"rows": r, "blas": [f"SGEMM(T,N,8,{r},4)"]} for r in (1, 2, 4)]
    assert rp.routine_words(same) == "SGEMM for every row count (1, 2, 4 rows)"
    split = [{"rows": 1, "blas": ["SGEMV(N,8,4)"]}, {"rows": 2, "blas": ["SGEMM(T,N,8,2,4)"]},
             {"rows": 4, "blas": ["SGEMM(T,N,8,4,4)"]}]
    assert rp.routine_words(split) == "SGEMV at 1 row; SGEMM at 2, 4 rows"
    assert rp.routine_words([{"rows": 1, "blas": []}]) is None


def test_row_costs_records_one_pair_each_with_consistent_rates():
    shapes = {"small": (16, 32), "wide": (16, 96)}
    records = rp.row_costs(shapes, [1, 2], cold_bytes=8 * 1024, rounds=3, threads=1)
    assert sorted((r["name"], r["rows"]) for r in records) == [
        ("small", 1), ("small", 2), ("wide", 1), ("wide", 2)]
    for r in records:
        k, n = shapes[r["name"]]
        assert r["copies"] == math.ceil(8 * 1024 / (4 * k * n))  # bytes between two uses
        assert len(r["samples_s"]) == 3 and r["median_s"] == statistics.median(r["samples_s"])
        assert r["weight_gb_s"] == pytest.approx(4 * k * n / r["median_s"] / 1e9)
        assert math.isnan(r["second_thread_share"])  # one thread: no second thread to read
    with pytest.raises(ValueError):
        rp.row_costs(shapes, [0], cold_bytes=0)
    with pytest.raises(ValueError):
        rp.row_costs(shapes, [1], cold_bytes=0, rounds=2)
