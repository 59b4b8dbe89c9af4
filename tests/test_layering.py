"""The package's layers run one way, and no module reaches into another's private names.

Every `import` and `from ... import` in every labkit module (function-level imports
included: a lazy import is still an arrow) is read from the source with `ast`, resolved to
the labkit module it names, and checked against the layer table below. A module may import
from its own layer or any layer beneath it, never from one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "labkit"

# Bottom to top. The first matching prefix decides a module's layer.
LAYERS: list[tuple[str, ...]] = [
    ("labkit.util",),                                                       # foundations
    ("labkit.tokenizer", "labkit.protocols", "labkit.sampling", "labkit.structured", "labkit.models",
     "labkit.kernels", "labkit.eval", "labkit"),                                              # the model's parts
    ("labkit.engine",),                                                     # the engine
    ("labkit.serve", "labkit.bench", "labkit.experiments", "labkit.sim",
     "labkit.agent"),                                                       # what runs on it
    ("labkit.book", "labkit.cli"),                                          # book support, CLI
]
LAYER_NAMES = ["foundations", "tokenizer/sampling/models/kernels", "engine",
               "serve/bench/experiments/sim/agent", "book/cli"]


def layer_of(module: str) -> int:
    best, rank = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    if rank is None:
        raise KeyError(module)
    return rank


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported labkit module, names taken from it) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "labkit"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "labkit":
                continue
            names = [a.name for a in node.names]
            # `from labkit.engine import loop` names a submodule: the arrow goes to it
            folder = PACKAGE.parent.joinpath(*target.split("."))
            subs = [n for n in names if (folder / f"{n}.py").exists() or (folder / n / "__init__.py").exists()]
            for n in subs:
                found.append((node.lineno, f"{target}.{n}", []))
            rest = [n for n in names if n not in subs]
            if rest:
                found.append((node.lineno, target, rest))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def upward_arrows(path: Path) -> list[str]:
    this = module_name(path)
    return [f"{path.relative_to(PACKAGE.parent)}:{line} {this} ({LAYER_NAMES[layer_of(this)]}) imports "
            f"{target} ({LAYER_NAMES[layer_of(target)]})"
            for line, target, _ in imports(path) if layer_of(target) > layer_of(this)]


def private_imports(path: Path) -> list[str]:
    this, wrong = module_name(path), []
    for line, target, names in imports(path):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        hidden = [part for part in target.split(".") if part.startswith("_") and not part.startswith("__")]
        if target != this and (private or hidden):
            wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} takes {', '.join(private or hidden)} "
                         f"from {target}")
    return wrong


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    for path in SOURCES:
        layer_of(module_name(path))


def test_layers_run_one_way():
    wrong = [arrow for path in SOURCES for arrow in upward_arrows(path)]
    assert not wrong, "imports that run up the layers:\n" + "\n".join(wrong)


def test_no_private_names_cross_modules():
    wrong = [taken for path in SOURCES for taken in private_imports(path)]
    assert not wrong, "private names imported across modules:\n" + "\n".join(wrong)


@pytest.mark.parametrize("source, target, upward", [
    ("from labkit.book.style import OKABE_ITO", "labkit.book.style", True),
    ("from labkit.experiments import batching", "labkit.experiments.batching", True),
    ("import labkit.engine.llm_engine", "labkit.engine.llm_engine", True),
    ("def f():\n    from ..engine import loop\n", "labkit.engine.loop", True),
    ("from ..util.timing import measure", "labkit.util.timing", False),
    ("from labkit.kernels.attention import _group", "labkit.kernels.attention", False),
])
def test_the_walker_sees_each_spelling(source, target, upward):
    """The checks are not blind: a probe module placed among the kernels for the test is
    resolved, and an upward arrow or a private name in it is reported, however spelt."""
    probe = PACKAGE / "kernels" / "layering_probe.py"
    probe.write_text(source + "\n")
    try:
        assert [t for _, t, _ in imports(probe)] == [target]
        assert bool(upward_arrows(probe)) is upward
        assert bool(private_imports(probe)) is ("_group" in source)
    finally:
        probe.unlink()


# The tokenizer package's own order (its __init__ lists it): each module imports only those
# before it, so the backends never reach back into the Tokenizer that picks them.
TOKENIZER_ORDER = ["contract", "byte_level", "sentencepiece", "detokenizer", "gguf_tokenizer"]


def test_the_tokenizer_package_runs_one_way():
    folder = PACKAGE / "tokenizer"
    assert sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__") == sorted(TOKENIZER_ORDER)
    wrong = []
    for rank, name in enumerate(TOKENIZER_ORDER):
        for line, target, _ in imports(folder / f"{name}.py"):
            parts = target.split(".")
            if parts[:2] == ["labkit", "tokenizer"]:
                if len(parts) < 3 or TOKENIZER_ORDER.index(parts[2]) >= rank:
                    wrong.append(f"tokenizer/{name}.py:{line} imports {target}")
    assert not wrong, "\n".join(wrong)
