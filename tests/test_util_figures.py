"""The figure helpers every chapter shares: panel letters and plain tick labels."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.util.figures import panel_labels, plain_log_ticks, plain_ticks, ticks_at  # noqa: E402


@pytest.fixture
def axes():
    fig, axes = plt.subplots(1, 2)
    yield axes
    plt.close(fig)


def labels(axis):
    axis.axes.figure.canvas.draw()
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text()]


def test_panel_labels_sit_above_the_axes(axes):
    panel_labels(axes)
    assert [[t.get_text() for t in ax.texts] for ax in axes] == [["(a)"], ["(b)"]]
    assert all(t.get_position()[1] > 1 for ax in axes for t in ax.texts)


def test_ticks_at_puts_plain_labels_exactly_at_the_values_and_no_minor_ticks(axes):
    ax = axes[0]
    ax.plot([128, 4096], [1, 2])
    ax.set_xscale("log", base=2)
    ticks_at(ax.xaxis, [128, 512, 4096])
    assert list(ax.xaxis.get_majorticklocs()) == [128, 512, 4096]
    assert labels(ax.xaxis) == ["128", "512", "4,096"]
    assert len(ax.xaxis.get_minorticklocs()) == 0


def test_plain_ticks_write_thousands_without_powers(axes):
    ax = axes[0]
    ax.plot([10, 10000], [1, 2])
    ax.set_xscale("log")
    plain_ticks(ax.xaxis)
    shown = labels(ax.xaxis)
    assert "10,000" in shown and "1,000" in shown
    assert not any("^" in s or "10^" in s for s in shown)
    assert all(t.get_text() == "" for t in ax.xaxis.get_minorticklabels())


def test_plain_log_ticks_label_only_ones_twos_threes_and_fives(axes):
    ax = axes[0]
    ax.plot([1, 2], [0.5, 700])
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.figure.canvas.draw()
    shown = {t.get_text() for t in ax.yaxis.get_ticklabels(minor=True) + ax.yaxis.get_ticklabels()}
    assert {"1", "2", "3", "5", "10", "100", "500"} <= shown
    assert "4" not in shown and "7" not in shown
