"""labkit/experiments/README.md maps every chapter to the experiment modules it imports, and
every module to its chapters and the first sentence of its docstring. It is rendered from the
notebooks and the modules, so it cannot drift: the test fails when it differs from a fresh
rendering, and `python tests/test_experiments_map.py` writes the fresh one."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "labkit" / "experiments"
README = EXPERIMENTS / "README.md"
PARTS = [(1, 6, "I. Understanding inference"), (7, 12, "II. Computational foundations"),
         (13, 18, "III. Making inference fast"), (19, 24, "IV. Modern model architectures"),
         (25, 30, "V. Building an inference service"), (31, 35, "VI. Protocols and applications"),
         (36, 40, "VII. Economics and evaluation"), (41, 45, "VIII. Inference Lab capstone")]
HEADER = """# labkit.experiments: the chapters' measurement code

One module per investigation, flat so that a chapter imports it by one name. Which chapter runs
which module is below, rendered from the notebooks' imports and the modules' docstrings by
`python tests/test_experiments_map.py` (its test fails when this file differs from a fresh
rendering). A module several chapters share is listed under each.
"""


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """The experiment modules a notebook source names: `labkit.experiments.x` in any import,
    or `from labkit.experiments import x, y as z`."""
    found = set(re.findall(r"labkit\.experiments\.(\w+)", source))
    for names in re.findall(r"from labkit\.experiments import ([^\n]+)", source):
        found |= {part.split(" as ")[0].strip(" ()") for part in names.split(",")}
    return found & modules


def modules() -> list[str]:
    return sorted(p.stem for p in EXPERIMENTS.glob("*.py") if p.stem != "__init__")


def chapters() -> dict[int, tuple[str, set[str]]]:
    """Chapter number -> (title, experiment modules its code imports)."""
    names = set(modules())
    found = {}
    for path in sorted((ROOT / "notebooks").glob("ch[0-9][0-9]-*.md")):
        source = path.read_text()
        title = re.search(r"^# (?:\d+\. )?(.+)$", source, re.M).group(1)
        found[int(path.name[2:4])] = (title, imported_modules(source, names))
    return found


def first_sentence(module: str) -> str:
    doc = ast.get_docstring(ast.parse((EXPERIMENTS / f"{module}.py").read_text())) or ""
    sentence = re.split(r"(?<=[.:;?])\s", " ".join(doc.split("\n\n")[0].split()))[0].rstrip(":;")
    return sentence if sentence.endswith((".", "?")) else sentence + "."


def render() -> str:
    found, lines = chapters(), [HEADER]
    for first, last, part in PARTS:
        rows = [n for n in range(first, last + 1) if n in found]
        if not rows:
            continue
        lines += [f"## Part {part}", "", "| Chapter | Modules it imports |", "|---|---|"]
        lines += [f"| {n}. {found[n][0]} | " + ", ".join(f"`{m}`" for m in sorted(found[n][1])) + " |"
                  for n in rows]
        lines.append("")
    lines += ["## Modules", "", "| Module | Chapters | What it holds |", "|---|---|---|"]
    for module in modules():
        used = ", ".join(str(n) for n, (_, names) in found.items() if module in names)
        lines.append(f"| `{module}` | {used} | {first_sentence(module)} |")
    return "\n".join(lines) + "\n"


def test_the_readme_is_the_rendered_map():
    assert README.read_text() == render(), "run: python tests/test_experiments_map.py"


def test_every_module_serves_a_chapter():
    unused = [m for m in modules() if f"| `{m}` |  |" in render()]
    assert not unused, f"experiment modules no chapter imports: {unused}"


def test_the_import_reader_sees_each_spelling():
    source = ("from labkit.experiments import attention_cost as ac, batching\n"
              "import labkit.experiments.kv_caching\nfrom labkit.experiments.speculation import x\n")
    names = {"attention_cost", "batching", "kv_caching", "speculation", "streaming"}
    assert imported_modules(source, names) == names - {"streaming"}


if __name__ == "__main__":
    README.write_text(render())
    sys.exit(0)
