"""Charts that more than one chapter draws. Style comes from `labkit.book.style`."""

from __future__ import annotations

STAGE_ORDER = ["load", "tokenize", "prefill", "sample", "decode", "detokenize"]


def plot_waterfall(ax, events, *, unit: float = 1e3, unit_label: str = "ms",
                   origin: str = "the request arrived"):
    """Draw one request's stages as a waterfall: a row per stage, a bar per call.

    `events` is a list of (stage, start_seconds, duration_seconds), as recorded in
    `StageTimings.events`; a "load" event may be prepended by the caller.
    """
    stages = [s for s in STAGE_ORDER if any(e[0] == s for e in events)]
    stages += sorted({e[0] for e in events} - set(stages))
    palette = STAGE_ORDER + [s for s in stages if s not in STAGE_ORDER]
    colours = {s: f"C{i}" for i, s in enumerate(palette)}  # a stage keeps its colour everywhere
    for row, stage in enumerate(stages):
        spans = [(start * unit, took * unit) for name, start, took in events if name == stage]
        ax.broken_barh(spans, (row - 0.35, 0.7), facecolors=colours[stage])
    ax.set_yticks(range(len(stages)), stages)
    ax.invert_yaxis()
    ax.set_xlabel(f"time since {origin} ({unit_label})")
    ax.set_xlim(0, max(start + took for _, start, took in events) * unit * 1.02)
    ax.grid(axis="y", visible=False)
    return ax
