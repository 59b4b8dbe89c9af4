"""`labkit book stale` on a small git repository built here: a chapter, a fake labkit whose
modules import each other (one import inside a function, one module named only by a
string), a C source a module compiles, and the chapter's record. Each case makes one commit
and checks the verdict against what that commit did; then the command runs on this
repository itself."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from labkit.book.chapter_inputs import Repository
from labkit.book.stale import EXIT_NO_HISTORY, EXIT_NOT_A_CHECKOUT, EXIT_OK, EXIT_STALE
from labkit.book.stale_report import run_stale

REPO_ROOT = Path(__file__).resolve().parent.parent
HEADER = ("---\njupytext:\n  text_representation:\n    extension: .md\n    format_name: myst\n"
          "kernelspec:\n  display_name: Python 3\n  language: python\n  name: python3\n---\n\n")
CODE = "from labkit import top as t\n\nprint(t.run())"


def chapter_text(prose: str = "Some prose.", code: str = CODE) -> str:
    return f"{HEADER}# 1. A chapter\n\n{prose}\n\n```{{code-cell}} ipython3\n{code}\n```\n\nMore prose.\n"


FILES = {
    "_config.yml": "title: test\n",
    "labkit/__init__.py": "",
    "labkit/top.py": ("def run():\n    from labkit import mid  # a lazy import still runs\n"
                      "    return mid.value()\n"),
    "labkit/mid.py": "from .pkg import deep\n\n\ndef value():\n    return deep.VALUE\n",
    "labkit/pkg/__init__.py": "",
    "labkit/pkg/deep.py": "VALUE = 1\nWORKER = 'labkit.worker'\nSOURCES = ('kernel.c',)\n",
    "labkit/worker.py": "STEP = 1\n",
    "labkit/csrc/kernel.c": "int f(void) { return 1; }\n",
    "labkit/unrelated.py": "X = 1\n",
    "notebooks/ch01-a-chapter.md": chapter_text(),
}


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def commit(root: Path, message: str, files: dict[str, str]) -> str:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)
    return git(root, "rev-parse", "HEAD")


def record(root: Path, revision: str) -> None:
    commit(root, "record", {"results/ch01/metrics.json": json.dumps({"git_revision": revision})})


def stale(root: Path, allow: str | None = None) -> tuple[int, str]:
    if allow is not None:
        (root / "results").mkdir(exist_ok=True)
        (root / "results/stale-allowed.toml").write_text(allow)
    out = io.StringIO()
    return run_stale(root, out=out), out.getvalue()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "book"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.email", "t@example.org")
    git(root, "config", "user.name", "t")
    record(root, commit(root, "the book", FILES))
    return root


def test_inputs_follow_imports_strings_and_sources(repo):
    inputs = Repository(repo).chapter_inputs("notebooks/ch01-a-chapter.md", [CODE])
    assert set(inputs.modules) == {"labkit", "labkit.top", "labkit.mid", "labkit.pkg",
                                   "labkit.pkg.deep", "labkit.worker"}
    assert "labkit/csrc/kernel.c" in inputs.files and "labkit/unrelated.py" not in inputs.files


def test_fresh_record_passes(repo):
    status, out = stale(repo)
    assert status == EXIT_OK, out
    assert "ch01  fresh" in out


def test_unrelated_change_keeps_it_fresh(repo):
    commit(repo, "unrelated", {"labkit/unrelated.py": "X = 2\n"})
    assert stale(repo)[0] == EXIT_OK


@pytest.mark.parametrize("path", ["labkit/pkg/deep.py", "labkit/worker.py", "labkit/csrc/kernel.c",
                                  "labkit/pkg/__init__.py"])
def test_change_to_a_transitive_input_is_stale_and_named(repo, path):
    sha = commit(repo, "touch an input", {path: (repo / path).read_text() + "\n# changed\n"})
    status, out = stale(repo)
    assert status == EXIT_STALE, out
    assert "ch01  STALE" in out and f"{sha[:7]} touch an input" in out and path in out


def test_prose_edit_is_fresh_and_code_edit_is_stale(repo):
    commit(repo, "prose", {"notebooks/ch01-a-chapter.md": chapter_text(prose="Other prose.")})
    assert stale(repo)[0] == EXIT_OK
    sha = commit(repo, "code", {"notebooks/ch01-a-chapter.md": chapter_text(code=CODE + "\nprint(2)")})
    status, out = stale(repo)
    assert status == EXIT_STALE
    assert f"{sha[:7]} code" in out and "ch01-a-chapter.md (code cells)" in out
    assert "prose" not in out.split("ch01  STALE")[1].split("FAILED")[0]


def test_allow_list_entry_excuses_and_unused_entry_fails(repo):
    sha = commit(repo, "rename a local", {"labkit/pkg/deep.py": FILES["labkit/pkg/deep.py"] + "Y = 2\n"})
    entry = (f'[[allow]]\nchapter = 1\ncommits = ["{sha[:9]}"]\nfiles = ["labkit/pkg/deep.py"]\n'
             'reason = "adds a name nothing reads"\n')
    status, out = stale(repo, entry)
    assert status == EXIT_OK, out
    assert "1 change(s) excused" in out
    unused = entry + '[[allow]]\nchapter = 1\nfiles = ["labkit/worker.py"]\nreason = "no longer needed"\n'
    status, out = stale(repo, unused)
    assert status == EXIT_STALE
    assert "(labkit/worker.py) excuses nothing now" in out


def test_allow_list_excuses_a_code_cell_edit_by_file(repo):
    source = "notebooks/ch01-a-chapter.md"
    commit(repo, "comment", {source: chapter_text(code="# a comment\n" + CODE)})
    status, out = stale(repo, f'[[allow]]\nchapter = 1\nfiles = ["{source}"]\nreason = "a comment only"\n')
    assert status == EXIT_OK, out


def test_code_cells_that_do_not_parse_are_not_fresh(repo):
    sha = commit(repo, "broken", {"notebooks/ch01-a-chapter.md": chapter_text(code=CODE + "\nprint(")})
    status, out = stale(repo)
    assert status == EXIT_STALE
    assert "do not parse as Python" in out and f"{sha[:7]} broken" in out


def test_allow_list_without_reason_is_refused(repo):
    status, out = stale(repo, '[[allow]]\nchapter = 1\nfiles = ["labkit/worker.py"]\n')
    assert status == EXIT_STALE and "a reason" in out


def test_revision_not_an_ancestor_is_stale(repo):
    git(repo, "checkout", "-q", "-b", "side")
    side = commit(repo, "side work", {"labkit/unrelated.py": "X = 3\n"})
    git(repo, "checkout", "-q", "main")
    record(repo, side)
    status, out = stale(repo)
    assert status == EXIT_STALE
    assert f"{side[:7]} is not an ancestor of HEAD" in out


def test_pending_rerun_is_tolerated_loudly_until_fresh(repo):
    pending = '[pending_rerun]\nissue = 33\nreason = "re-run later"\nchapters = [1]\n'
    status, out = stale(repo, pending)
    assert status == EXIT_STALE and "fresh now: take them off the list" in out
    commit(repo, "change", {"labkit/worker.py": "STEP = 2\n"})
    status, out = stale(repo, pending)
    assert status == EXIT_OK, out
    assert "STALE, PENDING RE-RUN" in out and "!!! 1 chapter(s) STALE and PENDING RE-RUN (issue 33)" in out


def test_without_history_says_so_with_its_own_status(repo, tmp_path):
    copy = tmp_path / "tarball"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    status, out = stale(copy)
    assert status == EXIT_NOT_A_CHECKOUT and "not a git checkout" in out
    commit(repo, "later", {"labkit/unrelated.py": "X = 4\n"})
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)], check=True)
    status, out = stale(shallow)
    assert status == EXIT_NO_HISTORY and "git fetch --unshallow" in out


def test_this_repository_lists_every_chapter():
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout: no history to judge the records by")
    out = io.StringIO()
    status = run_stale(REPO_ROOT, out=out)
    if status in (EXIT_NOT_A_CHECKOUT, EXIT_NO_HISTORY):
        pytest.skip(out.getvalue())
    assert status in (EXIT_OK, EXIT_STALE)
    listed = [line[:4] for line in out.getvalue().splitlines() if line[:2] == "ch" and line[4:6] == "  "]
    assert listed[:35] == [f"ch{n:02d}" for n in range(1, 36)]
