"""What a reader meets in every chapter's text: cross-references by label that resolve,
no typed chapter numbers, and code lines that fit the rendered column."""

import re
from pathlib import Path

import pytest

from labkit.book import runner

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted((REPO / "notebooks").glob("ch*.md"))
PAGES = sorted((REPO / "book").glob("*.md"))
CODE_COLUMN = 90  # characters a code line may take in the rendered book

TYPED_CHAPTER = re.compile(r"\b[Cc]hapters? \d+")
REFERENCE = re.compile(r"\{(?:ref|numref)\}`(?:[^`<]*<)?([^`>]+)>?`")
LABEL = re.compile(r"^\(([A-Za-z0-9_.:-]+)\)=\s*$", re.MULTILINE)


def _ids(paths):
    return [p.stem[:4] for p in paths]


def _labels() -> set[str]:
    labels: set[str] = set()
    for path in SOURCES + PAGES:
        labels.update(LABEL.findall(path.read_text(encoding="utf-8")))
    for path in SOURCES:
        for cell in runner.read_source(path).cells:
            name = cell.metadata.get("mystnb", {}).get("figure", {}).get("name")
            if name:
                labels.add(name)
    return labels


def _prose(path: Path) -> list[str]:
    """Markdown cells and figure captions: the text a reader reads."""
    texts = []
    for cell in runner.read_source(path).cells:
        if cell.cell_type == "markdown":
            texts.append(cell.source)
        caption = cell.metadata.get("mystnb", {}).get("figure", {}).get("caption")
        if caption:
            texts.append(caption)
    return texts


def _strip_heading_number(text: str) -> str:
    return re.sub(r"^# \d+\. ", "# ", text, flags=re.MULTILINE)


@pytest.mark.parametrize("path", SOURCES, ids=_ids(SOURCES))
def test_no_typed_chapter_numbers(path):
    """Other chapters are named by their label ({ref}`ch10`), so a renumbered book stays
    right and a pointer to a chapter that does not exist yet cannot be written."""
    typed = [m.group(0) for text in _prose(path)
             for m in TYPED_CHAPTER.finditer(_strip_heading_number(text))]
    assert not typed, f"typed chapter numbers {typed}: write {{ref}}`chNN` instead"


@pytest.mark.parametrize("path", SOURCES, ids=_ids(SOURCES))
def test_references_resolve(path):
    labels = _labels()
    missing = sorted({target for text in _prose(path) for target in REFERENCE.findall(text)}
                     - labels)
    assert not missing, f"references to labels that no page defines: {missing}"


@pytest.mark.parametrize("path", SOURCES, ids=_ids(SOURCES))
def test_code_lines_fit_the_column(path):
    long_lines = [
        line for cell in runner.read_source(path).cells
        if cell.cell_type == "code" and "remove-cell" not in cell.metadata.get("tags", [])
        for line in cell.source.splitlines() if len(line) > CODE_COLUMN
    ]
    assert not long_lines, (f"{len(long_lines)} code lines longer than {CODE_COLUMN} "
                            f"characters, e.g. {long_lines[0]!r}")


def test_reference_pattern_reads_both_spellings():
    assert REFERENCE.findall("see {ref}`ch10` and {ref}`the cache <ch10>`") == ["ch10", "ch10"]
    assert TYPED_CHAPTER.search("as chapter 7 showed")


CHECK_MARKER = "NBVAL_CHECK_OUTPUT"


@pytest.mark.parametrize("path", SOURCES, ids=_ids(SOURCES))
def test_check_markers_are_lines_of_their_own(path):
    """nbval honours ``# NBVAL_CHECK_OUTPUT`` only as a whole comment line; written at the
    end of a code line it does nothing, and the cell's output is silently not checked."""
    trailing = [
        line for cell in runner.read_source(path).cells if cell.cell_type == "code"
        for line in cell.source.splitlines()
        if CHECK_MARKER in line and line.strip().lstrip("#").strip() != CHECK_MARKER
    ]
    assert not trailing, f"{CHECK_MARKER} inside a code line (nbval ignores it): {trailing[:2]}"
