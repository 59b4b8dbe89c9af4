"""The one figure style of the book.

Call :func:`use_book_style` once in a chapter's setup cell, then make figures with
:func:`new_figure` (or plain matplotlib). The style:

- size 6.4 x 3.6 inches (16:9), constrained layout, 150 dpi when saved as PNG;
- readable type (10 pt body, 10 pt axis labels, 9 pt ticks and legends);
- a colour-blind-safe cycle (Okabe and Ito, 2008), with distinct line styles available in
  :data:`LINESTYLES` for figures that must also read in greyscale;
- no top or right spines, a light grid under the data;
- SVG text kept as text (``svg.fonttype: none``), so figures stay small and searchable.

Figures carry **no titles**. The caption comes from the notebook cell's metadata, which
myst-nb turns into a numbered figure ("Figure N") that prose can cite with
{numref}`fig-ch01-waterfall`. In the MyST source the cell reads::

    ```{code-cell} ipython3
    ---
    mystnb:
      figure:
        caption: Time per stage of one request (full profile).
        name: fig-ch01-waterfall
    ---
    fig, ax = new_figure()
    ...
    res.savefig(fig, "waterfall")
    ```

The cell must have exactly one output, the figure (``Results.savefig`` returns ``None``;
end any other last line with ``;``), or myst-nb makes one captioned figure per output.
Label every axis with its quantity and unit ("time per token (ms)").
"""

from __future__ import annotations

from typing import Any

from labkit.util.figures import (  # noqa: F401 (re-exported)
    panel_labels, plain_log_ticks, plain_ticks, ticks_at)
from labkit.util.palette import LINESTYLES, MARKERS, OKABE_ITO  # noqa: F401 (the style's palette)

FIGSIZE = (6.4, 3.6)

BOOK_RC: dict[str, Any] = {
    "figure.figsize": FIGSIZE,
    "figure.dpi": 100,
    "figure.constrained_layout.use": True,
    "figure.facecolor": "white",
    "savefig.dpi": 150,
    "savefig.facecolor": "white",
    "svg.fonttype": "none",
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.color": "#dddddd",
    "grid.linewidth": 0.6,
    "grid.alpha": 1.0,
    "lines.linewidth": 1.8,
    "lines.markersize": 5,
    "axes.formatter.useoffset": False,
    "image.cmap": "viridis",
}


def use_book_style(**overrides: Any) -> None:
    """Apply the book's matplotlib style (and any rcParams ``overrides``) globally."""
    import matplotlib as mpl
    from cycler import cycler

    mpl.rcParams.update(BOOK_RC)
    mpl.rcParams["axes.prop_cycle"] = cycler(color=OKABE_ITO)
    if overrides:
        mpl.rcParams.update(overrides)


def new_figure(nrows: int = 1, ncols: int = 1, *, width: float | None = None,
               height: float | None = None, **subplot_kw: Any):
    """``plt.subplots`` in the book's style: returns ``(fig, ax)`` (``ax`` is an array when
    there is more than one panel). ``width``/``height`` in inches default to 6.4 x 3.6;
    extra keyword arguments go to ``plt.subplots`` (``sharex``, ``sharey``, ...)."""
    import matplotlib.pyplot as plt

    use_book_style()
    size = (width or FIGSIZE[0], height or FIGSIZE[1])
    return plt.subplots(nrows, ncols, figsize=size, **subplot_kw)


__all__ = ["use_book_style", "new_figure", "OKABE_ITO", "LINESTYLES", "MARKERS", "FIGSIZE", "BOOK_RC",
           "panel_labels", "plain_log_ticks", "plain_ticks", "ticks_at"]
