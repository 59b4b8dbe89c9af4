import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from labkit.experiments.request_stages import (first_call_reading, plot_call_durations,
                                               plot_timeline, stage_colours)

EVENTS = [("tokenize", 0.0, 1e-4), ("prefill", 1e-4, 0.08), ("sample", 0.0801, 3e-4),
          ("detokenize", 0.0804, 5e-5), ("decode", 0.081, 0.05), ("sample", 0.131, 3e-4),
          ("decode", 0.1313, 0.05)]


def test_stage_colours_keep_known_order_and_add_new_stages():
    colours = stage_colours(["decode", "custom"])
    assert list(colours)[:2] == ["load", "tokenize"] and "custom" in colours
    assert len(set(colours.values())) == len(colours)


def test_timeline_draws_only_the_long_stages_and_counts_calls():
    fig, ax = plt.subplots()
    events = [("load", 0.0, 0.3)] + [(s, 0.3 + t, d) for s, t, d in EVENTS]
    rows = plot_timeline(ax, events)
    assert rows == ["load", "prefill", "decode"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["load", "prefill", "decode (2 calls)"]
    assert ax.get_xlim()[1] == pytest.approx((0.3 + 0.1313 + 0.05) * 1.02)
    # the load and the request are placed end to end: no claim of time since the load
    assert ax.get_xlabel() == "time (s)"
    plt.close(fig)


def test_timeline_needs_some_long_stage():
    fig, ax = plt.subplots()
    with pytest.raises(ValueError):
        plot_timeline(ax, [("tokenize", 0.0, 1e-4)])
    plt.close(fig)


def test_call_durations_put_every_call_on_a_log_axis_with_plain_ticks():
    fig, ax = plt.subplots()
    present = plot_call_durations(ax, EVENTS)
    assert present == ["tokenize", "prefill", "sample", "decode", "detokenize"]
    assert ax.get_yscale() == "log"
    assert sum(len(c.get_offsets()) for c in ax.collections) == len(EVENTS)
    fig.canvas.draw()
    ticks = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert "0.1" in ticks and "10" in ticks and not any("10^" in t or "$" in t for t in ticks)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[2] == "sample (2)"
    plt.close(fig)


def test_first_call_reading_follows_the_data():
    assert first_call_reading(0.10, [0.09, 0.11, 0.10]) == "within the range of the 3 later passes"
    assert first_call_reading(0.20, [0.09, 0.11, 0.10]) == "2.00 times their median, above every one of them"
    assert first_call_reading(0.05, [0.09, 0.11, 0.10]).endswith("below every one of them")
    with pytest.raises(ValueError):
        first_call_reading(0.1, [0.1])
