"""Where a chapter's evidence goes: figures, tables, headline numbers and their context.

In a notebook::

    res = Results("ch01", profile=profile, model="smollm2-135m")
    res.workload(prompt=PROMPT, max_new_tokens=16)
    res.metric("decode_tok_s", 12.4, unit="tokens/s", fmt="{:.1f}")   # glued for {glue:}`decode_tok_s`
    res.not_run("gpu_decode_tok_s", "no CUDA device")
    res.savefig(fig, "waterfall")       # results/ch01/waterfall.png and .svg
    res.table(df, "stages")             # results/ch01/stages.csv
    res.write()                         # results/ch01/metrics.json

The folder is ``results/chNN/`` for the ``full`` profile and ``results/_ci/chNN/`` for
``ci``, so a test run never overwrites the committed results; ``LABKIT_RESULTS_DIR``
replaces the ``results`` folder (the chapter and profile folders are kept below it). The
repository root is the nearest folder above the working directory that holds
``_config.yml`` (so a notebook run from ``notebooks/`` finds it). A chapter opened alone,
with no checkout around it (Colab, a downloaded notebook, labkit installed from a wheel),
writes to ``results/`` in its working folder, beside the notebook.

A fact about the machine (what fits in a cache, which configuration won) is never asserted:
:meth:`Results.fact` records it and glues the sentence for the outcome this run had, so
the prose reads true on any machine.

``metrics.json`` holds: chapter, profile, metrics (value, unit, note, formatted text),
not_run (name -> reason), workload, figures, tables, environment
(:func:`labkit.util.environment.capture`), git revision, and a UTC timestamp.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from labkit.book.profile import PROFILES, current_profile, find_repo_root

RESULTS_ENV = "LABKIT_RESULTS_DIR"
NOT_RUN = "NOT_RUN"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class GluedText(str):
    """A string that displays without quotes, so {glue:}`name` shows ``385 ms``, not
    ``'385 ms'`` (IPython's plain-text repr of a str keeps the quotes)."""

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))


def glue(name: str, value: Any, display: bool = False) -> bool:
    """``myst_nb.glue`` when myst-nb is importable (and an IPython kernel is running);
    otherwise do nothing. A ``str`` is glued as :class:`GluedText` (shown without quotes).
    Returns whether the value was glued."""
    try:
        from IPython import get_ipython
        from myst_nb import glue as _glue
    except ImportError:
        return False
    if get_ipython() is None:  # plain python: IPython's display would print the value
        return False
    if isinstance(value, str) and not isinstance(value, GluedText):
        value = GluedText(value)
    try:
        _glue(name, value, display=display)
    except Exception:  # no IPython display machinery (plain python): nothing to glue into
        return False
    return True


def chapter_id(chapter: str | int) -> str:
    """``1``, ``"1"``, ``"01"``, ``"ch01"`` or ``"ch01-what-is-inference"`` -> ``"ch01"``."""
    text = str(chapter).strip().lower()
    match = re.match(r"^(?:ch)?(\d{1,2})(?:$|-)", text)
    if not match:
        raise ValueError(f"not a chapter: {chapter!r} (expected a number like 1 or 'ch01')")
    number = int(match.group(1))
    if not 0 <= number <= 99:
        raise ValueError(f"chapter number out of range: {chapter!r}")
    return f"ch{number:02d}"


def results_root(profile: str, root: str | os.PathLike | None = None) -> Path:
    """The results folder for a profile: ``<repo>/results`` or ``$LABKIT_RESULTS_DIR``,
    plus ``_ci`` for the ci profile."""
    profile = current_profile(profile)
    base = os.environ.get(RESULTS_ENV)
    if base:
        top = Path(base).expanduser().resolve()
    else:
        try:
            top = find_repo_root(root) / "results"
        except FileNotFoundError:  # a chapter opened alone: results beside the notebook
            top = Path(root or Path.cwd()).resolve() / "results"
    sub = PROFILES[profile].results_subdir
    return top / sub if sub else top


def _jsonable(value: Any) -> Any:
    """Numbers, strings, lists and dicts as JSON can hold them (numpy/torch scalars, paths,
    NaN and inf as strings)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        try:
            return _jsonable(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    tolist = getattr(value, "tolist", None)  # small arrays
    if callable(tolist):
        return _jsonable(tolist())
    return str(value)


class Results:
    """Collects one chapter's evidence and writes it to ``results/[_ci/]chNN/``."""

    def __init__(self, chapter: str | int, profile: str | None = None, *,
                 model: str | None = None, root: str | os.PathLike | None = None,
                 glue_values: bool = True):
        self.chapter = chapter_id(chapter)
        self.profile = current_profile(profile)
        self.model = model
        self.dir = results_root(self.profile, root) / self.chapter
        try:
            self.repo_root: Path | None = find_repo_root(root)
        except FileNotFoundError:
            self.repo_root = None
        self.dir.mkdir(parents=True, exist_ok=True)
        self.glue_values = glue_values
        self.metrics: dict[str, dict[str, Any]] = {}
        self.not_run_reasons: dict[str, str] = {}
        self.workload_info: dict[str, Any] = {}
        self.figures: list[str] = []
        self.tables: list[str] = []

    def __repr__(self) -> str:
        return f"Results({self.chapter!r}, profile={self.profile!r}, dir={str(self.dir)!r})"

    @staticmethod
    def _check_name(name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(f"bad result name {name!r}: use letters, digits, '_', '-', '.'")
        return name

    def _glue(self, name: str, value: Any) -> None:
        if self.glue_values:
            glue(name, value, display=False)

    # figures and tables ------------------------------------------------------------

    def savefig(self, fig, name: str, *, dpi: int = 150) -> None:
        """Write ``fig`` as ``name.png`` (dpi 150) and ``name.svg``.

        Returns ``None`` on purpose: as the last line of a cell it adds no output, so a
        figure cell has exactly one output (the figure) and myst-nb's caption attaches to
        it. (Two outputs under one ``mystnb: figure`` would make two figures with one label.)
        """
        self._check_name(name)
        paths = [self.dir / f"{name}.png", self.dir / f"{name}.svg"]
        fig.savefig(paths[0], dpi=dpi)
        # A fixed hash salt keeps SVG ids stable, so re-runs diff cleanly.
        import matplotlib

        with matplotlib.rc_context({"svg.hashsalt": f"labkit-{self.chapter}-{name}"}):
            fig.savefig(paths[1], metadata={"Date": None})
        for path in paths:
            rel = path.name
            if rel not in self.figures:
                self.figures.append(rel)

    def table(self, df, name: str, *, index: bool = False):
        """Write a pandas DataFrame as ``name.csv`` and return it as a
        :class:`~labkit.book.tables.BookTable`, so the last line of a cell shows it with
        readable headers and without the 0..n-1 row numbers (the CSV keeps the names)."""
        from labkit.book.tables import book_table

        self._check_name(name)
        path = self.dir / f"{name}.csv"
        df.to_csv(path, index=index)
        if path.name not in self.tables:
            self.tables.append(path.name)
        return book_table(df)

    # numbers ---------------------------------------------------------------------------

    def metric(self, name: str, value: Any, unit: str | None = None, note: str | None = None,
               *, fmt: str | None = None) -> Any:
        """Record a headline figure and glue it under ``name``.

        With ``fmt`` (e.g. ``"{:.2f}"`` or ``"{:,}"``) the formatted string is glued, so the
        prose can write {glue:}`name` and get exactly the text that is recorded. Returns
        ``value``.
        """
        self._check_name(name)
        text = fmt.format(value) if fmt else None
        entry: dict[str, Any] = {"value": _jsonable(value)}
        if unit is not None:
            entry["unit"] = unit
        if note is not None:
            entry["note"] = note
        if text is not None:
            entry["text"] = text
        self.metrics[name] = entry
        self.not_run_reasons.pop(name, None)
        self._glue(name, text if text is not None else value)
        return value

    def fact(self, name: str, holds: bool, if_true: str, if_false: str, *,
             note: str | None = None) -> str:
        """Record a fact about this machine or run (a cache that holds a matrix, a
        configuration that won, a bound that was met) and glue under ``name`` the sentence
        written for the outcome it had: ``if_true`` or ``if_false``. Use it wherever the
        prose would otherwise state one machine's outcome as a law; assert only invariants.
        Returns the glued sentence."""
        self._check_name(name)
        if not isinstance(holds, bool):
            holds = bool(holds)  # numpy/torch booleans
        text = if_true if holds else if_false
        entry: dict[str, Any] = {"value": holds, "text": text, "kind": "fact"}
        if note is not None:
            entry["note"] = note
        self.metrics[name] = entry
        self.not_run_reasons.pop(name, None)
        self._glue(name, text)
        return text

    def not_run(self, name: str, reason: str, *, what: str | None = None) -> str:
        """Record that ``name`` could not be measured here, and why; glue
        ``"NOT_RUN (reason)"`` under ``name`` so the prose shows the reason, never a number.

        With ``what`` the glued text is a sentence of its own, ``"NOT_RUN: <what> did not run
        here (<reason>)."``, for a passage that stands where the measured sentence would be
        (glue the measured sentence under the same name with :meth:`metric` when it ran), so
        that NOT_RUN never sits inside a sentence written for a number."""
        self._check_name(name)
        if not reason or not str(reason).strip():
            raise ValueError("a NOT_RUN needs its reason")
        reason = str(reason).strip()
        self.not_run_reasons[name] = reason
        self.metrics.pop(name, None)
        if what is None:
            text = f"{NOT_RUN} ({reason})"
        else:
            text = f"{NOT_RUN}: {str(what).strip()} did not run here ({reason})."
        self._glue(name, text)
        return text

    def workload(self, **kw: Any) -> dict[str, Any]:
        """Record (add to) the workload: prompts, sizes, seeds, repetitions..."""
        self.workload_info.update({k: _jsonable(v) for k, v in kw.items()})
        return dict(self.workload_info)

    # the record ------------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """The dict that :meth:`write` stores as ``metrics.json``."""
        from labkit.kernels.dispatch import dispatch_report
        from labkit.models.registry import artefact_record
        from labkit.util.environment import capture

        environment = capture(artefact_record(self.model) if self.model else None, root=self.repo_root)
        environment["kernels"] = dispatch_report()
        return {
            "chapter": self.chapter,
            "profile": self.profile,
            "metrics": self.metrics,
            "not_run": self.not_run_reasons,
            "workload": self.workload_info,
            "figures": sorted(self.figures),
            "tables": sorted(self.tables),
            "environment": environment,
            "git_revision": environment["git"]["revision"],
            "git_dirty": environment["git"]["dirty"],
            "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }

    def write(self) -> Path:
        """Write ``metrics.json`` into the chapter's results folder and return its path."""
        path = self.dir / "metrics.json"
        record = self.record()
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path


ChapterResults = Results

__all__ = ["Results", "ChapterResults", "GluedText", "NOT_RUN", "RESULTS_ENV", "chapter_id", "results_root", "glue"]
