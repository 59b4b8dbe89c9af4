"""Run the book's notebooks and build the book.

The pipeline (``labkit book run`` / ``labkit book build`` call these functions):

1. ``notebooks/chNN-slug.md`` (MyST) is the source. :func:`sync_pair` copies its cells into
   the paired ``notebooks/chNN-slug.ipynb`` and keeps the outputs stored there (jupytext's
   ``--sync`` with the markdown file always taken as the source of the inputs, whatever
   the files' modification times).
2. :func:`run_chapters` executes each ``.ipynb`` with papermill (kernel ``python3``, working
   folder ``notebooks/``, parameter ``profile``), removes papermill's injected parameter
   cell and the papermill/execution metadata so re-runs diff cleanly, stores the result
   in the ``.ipynb`` and syncs the pair again.
3. :func:`write_toc` generates ``_toc.yml`` from the chapters on disk; :func:`build_book`
   writes it and runs ``jupyter-book build . -W --keep-going`` (stored outputs only).

:func:`sync_install_cells` rewrites the first code cell of every chapter to the install
cell generated from ``_config.yml`` (see :func:`labkit.book.profile.install_cell_source`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from labkit.book import pending_glue
from labkit.book.profile import (
    PARAMETERS_SOURCE,
    current_profile,
    find_repo_root,
    install_cell_source,
    is_install_cell,
    repository_branch,
    repository_url,
)

NOTEBOOK_DIR = "notebooks"
TOC_FILE = "_toc.yml"
MD_FORMAT = "md:myst"
INSTALL_TAG = "remove-cell"
PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
CELL_METADATA_DROP = ("papermill", "execution", "ExecuteTime")
NOTEBOOK_METADATA_DROP = ("papermill", "execution")

_CHAPTER_FILE = re.compile(r"^ch(\d{2})-[a-z0-9][a-z0-9-]*$")

# (opener, caption, first chapter, last chapter)
PARTS: tuple[tuple[str, str, int, int], ...] = (
    ("book/part1", "Part I. Understanding inference", 1, 6),
    ("book/part2", "Part II. Computational foundations", 7, 12),
    ("book/part3", "Part III. Making inference fast", 13, 18),
    ("book/part4", "Part IV. Modern model architectures", 19, 24),
    ("book/part5", "Part V. Building an inference service", 25, 30),
    ("book/part6", "Part VI. Protocols and applications", 31, 35),
    ("book/part7", "Part VII. Economics and evaluation", 36, 40),
    ("book/part8", "Part VIII. Inference Lab capstone", 41, 45),
)


class ChapterRunError(RuntimeError):
    """One or more chapters failed to execute; ``.runs`` holds every chapter's report."""

    def __init__(self, runs: list["ChapterRun"]):
        self.runs = runs
        failed = [run for run in runs if not run.ok]
        lines = [f"{len(failed)} of {len(runs)} chapter(s) failed:"]
        lines += [f"  {run.name}: {run.error}" for run in failed]
        super().__init__("\n".join(lines))


@dataclass
class ChapterRun:
    """The report for one executed chapter."""

    name: str
    ok: bool
    seconds: float
    profile: str
    error: str | None = None
    failed_notebook: Path | None = None

    def __str__(self) -> str:
        status = "ok" if self.ok else "FAILED"
        text = f"{self.name}: {status} ({self.seconds:.1f} s, profile {self.profile})"
        if self.error:
            text += f"\n    {self.error}"
        if self.failed_notebook:
            text += f"\n    executed notebook with the error: {self.failed_notebook}"
        return text


# --------------------------------------------------------------------------------------
# Chapters on disk and the table of contents
# --------------------------------------------------------------------------------------

def _root(root: str | Path | None) -> Path:
    return Path(root).resolve() if root else find_repo_root()


def chapter_number(path: str | Path) -> int:
    """``notebooks/ch07-matmul.ipynb`` -> 7 (ValueError for a name that is not a chapter)."""
    stem = Path(path).stem
    match = _CHAPTER_FILE.match(stem)
    if not match:
        raise ValueError(f"{path}: a chapter file is named chNN-slug (lower case, digits, '-')")
    return int(match.group(1))


def part_of(number: int) -> int:
    """The part (1-8) a chapter number belongs to."""
    for index, (_, _, first, last) in enumerate(PARTS, start=1):
        if first <= number <= last:
            return index
    raise ValueError(f"chapter {number} is outside 1-45")


def chapter_files(root: str | Path | None = None, suffix: str = ".ipynb") -> list[Path]:
    """Chapter files ``notebooks/ch*<suffix>``, sorted by chapter number."""
    folder = _root(root) / NOTEBOOK_DIR
    files = [p for p in folder.glob(f"ch*{suffix}") if p.is_file()]
    return sorted(files, key=lambda p: (chapter_number(p), p.name))


def toc_text(root: str | Path | None = None) -> str:
    """The ``_toc.yml`` that lists every chapter notebook present on disk."""
    by_part: dict[int, list[str]] = {index: [] for index in range(1, len(PARTS) + 1)}
    seen: dict[int, str] = {}
    for path in chapter_files(root, ".ipynb"):
        number = chapter_number(path)
        if number in seen:
            raise ValueError(f"two notebooks for chapter {number}: {seen[number]} and {path.name}")
        seen[number] = path.name
        by_part[part_of(number)].append(f"{NOTEBOOK_DIR}/{path.stem}")
    lines = [
        "# GENERATED by labkit.book.runner.write_toc() from notebooks/ch*.ipynb:",
        "# do not edit by hand; run `labkit book build` (or write_toc()) instead.",
        "format: jb-book",
        "root: book/intro",
        "parts:",
    ]
    for index, (opener, caption, _, _) in enumerate(PARTS, start=1):
        lines.append(f'  - caption: "{caption}"')
        lines.append("    chapters:")
        lines.append(f"      - file: {opener}")
        lines += [f"      - file: {doc}" for doc in by_part[index]]
    return "\n".join(lines) + "\n"


def write_toc(root: str | Path | None = None) -> Path:
    """Write ``_toc.yml`` from the chapters on disk (only if it changed); return its path."""
    path = _root(root) / TOC_FILE
    text = toc_text(root)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    return path


def toc_is_current(root: str | Path | None = None) -> bool:
    path = _root(root) / TOC_FILE
    return path.is_file() and path.read_text(encoding="utf-8") == toc_text(root)


def resolve_chapters(chapters: Iterable[str | int] | str | int | None = None,
                     root: str | Path | None = None) -> list[Path]:
    """The MyST sources (``notebooks/chNN-slug.md``) of the selected chapters.

    A selector is a number (``1``, ``"01"``), ``"ch01"``, a slug (``"what-is-inference"``),
    a file stem (``"ch01-what-is-inference"``) or a path to the ``.md`` or ``.ipynb``.
    ``None`` selects every ``notebooks/ch*.md``.
    """
    sources = chapter_files(root, ".md")
    if chapters is None:
        return sources
    if isinstance(chapters, (str, int)):
        chapters = [chapters]
    selected: list[Path] = []
    for item in chapters:
        text = str(item).strip()
        candidate = Path(text)
        if candidate.suffix in (".md", ".ipynb") and candidate.exists():
            matches = [candidate.resolve().with_suffix(".md")]
        elif re.fullmatch(r"(ch)?\d{1,2}", text.lower()):
            number = int(text.lower().removeprefix("ch"))
            matches = [p for p in sources if chapter_number(p) == number]
        else:
            stem = text.lower()
            matches = [p for p in sources if p.stem == stem or p.stem[5:] == stem]
        if len(matches) != 1:
            known = ", ".join(p.stem for p in sources) or "none"
            raise ValueError(f"chapter {item!r} matches {len(matches)} notebooks (have: {known})")
        if not matches[0].is_file():
            raise FileNotFoundError(f"{matches[0]} does not exist")
        if matches[0] not in selected:
            selected.append(matches[0])
    return selected


# --------------------------------------------------------------------------------------
# Pairs: the MyST source and the notebook with outputs
# --------------------------------------------------------------------------------------

def _jupytext_config(path: Path):
    from jupytext.config import load_jupytext_config

    return load_jupytext_config(str(path.resolve()))


def read_source(md_path: str | Path):
    """The notebook that a MyST source describes (no outputs)."""
    import jupytext

    md_path = Path(md_path)
    return jupytext.read(md_path, fmt=MD_FORMAT, config=_jupytext_config(md_path))


def read_notebook(ipynb_path: str | Path):
    import nbformat

    return nbformat.read(str(ipynb_path), as_version=4)


def cell_inputs(nb) -> list[tuple[str, str, tuple[str, ...]]]:
    """(cell type, source, tags) of every cell: what must agree between the two files."""
    return [
        (cell.cell_type, cell.source.rstrip("\n"), tuple(cell.get("metadata", {}).get("tags", [])))
        for cell in nb.cells
    ]


def strip_execution_metadata(nb):
    """Remove papermill's injected parameter cell, papermill/execution metadata (cell and
    notebook level) and empty tag lists, in place; return ``nb``."""
    nb.cells = [c for c in nb.cells if INJECTED_TAG not in c.get("metadata", {}).get("tags", [])]
    for cell in nb.cells:
        meta = cell.setdefault("metadata", {})
        for key in CELL_METADATA_DROP:
            meta.pop(key, None)
        if "tags" in meta and not meta["tags"]:
            del meta["tags"]
    for key in NOTEBOOK_METADATA_DROP:
        nb.metadata.pop(key, None)
    return nb


def sync_pair(md_path: str | Path) -> Path:
    """Make ``chNN.ipynb`` carry exactly the cells of ``chNN.md``, keeping the outputs of
    the code cells whose text is unchanged. Creates the ``.ipynb`` if it is missing.
    The ``.md`` is never rewritten. Returns the ``.ipynb`` path.

    A code cell edited in the ``.md`` loses its stored outputs (and any value it glued):
    jupytext pairs an edited cell with its old outputs, which would then be shown, glued
    and checked by nbval as if the new code had produced them. Until the chapter is run
    again, the strict book build reports the missing glue instead."""
    import jupytext
    from jupytext.combine import combine_inputs_with_outputs, map_outputs_to_inputs

    md_path = Path(md_path)
    ipynb_path = md_path.with_suffix(".ipynb")
    config = _jupytext_config(md_path)
    source = read_source(md_path)
    if ipynb_path.is_file():
        outputs = strip_execution_metadata(read_notebook(ipynb_path))
        paired = map_outputs_to_inputs(source.cells, outputs.cells)
        notebook = combine_inputs_with_outputs(source, outputs, fmt=MD_FORMAT)
        # The .md is the source of cell metadata too (tags, figure captions): jupytext's
        # combine can keep the .ipynb's stale copy, so take every cell's metadata from the .md.
        for cell, src, index in zip(notebook.cells, source.cells, paired):
            cell.metadata = type(src.metadata)(src.metadata)
            if (cell.cell_type == "code" and index is not None
                    and outputs.cells[index].source != src.source):
                cell.outputs, cell.execution_count = [], None
    else:
        notebook = source
    notebook.metadata.get("jupytext", {}).pop("text_representation", None)
    if not notebook.metadata.get("jupytext", True):
        notebook.metadata.pop("jupytext")
    text = jupytext.writes(notebook, fmt="ipynb", config=config)
    if not text.endswith("\n"):
        text += "\n"  # as `jupytext --sync` writes it, so either tool leaves the file unchanged
    if not ipynb_path.is_file() or ipynb_path.read_text(encoding="utf-8") != text:
        ipynb_path.write_text(text, encoding="utf-8")
    return ipynb_path


def pair_in_sync(md_path: str | Path) -> bool:
    """Whether the ``.ipynb`` has the same cells (type, text, tags) as the ``.md``."""
    md_path = Path(md_path)
    ipynb_path = md_path.with_suffix(".ipynb")
    if not ipynb_path.is_file():
        return False
    return cell_inputs(read_source(md_path)) == cell_inputs(read_notebook(ipynb_path))


def sync_install_cells(root: str | Path | None = None,
                       chapters: Iterable[str | int] | None = None) -> list[Path]:
    """Make the first code cell of every chapter source the install cell (generated from
    ``_config.yml``, tagged ``remove-cell``) and its parameters cell the commented profile
    switch (:data:`~labkit.book.profile.PARAMETERS_SOURCE`), then sync its ``.ipynb``. An existing install
    cell is replaced, otherwise one is inserted before the first code cell. Returns the
    sources that changed."""
    import jupytext
    from nbformat.v4 import new_code_cell

    root = _root(root)
    wanted = install_cell_source(repository_url(root), repository_branch(root))
    changed: list[Path] = []
    for md_path in resolve_chapters(chapters, root):
        notebook = read_source(md_path)
        parameters = parameters_cell(notebook)
        parameters_changed = parameters is not None and parameters.source != PARAMETERS_SOURCE
        if parameters_changed:
            parameters.source = PARAMETERS_SOURCE
        code = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code"]
        first = code[0] if code else None
        if first is not None and is_install_cell(notebook.cells[first].source):
            cell = notebook.cells[first]
            tags = list(cell.metadata.get("tags", []))
            if cell.source == wanted and INSTALL_TAG in tags and not parameters_changed:
                continue
            cell.source = wanted
            if INSTALL_TAG not in tags:
                cell.metadata["tags"] = [INSTALL_TAG, *tags]
        else:
            position = first if first is not None else len(notebook.cells)
            notebook.cells.insert(position, new_code_cell(wanted, metadata={"tags": [INSTALL_TAG]}))
        jupytext.write(notebook, md_path, fmt=MD_FORMAT, config=_jupytext_config(md_path))
        if md_path.with_suffix(".ipynb").is_file():
            sync_pair(md_path)
        changed.append(md_path)
    return changed


def parameters_cell(nb):
    """The cell tagged ``parameters`` (or ``None``)."""
    for cell in nb.cells:
        if cell.cell_type == "code" and PARAMETERS_TAG in cell.get("metadata", {}).get("tags", []):
            return cell
    return None


# --------------------------------------------------------------------------------------
# Running chapters
# --------------------------------------------------------------------------------------

def _execute(md_path: Path, profile: str, timeout: float | None, kernel: str, root: Path) -> ChapterRun:
    import nbformat
    import papermill

    name = md_path.stem
    start = time.perf_counter()
    ipynb_path = sync_pair(md_path)
    if parameters_cell(read_notebook(ipynb_path)) is None:
        return ChapterRun(name, False, 0.0, profile, f"{md_path.name} has no cell tagged 'parameters'")
    failed_dir = root / "_build" / "papermill"
    with tempfile.TemporaryDirectory(prefix=f"labkit-{name}-") as tmp:
        # Execute into a temporary file: stored outputs are replaced only when the run succeeds.
        out_path = Path(tmp) / ipynb_path.name
        error = None
        try:
            # The kernel inherits this: chapters skip live-only widgets (labkit.book.explorer).
            os.environ["LABKIT_HEADLESS"] = "1"
            papermill.execute_notebook(
                str(ipynb_path), str(out_path),
                parameters={"profile": profile},
                kernel_name=kernel,
                cwd=str(ipynb_path.parent),
                execution_timeout=timeout,
                progress_bar=False,
                log_output=False,
                request_save_on_cell_execute=False,
            )
        except Exception as exc:  # PapermillExecutionError, timeouts, a dead kernel
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        seconds = time.perf_counter() - start
        if error is not None:
            kept = None
            if out_path.is_file():
                failed_dir.mkdir(parents=True, exist_ok=True)
                kept = failed_dir / ipynb_path.name
                shutil.copyfile(out_path, kept)
            return ChapterRun(name, False, seconds, profile, error, kept)
        executed = strip_execution_metadata(read_notebook(out_path))
    nbformat.write(executed, str(ipynb_path))
    sync_pair(md_path)
    if not pair_in_sync(md_path):
        return ChapterRun(name, False, time.perf_counter() - start, profile,
                          "the executed notebook's cells differ from the MyST source")
    return ChapterRun(name, True, time.perf_counter() - start, profile)


def execute_chapters(profile: str = "full", chapters: Sequence[str | int] | str | int | None = None,
                     timeout: float | None = None, *, root: str | Path | None = None,
                     kernel: str = "python3",
                     log: Callable[[str], None] | None = print) -> list[ChapterRun]:
    """Execute the selected chapters and return one :class:`ChapterRun` per chapter (a
    failing chapter is reported, not raised; the others still run). See :func:`run_chapters`."""
    profile = current_profile(profile)
    root = _root(root)
    sources = resolve_chapters(chapters, root)
    if not sources:
        raise FileNotFoundError(f"no chapter sources (ch*.md) under {root / NOTEBOOK_DIR}")
    sync_install_cells(root, [str(p) for p in sources])
    runs: list[ChapterRun] = []
    for md_path in sources:
        if log:
            log(f"running {md_path.stem} (profile {profile}) ...")
        run = _execute(md_path, profile, timeout, kernel, root)
        runs.append(run)
        if log:
            log(str(run))
    write_toc(root)
    if log:
        ok = sum(run.ok for run in runs)
        total = sum(run.seconds for run in runs)
        log(f"{ok} of {len(runs)} chapter(s) ok in {total:.1f} s")
    return runs


def run_chapters(profile: str = "full", chapters: Sequence[str | int] | str | int | None = None,
                 timeout: float | None = None, *, root: str | Path | None = None,
                 kernel: str = "python3", raise_on_failure: bool = False,
                 log: Callable[[str], None] | None = print) -> int:
    """Execute chapters with papermill, store their outputs in the ``.ipynb``; return an
    exit code: 0 when every chapter ran, 1 when one failed, 2 when the selection is wrong.

    ``chapters`` selects by number, ``chNN``, slug or path (default: every
    ``notebooks/ch*.md``); ``timeout`` is papermill's limit per cell in seconds (``None``:
    no limit). Every selected chapter runs even if an earlier one fails; each is reported
    (ok or FAILED, seconds, the error) through ``log``. With ``raise_on_failure`` a failure
    raises :class:`ChapterRunError` (its ``runs`` holds the reports) instead of returning 1.
    Use :func:`execute_chapters` to get the reports as objects.
    """
    try:
        runs = execute_chapters(profile, chapters, timeout, root=root, kernel=kernel, log=log)
    except (ValueError, FileNotFoundError) as exc:
        if raise_on_failure:
            raise
        if log:
            log(f"labkit book run: {exc}")
        return 2
    if all(run.ok for run in runs):
        return 0
    if raise_on_failure:
        raise ChapterRunError(runs)
    return 1


# --------------------------------------------------------------------------------------
# Building the book
# --------------------------------------------------------------------------------------

def jupyter_book_executable() -> str:
    """The ``jupyter-book`` next to the running Python (the venv's), else one on PATH."""
    local = Path(sys.executable).with_name("jupyter-book")
    if local.is_file():
        return str(local)
    found = shutil.which("jupyter-book")
    if not found:
        raise FileNotFoundError("jupyter-book is not installed (pip install -e '.[book]')")
    return found


def build_book(strict: bool = True, *, root: str | Path | None = None, all_pages: bool = True,
               builder: str = "html", log: Callable[[str], None] | None = print) -> int:
    """Write ``_toc.yml``, then render the stored outputs with ``jupyter-book build``.

    ``strict`` adds ``-W --keep-going``: every warning is reported and makes the exit code
    non-zero. ``all_pages`` rebuilds every page (an incremental build would not repeat the
    warnings of unchanged pages). Returns jupyter-book's exit code (0: built, no warnings).
    """
    root = _root(root)
    write_toc(root)
    cmd = [jupyter_book_executable(), "build", str(root), "--builder", builder]
    if strict:
        cmd += ["-W", "--keep-going"]
    if all_pages:
        cmd.append("--all")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")
    lines = []
    for line in proc.stdout:          # shown as it comes, and kept for the triage below
        sys.stdout.write(line)
        lines.append(line)
    returncode = proc.wait()
    seconds = time.perf_counter() - start
    banner = "=" * 72
    if returncode != 0 and strict:
        forgiven = forgiven_pending_glue("".join(lines), root)
        if forgiven:
            returncode = 0
            if log:
                log(f"{banner}\nBOOK BUILT WITH CHAPTERS PENDING RE-RUN: "
                    + ", ".join(f"ch{n:02d} ({count} glued value(s) blank)"
                                for n, count in sorted(forgiven.items()))
                    + f"\ntheir text is newer than their stored run ([pending_rerun] in "
                    f"results/stale-allowed.toml); re-run them: labkit book run --profile full N"
                    f"\n{banner}")
    if log:
        if returncode == 0:
            log(f"book built in {seconds:.1f} s: {root / '_build' / builder / 'index.html'}")
        else:
            log(f"{banner}\nBOOK BUILD FAILED (exit {returncode}) after {seconds:.1f} s"
                + (": warnings are errors (-W); see the WARNING lines above" if strict else "")
                + f"\n{banner}")
    return returncode


def forgiven_pending_glue(build_output: str, root: Path) -> dict[int, int] | None:
    """{pending chapter: blank glued values} when every problem the strict build reported is
    a missing glued value of a chapter under `[pending_rerun]` and their count is the
    build's own warning count; None otherwise (the failure stands)."""
    totals = re.findall(r"build finished with problems, (\d+) warnings?", build_output)
    triaged = pending_glue.triage(build_output, pending_glue.pending_chapters(root))
    if not totals or not triaged.ok or not triaged.forgiven:
        return None
    return triaged.forgiven if sum(triaged.forgiven.values()) == int(totals[-1]) else None


__all__ = [
    "PARTS",
    "ChapterRun",
    "ChapterRunError",
    "build_book",
    "chapter_files",
    "chapter_number",
    "execute_chapters",
    "forgiven_pending_glue",
    "part_of",
    "pair_in_sync",
    "parameters_cell",
    "read_notebook",
    "read_source",
    "resolve_chapters",
    "run_chapters",
    "strip_execution_metadata",
    "sync_install_cells",
    "sync_pair",
    "toc_is_current",
    "toc_text",
    "write_toc",
]
