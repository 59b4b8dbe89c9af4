"""labkit/experiments/README.md maps every chapter to the experiment modules it imports, and
every module to its chapters: both tables must be what the notebooks' code actually imports."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "labkit" / "experiments"


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """The experiment modules a notebook source names: `labkit.experiments.x` in any import,
    or `from labkit.experiments import x, y as z`."""
    found = set(re.findall(r"labkit\.experiments\.(\w+)", source))
    for names in re.findall(r"from labkit\.experiments import ([^\n]+)", source):
        found |= {part.split(" as ")[0].strip(" ()") for part in names.split(",")}
    return found & modules


def notebook_map() -> dict[int, set[str]]:
    modules = {p.stem for p in EXPERIMENTS.glob("*.py") if p.stem != "__init__"}
    return {int(path.name[2:4]): imported_modules(path.read_text(), modules)
            for path in sorted((ROOT / "notebooks").glob("ch[0-9][0-9]-*.md"))}


def readme_tables() -> tuple[dict[int, set[str]], dict[str, set[int]]]:
    chapters, modules = {}, {}
    for line in (EXPERIMENTS / "README.md").read_text().splitlines():
        chapter = re.match(r"\| (\d+)\. [^|]+\| ([^|]*)\|$", line)
        if chapter:
            chapters[int(chapter.group(1))] = set(re.findall(r"`(\w+)`", chapter.group(2)))
        module = re.match(r"\| `(\w+)` \| ([\d, ]*) \|", line)
        if module:
            modules[module.group(1)] = {int(n) for n in re.findall(r"\d+", module.group(2))}
    return chapters, modules


def test_the_readme_lists_each_chapters_modules():
    chapters, _ = readme_tables()
    assert chapters == notebook_map()


def test_the_readme_lists_each_modules_chapters():
    _, modules = readme_tables()
    expected: dict[str, set[int]] = {p.stem: set() for p in EXPERIMENTS.glob("*.py") if p.stem != "__init__"}
    for chapter, names in notebook_map().items():
        for name in names:
            expected[name].add(chapter)
    assert modules == expected


def test_the_import_reader_sees_each_spelling():
    source = ("from labkit.experiments import attention_cost as ac, batching\n"
              "import labkit.experiments.kv_caching\nfrom labkit.experiments.speculation import x\n")
    names = {"attention_cost", "batching", "kv_caching", "speculation", "streaming"}
    assert imported_modules(source, names) == names - {"streaming"}
