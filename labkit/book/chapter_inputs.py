"""What a chapter's stored outputs were computed from: its code cells, the labkit modules they
import (closed over labkit's own imports) and the files those modules build or read.

The modules are found by reading source with `ast`, never by importing it: every `import` and
`from ... import` anywhere in a file (a function-level import still runs when the function
does), every package `__init__.py` on the way to a module (Python executes it first), and a
string that names a labkit module exactly (`python -m labkit.cli` in a subprocess, a worker
started by name). Files that are not Python are found the same way, by a string constant:
one equal to a file's name (`"labkit_kernels.c"`, the C sources `labkit.kernels.native`
compiles at import; `"gemma3_chat.jinja"`), to a folder's name (`"moe-routing"`) or to the
tail of a path (`"labkit/data/eval/python-docs-prose.txt"` in a code cell). A path that code
assembles from computed pieces would be missed; none does today (the test of this module
holds the list of what is found).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

PACKAGE = "labkit"
# Where files that code reads live: the book's data and the package's own data.
DATA_ROOTS = ("data", PACKAGE)
# Names of folders too generic to identify one (every package has a `data` of some kind).
GENERIC_FOLDERS = frozenset({"data"})
_DOCUMENT = re.compile(r"^(README|LICENSE)|\.md$", re.IGNORECASE)  # read by people, not code
_MAGIC_LINE = re.compile(r"^\s*[%!]")  # IPython magics and shell escapes: not Python


@dataclass(frozen=True)
class ChapterInputs:
    """A chapter's inputs, as paths relative to the repository root."""

    source: str                  # notebooks/chNN-slug.md (only its code cells count)
    modules: tuple[str, ...]     # dotted names of the labkit modules it runs
    files: tuple[str, ...]       # those modules' files and the data files, sorted

    @property
    def tracked(self) -> tuple[str, ...]:
        """Every input file, the source included."""
        return (self.source, *self.files)


def python_source(cells: list[str]) -> str:
    """Code cells joined into one parseable text: magic and shell lines become blank."""
    lines = [("" if _MAGIC_LINE.match(line) else line) for cell in cells for line in cell.splitlines()]
    return "\n".join(lines)


def string_constants(tree: ast.AST) -> set[str]:
    return {node.value.strip() for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def imported_names(tree: ast.AST, package: str | None) -> set[str]:
    """Dotted names the imports of `tree` mention: the module of each `import`, and for
    `from M import a` both M and M.a (a may be a module; the caller keeps what exists).
    `package` resolves relative imports (None outside a package)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if package is None:
                    continue
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def _is_data_file(relative: Path) -> bool:
    return relative.suffix != ".py" and not _DOCUMENT.search(relative.name) and not any(
        part.startswith(".") or part == "__pycache__" for part in relative.parts)


class Repository:
    """The labkit modules and data files of a checkout, and the imports between modules."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self._direct: dict[str, frozenset[str]] = {}
        self._strings: dict[str, frozenset[str]] = {}

    @cached_property
    def module_files(self) -> dict[str, str]:
        """Dotted module name -> its file, relative to the root."""
        found = {}
        for path in sorted((self.root / PACKAGE).rglob("*.py")):
            relative = path.relative_to(self.root)
            if "__pycache__" in relative.parts:
                continue
            parts = relative.with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = relative.as_posix()
        return found

    @cached_property
    def data_files(self) -> tuple[str, ...]:
        files = []
        for top in DATA_ROOTS:
            for path in (self.root / top).rglob("*"):
                relative = path.relative_to(self.root)
                if path.is_file() and _is_data_file(relative):
                    files.append(relative.as_posix())
        return tuple(sorted(set(files)))

    @cached_property
    def _data_names(self) -> dict[str, set[str]]:
        """File name or distinctive folder name -> the data files it identifies."""
        packages = {Path(f).parent.as_posix() for f in self.module_files.values()}
        by_name: dict[str, set[str]] = {}
        for file in self.data_files:
            path = Path(file)
            by_name.setdefault(path.name, set()).add(file)
            for folder in path.parents[:-1]:
                if folder.name not in GENERIC_FOLDERS and folder.as_posix() not in packages \
                        and folder.as_posix() not in DATA_ROOTS:
                    by_name.setdefault(folder.name, set()).add(file)
        return by_name

    def data_named_by(self, strings: set[str]) -> set[str]:
        """The data files that these string constants name (see the module's docstring)."""
        found: set[str] = set()
        for text in strings:
            text = text.removeprefix("./").rstrip("/")
            if not text or "\n" in text:
                continue
            if "/" not in text:
                found |= self._data_names.get(text, set())
                continue
            for file in self.data_files:  # a path's tail: a file, or a folder holding files
                for candidate in (file, *(p.as_posix() for p in Path(file).parents[:-1])):
                    if candidate == text or candidate.endswith("/" + text):
                        found.add(file)
        return found

    def _package_of(self, module: str) -> str:
        return module if self.module_files[module].endswith("__init__.py") else module.rpartition(".")[0]

    def _modules_among(self, names: set[str]) -> set[str]:
        """The labkit modules these dotted names bring in: each one that is a module, and
        every package above it (its __init__ runs first)."""
        found = set()
        for name in names:
            parts = name.split(".")
            for end in range(1, len(parts) + 1):
                prefix = ".".join(parts[:end])
                if prefix in self.module_files:
                    found.add(prefix)
        return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}

    def _read(self, module: str) -> None:
        path = self.root / self.module_files[module]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        self._strings[module] = frozenset(string_constants(tree))
        names = imported_names(tree, self._package_of(module)) | self._strings[module]
        self._direct[module] = frozenset(self._modules_among(names) - {module})

    def direct_imports(self, module: str) -> frozenset[str]:
        if module not in self._direct:
            self._read(module)
        return self._direct[module]

    def strings_of(self, module: str) -> frozenset[str]:
        if module not in self._strings:
            self._read(module)
        return self._strings[module]

    def closure(self, modules: set[str]) -> set[str]:
        """`modules` and everything they import, transitively."""
        seen: set[str] = set()
        todo = list(self._modules_among(modules))
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(self.direct_imports(module) - seen)
        return seen

    def chapter_inputs(self, source: str | Path, code_cells: list[str]) -> ChapterInputs:
        """The inputs of the chapter whose source is `source` and whose code cells are
        `code_cells`. SyntaxError where the cells are not Python once magics are removed."""
        tree = ast.parse(python_source(code_cells), filename=str(source))
        modules = self.closure(imported_names(tree, None) | string_constants(tree))
        strings = string_constants(tree)
        for module in modules:
            strings |= self.strings_of(module)
        files = {self.module_files[m] for m in modules} | self.data_named_by(strings)
        relative = Path(source)
        if relative.is_absolute():
            relative = relative.resolve().relative_to(self.root)
        return ChapterInputs(relative.as_posix(), tuple(sorted(modules)), tuple(sorted(files)))
