"""labkit.experiments.moe_costs: one expert's time at a row count (every expert called, so
the weights stream), the union priced from it against hand sums, the tolerance's
direction, and the CPU time other processes used (from /proc/stat's fields)."""

import os
import subprocess
import sys

import pytest
import torch

from labkit.experiments import moe_costs as mc
from labkit.experiments import moe_layer as moe


def test_expert_row_times_runs_every_expert_at_every_row_count(monkeypatch):
    w = moe.random_moe(32, 64, experts=8, top_k=2, seed=0)
    shapes = []
    real = mc.swiglu

    def counting(x, w1, w3, w2):
        shapes.append(tuple(x.shape))
        return real(x, w1, w3, w2)

    monkeypatch.setattr(mc, "swiglu", counting)
    times = mc.expert_row_times(w, [1, 4], rounds=3, warmup=1)
    assert sorted(times) == [1, 4] and all(len(v) == 3 and min(v) > 0 for v in times.values())
    # (1 warm-up + 3 rounds) x 2 row counts x 8 experts, each on its own n rows
    assert len(shapes) == 4 * 2 * 8
    assert shapes.count((1, 32)) == shapes.count((4, 32)) == 4 * 8


def test_per_expert_ms_interpolates_and_extends_the_nearest_segment():
    known = {1: 2.0, 4: 5.0, 8: 6.0}
    assert mc.per_expert_ms(known, 4) == 5.0
    assert mc.per_expert_ms(known, 2) == pytest.approx(3.0)
    assert mc.per_expert_ms(known, 6) == pytest.approx(5.5)
    assert mc.per_expert_ms(known, 16) == pytest.approx(8.0)  # 6 + 8 x 0.25


def test_the_prediction_sums_the_chosen_experts_at_their_rows():
    known = {1: 1.0, 2: 1.5, 4: 2.0}
    load = torch.tensor([0, 3, 1, 0, 4, 0, 0, 2])
    # 3 rows: 1.75; 1 row: 1.0; 4 rows: 2.0; 2 rows: 1.5; the unchosen four cost nothing
    assert mc.predicted_layer_ms(load, known) == pytest.approx(6.25)


def test_explains_only_within_the_factor_either_way():
    assert mc.explains(10.0, 9.0) and mc.explains(9.0, 10.0)
    assert not mc.explains(10.0, 7.0) and not mc.explains(7.0, 10.0)
    assert mc.explains(10.0, 7.0, factor=1.5)


def test_busy_ticks_leaves_out_idle_and_iowait():
    stat = "cpu  100 5 20 1000 50 3 2 1 0 0\ncpu0 50 2 10 500 25 1 1 0 0 0\n"
    assert mc.busy_ticks(stat) == 100 + 5 + 20 + 3 + 2 + 1
    with pytest.raises(ValueError):
        mc.busy_ticks("cpu0 1 2 3 4 5 6 7 8\n")


def test_others_cpu_seconds_subtracts_this_process():
    assert mc.others_cpu_seconds(100, 400, 100, 1.0, 2.5) == pytest.approx(1.5)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_a_busy_child_is_counted_elsewhere():
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    with mc.cpu_used_elsewhere() as used:
        subprocess.run([sys.executable, "-c", spin], check=True)
    assert used.others_cpu_s >= 0.5 and 0 < used.share <= 1.05
