"""One request, stage by stage: where its time goes, drawn so that every stage can be read.

A request's stages differ by four orders of magnitude: a decode step takes tens of
milliseconds, a tokenizer call a tenth of one. On a shared time axis the short calls are
thinner than a pixel, so this module draws a request twice:

* :func:`plot_timeline` puts the load of the model and the long stages (prefill, each decode
  step) on one time axis, each call a bar with a white edge so that the steps stay apart;
* :func:`plot_call_durations` gives every call its own point, in the order the calls ran,
  with its duration on a logarithmic axis, so the short stages are as legible as the long.

:func:`first_call_reading` says in words where the first call after loading falls against
the calls after it, so that a sentence about "one-time costs" follows the data.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from labkit.util.figures import ticks_at
from labkit.util.palette import MARKERS, OKABE_ITO

__all__ = ["STAGE_ORDER", "stage_colours", "plot_timeline", "plot_call_durations",
           "first_call_reading", "label_panel"]

# The order in which a request meets its stages; a stage keeps its colour in every panel.
STAGE_ORDER = ["load", "tokenize", "prefill", "sample", "decode", "detokenize"]


def stage_colours(stages: Sequence[str] = STAGE_ORDER) -> dict[str, str]:
    """A colour per stage: the known stages in ``STAGE_ORDER`` first, others after them."""
    names = list(STAGE_ORDER) + [s for s in stages if s not in STAGE_ORDER]
    return {s: OKABE_ITO[i % len(OKABE_ITO)] for i, s in enumerate(names)}


def label_panel(ax, letter: str) -> None:
    """Write "(a)" etc. above the top-left corner of ``ax``, outside the data."""
    ax.text(0.0, 1.02, f"({letter})", transform=ax.transAxes, ha="left", va="bottom",
            fontsize=10, fontweight="bold")


def plot_timeline(ax, events: Sequence[tuple[str, float, float]], *,
                  stages: Sequence[str] = ("load", "prefill", "decode")):
    """A waterfall of the calls of ``stages`` only, in seconds from the first event.

    ``events`` are ``(stage, start_s, duration_s)``; the caller prepends the load, shifting
    the request's events by its duration. The axis is then composed, not one measured
    stretch of time (whatever ran between the load and that request is left out): it says
    only "time (s)", and the caption says how the events were placed. Each call is one bar
    with a white edge, so the fifteen decode steps of a row can be counted. Stages not in
    ``stages`` are left out: they are too short to see on this axis
    (:func:`plot_call_durations` draws them).
    """
    colours = stage_colours([e[0] for e in events])
    rows = [s for s in stages if any(e[0] == s for e in events)]
    if not rows:
        raise ValueError(f"no events of the stages {list(stages)}")
    for row, stage in enumerate(rows):
        spans = [(start, took) for name, start, took in events if name == stage]
        ax.broken_barh(spans, (row - 0.35, 0.7), facecolors=colours[stage],
                       edgecolors="white", linewidth=0.8)
    labels = [f"{s} ({sum(e[0] == s for e in events)} calls)"
              if sum(e[0] == s for e in events) > 1 else s for s in rows]
    ax.set_yticks(range(len(rows)), labels)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, max(start + took for _, start, took in events) * 1.02)
    ax.set_xlabel("time (s)")
    ax.grid(axis="y", visible=False)
    return rows


def plot_call_durations(ax, events: Sequence[tuple[str, float, float]]):
    """Every call's duration (ms, log axis) against its place in the order of calls.

    One marker and colour per stage; the legend sits right of the axes, outside the data.
    Tick labels are plain numbers of milliseconds (0.01, 0.1, 1, 10, 100), not powers of ten.
    Returns the stages drawn, in legend order.
    """
    if not events:
        raise ValueError("no events to draw")
    colours = stage_colours([e[0] for e in events])
    present = [s for s in colours if any(e[0] == s for e in events)]
    for index, stage in enumerate(present):
        points = [(order, 1e3 * took) for order, (name, _, took) in enumerate(events, start=1)
                  if name == stage]
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=22, zorder=3,
                   color=colours[stage], marker=MARKERS[index % len(MARKERS)],
                   label=f"{stage} ({len(points)})")
    ax.set_yscale("log")
    durations = [1e3 * took for _, _, took in events if took > 0]
    low, high = min(durations), max(durations)
    decades = [10.0 ** k for k in range(-4, 6) if low / 10 <= 10.0 ** k <= high * 10]
    ax.set_ylim(low / 2, high * 2)
    ticks_at(ax.yaxis, decades, "{:g}")
    ax.set_xlim(0, len(events) + 1)
    ax.set_xlabel("call, in the order the request made it")
    ax.set_ylabel("duration of the call (ms)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1, fontsize=8,
              title="stage (calls)", title_fontsize=8, frameon=False)
    return present


def first_call_reading(first: float, later: Sequence[float]) -> str:
    """Where the first call falls against the identical calls after it, in words.

    "within the range of the N later passes" when ``min(later) <= first <= max(later)``;
    otherwise "X times their median, above every one of them" (or "below"). Needs at
    least two later calls, so that the range means something.
    """
    later = list(later)
    if len(later) < 2:
        raise ValueError(f"need at least two later calls, got {len(later)}")
    if min(later) <= first <= max(later):
        return f"within the range of the {len(later)} later passes"
    ratio = first / statistics.median(later)
    side = "above" if first > max(later) else "below"
    return f"{ratio:.2f} times their median, {side} every one of them"
