"""The static roofline explorer: self-contained HTML whose formula matches predict()."""

import json
import re

import pytest

from labkit.book.explorer import explorer_html, explorer_predict, explorer_rows, gemm_prediction
from labkit.sim.roofline import Machine, Op, matmul_op, predict

MACHINE = Machine(peak_flops=123.4e9, bandwidth=9.87e9, overhead=4.5e-6, threads=2)
OPS = [{"name": "gemm <1>", "flops": 2e9, "bytes": 12e6, "measured_s": 0.02},
       {"name": "copy", "flops": 0.0, "bytes": 8e6}]


def _data(page: str, uid: str) -> dict:
    m = re.search(rf'<script type="application/json" id="{uid}-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def test_html_is_self_contained_with_sliders_and_ceilings():
    page = explorer_html(MACHINE, OPS, uid="rfx-test")
    assert not re.search(r"\bsrc\s*=", page)
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page and "<link" not in page
    for s in ("peak", "bw", "ovh", "m", "n", "k"):
        assert f'id="rfx-test-{s}"' in page and 'type="range"' in page
    d = _data(page, "rfx-test")["defaults"]
    assert d["peak_gflops"] == pytest.approx(123.4)
    assert d["bandwidth_gbs"] == pytest.approx(9.87)
    assert d["overhead_us"] == pytest.approx(4.5)
    assert "gemm &lt;1&gt;" in page  # names are escaped


def test_ids_unique_per_snippet():
    a, b = explorer_html(MACHINE, OPS), explorer_html(MACHINE, OPS)
    ida = re.search(r'<div id="(rfx-[0-9a-f]+)"', a).group(1)
    assert ida not in b


def test_formula_matches_predict():
    page = explorer_html(MACHINE, OPS, uid="rfx-x")
    data = _data(page, "rfx-x")
    d = data["defaults"]
    for row, o in zip(data["ops"], OPS):
        expected = predict(Op(o["name"], o["flops"], o["bytes"]), MACHINE)
        assert row["predicted_s"] == pytest.approx(expected)
        js = explorer_predict(row["flops"], row["bytes"], d["peak_gflops"], d["bandwidth_gbs"],
                              d["overhead_us"])
        assert js == pytest.approx(expected, rel=1e-12)
    # the JavaScript evaluates the same expression
    assert "return ovh*1e-6+Math.max(f/(peak*1e9),b/(bw*1e9));" in page
    assert explorer_rows(MACHINE, OPS)[1]["measured_s"] is None
    t, which = gemm_prediction(MACHINE, 1, 576, 576)
    assert t == pytest.approx(predict(matmul_op(1, 576, 576), MACHINE)) and which == "memory"


def test_static_plots_draw():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from labkit.book.explorer import plot_predicted_vs_measured, plot_roofline, plot_time_panel
    t = pd.DataFrame({"kind": ["gemm", "copy"], "flops": [2e9, 0.0], "bytes": [12e6, 8e6],
                      "intensity": [2e9 / 12e6, 0.0], "measured_s": [0.02, 0.001],
                      "predicted_s": [0.017, 0.0009], "bound": ["compute", "memory"]})
    fig, axes = plt.subplots(1, 3)
    plot_roofline(axes[0], {"2 threads": MACHINE}, t)
    plot_time_panel(axes[1], MACHINE, t)
    plot_predicted_vs_measured(axes[2], t)
    assert axes[0].get_xscale() == "log" and len(axes[2].collections) >= 3
    plt.close(fig)


def test_headless_flag_decides_when_set(monkeypatch):
    from labkit.book.explorer import HEADLESS_ENV, running_headless
    monkeypatch.setenv(HEADLESS_ENV, "1")
    assert running_headless(markers=("no-such-program-name",))
    monkeypatch.setenv(HEADLESS_ENV, "0")
    assert not running_headless()


def test_headless_falls_back_to_the_parent_command_line(monkeypatch):
    import os

    from labkit.book import explorer
    monkeypatch.delenv(explorer.HEADLESS_ENV, raising=False)
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        argv0 = os.path.basename(f.read().split(b"\0")[0].decode())
    assert explorer.parent_command_line().split(" ")[0].endswith(argv0)
    assert explorer.running_headless(markers=(argv0,))
    assert not explorer.running_headless(markers=("no-such-program-name",))
    monkeypatch.setattr(explorer, "parent_command_line", lambda: "/usr/bin/python -m papermill x")
    assert explorer.running_headless()
    monkeypatch.setattr(explorer, "parent_command_line", lambda: "/usr/bin/python -m jupyter lab")
    assert not explorer.running_headless()


def test_kind_colors_are_distinct_and_stable():
    from labkit.book.explorer import KINDS, kind_color
    assert len({kind_color(k) for k in KINDS}) == len(KINDS)
    assert kind_color("gemv") == kind_color("gemv") and kind_color("other") == "#000000"
