"""Glued values a chapter's text shows but its stored run does not carry, and what the
strict book build may forgive.

A chapter's prose can be edited to glue a new value before the chapter is re-run (an issue
fixes many chapters, then re-runs them quietly one at a time). Until the re-run the stored
notebook has no output for that key, and the strict build (``-W``) fails on it. A chapter
listed under ``[pending_rerun]`` in ``results/stale-allowed.toml`` is declared stale on
purpose: for it alone the build forgives exactly that warning, and says loudly which
chapters showed blanks. Any other warning, or a missing value in a chapter that is not
pending, still fails the build (and ``tests/test_book_glue.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from labkit.book.stale import ALLOW_FILE, read_allow_list

# the role ({glue:}`key`, {glue:text}`key:.2f`) and the directive (```{glue:figure} key)
GLUE_REFERENCE = re.compile(r"\{glue(?::[a-z]*)?\}(?:`|[ \t]+)([A-Za-z_][A-Za-z0-9_]*)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PROBLEM = re.compile(r"\b(WARNING|ERROR|CRITICAL|SEVERE):")
_MISSING_GLUE = re.compile(r"notebooks/ch(\d+)-[^/:]*\.ipynb:\d+: WARNING: No key '([A-Za-z0-9_]+)' "
                           r"found in glue data")


def glue_references(notebook: dict) -> set[str]:
    """Keys the markdown cells show with the `{glue:}` role (any of its forms)."""
    keys: set[str] = set()
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            keys |= set(GLUE_REFERENCE.findall("".join(cell["source"])))
    return keys


def glued_outputs(notebook: dict) -> set[str]:
    """Keys the stored code-cell outputs carry (myst-nb's glue writes them as display data
    with a `scrapbook` name)."""
    keys: set[str] = set()
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            name = output.get("metadata", {}).get("scrapbook", {}).get("name")
            if name:
                keys.add(name)
    return keys


def missing_glue(path: Path) -> list[str]:
    """The keys a stored notebook's text shows and no stored output carries, sorted."""
    notebook = json.loads(path.read_text(encoding="utf-8"))
    return sorted(glue_references(notebook) - glued_outputs(notebook))


def pending_chapters(root: Path) -> set[int]:
    """The chapters `[pending_rerun]` lists (none when the allow-list is absent)."""
    numbers = {int(m.group(1)) for m in (re.match(r"ch(\d+)-", p.name)
                                        for p in (root / "notebooks").glob("ch*.md")) if m}
    return set(read_allow_list(root / ALLOW_FILE, numbers).pending)


@dataclass(frozen=True)
class BuildTriage:
    forgiven: dict[int, int]   # pending chapter -> how many missing-glue warnings it had
    failing: list[str]         # every other problem line, as the build printed it

    @property
    def ok(self) -> bool:
        return not self.failing


def triage(build_output: str, pending: set[int]) -> BuildTriage:
    """Sort the strict build's problem lines: a missing glued value in a pending chapter is
    forgiven (counted per chapter); every other WARNING/ERROR line fails."""
    forgiven: dict[int, int] = {}
    failing = []
    for raw in build_output.splitlines():
        line = _ANSI.sub("", raw)
        if not _PROBLEM.search(line) or "Location 'file:" in line:   # pip's index notes
            continue
        match = _MISSING_GLUE.search(line)
        if match and int(match.group(1)) in pending:
            forgiven[int(match.group(1))] = forgiven.get(int(match.group(1)), 0) + 1
        else:
            failing.append(line.strip())
    return BuildTriage(forgiven, failing)
