"""Small figure helpers every chapter's plots share: plain tick labels on log axes and
panel letters. Beneath both the book's style (`labkit.book.style`) and the experiments' plots."""

from __future__ import annotations

import math


def panel_labels(axes, labels="abcdefgh") -> None:
    """Write "(a)", "(b)", ... above the top-left corner of each axes, outside the data."""
    for ax, letter in zip(axes, labels):
        ax.text(0, 1.02, f"({letter})", transform=ax.transAxes, fontweight="bold",
                va="bottom", ha="left")


def plain_log_ticks(axis) -> None:
    """Label a log-scaled matplotlib axis (``ax.xaxis`` or ``ax.yaxis``) with plain numbers
    (``0.5``, ``2``, ``300``) instead of powers, labelling only the 1s, 2s, 3s and 5s."""
    from matplotlib.ticker import FuncFormatter

    def label(value, _):
        if value <= 0:
            return ""
        lead = round(value / 10 ** math.floor(math.log10(value)))
        return f"{value:g}" if lead in (1, 2, 3, 5) else ""

    axis.set_major_formatter(FuncFormatter(label))
    axis.set_minor_formatter(FuncFormatter(label))


def plain_ticks(axis, fmt: str = "{:,g}") -> None:
    """Label every major tick of `axis` with a plain number (``1,000``, not ``10^3``) and
    every minor one with nothing."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda value, _: fmt.format(value)))
    axis.set_minor_formatter(NullFormatter())


def ticks_at(axis, values, fmt: str = "{:,g}") -> None:
    """Put the ticks of `axis` exactly at `values` (the sizes a sweep measured, say),
    labelled as plain numbers, with no minor ticks between them."""
    from matplotlib.ticker import FixedLocator, NullLocator

    axis.set_major_locator(FixedLocator(list(values)))
    axis.set_minor_locator(NullLocator())
    plain_ticks(axis, fmt)


__all__ = ["panel_labels", "plain_log_ticks", "plain_ticks", "ticks_at"]
